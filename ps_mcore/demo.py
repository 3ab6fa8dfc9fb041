"""``ps-mcore demo``: every standard workload through a tiny Megatron GPT, shared vs. unshared.

One real megatron-core ``GPTModel`` with tree specs (Qwen2-like: GQA, qkv bias, RMSNorm,
SwiGLU, RoPE) runs each workload twice per training step, as the packed prefix forest and
as the unshared batch (one segment per sequence), and the table shows what sharing saved
and that nothing changed: log-probs and every parameter gradient of a per-sample-weighted
loss agree. Exit status 1 when they do not.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ps_mcore.flops import DecoderShape
from ps_mcore.planner import TreePlan, plan_prefix_tree, plan_unshared
from ps_mcore.workloads import WORKLOADS, Workload, make_workload

TINY = DecoderShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1024)
TOLERANCE = 1e-4  # fp32: max |delta log-prob| and max relative gradient difference

# The planner the demo uses; tests swap in a broken one to see the parity check fail.
plan_fn: Callable[[Workload], TreePlan] = lambda w: plan_prefix_tree(w.sequences)  # noqa: E731


@dataclass
class StepResult:
    logprobs: torch.Tensor
    grads: dict[str, torch.Tensor]
    ms: float
    activation_mib: float


def _init_megatron() -> None:
    """A one-process group and Megatron parallel state (TP=PP=CP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def build_model(shape: DecoderShape, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A real megatron-core GPTModel with tree specs, fp32, random weights."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    _init_megatron()
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.1,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config, get_gpt_layer_local_tree_spec(normalization="RMSNorm"), vocab_size=shape.vocab,
        max_sequence_length=1 << 16, position_embedding_type="rope", rotary_base=1_000_000,
        share_embeddings_and_output_weights=False,
    )
    return model.to(device)


def train_step(model, plan: TreePlan, token_weight: torch.Tensor, iters: int) -> StepResult:
    """Forward + backward of a per-sample-weighted log-prob loss; median time of ``iters``."""
    from ps_mcore.layer_specs import TreePackedSeqParams
    from ps_mcore.logprobs import token_logprobs

    psp = TreePackedSeqParams.from_plan(plan)
    saved: dict[int, int] = {}

    def count(x):
        if x.device.type != "meta":
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    def step(measure_memory=False):
        model.zero_grad(set_to_none=True)
        hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda x: x)
        with hooks if measure_memory else contextlib.nullcontext():
            logits = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                           attention_mask=None, packed_seq_params=psp)[0]
            logprobs, _ = token_logprobs(logits, plan)
        (-(logprobs * token_weight).sum() / token_weight.numel()).backward()
        return logprobs.detach()

    logprobs = step(measure_memory=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    step()  # warm-up: allocator, caches
    times = []
    for _ in range(iters):
        if plan.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if plan.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return StepResult(logprobs, grads, float(np.median(times)), sum(saved.values()) / 2**20)


@contextlib.contextmanager
def _megatron_rope_on(device: torch.device):
    """Megatron's RoPE moves its frequencies to ``torch.cuda.current_device()`` on first use;
    on a CPU-only machine point that at the CPU for the demo's duration (restored after)."""
    if device.type != "cpu":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def compare(model, w: Workload, device, iters: int, seed: int) -> dict:
    plan = plan_fn(w).to(device)
    unshared = plan_unshared(w.sequences).to(device)
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.2, 2.0, len(w.sequences))
    token_weight = torch.tensor(np.repeat(weights, [len(s) for s in w.sequences]),
                                dtype=torch.float32, device=device)
    base = train_step(model, unshared, token_weight, iters)
    tree = train_step(model, plan, token_weight, iters)
    grad_rel = max(
        ((tree.grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in base.grads.items()
    )
    stats = plan.stats()
    return {
        "workload": w.name, "N": stats["N"], "T": stats["T"], "dedup": stats["dedup"],
        "ideal": TINY.ideal_speedup(stats), "unshared ms": base.ms, "shared ms": tree.ms,
        "speedup": base.ms / tree.ms, "act MiB unshared": base.activation_mib,
        "act MiB shared": tree.activation_mib,
        "max |d logp|": (tree.logprobs - base.logprobs).abs().max().item(),
        "max grad rel": grad_rel,
    }


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--scale", type=float, default=1 / 16,
                        help="length scale of the standard workloads (default 1/16)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per path")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)


def run_demo(args: argparse.Namespace) -> int:
    from ps_mcore.table import format_table

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    model = build_model(TINY, device, args.seed)
    rows = []
    for i, name in enumerate(args.workloads):
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(args.workloads)}] {name} ...", end="", file=sys.stderr, flush=True)
        w = make_workload(name, seed=args.seed, scale=args.scale, vocab=TINY.vocab)
        with _megatron_rope_on(device):
            rows.append(compare(model, w, device, args.iters, args.seed))
        print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    ok = all(r["max |d logp|"] < TOLERANCE and r["max grad rel"] < TOLERANCE for r in rows)
    for r in rows:
        r["parity"] = "ok" if r["max |d logp|"] < TOLERANCE and r["max grad rel"] < TOLERANCE else "FAIL"
    print(f"ps-mcore demo: tiny Megatron GPT ({TINY.layers} layers, hidden {TINY.hidden}, GQA "
          f"{TINY.heads}/{TINY.kv_heads}), fp32 on {device}, workloads at scale {args.scale:g}")
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]))
    print("parity: " + ("shared == unshared (log-probs and all gradients)" if ok else
                        f"FAILED (tolerance {TOLERANCE:g})"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ps-mcore demo", description=__doc__)
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))
