"""torchrun worker for tests/test_verl_ulysses.py: verl's real FSDP engine (0.8.0 or 0.9.1) under
DeepSpeed-Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` = world size,
tiny random Qwen2: 4 query / 2 kv heads), patched vs stock, on gloo (CPU) or NCCL.

Stock: verl's own Ulysses path (rows padded and sliced per rank, verl's all-to-all around
``_flash_attention_forward``, log-probs gathered with its gradient scaling). Patched: the
packed tree rows split over the SP ranks (``ps_mcore.fsdp_bridge.sequence_parallel``). Per
rank: actor log-probs and entropy (one float temperature, per-sample temperatures, and verl's
fused kernels with one float temperature), the PPO loss and every gradient summed over the SP
group (what FSDP's reduction sees), critic values, value loss and gradients. Test-only shims:
``tests/ulysses_shims.py`` (gloo has no all_to_all; no flash-attn kernel on CPU or on the GPU machine).

Section ``vlm``: a tiny Qwen2.5-VL (``tests/test_verl_vlm.py``'s builder) under Ulysses, stock
vs tree, on batches with images, without images and with different images under one prompt:
log-probs, entropy, the PPO loss, every gradient (vision tower included) and how many images the
vision tower encodes per rank. Stock is verl's engine with the parts of verl's Ulysses VLM patch
that import on transformers 5 (``patch_vlm_for_ulysses_input_slicing`` on the text model: slice
after the embedding; ``_ulysses_flash_attention_forward``); ``verl.models.transformers.qwen2_vl``
(verl's own model and attention forwards) cannot import there, so Hugging Face's run instead.

Usage: ``torchrun --standalone --nproc_per_node SP verl_ulysses_worker.py OUT [cpu|cuda] [text|vlm]``;
rank 0 writes every rank's JSON report to OUT.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from gloo_world import init_torchrun_world
import verl_batches  # noqa: F401  (before verl: verl 0.9.1 without a GPU gets the CPU platform)


def stock_ulysses_model(seed: int, value: bool, device: torch.device, fused: bool = False):
    """A tiny Qwen2 as verl's FSDP engine builds it for Ulysses: flash_attention_2 (the
    kernel shimmed), ``apply_monkey_patch(ulysses_sp_size=...)``; ``fused``: with verl's fused
    forward (torch backend), which replaces the model class's ``forward`` (see
    :func:`restored_class_forward`)."""
    from test_verl_fsdp import make_model
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model = make_model(seed=seed, value=value).to(device)
    model.config._attn_implementation_internal = "flash_attention_2"
    fused_kwargs = dict(use_fused_kernels=True, fused_kernels_backend="torch") if fused else {}
    apply_monkey_patch(model, ulysses_sp_size=dist.get_world_size(), use_remove_padding=True, **fused_kwargs)
    return model


@contextlib.contextmanager
def restored_class_forward(cls):
    """Give ``cls`` its own ``forward`` back on leaving (after uninstalling the patchset, whose
    tree wrapper of verl's fused forward would otherwise be restored later)."""
    from ps_mcore import setup

    forward = cls.__dict__["forward"]
    try:
        yield
    finally:
        setup.uninstall()
        cls.forward = forward


def _engine(cls, model, setting):
    from test_verl_fsdp import make_engine
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group
    from verl.workers.engine.fsdp import transformer_impl as impl

    engine = make_engine(impl, cls, model, setting, ulysses_sequence_parallel_size=dist.get_world_size())
    set_ulysses_sequence_parallel_group(engine.ulysses_parallel_group)  # what train/eval mode sets
    return engine


def _run(cls, model, data, setting, loss_fn, patched):
    from verl_helpers import fsdp_patchset

    from ps_mcore import setup

    if patched:
        setup.install([fsdp_patchset()])
    else:
        setup.uninstall()
    engine = _engine(cls, model, setting)
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    grads = []
    for p in model.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        dist.all_reduce(g, group=engine.ulysses_parallel_group)  # FSDP reduces over data x SP
        grads.append(g)
    return out, grads


HF_TEXT_FORWARD = "_test_hf_forward"  # the text model's forward before verl's slicing wrapper


def stock_ulysses_vlm(kind: str, device: torch.device):
    """A tiny Qwen2-VL / Qwen2.5-VL as verl's FSDP engine builds it for Ulysses: the text decoder
    on flash_attention_2 (the kernel shimmed) behind verl's Ulysses attention wrapper, verl's
    input slicing after the embedding; the vision tower (not sequence parallel) on sdpa."""
    from test_verl_vlm import make_vlm
    from transformers.integrations import flash_attention
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel
    from verl.models.transformers import monkey_patch

    model = make_vlm(kind).to(device)
    model.config.text_config._attn_implementation_internal = "flash_attention_2"
    for cls in (Qwen2VLTextModel, Qwen2_5_VLTextModel):  # what apply_monkey_patch does for them
        if not hasattr(cls, HF_TEXT_FORWARD):
            setattr(cls, HF_TEXT_FORWARD, cls.forward)
            monkey_patch.patch_vlm_for_ulysses_input_slicing(cls)
    flash_attention._flash_attention_forward = monkey_patch._ulysses_flash_attention_forward
    return model


def _grad_rel(a, b) -> float:
    return max(float((x - y).abs().max()) / max(float(x.abs().max()), 1e-12) for x, y in zip(a, b))


def _max_diff(a, b, mask=None) -> float:
    a, b = a.values().detach().cpu().float(), b.values().detach().cpu().float()
    if mask is not None:
        a, b = a[mask], b[mask]
    return float((a - b).abs().max())


def _data(seed, **meta):
    from verl_batches import WORKLOADS, make_batch

    rng = np.random.default_rng(seed)
    samples = WORKLOADS["tree"](rng) + WORKLOADS["grpo"](rng, prompts=1) + WORKLOADS["stepwise"](rng, steps=3)
    return make_batch(samples, rng, **{"temperature": 0.8, "max_token_len_per_gpu": 30, **meta})


def actor_report(device, per_sample: bool, fused: bool = False) -> dict:
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl_batches import sample_temperatures, seq_last_mask, step_tokens, tree_setting

    model = stock_ulysses_model(seed=4, value=False, device=device, fused=fused)
    data = _data(5, use_fused_kernels=fused)
    if per_sample:
        data["temperature"] = sample_temperatures(data.batch_size[0], seed=5)
    setting = tree_setting()
    loss_fn = partial(ppo_loss, config=FSDPActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2,
                                                       entropy_coeff=0.01))
    cls = impl.FSDPEngineWithLMHead
    stock_i, _ = _run(cls, model, data, setting, None, patched=False)
    tree_i, _ = _run(cls, model, data, setting, None, patched=True)
    stock_t, g_stock = _run(cls, model, data, setting, loss_fn, patched=False)
    tree_t, g_tree = _run(cls, model, data, setting, loss_fn, patched=True)
    s, t = stock_i["model_output"], tree_i["model_output"]
    keep = seq_last_mask(s["log_probs"])
    n, packed = step_tokens(tree_i)
    return {
        "offsets_equal": bool(torch.equal(s["log_probs"].offsets().cpu(), t["log_probs"].offsets().cpu())),
        "log_probs": _max_diff(s["log_probs"], t["log_probs"], keep),
        "entropy": _max_diff(s["entropy"], t["entropy"]),
        "loss": [float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))],
        "grad_rel": _grad_rel(g_stock, g_tree),
        "grad_norm": float(sum(float(g.norm()) for g in g_stock)),
        "tokens": [n, packed],
        "micro_batches": len(tree_i["metrics"]["prefix_sharing/tokens_in"]) if "prefix_sharing/tokens_in" in
        tree_i["metrics"] else 0,
    }


def fused_actor_report(device) -> dict:
    """:func:`actor_report` with verl's fused kernels (one float temperature: verl's fused
    forward refuses a temperature tensor)."""
    from transformers import Qwen2ForCausalLM

    with restored_class_forward(Qwen2ForCausalLM):
        return actor_report(device, per_sample=False, fused=True)


def statistics_report(device) -> dict:
    """``calculate_sum_pi_squared`` and top-k distillation (verl's ``distillation_ppo_loss`` as
    the logits processor: teacher ids sliced over the SP ranks in stock), per-sample
    temperatures: outputs, loss and every gradient."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl_batches import (
        DISTILLATION_KEYS, distillation_loss, sample_temperatures, step_tokens, tree_setting, with_statistics,
    )

    model = stock_ulysses_model(seed=6, value=False, device=device)
    data = with_statistics(_data(6), seed=6)
    data["temperature"] = sample_temperatures(data.batch_size[0], seed=6)
    loss_fn = distillation_loss(FSDPActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01), data)
    cls = impl.FSDPEngineWithLMHead
    stock, g_stock = _run(cls, model, data, tree_setting(), loss_fn, patched=False)
    tree, g_tree = _run(cls, model, data, tree_setting(), loss_fn, patched=True)
    keys = ("sum_pi_squared",) + DISTILLATION_KEYS
    s, t = stock["model_output"], tree["model_output"]
    return {
        "outputs": {k: _max_diff(s[k], t[k]) for k in keys},
        "loss": [float(np.sum(stock["loss"])), float(np.sum(tree["loss"]))],
        "grad_rel": _grad_rel(g_stock, g_tree),
        "tokens": list(step_tokens(tree)),
    }


def critic_report(device) -> dict:
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl.workers.utils.losses import value_loss

    from verl_batches import tree_setting, with_value_targets

    model = stock_ulysses_model(seed=3, value=True, device=device)
    data = with_value_targets(_data(8, use_dynamic_bsz=False, micro_batch_size_per_gpu=3), seed=8)
    setting = tree_setting()
    loss_fn = partial(value_loss, config=FSDPCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    cls = impl.FSDPEngineWithValueHead
    stock_i, _ = _run(cls, model, data, setting, None, patched=False)
    tree_i, _ = _run(cls, model, data, setting, None, patched=True)
    stock_t, g_stock = _run(cls, model, data, setting, loss_fn, patched=False)
    tree_t, g_tree = _run(cls, model, data, setting, loss_fn, patched=True)
    s, t = stock_i["model_output"]["values"], tree_i["model_output"]["values"]
    return {
        "values": _max_diff(s, t),
        "loss": [float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))],
        "grad_rel": _grad_rel(g_stock, g_tree),
    }


def vlm_report(device, kind: str = "qwen2_5_vl") -> dict:
    """Per layout: outputs, PPO loss and gradients stock vs tree; images the vision tower saw."""
    from test_verl_fsdp import _ppo, _setting
    from test_verl_vlm import LAYOUTS, vlm_batch
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl_batches import seq_last_mask, step_tokens

    from ps_mcore import setup

    model = stock_ulysses_vlm(kind, device)
    images_seen = []
    visual = type(model.model.visual)
    visual_forward = visual.forward

    def counting(self, hidden_states, grid_thw, **kwargs):
        images_seen.append(int(grid_thw.shape[0]))
        return visual_forward(self, hidden_states, grid_thw, **kwargs)

    visual.forward = counting
    def step(data, patched):
        images_seen.clear()
        out, grads = _run(impl.FSDPEngineWithLMHead, model, data, _setting("prompt_only"), _ppo(), patched)
        return out, grads, [p.grad is None for p in model.parameters()], sum(images_seen)

    report, stock_images = {}, None
    for layout in ("images", "text-only", "different-images"):
        data = vlm_batch(model, np.random.default_rng(LAYOUTS.index(layout)), layout)
        runs = [step(data, patched) for patched in (False, True)]
        stock_images = runs[0] if stock_images is None else stock_images
        (stock, g_stock, none_stock, img_stock), (tree, g_tree, none_tree, img_tree) = runs
        s, t = stock["model_output"], tree["model_output"]
        report[layout] = {
            "offsets_equal": bool(torch.equal(s["log_probs"].offsets().cpu(), t["log_probs"].offsets().cpu())),
            "log_probs": _max_diff(s["log_probs"], t["log_probs"], seq_last_mask(s["log_probs"])),
            "entropy": _max_diff(s["entropy"], t["entropy"]),
            "loss": [float(np.sum(stock["loss"])), float(np.sum(tree["loss"]))],
            "grad_rel": _grad_rel(g_stock, g_tree),
            "same_grads_present": none_stock == none_tree,
            "visual_grads": sum(float(g.abs().sum()) for (n, _), g in zip(model.named_parameters(), g_tree)
                                if ".visual." in f".{n}"),
            "tokens": list(step_tokens(tree)),
            "images_encoded": [img_stock, img_tree],
        }
    # the tree slices after the embedding by itself too (verl's slicing wrapper not installed)
    text_model = type(model.model.language_model)
    verl_forward, text_model.forward = text_model.forward, getattr(text_model, HF_TEXT_FORWARD)
    tree, g_tree, *_ = step(vlm_batch(model, np.random.default_rng(LAYOUTS.index("images")), "images"), True)
    setup.uninstall()
    text_model.forward = verl_forward
    report["images_without_verl_slicing"] = {
        "loss": [float(np.sum(stock_images[0]["loss"])), float(np.sum(tree["loss"]))],
        "grad_rel": _grad_rel(stock_images[1], g_tree),
    }
    visual.forward = visual_forward
    return report


def main(out_path: str, device: str = "cpu", section: str = "text") -> None:
    from megatron_shims import write_reports
    from ulysses_shims import emulate_all_to_all, varlen_attention_from_position_ids
    from verl.models.transformers import monkey_patch

    dev = init_torchrun_world(device)
    emulate_all_to_all()
    monkey_patch._flash_attention_forward = varlen_attention_from_position_ids
    if section == "vlm":
        report = {"rank": dist.get_rank(), "vlm": vlm_report(dev)}
    else:
        report = {
            "rank": dist.get_rank(),
            "actor": actor_report(dev, per_sample=False),
            "actor_per_sample_temperature": actor_report(dev, per_sample=True),
            "actor_fused": fused_actor_report(dev),
            "critic": critic_report(dev),
            "statistics": statistics_report(dev),
        }
    write_reports(report, out_path)
    from ps_mcore import setup

    setup.uninstall()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
