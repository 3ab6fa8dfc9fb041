"""Shared helpers for the benchmarks: timing, memory, environment header, markdown table."""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn`` in ms (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    cuda = torch.cuda.is_available()
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


def environment() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return (
        f"date {datetime.date.today()}, device {gpu}, torch {torch.__version__}, "
        f"python {platform.python_version()}, command `python {' '.join(sys.argv)}`"
    )


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return "-" if x != x else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return str(x)

    cells = [[fmt(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in cells])
