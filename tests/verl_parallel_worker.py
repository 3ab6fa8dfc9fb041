"""torchrun worker for tests/test_verl_megatron_parallel.py: verl 0.8.0's real Megatron engine
(``forward_backward_batch``, ``forward_step``, its THD preprocessing and megatron's own
``get_forward_backward_func`` schedules) under one model-parallel layout, patched vs stock, on
tiny tree-spec GPTModels, on gloo (CPU) or NCCL (one GPU per rank).

Layouts: CP=2, CP=4, TP=2 + SP, PP=2 x VPP=2 (megatron's interleaved 1F1B), CP=2 x TP=2 + SP.
The stock run is verl's stock forward on the unshared batch (under CP the tree-spec model runs
verl's per-sequence CP chunks); the patched run shares prefixes. Per rank: log-probs, entropy,
the PPO loss and every local gradient of an actor (per-sample temperatures under CP); values, the value loss and every gradient
of a critic; ``sum_pi_squared`` and top-k distillation outputs, loss and gradients; under TP
without CP or PP, MTP training's loss, logged MTP losses and gradients; with the direct builder
``use_fused_kernels`` (verl's fused GPTModel forward, a CPU stand-in for its kernel: on the
tree under TP + SP and PP, verl's stock fused forward under CP); and
``ENABLE_PREFIX_SHARING=0`` against stock, bit for bit.

Builders: ``direct`` (megatron's GPTModel with the local tree spec, random weights) or, with
verl 0.9.1 and Megatron-Bridge, ``bridge``: verl's own engine build (``_build_tf_config`` +
``_build_megatron_module``: ``AutoBridge`` on the HF checkpoints the test wrote, the provider's
TE spec converted by the patchset, Bridge loading the weights; TE shimmed for the CPU,
tests/te_cpu_shims.py).

Usage: ``torchrun --standalone --nproc_per_node N verl_parallel_worker.py LAYOUT OUT [cpu|cuda]
[bridge ACTOR_HF CRITIC_HF]``; rank 0 writes every rank's JSON report to OUT.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

LAYOUTS = {
    "cp2": dict(tp=1, cp=2, pp=1, vpp=None, sp=False),
    "cp4": dict(tp=1, cp=4, pp=1, vpp=None, sp=False),
    "tp2sp": dict(tp=2, cp=1, pp=1, vpp=None, sp=True),
    "pp2vpp2": dict(tp=1, cp=1, pp=2, vpp=2, sp=False),
    "cp2tp2sp": dict(tp=2, cp=2, pp=1, vpp=None, sp=True),
}
DEVICE = torch.device("cpu")
BRIDGE_CHECKPOINTS: dict[str, str] = {}  # kind -> HF checkpoint path when models come from Megatron-Bridge


def world_size(layout: str) -> int:
    lay = LAYOUTS[layout]
    return lay["tp"] * lay["cp"] * lay["pp"]


def init(layout: str, device: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_shims import enable_cpu_pipeline, init_cpu_megatron

    global DEVICE
    lay = LAYOUTS[layout]
    if device == "cpu":
        init_cpu_megatron(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], vpp=lay["vpp"])
        enable_cpu_pipeline()  # megatron's real schedules on gloo
        return
    from megatron.core import tensor_parallel

    DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=lay["tp"], context_parallel_size=lay["cp"],
        pipeline_model_parallel_size=lay["pp"], virtual_pipeline_model_parallel_size=lay["vpp"],
    )
    tensor_parallel.model_parallel_cuda_manual_seed(0)


class ValueHead(torch.nn.Module):
    """A replicated value head in place of the LM head (verl's value models; test-only). Under
    SP it gathers the sequence first (backward: each TP rank keeps its own rows' gradient)."""

    def __init__(self, hidden, sequence_parallel):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.linear = torch.nn.Linear(hidden, 1, bias=False)
        torch.nn.init.normal_(self.linear.weight, std=0.3, generator=torch.Generator().manual_seed(0))

    def forward(self, x, weight=None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        return self.linear(x), None


def bridge_chunks(layout: str, kind: str, value_head: bool) -> list:
    """This rank's model chunks built by verl 0.9.1's Megatron engine through Megatron-Bridge
    with the patchset installed (tree layers, HF weights); a value model's head (verl's
    ``LinearForLastLayer``, not in the checkpoint) is re-initialised alike on every rank."""
    from bridge_helpers import bridge_engine
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl_helpers import megatron_patchset

    from ps_mcore import setup
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting

    lay = LAYOUTS[layout]
    setup.install([megatron_patchset()])
    cls = impl.MegatronEngineWithValueHead if value_head else impl.MegatronEngineWithLMHead
    engine = bridge_engine(
        cls, BRIDGE_CHECKPOINTS[kind], PrefixSharingSetting(True, PrefixGrouperConfig()), value=value_head,
        tensor_model_parallel_size=lay["tp"], context_parallel_size=lay["cp"],
        pipeline_model_parallel_size=lay["pp"], virtual_pipeline_model_parallel_size=lay["vpp"],
        sequence_parallel=lay["sp"])
    for chunk in engine.module:
        if value_head and chunk.post_process:
            torch.nn.init.normal_(chunk.output_layer.weight, std=0.3, generator=torch.Generator().manual_seed(0))
    return [chunk.to(DEVICE) for chunk in engine.module]


def build_chunks(layout: str, kind: str, seed: int, value_head: bool = False, mtp_layers: int = 0) -> list:
    """This rank's model chunks (one per virtual stage) with tree specs, randomized alike on
    every rank of the same shard (or from Megatron-Bridge: :func:`bridge_chunks`);
    ``mtp_layers``: megatron's MTP block (no pipeline) with verl's MTP patches."""
    if BRIDGE_CHECKPOINTS:
        return bridge_chunks(layout, kind, value_head)
    from megatron.core import parallel_state as ps

    from megatron_shims import build_gpt, layer_spec_args, randomize_, sp_block_spec, tiny_config
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    lay = LAYOUTS[layout]
    extra = dict(tensor_model_parallel_size=lay["tp"], context_parallel_size=lay["cp"],
                 sequence_parallel=lay["sp"])
    if lay["pp"] > 1:
        extra.update(num_layers=4, pipeline_model_parallel_size=lay["pp"],
                     virtual_pipeline_model_parallel_size=lay["vpp"], pipeline_dtype=torch.float32,
                     variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        if DEVICE.type == "cpu":
            # gloo matches point-to-point messages per peer in posting order; with PP=2 the
            # previous and next stage are one peer, and the batched p2p path posts send_prev
            # before send_next on every rank, crossing the interleaved schedule's messages
            extra["batch_p2p_comm"] = False
    if mtp_layers:
        extra["mtp_num_layers"] = mtp_layers
    cfg = tiny_config(kind, **extra)
    cfg.tree_attention_backend = "chunked"  # exact fp32 math on any device
    spec = get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))
    if lay["sp"]:
        spec = sp_block_spec(spec, cfg.num_layers)
    if mtp_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        from megatron_shims import sp_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
        extra_model = {"mtp_block_spec": sp_mtp_block_spec(mtp) if lay["sp"] else mtp}
    else:
        extra_model = {}
    chunks = []
    for vp in range(lay["vpp"] or 1):
        kw = {}
        if lay["pp"] > 1:
            vp_stage = vp if lay["vpp"] else None
            kw = dict(pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                      post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                      vp_stage=vp_stage)
        model = build_gpt(cfg, spec, **kw, **extra_model)
        randomize_(model, seed=seed + 7 * vp + 131 * ps.get_pipeline_model_parallel_rank())
        if mtp_layers:
            from verl.utils.megatron_utils import patch_engine_mtp

            patch_engine_mtp(model, SimpleNamespace(mtp=SimpleNamespace(detach_encoder=False)))
        if value_head and model.post_process:
            model.output_layer = ValueHead(cfg.hidden_size, cfg.sequence_parallel)
        chunks.append(model.to(DEVICE))
    return chunks


def make_data(layout: str, seed: int, **meta):
    from verl_batches import WORKLOADS, make_batch

    rng = np.random.default_rng(seed)
    samples = WORKLOADS["tree"](rng) + WORKLOADS["grpo"](rng, prompts=1) + WORKLOADS["stepwise"](rng, steps=3)
    # ~40 tokens per CP rank: several micro-batches (a multiple of PP under VPP)
    meta = {"temperature": 0.8, "max_token_len_per_gpu": 40, **meta}
    data = make_batch(samples, rng, **meta)
    return data


def run_engine(cls, chunks, data, setting, loss_fn, patched, env_value=None, mtp: bool = False,
               use_fused_kernels: bool = False):
    """One ``forward_backward_batch`` (``mtp``: verl's MTP training on; ``use_fused_kernels``: the
    engine setting verl 0.9.1 checks the batch flag against); returns (output, this rank's grads)."""
    from verl_batches import engine_shell
    from verl_helpers import megatron_patchset

    from ps_mcore import setup

    if patched:
        setup.install([megatron_patchset()])
    else:
        setup.uninstall()
    previous = os.environ.get("ENABLE_PREFIX_SHARING")
    if env_value is not None:
        os.environ["ENABLE_PREFIX_SHARING"] = env_value
    try:
        engine = engine_shell(cls, chunks[0], setting)
        engine.module = chunks
        engine.engine_config.use_fused_kernels = use_fused_kernels
        if mtp:
            engine.model_config.mtp = SimpleNamespace(enable=True, enable_train=True, detach_encoder=False)
        for m in chunks:
            m.zero_grad(set_to_none=True)
        out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    finally:
        if env_value is not None:
            if previous is None:
                os.environ.pop("ENABLE_PREFIX_SHARING", None)
            else:
                os.environ["ENABLE_PREFIX_SHARING"] = previous
    if loss_fn is not None:
        from megatron.core import parallel_state as ps

        from megatron_shims import finalize_grads

        for m in chunks:  # what megatron's DDP / finalize_model_grads sum over CP and (SP) TP
            finalize_grads(m, m.config, ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group())
    grads = [p.grad.detach().clone() if p.grad is not None else None for m in chunks for p in m.parameters()]
    return out, grads


def _max_diff(a, b, mask=None) -> float:
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).abs().max()) if a.numel() else 0.0


def _grad_report(g_stock, g_tree) -> dict:
    """Largest |tree - stock| per tensor relative to the tensor's largest stock entry."""
    worst, missing = 0.0, 0
    for a, b in zip(g_stock, g_tree):
        if a is None or b is None:
            missing += int((a is None) != (b is None))
            continue
        scale = max(float(a.abs().max()), 1e-12)
        worst = max(worst, _max_diff(a, b) / scale)
    return {"grad_rel": worst, "grad_missing": missing, "num_grads": sum(g is not None for g in g_stock)}


def _outputs(out, keys):
    mo = out.get("model_output") or {}
    return {k: mo[k] for k in keys if k in mo}


def actor_report(layout: str) -> dict:
    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl_batches import seq_last_mask, tree_setting

    from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED

    chunks = build_chunks(layout, "qwen2", seed=11)
    data = make_data(layout, 5)
    if LAYOUTS[layout]["cp"] > 1:  # per-sample temperatures: each CP rank's tokens read their own
        from verl_batches import sample_temperatures

        data["temperature"] = sample_temperatures(data.batch_size[0], seed=5)
    setting = tree_setting()
    loss_fn = partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2,
                                                        entropy_coeff=0.01))
    cls = impl.MegatronEngineWithLMHead
    stock_i, _ = run_engine(cls, chunks, data, setting, None, patched=False)
    tree_i, _ = run_engine(cls, chunks, data, setting, None, patched=True)
    stock_t, g_stock = run_engine(cls, chunks, data, setting, loss_fn, patched=False)
    tree_t, g_tree = run_engine(cls, chunks, data, setting, loss_fn, patched=True)
    off_t, g_off = run_engine(cls, chunks, data, setting, loss_fn, patched=True, env_value="0")
    off_i, _ = run_engine(cls, chunks, data, setting, None, patched=True, env_value="0")
    rep = {"actor": _grad_report(g_stock, g_tree)}
    rep["actor"]["off_grads_equal"] = all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(g_stock, g_off))
    last = bool(stock_i)
    rep["actor"]["last_stage"] = last
    if last:
        s, t, o = (_outputs(x, ("log_probs", "entropy")) for x in (stock_i, tree_i, off_i))
        keep = seq_last_mask(s["log_probs"])
        rep["actor"].update(
            offsets_equal=bool(torch.equal(s["log_probs"].offsets(), t["log_probs"].offsets())),
            log_probs=_max_diff(s["log_probs"].values(), t["log_probs"].values(), keep),
            entropy=_max_diff(s["entropy"].values(), t["entropy"].values()),
            loss=[float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))],
            off_outputs_equal=all(torch.equal(s[k].values(), o[k].values()) for k in s),
            off_loss_equal=stock_t["loss"] == off_t["loss"],
            off_no_metrics=TOKENS_IN not in off_i["metrics"],
            tokens=[sum(tree_i["metrics"][TOKENS_IN]), sum(tree_i["metrics"][TOKENS_PACKED])],
            micro_batches=len(tree_i["metrics"][TOKENS_IN]),
            num_input_tokens=int(data["input_ids"].offsets()[-1]),
        )
    return rep


def statistics_report(layout: str) -> dict:
    """``calculate_sum_pi_squared`` and top-k distillation (verl's ``distillation_ppo_loss`` as
    the logits processor), per-sample temperatures: outputs, loss and every gradient."""
    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl_batches import DISTILLATION_KEYS, distillation_loss, sample_temperatures, tree_setting, with_statistics

    from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED

    chunks = build_chunks(layout, "qwen2", seed=12)
    data = with_statistics(make_data(layout, 6), seed=6)
    data["temperature"] = sample_temperatures(data.batch_size[0], seed=6)
    loss_fn = distillation_loss(McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01), data)
    cls = impl.MegatronEngineWithLMHead
    stock, g_stock = run_engine(cls, chunks, data, tree_setting(), loss_fn, patched=False)
    tree, g_tree = run_engine(cls, chunks, data, tree_setting(), loss_fn, patched=True)
    rep = _grad_report(g_stock, g_tree)
    keys = ("sum_pi_squared",) + DISTILLATION_KEYS
    s, t = _outputs(stock, keys), _outputs(tree, keys)
    rep["last_stage"] = bool(s)
    if s:
        rep.update(outputs={k: _max_diff(s[k].values(), t[k].values()) for k in keys},
                   loss=[float(np.sum(stock["loss"])), float(np.sum(tree["loss"]))],
                   tokens=[sum(tree["metrics"][TOKENS_IN]), sum(tree["metrics"][TOKENS_PACKED])])
    return {"statistics": rep}


def fused_report(layout: str) -> dict:
    """``use_fused_kernels``: verl's fused GPTModel forward, its Triton kernel replaced by the
    CPU stand-in ``cpu_linear_cross_entropy`` (vocab-parallel under TP) in both runs: log-probs,
    entropy, the PPO loss, every gradient, and the rows the kernel saw in the log-prob pass."""
    from verl.models.mcore import model_forward_fused
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl_batches import seq_last_mask, tree_setting

    from megatron_shims import cpu_linear_cross_entropy

    chunks = build_chunks(layout, "qwen2", seed=13)
    for m in chunks:
        model_forward_fused.patch_fused_forward(m)
    data = make_data(layout, 9)
    tu.assign_non_tensor(data, use_fused_kernels=True)
    loss_fn = partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2,
                                                        entropy_coeff=0.01))
    cls, kernel, runs = impl.MegatronEngineWithLMHead, model_forward_fused.linear_cross_entropy, {}
    try:
        for name, patched in (("stock", False), ("tree", True)):
            rows = []
            model_forward_fused.linear_cross_entropy = partial(cpu_linear_cross_entropy, rows_seen=rows)
            infer, _ = run_engine(cls, chunks, data, tree_setting(), None, patched, use_fused_kernels=True)
            kernel_rows = sum(rows)
            train, grads = run_engine(cls, chunks, data, tree_setting(), loss_fn, patched, use_fused_kernels=True)
            runs[name] = (infer, kernel_rows, train, grads)
    finally:
        model_forward_fused.linear_cross_entropy = kernel
    (stock_i, stock_rows, stock_t, g_stock), (tree_i, tree_rows, tree_t, g_tree) = runs["stock"], runs["tree"]
    rep = _grad_report(g_stock, g_tree)
    rep["last_stage"] = bool(stock_i)
    if stock_i:
        s, t = _outputs(stock_i, ("log_probs", "entropy")), _outputs(tree_i, ("log_probs", "entropy"))
        keep = seq_last_mask(s["log_probs"])
        rep.update(
            log_probs=_max_diff(s["log_probs"].values(), t["log_probs"].values(), keep),
            entropy=_max_diff(s["entropy"].values(), t["entropy"].values()),
            loss=[float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))],
            kernel_rows=[stock_rows, tree_rows],
            num_input_tokens=int(data["input_ids"].offsets()[-1]),
        )
    return {"fused": rep}


def critic_report(layout: str) -> dict:
    from verl.workers.config import McoreCriticConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.losses import value_loss

    from verl_batches import tree_setting, with_value_targets

    chunks = build_chunks(layout, "qwen3", seed=3, value_head=True)
    # value_loss is a per-micro-batch mean: the same fixed micro-batches in both runs (12
    # samples in unit order, so the prefix-aware split is verl's)
    data = with_value_targets(make_data(layout, 8, use_dynamic_bsz=False, micro_batch_size_per_gpu=3), seed=8)
    setting = tree_setting()
    loss_fn = partial(value_loss, config=McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    cls = impl.MegatronEngineWithValueHead
    stock_i, _ = run_engine(cls, chunks, data, setting, None, patched=False)
    tree_i, _ = run_engine(cls, chunks, data, setting, None, patched=True)
    stock_t, g_stock = run_engine(cls, chunks, data, setting, loss_fn, patched=False)
    tree_t, g_tree = run_engine(cls, chunks, data, setting, loss_fn, patched=True)
    rep = _grad_report(g_stock, g_tree)
    if stock_i:
        s, t = stock_i["model_output"]["values"], tree_i["model_output"]["values"]
        rep.update(values=_max_diff(s.values(), t.values()),
                   offsets_equal=bool(torch.equal(s.offsets(), t.offsets())),
                   loss=[float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))])
    return {"critic": rep}


def mtp_report(layout: str) -> dict:
    """MTP training (2 layers) under TP without CP or PP: the PPO loss, the logged MTP losses
    and every gradient, tree vs verl's stock MTP on the unshared batch (fixed micro-batches:
    the logged MTP loss is a mean of per-micro-batch means)."""
    lay = LAYOUTS[layout]
    if lay["tp"] == 1 or lay["cp"] > 1 or lay["pp"] > 1 or BRIDGE_CHECKPOINTS:  # Bridge's models: no MTP block
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl_batches import tree_setting

    from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED

    MTPLossLoggingHelper.tracker.clear()
    chunks = build_chunks(layout, "qwen2", seed=13, mtp_layers=2)
    data = make_data(layout, 9, use_dynamic_bsz=False, micro_batch_size_per_gpu=6)
    loss_fn = partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2))
    runs = [run_engine(impl.MegatronEngineWithLMHead, chunks, data, tree_setting(), loss_fn, patched, mtp=True)
            for patched in (False, True)]
    (stock, g_stock), (tree, g_tree) = runs
    rep = _grad_report(g_stock, g_tree)
    keys = sorted(k for k in stock["metrics"] if k.startswith("mtp_losses/"))
    rep.update(
        loss=[float(np.sum(stock["loss"])), float(np.sum(tree["loss"]))],
        mtp_keys=[keys, sorted(k for k in tree["metrics"] if k.startswith("mtp_losses/"))],
        mtp_losses=[[float(np.sum(run["metrics"][k])) for k in keys] for run in (stock, tree)],
        tokens=[sum(tree["metrics"][TOKENS_IN]), sum(tree["metrics"][TOKENS_PACKED])],
        mtp_grads=all(float(p.grad.abs().max()) > 0 for m in chunks for n, p in m.named_parameters()
                      if n.startswith("mtp.")),
    )
    return {"mtp": rep}


def plan_mismatch_report(layout: str) -> dict:
    """A rank whose micro-batch differs: the plan check raises before the schedule."""
    from megatron.core import parallel_state as ps

    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
    from ps_mcore.integrations.verl_common.engine import EngineStep
    from ps_mcore.integrations.verl_common.megatron import check_same_plans

    if not (ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1
            or ps.get_context_parallel_world_size() > 1):
        return {}
    data = make_data(layout, 5)
    if dist.get_rank() == 0:
        data["input_ids"].values()[3] += 1  # one token differs on one rank
    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=3)
    step = EngineStep(engine=None)
    try:
        check_same_plans(step, [data], config)
        message = "not raised"
    except RuntimeError as e:
        message = str(e)
    return {"plan_mismatch": message}


def main(layout: str, out_path: str, device: str = "cpu", builder: str = "direct", actor_hf: str = "",
         critic_hf: str = "") -> None:
    from megatron_shims import write_reports

    init(layout, device)
    if builder == "bridge":
        from bridge_helpers import prepare_cpu_bridge

        prepare_cpu_bridge()
        BRIDGE_CHECKPOINTS.update(qwen2=actor_hf, qwen3=critic_hf)
    import verl.workers.engine.megatron.transformer_impl as impl
    from megatron.core.pipeline_parallel import get_forward_backward_func

    impl.get_forward_backward_func = get_forward_backward_func  # megatron's real schedules
    report = {"rank": dist.get_rank()}
    report.update(actor_report(layout))
    report.update(critic_report(layout))
    report.update(statistics_report(layout))
    report.update(plan_mismatch_report(layout))
    report.update(mtp_report(layout))
    if builder == "direct":
        report.update(fused_report(layout))
    write_reports(report, out_path)
    from ps_mcore import setup

    setup.uninstall()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:7])
