"""torchrun worker for tests/test_megatron_parallel.py: the tree-spec GPTModel under one
model-parallel layout (CP, TP+SP, PP, CP x TP+SP) on gloo (CPU) or NCCL (one GPU per rank).

Usage: ``torchrun --standalone --nproc_per_node N megatron_parallel_worker.py LAYOUT PAYLOAD OUT
[cpu|cuda]``. PAYLOAD (written by the test) holds, per tiny config (of KINDS), the single-rank
weights and the cases
(plan, per-token weights, logits probe). Every rank runs every case on the same model (grads
accumulate over cases); rank 0 writes the full logits, log-probs, entropies and gradients
(gathered over TP / CP / PP) plus the messages of the refusals it checked to OUT.
"""

from __future__ import annotations

import re
import sys

import torch
import torch.distributed as dist

from megatron_shims import (
    build_gpt,
    enable_cpu_pipeline,
    finalize_grads,
    init_cpu_megatron,
    layer_spec_args,
    shard_,
    sp_block_spec,
    tiny_config,
    unshard,
)

KINDS = ("qwen2", "qwen3")
# sliding windows in alternating layers and learnable sinks (megatron's window_size /
# window_attn_skip_freq / softmax_type) on the qwen2 shapes: run under CP=2
VARIANT_KINDS = ("qwen2-swa-sinks",)
DEVICE = torch.device("cpu")  # main() sets the rank's GPU for "cuda"
LAYOUTS = {
    "single": dict(tp=1, cp=1, pp=1, sp=False),
    "cp2": dict(tp=1, cp=2, pp=1, sp=False),
    "tp2sp": dict(tp=2, cp=1, pp=1, sp=True),
    "pp2": dict(tp=1, cp=1, pp=2, sp=False),
    "cp2tp2sp": dict(tp=2, cp=2, pp=1, sp=True),
}


def world_size(layout: str) -> int:
    lay = LAYOUTS[layout]
    return lay["tp"] * lay["cp"] * lay["pp"]


def pad_multiple(layout: str) -> int:
    """verl's THD rule: a multiple of TP, of 2*CP*TP under CP."""
    lay = LAYOUTS[layout]
    return 2 * lay["cp"] * lay["tp"] if lay["cp"] > 1 else lay["tp"]


def build_model(kind: str, layout: str, **model_kwargs):
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    lay = LAYOUTS[layout]
    extra = dict(tensor_model_parallel_size=lay["tp"], context_parallel_size=lay["cp"],
                 sequence_parallel=lay["sp"])
    if lay["pp"] > 1:  # variable_seq_lengths: micro-batches of different T_pad, as verl runs
        # (megatron's config check rejects it with the default MoE dispatcher, even without MoE)
        extra.update(pipeline_model_parallel_size=lay["pp"], pipeline_dtype=torch.float32,
                     variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    cfg = tiny_config(kind, **extra)
    cfg.tree_attention_backend = "chunked"  # exact fp32 math on any device (CUDA too)
    spec = get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))
    if lay["sp"]:
        spec = sp_block_spec(spec, cfg.num_layers)
    return build_gpt(cfg, spec, **model_kwargs).to(DEVICE)


def tree_loss(logits, psp, w_tok, probe, tp_group=None, cp_group=None):
    """``sum(w * (logprobs + 0.1 * entropy)) + 1e-2 * <unpacked logits, probe>`` from this
    rank's logits ``[T_pad / cp, V_local]``; returns (loss, full-row outputs)."""
    from ps_mcore.layer_specs import cp_token_logprobs, gather_cp_rows

    plan = psp.plan
    lp, ent = cp_token_logprobs(logits, psp, compute_entropy=True, tp_group=tp_group, cp_group=cp_group)
    full = gather_cp_rows(logits, psp, cp_group)  # [T_pad, V_local] plan order
    loss = (w_tok * (lp + 0.1 * ent)).sum() + 1e-2 * (plan.unpack(full) * probe).sum()
    out = {"logits": full[: plan.num_tokens].detach(), "logprobs": lp.detach(), "entropy": ent.detach()}
    return loss, out


def packed_params(plan, layout: str, cp_rank: int = 0):
    from ps_mcore.layer_specs import TreePackedSeqParams

    return TreePackedSeqParams.from_plan(
        plan, pad_to_multiple_of=pad_multiple(layout), cp_size=LAYOUTS[layout]["cp"], cp_rank=cp_rank
    )


def tree_step(model, case, layout: str, cp_rank=0, tp_group=None, cp_group=None) -> dict:
    """Forward + backward of one case on this rank's rows (grads accumulate)."""
    plan = case["plan"]
    psp = packed_params(plan, layout, cp_rank)
    logits = model(
        input_ids=psp.cp_shard(plan.input_ids)[None], position_ids=psp.cp_shard(psp.position_ids)[None],
        attention_mask=None, packed_seq_params=psp,
    )[0]
    loss, out = tree_loss(logits, psp, case["w_tok"], case["probe"], tp_group, cp_group)
    loss.backward()
    return out


# ----------------------------------------------------------------------------- refusals


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "not raised"


def cp_refusals(model, plan, cp_group) -> dict:
    """What a CP model does with batches it cannot run (messages, checked by the test)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ps_mcore.layer_specs import TreeCoreAttention, TreePackedSeqParams

    cfg = model.config
    core = model.decoder.layers[0].self_attention.core_attention
    q = torch.zeros(8, 4, 16, device=DEVICE)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)  # not padded to 2*cp
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6,
                          max_seqlen_kv=6)
    no_cp = TreePackedSeqParams.from_plan(plan)
    return {
        "flex": _message(lambda: TreeCoreAttention(cfg, 1, backend="flex")),
        "sbhd": _message(lambda: core(q[:, None], q[:, None], q[:, None], None)),
        "thd": _message(lambda: core(q, q, q, None, packed_seq_params=thd)),
        "no_cp_params": _message(lambda: core(q, q, q, None, packed_seq_params=no_cp)),
        "wrong_rank": _message(lambda: core(q, q, q, None, packed_seq_params=TreePackedSeqParams.from_plan(
            plan, 4, cp_size=2, cp_rank=1 - dist.get_rank(cp_group)))),
    }


# ----------------------------------------------------------------------------- layouts


def _load(model, state, tp_rank, tp, rename=lambda n: n) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_(state[rename(name)], p, tp_rank, tp))


def run_cases(kind: str, layout: str, case_list: list, state: dict) -> dict:
    from megatron.core import parallel_state as ps

    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    cp_rank = ps.get_context_parallel_rank()
    model = build_model(kind, layout)
    _load(model, state, tp_rank, tp)
    outs = []
    for case in case_list:
        probe = case["probe"].chunk(tp, dim=1)[tp_rank]  # the vocab shard this rank's logits hold
        out = tree_step(model, {**case, "probe": probe}, layout, cp_rank, tp_group, cp_group)
        parts = [torch.empty_like(out["logits"]) for _ in range(tp)]
        dist.all_gather(parts, out["logits"].contiguous(), group=tp_group)
        outs.append({**out, "logits": torch.cat(parts, -1)})
    finalize_grads(model, model.config, tp_group, cp_group)
    grads = {n: unshard(p.grad, p, tp_group) for n, p in model.named_parameters()}
    result = {"cases": outs, "grads": grads}
    if LAYOUTS[layout]["cp"] > 1:
        result["refusals"] = cp_refusals(model, case_list[0]["plan"], cp_group)
    return result


def _global_layer_names(offset: int):
    """Stage-local ``decoder.layers.{i}.`` <-> global ``decoder.layers.{offset + i}.``."""
    def to_global(name: str) -> str:
        return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)

    return to_global


def run_pipeline(kind: str, layout: str, case_list: list, state: dict) -> dict:
    """Megatron's 1F1B schedule over the cases as micro-batches; every stage plans alike."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ps_mcore.layer_specs import assert_same_plan

    if DEVICE.type == "cpu":
        enable_cpu_pipeline()
    group = ps.get_pipeline_model_parallel_group()
    rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    first, last = rank == 0, rank == pp - 1
    model = build_model(kind, layout, pre_process=first, post_process=last)
    to_global = _global_layer_names(rank * model.config.num_layers // pp)
    _load(model, state, 0, 1, to_global)

    plans = [case["plan"] for case in case_list]
    refusals = {"pp_plan_mismatch": _message(  # one stage planned the micro-batches in another order
        lambda: assert_same_plan(plans if first else plans[::-1], group))}
    assert_same_plan(plans, group)  # before the schedule: a collective inside forward_step deadlocks
    outs: list[dict] = []

    def forward_step(data_iterator, model):
        case = next(data_iterator)
        plan = case["plan"]
        psp = packed_params(plan, layout)
        output = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                       attention_mask=None, packed_seq_params=psp)

        def loss_func(logits):  # last stage only: it alone unpacks
            loss, out = tree_loss(logits[0], psp, case["w_tok"], case["probe"])
            outs.append(out)
            return loss * len(case_list), {}  # the schedule divides by the micro-batch count

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(case_list), model=[model],
        num_microbatches=len(case_list), seq_length=max(p.num_tokens for p in plans),
        micro_batch_size=1, forward_only=False,
    )
    local = _to({"grads": {to_global(n): p.grad for n, p in model.named_parameters()},
                 "cases": outs if last else None}, "cpu")
    gathered = [None] * pp
    dist.all_gather_object(gathered, local, group=group)
    grads = {n: g for part in gathered for n, g in part["grads"].items()}
    cases = next(part["cases"] for part in gathered if part["cases"] is not None)
    return {"cases": cases, "grads": grads, "refusals": refusals}


def _to(obj, device):
    """Tensors (and plans) inside dicts / lists moved to ``device``."""
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj.to(device) if hasattr(obj, "to") else obj


def init_cuda_megatron(tp: int, cp: int, pp: int) -> None:
    """NCCL, one GPU per rank, megatron parallel state and its CUDA RNG."""
    import os

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    global DEVICE
    DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def main(layout: str, payload_path: str, out_path: str, device: str = "cpu") -> None:
    lay = LAYOUTS[layout]
    init = init_cpu_megatron if device == "cpu" else init_cuda_megatron
    init(tp=lay["tp"], cp=lay["cp"], pp=lay["pp"])
    payload = torch.load(payload_path, weights_only=False)
    run = run_pipeline if lay["pp"] > 1 else run_cases
    results = {kind: _to(run(kind, layout, _to(case["cases"], DEVICE), case["state"]), "cpu")
               for kind, case in payload.items()}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
