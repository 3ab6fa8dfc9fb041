"""``ps-mcore demo``: every standard workload through a tiny Megatron GPT, shared vs. unshared.

One real megatron-core ``GPTModel`` with tree specs (Qwen2-like: GQA, qkv bias, RMSNorm,
SwiGLU, RoPE) runs each workload twice per training step, as the packed prefix forest and
as the unshared batch (one segment per sequence), and the table shows what sharing saved
and that nothing changed: log-probs and every parameter gradient of a per-sample-weighted
loss agree. Exit status 1 when they do not, 2 on a usage error (e.g. ``--device cuda`` without
a GPU). Third-party warnings are hidden unless ``-v``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
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


# Timing on a shared CPU is noisy: each path's steps alternate with the other's (load changes
# hit both) and the median of --iters counts. A row is flagged when its timings spread more
# than NOISE_SPREAD of their median, or its speedup beats the FLOP ideal by NOISE_OVER_IDEAL
# (sharing cannot save more work than the FLOPs it removes).
NOISE_SPREAD = 0.5
NOISE_OVER_IDEAL = 1.5

LEGEND = """\
N, T: tokens unshared / packed (dedup = N/T); ideal: model-FLOP ratio, the most sharing can save;
ms: median of --iters alternating training steps (fwd+bwd, log-probs); speedup = unshared/shared ms;
act MiB: activations kept for backward; max |d logp|, max grad rel: shared vs. unshared log-probs
and parameter gradients (relative); parity ok when both are below {tol:g}."""


@dataclass
class StepResult:
    logprobs: torch.Tensor
    grads: dict[str, torch.Tensor]
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


def make_step(model, plan: TreePlan, token_weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """One training step (forward + backward of a per-sample-weighted log-prob loss) on
    ``plan``; ``step(measure_memory=True)`` also records the activations saved for backward
    in ``step.saved`` (storage -> bytes). Returns the detached log-probs ``[N]``."""
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

    step.saved = saved
    return step


def first_step(model, step) -> StepResult:
    """Run ``step`` once, keeping its log-probs, every parameter gradient and its activations."""
    logprobs = step(measure_memory=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return StepResult(logprobs, grads, sum(step.saved.values()) / 2**20)


def time_alternating(steps: list[Callable], iters: int, device: torch.device) -> list[list[float]]:
    """Milliseconds of ``iters`` runs of each step, run in turn (a, b, a, b, ...) after one
    warm-up each, so a load change on a shared machine hits every path alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps:
        step()  # warm-up: allocator, caches
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(iters):
        for step, out in zip(steps, times):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
    return times


def noisy_timing(times: list[list[float]], speedup: float, ideal: float) -> bool:
    """True when these timings cannot be trusted: a path's runs spread more than
    ``NOISE_SPREAD`` of their median, or the speedup beats the ideal by ``NOISE_OVER_IDEAL``."""
    spread = max((max(t) - min(t)) / max(float(np.median(t)), 1e-9) for t in times)
    return spread > NOISE_SPREAD or speedup > ideal * NOISE_OVER_IDEAL


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
    steps = [make_step(model, unshared, token_weight), make_step(model, plan, token_weight)]
    base, tree = (first_step(model, step) for step in steps)
    base_ms, tree_ms = time_alternating(steps, iters, plan.device)
    grad_rel = max(
        ((tree.grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in base.grads.items()
    )
    stats = plan.stats()
    ideal = TINY.ideal_speedup(stats)
    speedup = float(np.median(base_ms) / np.median(tree_ms))
    noisy = noisy_timing([base_ms, tree_ms], speedup, ideal)
    return {
        "workload": w.name, "N": stats["N"], "T": stats["T"], "dedup": stats["dedup"],
        "ideal": ideal, "unshared ms": float(np.median(base_ms)), "shared ms": float(np.median(tree_ms)),
        "speedup": speedup, "act MiB unshared": base.activation_mib,
        "act MiB shared": tree.activation_mib,
        "max |d logp|": (tree.logprobs - base.logprobs).abs().max().item(),
        "max grad rel": grad_rel, "noisy": noisy,
    }


def _bounded(kind: type, allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a positive (or, with ``allow_zero``, non-negative) finite ``kind``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else 'positive'}, got {text}")
        return value

    parse.__name__ = f"{'non-negative' if allow_zero else 'positive'} {kind.__name__}"
    return parse


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--scale", type=_bounded(float), default=1 / 16,
                        help="length scale of the standard workloads (default 1/16)")
    parser.add_argument("--iters", type=_bounded(int), default=3,
                        help="timed steps per path, alternating; the median counts (default 3)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (cuda if available, else cpu), cpu or cuda")
    parser.add_argument("--seed", type=_bounded(int, allow_zero=True), default=0,
                        help="seed of the workloads, the weights and the loss weights (default 0)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show third-party warnings (Megatron's missing TE/Apex notes), hidden by default")


def _resolve_device(name: str) -> torch.device | str:
    """The device, or the one-line reason it cannot be used here (a usage error)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"--device cuda: no CUDA device is available (torch {torch.__version__}, {build}); "
                "use --device cpu or auto")
    return torch.device(name)


@contextlib.contextmanager
def _third_party_warnings(show: bool):
    """Hide other packages' warnings (Megatron's "TE/Apex not installed" notes on CPU) unless
    ``show``; ps-mcore's own warnings (fallbacks) always show."""
    if show:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", message=r"\[prefix_sharing\]")
        warnings.filterwarnings("default", module=r"ps_mcore(\.|$)")
        yield


def run_demo(args: argparse.Namespace) -> int:
    from ps_mcore.table import format_cell, format_table

    device = _resolve_device(args.device)
    if isinstance(device, str):
        print(f"ps-mcore demo: error: {device}", file=sys.stderr)
        return 2
    rows = []
    with _third_party_warnings(getattr(args, "verbose", False)):
        model = build_model(TINY, device, args.seed)
        for i, name in enumerate(args.workloads):
            t0 = time.perf_counter()
            print(f"[{i + 1}/{len(args.workloads)}] {name} ...", end="", file=sys.stderr, flush=True)
            w = make_workload(name, seed=args.seed, scale=args.scale, vocab=TINY.vocab)
            with _megatron_rope_on(device):
                rows.append(compare(model, w, device, args.iters, args.seed))
            print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    ok = all(r["max |d logp|"] < TOLERANCE and r["max grad rel"] < TOLERANCE for r in rows)
    noisy = [r.pop("noisy") for r in rows]
    for r, flag in zip(rows, noisy):
        r["parity"] = "ok" if r["max |d logp|"] < TOLERANCE and r["max grad rel"] < TOLERANCE else "FAIL"
        if flag:
            r["speedup"] = format_cell(r["speedup"]) + "*"
    print(f"ps-mcore demo: tiny Megatron GPT ({TINY.layers} layers, hidden {TINY.hidden}, GQA "
          f"{TINY.heads}/{TINY.kv_heads}), fp32 on {device}, workloads at scale {args.scale:g}")
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]))
    print(LEGEND.format(tol=TOLERANCE))
    if any(noisy):
        print(f"* noisy timing (runs spread over {NOISE_SPREAD:.0%} of their median, or speedup over "
              f"{NOISE_OVER_IDEAL:g}x the ideal): this machine is busy; parity is unaffected. "
              "Rerun with more --iters\n  or on an idle machine.")
    print("parity: " + ("shared == unshared (log-probs and all gradients)" if ok else
                        f"FAILED (tolerance {TOLERANCE:g})"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ps-mcore demo", description=__doc__)
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))
