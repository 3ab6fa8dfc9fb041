"""Shared helpers for the benchmarks: timing, memory, environment header, markdown table."""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from ps_mcore.table import format_table as markdown_table  # noqa: F401  (one table format)


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


def write_report(report: str, out: str | None) -> None:
    """Print the report; also write it to ``out`` (markdown) when given."""
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report)


def model_benchmark_parser(doc: str):
    """The arguments every whole-model benchmark (model.py, hf.py) shares."""
    import argparse

    from ps_mcore.workloads import WORKLOADS

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny dims, workloads at 1/32")
    p.add_argument("--out", help="also write the table (markdown) here")
    return p


def parse_model_benchmark_args(parser, script: str):
    """Parse; refuse a GPU run without CUDA; shorten a ``--tiny`` smoke run."""
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.tiny:
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 2)
    return args
