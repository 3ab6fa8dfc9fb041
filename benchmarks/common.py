"""Shared helpers for the benchmarks: timing, memory, environment header, markdown table."""

from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ps_mcore.table import format_table as markdown_table  # noqa: F401  (one table format)


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10, queued: bool = False) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on GPU, perf_counter on CPU).

    By default each step starts on an idle GPU (a sync after every step): the time then holds
    the host's launch latency of the step's first kernels, as a training step with syncs sees
    it. ``queued=True`` launches the steps back to back and syncs once (each step still between
    its own two events, as ``triton.testing.do_bench`` times kernels): a step costs
    max(GPU time, host time), what one layer costs inside a model whose host runs ahead."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda and queued:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    samples = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak GPU memory allocated above the current level while running ``fn`` once (MiB)."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


class PairedSteps:
    """The baseline and tree fwd+bwd steps of one workload, from a subclass's
    ``base_logprobs()`` / ``tree_logprobs()`` (``[N]`` each, batch order): loss = sum of
    ``self.token_weights`` x log-probs; ``self.models`` are zeroed before each step."""

    models: tuple
    token_weights: torch.Tensor

    def _step(self, logprobs_fn) -> None:
        for model in self.models:
            model.zero_grad(set_to_none=True)
        (logprobs_fn() * self.token_weights).sum().backward()

    def base_step(self) -> None:
        self._step(self.base_logprobs)

    def tree_step(self) -> None:
        self._step(self.tree_logprobs)

    @torch.no_grad()
    def max_logprob_diff(self) -> float:
        """Tree vs. baseline log-probs (a sanity check of the run, not a test)."""
        return float((self.tree_logprobs() - self.base_logprobs()).abs().max())


@dataclass
class Measured:
    """One workload's baseline step vs tree step: plan statistics, ideal speedup, median ms and
    peak MiB of each."""

    stats: dict
    ideal: float
    base_ms: float
    tree_ms: float
    base_mib: float
    tree_mib: float

    @property
    def speedup(self) -> float:
        return self.base_ms / self.tree_ms

    def row(self, name: str) -> list:
        """The standard leading columns: workload, N, T, dedup, attn ratio, ideal, base ms,
        tree ms, speedup, meas/ideal, base MiB, tree MiB."""
        s = self.stats
        return [name, s["N"], s["T"], s["dedup"], s["attn_flop_ratio"], self.ideal, self.base_ms,
                self.tree_ms, self.speedup, self.speedup / self.ideal, self.base_mib, self.tree_mib]


def release_grads(steps) -> None:
    """Free the gradients of ``steps.models``: each step allocates its own, so a peak measured
    while an earlier step's gradients are still allocated would miss them (the step frees and
    reallocates them inside the measured window)."""
    for model in steps.models:
        model.zero_grad(set_to_none=True)


def measure(steps, shape, warmup: int, iters: int, queued: bool = False) -> Measured:
    """Time and peak memory of ``steps.base_step`` vs ``steps.tree_step``; ``steps.plan`` is the
    tree plan, ``shape.ideal_speedup(stats)`` the FLOP-weighted ideal, ``steps.models`` the
    models whose gradients are freed before each memory run (:func:`release_grads`).
    ``queued``: steps back to back (:func:`time_ms`)."""
    stats = steps.plan.stats(window=shape.window)  # windowed layers count windowed pairs
    base_ms = time_ms(steps.base_step, warmup, iters, queued)
    tree_ms = time_ms(steps.tree_step, warmup, iters, queued)
    release_grads(steps)
    base_mib = peak_mib(steps.base_step)
    release_grads(steps)
    tree_mib = peak_mib(steps.tree_step)
    release_grads(steps)
    return Measured(stats, shape.ideal_speedup(stats), base_ms, tree_ms, base_mib, tree_mib)


# the columns of the whole-model tables (model.py, hybrid.py): Measured.row + decoder_row's tail
DECODER_HEADERS = ["workload", "N", "T", "dedup", "attn ratio", "ideal", "base ms", "tree ms", "speedup",
                   "meas/ideal", "base MiB", "tree MiB", "mem ratio", "T/N", "max |dlogp|"]


def decoder_row(name: str, m: Measured, steps) -> list:
    """A :data:`DECODER_HEADERS` row; ``steps.max_logprob_diff()`` is the run's sanity check."""
    return m.row(name) + [m.tree_mib / m.base_mib, m.stats["T"] / m.stats["N"], steps.max_logprob_diff()]


def workload_rows(
    args, shape, new_steps: Callable[[list], object], row: Callable[[str, Measured, object], list],
    scale: float = 1.0, verbose: bool = True,
) -> list[list]:
    """One table row per workload in ``args.workloads`` (seed ``args.seed``, lengths x ``scale``,
    ids below ``shape.vocab``): ``new_steps(sequences)`` builds the baseline/tree steps,
    :func:`measure` times them, ``row(name, measured, steps)`` makes the row."""
    from ps_mcore.workloads import make_workload

    rows = []
    for i, name in enumerate(args.workloads):
        if verbose:
            print(f"[{i + 1}/{len(args.workloads)}] {name}", flush=True)
        w = make_workload(name, seed=args.seed, scale=scale, vocab=shape.vocab)
        steps = new_steps(w.sequences)
        measured = measure(steps, shape, args.warmup, args.iters, not args.synced)
        rows.append(row(name, measured, steps))
        if verbose:  # the row as soon as it exists: a long run that is cut short still says something
            print("  " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
        if name in getattr(args, "profile", ()) and torch.cuda.is_available():
            print(profile_steps({"base": steps.base_step, "tree": steps.tree_step}, f"profile: {name}"), flush=True)
        del steps
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# kernel name fragments -> where the time goes (first match wins; the rest is "other")
KERNEL_KINDS = (
    ("optimizer", ("multi_tensor", "adam")),
    ("attention", ("flash", "fmha", "attn", "cudnn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")),
    ("gather/scatter", ("index", "gather", "scatter", "embedding")),
    ("softmax/reduce", ("softmax", "logsumexp", "reduce", "norm", "sum")),
    ("copy/cast", ("copy", "cat", "fill", "to_copy")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def step_kernels(step: Callable[[], object], iters: int = 3,
                 top: dict[str, float] | None = None) -> tuple[dict[str, float], float, int]:
    """One run of ``step``, then ``iters`` under the CUDA profiler: per step, the kernel (and
    copy) time in ms by :func:`kernel_kind`, the wall time in ms, and the kernels launched.
    ``top``, when given, receives each kernel's own time in ms per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / iters
    kinds: dict[str, float] = {}
    launched = 0
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if event.device_type.name == "CUDA" and us:
            kinds[kernel_kind(event.key)] = kinds.get(kernel_kind(event.key), 0.0) + us / 1e3 / iters
            launched += event.count
            if top is not None:
                top[event.key] = top.get(event.key, 0.0) + us / 1e3 / iters
    return kinds, wall, launched // iters


def profile_steps(named_steps: dict[str, Callable[[], object]], title: str, iters: int = 3,
                  top_kernels: int = 12) -> str:
    """Where one step's time goes, per step in ms: CUDA kernel time by kind, the wall time the
    kernels leave uncovered (launch latency, host work, syncs), and the ``top_kernels`` kernels
    that take the most time over all steps. One column per step."""
    columns, per_kernel, lost = {}, {}, []
    for label, step in named_steps.items():
        per_kernel[label] = {}
        kinds, wall, launched = step_kernels(step, iters, per_kernel[label])
        if not launched:  # a GPU step always launches kernels: the profiler lost its trace
            lost.append(label)
            columns[label] = {"wall": wall}
            continue
        kernels = sum(kinds.values())
        columns[label] = {**kinds, "all kernels": kernels, "wall": wall, "uncovered": wall - kernels}
    rows_order = [k for k, _ in KERNEL_KINDS] + ["other", "all kernels", "wall", "uncovered"]
    rows = [[kind] + [columns[c].get(kind, 0.0 if c not in lost else math.nan) for c in columns]
            for kind in rows_order]
    names = sorted({n for times in per_kernel.values() for n in times},
                   key=lambda n: -sum(times.get(n, 0.0) for times in per_kernel.values()))[:top_kernels]
    top = [[n[:90]] + [math.nan if c in lost else per_kernel[c].get(n, 0.0) for c in columns] for n in names]
    syncs = [[label, count, where] for label, step in named_steps.items() for where, count in host_syncs(step)]
    note = (f"\n\nThe profiler recorded no kernels for {', '.join(lost)}: its trace of the step was lost, so "
            "only the wall time is a measurement" if lost else "")
    return (
        f"{title} (ms per step)\n\n" + markdown_table(["kind", *columns], rows) + note
        + "\n\nkernels taking the most time (ms per step)\n\n" + markdown_table(["kernel", *columns], top)
        + "\n\nhost syncs per step (the GPU queue drains at each; source = innermost project frames)\n\n"
        + (markdown_table(["step", "syncs", "source"], syncs) if syncs else "none")
    )


PROJECT_FRAMES = ("ps_mcore/", "prefix_sharing/", "verl/", "megatron/", "benchmarks/", "fla/", "transformer_engine/")


def host_syncs(step: Callable[[], object]) -> list[tuple[str, int]]:
    """Where one run of ``step`` makes the host wait for the GPU: ``(source, count)`` pairs, most
    frequent first. torch's sync debug mode warns at every synchronizing CUDA op; the source is
    the innermost project frames of the warning's Python stack. Verified on forward-pass syncs
    (Megatron's THD RoPE, 2026-12-03); a sync inside the backward pass is reported at the
    step's ``.backward()`` if autograd hands its threads' warnings back (not checked)."""
    step()
    torch.cuda.synchronize()
    counts: dict[str, int] = {}

    def record(message, *args, **kwargs) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack())
                  if any(k in f.filename for k in PROJECT_FRAMES) and f.name not in ("record", "host_syncs")]
        where = " < ".join(frames[:3]) or "?"
        counts[where] = counts.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sorted(counts.items(), key=lambda kv: -kv[1])


@contextlib.contextmanager
def profiler_ranges(module_prefixes: tuple[str, ...]):
    """Inside the block, every Python function of the loaded modules whose names start with one
    of ``module_prefixes`` (module-level functions, wherever they were imported to, and the
    methods of the classes defined there) runs inside a profiler range named after it
    (``module.function`` or ``Class.method``). The originals are back on exit."""
    restore = []
    wrapped: dict[int, Callable] = {}
    ours = [m for name, m in list(sys.modules.items()) if m is not None and name.startswith(module_prefixes)]
    for module in ours:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
                wrapped.setdefault(id(obj), _ranged(obj, f"{module.__name__.rsplit('.', 1)[-1]}.{name}"))
            elif isinstance(obj, type) and obj.__module__ == module.__name__:
                for attr, fn in list(vars(obj).items()):
                    if isinstance(fn, types.FunctionType) and not attr.startswith("__"):
                        restore.append((obj, attr, fn))
                        setattr(obj, attr, _ranged(fn, f"{obj.__name__}.{attr}"))
    with warnings.catch_warnings():  # some modules hold deprecated aliases that warn when touched
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):  # every name a wrapped function was imported under
            if not isinstance(module, types.ModuleType):
                continue
            for name, obj in list(getattr(module, "__dict__", {}).items()):
                if isinstance(obj, types.FunctionType) and id(obj) in wrapped and wrapped[id(obj)].__wrapped__ is obj:
                    restore.append((module, name, obj))
                    setattr(module, name, wrapped[id(obj)])
    try:
        yield
    finally:
        for owner, name, fn in reversed(restore):
            setattr(owner, name, fn)


def _ranged(fn: Callable, label: str) -> Callable:
    record = torch.autograd.profiler.record_function

    def ranged(*args, **kwargs):
        with record(label):
            return fn(*args, **kwargs)

    ranged.__wrapped__ = fn
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(ranged, attr, getattr(fn, attr, None))
    return ranged


def gpu_idle_by_function(step: Callable[[], object], module_prefixes: tuple[str, ...], title: str,
                         top: int = 30) -> str:
    """Where the GPU waits for the host in one run of ``step`` (after one unprofiled run): the
    functions of ``module_prefixes`` (:func:`profiler_ranges`) by the GPU idle time while they
    run on the host (inclusive, ms), with their host time (ms) and calls. Sources of idle time
    the profiler cannot see (the profiler's own cost, unwrapped code) show at the callers."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with profiler_ranges(module_prefixes), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation"]
    if not ranges:
        return f"{title}: no profiled function ran"
    busy = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not busy:  # a GPU step always launches kernels: the trace lost them, and idle time is unknown
        return f"{title}: the profiler recorded no kernels (its trace of the step was lost)"
    window, idle_total, by_name = idle_by_range(ranges, busy)
    names = sorted(by_name, key=lambda n: -by_name[n][0])[:top]
    rows = [[n, by_name[n][0] / 1e3, by_name[n][1] / 1e3, by_name[n][2]] for n in names]
    return (f"{title}: {window / 1e3:.0f} ms, GPU idle {idle_total / 1e3:.0f} ms (ms in the call)\n\n"
            + markdown_table(["function", "GPU idle", "host", "calls"], rows))


def idle_by_range(ranges: list[tuple[str, float, float]], busy: list[tuple[float, float]]
                  ) -> tuple[float, float, dict[str, tuple[float, float, int]]]:
    """``ranges``: host ``(name, start, end)``; ``busy``: GPU ``(start, end)`` (one clock).
    Returns the window the ranges span, the GPU's idle time in it, and per name ``(idle time
    inside its calls, host time, calls)``; a call inside a running call of the same name
    (recursion) is not counted again."""
    ranges = sorted(ranges, key=lambda r: r[1])
    lo, hi = ranges[0][1], max(end for _, _, end in ranges)
    gaps, reached = [], lo
    for start, stop in sorted(busy):
        if start > reached:
            gaps.append((reached, min(start, hi)))
        reached = max(reached, stop)
    gaps = [(a, b) for a, b in gaps + [(reached, hi)] if b > a]
    starts, before = [a for a, _ in gaps], [0.0]  # idle time before each gap
    for a, b in gaps:
        before.append(before[-1] + b - a)

    def idle_until(t: float) -> float:
        i = bisect.bisect_right(starts, t)
        return before[i] - (max(0.0, gaps[i - 1][1] - t) if i else 0.0)

    by_name: dict[str, tuple[float, float, int]] = {}
    open_until: dict[str, float] = {}
    for name, a, b in ranges:
        if open_until.get(name, -math.inf) >= b:
            continue
        open_until[name] = b
        idle, host, calls = by_name.get(name, (0.0, 0.0, 0))
        by_name[name] = (idle + idle_until(b) - idle_until(a), host + b - a, calls + 1)
    return hi - lo, before[-1], by_name


def _short(path: str) -> str:
    """'/.../site-packages/megatron/core/x.py' -> 'megatron/core/x.py'."""
    start = min((i for i in (path.find(k) for k in PROJECT_FRAMES) if i >= 0), default=0)
    return path[start:]


def environment() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return (
        f"date {datetime.date.today()}, device {gpu}, torch {torch.__version__}, "
        f"python {platform.python_version()}, command `python {' '.join(sys.argv)}`"
    )


def write_report(report: str, out: str | None) -> None:
    """Print the report; also write it to ``out`` (markdown) when given."""
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)


def add_run_arguments(p, tiny_help: str) -> None:
    """``--seed``, ``--warmup``, ``--iters``, ``--tiny`` (``tiny_help``) and ``--out``."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--out", help="also write the table (markdown) here")


def model_benchmark_parser(doc: str):
    """The arguments every whole-model benchmark (model.py, hf.py) shares."""
    import argparse

    from ps_mcore.workloads import WORKLOADS

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    add_run_arguments(p, "CPU, tiny dims, workloads at 1/32")
    p.add_argument("--synced", action="store_true",
                   help="sync after every step, so each step also pays the host's latency before its "
                        "first kernel (default: steps back to back, one sync at the end, as a training "
                        "loop runs micro-batches)")
    p.add_argument("--queued", action="store_true", help=argparse.SUPPRESS)  # the default; older commands in docs/ say it
    p.add_argument("--profile", nargs="*", default=[], metavar="WORKLOAD",
                   help="also print where the base and tree step times go for these workloads (CUDA)")
    return p


def parse_model_benchmark_args(parser, script: str):
    """Parse; refuse a GPU run without CUDA; shorten a ``--tiny`` smoke run."""
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.tiny:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 2)
    return args
