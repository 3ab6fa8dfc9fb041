"""``ps-mcore demo``: every standard workload through a Megatron GPT, shared vs. unshared.

A real megatron-core ``GPTModel`` with tree specs (Qwen2-like: GQA, qkv bias, RMSNorm,
SwiGLU, RoPE) runs each workload twice per training step, as the packed prefix forest and
as the unshared batch (one segment per sequence), and the tables show what sharing saved
and that nothing changed: log-probs and every parameter gradient of a per-sample-weighted
loss agree (fp32, to 1e-4).

On the CPU one tiny model (fp32, workloads at 1/16 of their length) does both. On a GPU the
parity check runs that tiny model in fp32 with the pure-torch attention kernel, and the
speed table is what a GPU user gets: a model with Qwen2.5-1.5B layer shapes (4 layers) in
bf16, the attention kernels ``auto`` picks (torch's flash kernel, or cuDNN through
Transformer Engine where installed), the standard workloads at full length (about 45 GB peak
on the longest; ``--scale`` shrinks them), steps timed after warm-up, queued back to back as a
training loop runs micro-batches.

With ``--max-tokens N`` (a micro-batch token budget, at the workloads' scale) the shared side
is the cross-micro-batch schedule (:mod:`ps_mcore.minibatch`): the forest is cut into steps of
at most N tokens (kept prefix state included) and every row is computed once; the tables add
what splitting the sharing units into pieces of N tokens would compute instead, and the
``agent-long`` workload (several budgets large) joins the default set. On a GPU the parity
table, at its own scale, gets the budget scaled with it.

Exit status 1 when parity fails, 2 on a usage error (e.g. ``--device cuda`` without a GPU, or
a budget too small for a workload's context). Third-party warnings are hidden unless ``-v``.
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

from ps_mcore.attention.backends import auto_choice, cp_kernel
from ps_mcore.attention.kernel_choice import context_plan_shape
from ps_mcore.flops import DecoderShape
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.integrations.verl_common.microbatch import split_unit_tokens
from ps_mcore.logprobs import token_logprobs
from ps_mcore.minibatch import BudgetTooSmall, MiniBatchPlan, kept_kv_row_cost, schedule_tree
from ps_mcore.planner import TreePlan, plan_prefix_tree, plan_unshared
from ps_mcore.schedule import ScheduleRunner
from ps_mcore.table import format_cell, format_table
from ps_mcore.workloads import ALL_WORKLOADS, BUDGET_WORKLOADS, WORKLOADS, Workload, make_workload

TINY = DecoderShape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1024)
# What the GPU speed table runs: Qwen2.5-1.5B layer shapes, 4 layers (benchmarks/model.py's model).
GPU_SHAPE = DecoderShape(layers=4, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936)
TOLERANCE = 1e-4  # fp32: max |delta log-prob| and max relative gradient difference
CPU_SCALE = 1 / 16

# The planner the demo uses; tests swap in a broken one to see the parity check fail.
plan_fn: Callable[[Workload], TreePlan] = lambda w: plan_prefix_tree(w.sequences)  # noqa: E731


# Timing on a CPU shared with other work: the two paths' steps alternate (load changes hit
# both), each path runs at least --iters times and until TIMED_SECONDS of its steps have
# run, and the fastest run counts (other load only ever slows a run down). A row is flagged
# when not even a path's two fastest runs agree within NOISE_SPREAD, or its speedup beats the
# FLOP ideal by NOISE_OVER_IDEAL (sharing cannot save more work than the FLOPs it removes).
# On a GPU steps are queued back to back, each between its own CUDA events, after
# GPU_WARMUP untimed steps; the median counts.
NOISE_SPREAD = 0.25
NOISE_OVER_IDEAL = 1.5
TIMED_SECONDS = 0.5
MAX_ITERS = 25
GPU_WARMUP = 2

LEGEND = """\
N, T: tokens unshared / packed (dedup = N/T); ideal: model-FLOP ratio, the most sharing can save;
ms: {timing} training steps (fwd+bwd, log-probs); speedup = unshared/shared ms;
act MiB: activations kept for backward; max |d logp|, max grad rel: shared vs. unshared log-probs
and parameter gradients (relative){bf16}."""
CPU_TIMING = "fastest of the alternating"
GPU_TIMING = "median of the queued"
BF16_NOTE = ";\nin bf16 the two paths round differently (log-probs differ by up to a few 1e-2): exactness is what the\nfp32 parity table checks"
BUDGET_LEGEND = """With --max-tokens {budget}: T split = tokens computed when every sharing unit larger than the budget
is split into pieces that each recompute their shared prefix ("-": a sequence is longer than the
budget, which splitting cannot run); the shared side is the cross-micro-batch
schedule: T computed once, recomputed = forwards run again before a K/V-kept prefix's backward, steps =
micro-batches; its act MiB is the peak over steps of the activations held (kept prefix graphs included)
plus the kept K/V and gradient accumulators."""


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


def build_model(shape: DecoderShape, device: torch.device, seed: int = 0,
                dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.nn.Module:
    """A real megatron-core GPTModel with tree specs, random weights; ``backend`` is its tree
    attention backend (``config.tree_attention_backend``)."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec  # imports megatron-core

    _init_megatron()
    torch.manual_seed(seed)
    on_gpu = device.type == "cuda"
    if on_gpu:  # parameters are initialised on the GPU, from Megatron's CUDA RNG
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=not on_gpu, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        init_method_std=0.1 if dtype == torch.float32 else 0.02,
        # no torch.compile'd fusions: nothing recompiles as the workloads' shapes change
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    config.tree_attention_backend = backend
    model = GPTModel(
        config, get_gpt_layer_local_tree_spec(normalization="RMSNorm"), vocab_size=shape.vocab,
        max_sequence_length=1 << 16, position_embedding_type="rope", rotary_base=1_000_000,
        share_embeddings_and_output_weights=False,
    )
    return model.to(device)


def _saved_bytes_hook(saved: dict[int, int]):
    """Record every tensor saved for backward in ``saved`` (storage -> bytes)."""

    def count(x):
        if x.device.type != "meta":
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    return torch.autograd.graph.saved_tensors_hooks(count, lambda x: x)


def make_step(model, plan: TreePlan, token_weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """One training step (forward + backward of a per-sample-weighted log-prob loss) on
    ``plan``; ``step(measure_memory=True)`` also records the activations saved for backward
    in ``step.saved`` (storage -> bytes). Returns the detached log-probs ``[N]``."""
    from ps_mcore.layer_specs import TreePackedSeqParams  # imports megatron-core

    psp = TreePackedSeqParams.from_plan(plan)
    saved: dict[int, int] = {}

    def step(measure_memory=False):
        model.zero_grad(set_to_none=True)
        with _saved_bytes_hook(saved) if measure_memory else contextlib.nullcontext():
            logits = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                           attention_mask=None, packed_seq_params=psp)[0]
            logprobs, _ = token_logprobs(logits, plan)
        (-(logprobs * token_weight).sum() / token_weight.numel()).backward()
        return logprobs.detach()

    step.saved = saved
    return step


def make_schedule_step(model, plan: MiniBatchPlan, token_weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """One training step over a cross-micro-batch schedule: every step's forward, its share of
    the per-sample-weighted loss, its backward and releases. ``step(measure_memory=True)`` puts
    the peak held bytes in ``step.saved`` (see :func:`schedule_peak_bytes`). Returns the
    detached log-probs ``[N]``."""
    from ps_mcore.layer_specs.schedule import gpt_call  # imports megatron-core

    run_call = gpt_call(model)
    tokens = [torch.from_numpy(plan.sample_tokens(s.samples)).to(token_weight.device) for s in plan.steps]
    saved: dict[str, int] = {}

    def step(measure_memory=False):
        model.zero_grad(set_to_none=True)
        call_bytes: dict[int, int] = {}
        kept_bytes = [0]

        def measured(call_plan):
            held: dict[int, int] = {}
            with _saved_bytes_hook(held):
                out = run_call(call_plan)
            call = getattr(call_plan, "call", 0)  # a forest that fits: one call, the TreePlan
            call_bytes.setdefault(call, sum(held.values()))  # the first run of a call
            return out

        runner = ScheduleRunner(plan, measured if measure_memory else run_call)
        logprobs = torch.empty(plan.tree.num_input_tokens, device=token_weight.device)
        for j, rows in enumerate(tokens):
            out = runner.forward(j)
            kept_bytes[0] = max(kept_bytes[0], runner.kept_bytes())
            logprobs[rows] = out["log_probs"].detach()
            (-(out["log_probs"] * token_weight[rows]).sum() / token_weight.numel()).backward()
            runner.release(j)
        runner.finish()
        if measure_memory:
            saved["peak"] = schedule_peak_bytes(plan, call_bytes) + kept_bytes[0]
        return logprobs

    step.saved = saved
    return step


def schedule_peak_bytes(plan: MiniBatchPlan, call_bytes: dict[int, int]) -> int:
    """Peak over steps of the activations a schedule holds: the bytes its calls saved for
    backward, plus those of graph-kept calls from earlier steps not yet released."""
    peak = 0
    for step in plan.steps:
        held = sum(call_bytes.get(c, 0) for c in step.calls)
        held += sum(call_bytes.get(c.index, 0) for c in plan.calls
                    if c.kept and not c.recompute and c.step < step.index <= c.release)
        peak = max(peak, held)
    return peak


def first_step(model, step) -> StepResult:
    """Run ``step`` once, keeping its log-probs, every parameter gradient and its activations."""
    logprobs = step(measure_memory=True)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return StepResult(logprobs, grads, sum(step.saved.values()) / 2**20)


def time_alternating(steps: list[Callable], iters: int) -> list[list[float]]:
    """Milliseconds of runs of each step, run in turn (a, b, a, b, ...) after one warm-up each,
    so a load change on a shared machine hits every path alike: at least ``iters`` runs each,
    and more (up to ``MAX_ITERS``) until every path has run for ``TIMED_SECONDS``."""
    for step in steps:
        step()  # warm-up: allocator, caches
    times: list[list[float]] = [[] for _ in steps]
    while len(times[0]) < iters or (
        len(times[0]) < MAX_ITERS and min(sum(t) for t in times) < TIMED_SECONDS * 1e3
    ):
        for step, out in zip(steps, times):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
    return times


def time_queued(steps: list[Callable], iters: int) -> list[list[float]]:
    """Milliseconds of ``iters`` runs of each step on the GPU after ``GPU_WARMUP`` untimed ones:
    steps queued back to back (the host runs ahead, as in a training loop), each between its
    own two CUDA events, one synchronisation at the end."""
    timed = []
    for step in steps:
        for _ in range(GPU_WARMUP):
            step()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        timed.append([start.elapsed_time(end) for start, end in events])
    return timed


def noisy_timing(times: list[list[float]], speedup: float, ideal: float) -> bool:
    """True when these CPU timings cannot be trusted: a path's two fastest runs differ by more
    than ``NOISE_SPREAD`` of the fastest, or the speedup beats the ideal by ``NOISE_OVER_IDEAL``."""
    def spread(t: list[float]) -> float:
        fastest = sorted(t)[:2]
        return (fastest[-1] - fastest[0]) / max(fastest[0], 1e-9)

    return max(map(spread, times)) > NOISE_SPREAD or speedup > ideal * NOISE_OVER_IDEAL


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


def split_tokens(w: Workload, max_tokens: int) -> float:
    """Tokens computed when every sharing unit larger than ``max_tokens`` is split into pieces
    that each recompute their shared prefix (the verl glue's dynamic micro-batching); NaN when
    a sequence is longer than the budget (that path cannot run it)."""
    if max(len(s) for s in w.sequences) > max_tokens:
        return float("nan")
    config = PrefixGrouperConfig(mode="arbitrary_prefix")
    return int(sum(split_unit_tokens([np.asarray(s) for s in w.sequences], config, max_tokens)))


def kv_row_cost(shape: DecoderShape, dtype_bytes: int = 4) -> float:
    """The demo model's kept K/V row cost (budget tokens per kept row, fp32 by default)."""
    return kept_kv_row_cost(shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                            shape.ffn, shape.vocab, dtype_bytes=dtype_bytes)


@dataclass
class PairedSteps:
    """A workload's two training steps, [unshared batch, prefix forest] (with a token budget
    the forest runs as its cross-micro-batch ``schedule``), and its sharing columns."""

    plan: TreePlan
    steps: list[Callable[..., torch.Tensor]]
    columns: dict
    schedule: MiniBatchPlan | None = None


def _paired_steps(model, w: Workload, device, seed: int, shape: DecoderShape,
                  max_tokens: int | None = None, dtype_bytes: int = 4) -> PairedSteps:
    """The plan of ``w`` and its two training steps; each sample's loss weight is drawn from
    ``seed``. With ``max_tokens`` the shared step runs the forest's cross-micro-batch schedule
    (kept K/V rows costed for ``shape`` in ``dtype_bytes``); raises :class:`BudgetTooSmall`
    when the budget cannot hold a context."""
    host_plan = plan_fn(w)
    plan = host_plan.to(device)
    unshared = plan_unshared(w.sequences).to(device)
    weights = np.random.default_rng(seed).uniform(0.2, 2.0, len(w.sequences))
    token_weight = torch.tensor(np.repeat(weights, [len(s) for s in w.sequences]),
                                dtype=torch.float32, device=device)
    stats = plan.stats()
    budget, schedule = {}, None
    if max_tokens is None:
        shared = make_step(model, plan, token_weight)
    else:
        schedule = schedule_tree(host_plan, max_tokens, kv_row_cost=kv_row_cost(shape, dtype_bytes))
        shared = make_schedule_step(model, schedule, token_weight)
        budget = {"T split": split_tokens(w, max_tokens), "recomputed": schedule.recomputed_tokens,
                  "steps": schedule.num_steps}
    columns = {"N": stats["N"], "T": stats["T"], **budget, "dedup": stats["dedup"],
               "ideal": shape.ideal_speedup(stats)}
    return PairedSteps(plan, [make_step(model, unshared, token_weight), shared], columns, schedule)


def compare(model, w: Workload, device, seed: int, iters: int | None, max_tokens: int | None = None) -> dict:
    """One row of the fp32 table: sharing, parity of log-probs and every gradient, and with
    ``iters`` the CPU timing (fastest alternating runs, ``noisy`` flag) and activation memory;
    with ``max_tokens`` the shared side is the cross-micro-batch schedule."""
    paired = _paired_steps(model, w, device, seed, TINY, max_tokens)
    steps = paired.steps
    base, tree = (first_step(model, step) for step in steps)
    row = {"workload": w.name, **paired.columns}
    if iters is not None:
        times = time_alternating(steps, iters)
        base_ms, tree_ms = min(times[0]), min(times[1])
        row.update({"unshared ms": base_ms, "shared ms": tree_ms, "speedup": base_ms / tree_ms})
        row["meas/ideal"] = row["speedup"] / row["ideal"]
        row.update({"act MiB unshared": base.activation_mib, "act MiB shared": tree.activation_mib})
        row["noisy"] = noisy_timing(times, row["speedup"], row["ideal"])
    grad_rel = max(
        ((tree.grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in base.grads.items()
    )
    row.update({"max |d logp|": (tree.logprobs - base.logprobs).abs().max().item(), "max grad rel": grad_rel})
    return row


def speed_row(model, w: Workload, device, seed: int, iters: int, shape: DecoderShape,
              max_tokens: int | None = None) -> dict:
    """One row of the GPU speed table: queued timing of both paths, activation memory, the
    kernel/layout ``auto`` runs for the tree (a schedule's context calls: the gather-KV kernel
    against kept K/V), and the bf16 log-prob difference (not a check)."""
    paired = _paired_steps(model, w, device, seed, shape, max_tokens, dtype_bytes=2)
    plan, steps = paired.plan, paired.steps
    logprobs = [step(measure_memory=True) for step in steps]
    act_mib = [sum(step.saved.values()) / 2**20 for step in steps]
    base_ms, tree_ms = (float(np.median(t)) for t in time_queued(steps, iters))
    q = torch.empty(1, shape.heads, shape.head_dim, dtype=torch.bfloat16, device=device)
    if paired.schedule is None or len(paired.schedule.calls) == 1:
        kernel = "/".join(auto_choice(q, plan))
    else:
        calls = paired.schedule.calls
        largest = paired.schedule.call_plan(max(range(len(calls)), key=lambda i: calls[i].num_rows))
        call_shape = context_plan_shape(largest, shape.heads, shape.head_dim)
        kernel = cp_kernel("auto", q, purpose="against kept context K/V", shape=call_shape).name + "/context"
    row = {"workload": w.name, **paired.columns, "kernel": kernel,
           "unshared ms": base_ms, "shared ms": tree_ms, "speedup": base_ms / tree_ms}
    row["meas/ideal"] = row["speedup"] / row["ideal"]
    row.update({"act MiB unshared": act_mib[0], "act MiB shared": act_mib[1],
                "max |d logp|": (logprobs[1] - logprobs[0]).abs().max().item()})
    model.zero_grad(set_to_none=True)
    return row


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
    parser.add_argument("--workloads", nargs="+", default=None, choices=ALL_WORKLOADS,
                        help=f"default: {' '.join(WORKLOADS)} (and {' '.join(BUDGET_WORKLOADS)} with --max-tokens)")
    parser.add_argument("--scale", type=_bounded(float),
                        help="length scale of the standard workloads (default 1/16 on the CPU, 1 on a "
                        "GPU: about 45 GB peak on grpo-long-prompt; the GPU's fp32 parity check runs at 1/16)")
    parser.add_argument("--iters", type=_bounded(int),
                        help="timed steps per path (default 3 on the CPU, alternating, more while the "
                        "steps are short, the fastest counts; 5 on a GPU, queued, the median counts)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (cuda if available, else cpu), cpu or cuda")
    parser.add_argument("--seed", type=_bounded(int, allow_zero=True), default=0,
                        help="seed of the workloads, the weights and the loss weights (default 0)")
    parser.add_argument("--max-tokens", type=_bounded(int), default=None, metavar="N",
                        help="micro-batch token budget (at the workloads' scale): run the "
                        "cross-micro-batch schedule and compare with splitting (default: none, one "
                        "micro-batch per workload)")
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


def _dims(shape: DecoderShape) -> str:
    return (f"{shape.layers} layers, hidden {shape.hidden}, GQA {shape.heads}/{shape.kv_heads} x "
            f"{shape.head_dim}, vocab {shape.vocab}")


def _rows(names: list[str], title: str, row: Callable[[str], dict]) -> list[dict]:
    """``row(name)`` for every workload, with progress on stderr."""
    rows = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        print(f"[{title} {i + 1}/{len(names)}] {name} ...", end="", file=sys.stderr, flush=True)
        try:
            rows.append(row(name))
        except BudgetTooSmall as err:
            raise BudgetTooSmall(f"{name}: {err}") from None
        print(f" {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return rows


def _budget_note(max_tokens: int | None) -> str:
    return "" if max_tokens is None else f", micro-batch budget {max_tokens} tokens"


def _print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print(format_table(list(rows[0]), [list(r.values()) for r in rows]))


def run_demo(args: argparse.Namespace) -> int:
    device = _resolve_device(args.device)
    if isinstance(device, str):
        print(f"ps-mcore demo: error: {device}", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    scale = args.scale if args.scale is not None else (1.0 if gpu else CPU_SCALE)
    iters = args.iters if args.iters is not None else (5 if gpu else 3)
    fp32_scale = CPU_SCALE if gpu else scale
    max_tokens = getattr(args, "max_tokens", None)
    # The budget is at the workloads' scale; the GPU's parity table runs at its own.
    fp32_budget = None if max_tokens is None else max(1, round(max_tokens * fp32_scale / scale))
    names = args.workloads or list(WORKLOADS) + (list(BUDGET_WORKLOADS) if max_tokens else [])

    def workload(name: str, shape: DecoderShape, at: float) -> Workload:
        return make_workload(name, seed=args.seed, scale=at, vocab=shape.vocab)

    try:
        with _third_party_warnings(getattr(args, "verbose", False)), _megatron_rope_on(device):
            model = build_model(TINY, device, args.seed, backend="chunked")
            rows = _rows(names, "parity" if gpu else "demo", lambda name: compare(
                model, workload(name, TINY, fp32_scale), device, args.seed, None if gpu else iters, fp32_budget))
            del model
            speed = []
            if gpu:
                torch.cuda.empty_cache()
                model = build_model(GPU_SHAPE, device, args.seed, dtype=torch.bfloat16)
                speed = _rows(names, "speed", lambda name: speed_row(
                    model, workload(name, GPU_SHAPE, scale), device, args.seed, iters, GPU_SHAPE, max_tokens))
                del model
    except BudgetTooSmall as err:
        print(f"\nps-mcore demo: error: {err}", file=sys.stderr)
        return 2
    passed = [r["max |d logp|"] < TOLERANCE and r["max grad rel"] < TOLERANCE for r in rows]
    noisy = [r.pop("noisy", False) for r in rows]
    for r, ok, flag in zip(rows, passed, noisy):
        r["parity"] = "ok" if ok else "FAIL"
        if flag:
            r["speedup"] = format_cell(r["speedup"]) + "*"
    tiny = f"tiny Megatron GPT ({_dims(TINY)}), fp32 on {device}"
    if gpu:
        _print_table(f"ps-mcore demo, parity: {tiny}, pure-torch attention kernel (chunked), "
                     f"workloads at scale {fp32_scale:g}{_budget_note(fp32_budget)}", rows)
        print()
        _print_table(f"ps-mcore demo, speed: Megatron GPT with Qwen2.5-1.5B layer shapes ({_dims(GPU_SHAPE)}), "
                     f"bf16 on {device} ({torch.cuda.get_device_name(device)}), attention kernel "
                     f"picked by auto (column kernel), workloads at scale {scale:g}{_budget_note(max_tokens)}, "
                     f"{GPU_WARMUP} warm-up + {iters} timed steps per path", speed)
        print(LEGEND.format(timing=GPU_TIMING, bf16=BF16_NOTE))
    else:
        _print_table(f"ps-mcore demo: {tiny}, workloads at scale {scale:g}{_budget_note(max_tokens)}", rows)
        print(LEGEND.format(timing=CPU_TIMING, bf16=""))
    if max_tokens:
        print(BUDGET_LEGEND.format(budget=max_tokens))
    print(f"parity ok when both are below {TOLERANCE:g}.")
    if any(noisy):
        print(f"* noisy timing (a path's two fastest runs differ by over {NOISE_SPREAD:.0%}, or the "
              f"speedup is over {NOISE_OVER_IDEAL:g}x the ideal): this machine is busy; parity is "
              "unaffected. Rerun with more --iters\n  or on an idle machine.")
    print("parity: " + ("shared == unshared (log-probs and all gradients)" if all(passed) else
                        f"FAILED (tolerance {TOLERANCE:g})"))
    return 0 if all(passed) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ps-mcore demo", description=__doc__)
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))
