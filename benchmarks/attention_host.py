"""Where one tree-attention step's time goes: the host (Python and launches) or the GPU (kernels).

    python benchmarks/attention_host.py [--backends varlen cudnn fa4] [--out FILE]

Per standard workload, on the tree plan and on the unshared plan, per backend, one fwd+bwd
step (Hq=16, Hkv=2, D=128, bf16):

* host ms: the step launched 10 times back to back behind a ~1 s GPU sleep, so the host never
  waits on the GPU (the Python, the autograd and the launches of one step);
* kernel ms: the step's CUDA kernels and copies summed (torch.profiler, 5 steps);
* queued ms: ``common.time_ms(queued=True)`` as in attention.py, about max(host, kernel);
* kernels: launched per step.

A step whose host ms exceeds its kernel ms is host-bound when timed alone; inside a model the
other layers' GPU work can hide that host time (cuDNN's and FlashAttention-4's calls cost the
host more than torch flash's, and their kernels are faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from attention import fwd_bwd, leaves  # noqa: E402
from common import environment, markdown_table, step_kernels, time_ms, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared, tree_attention  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.workloads import WORKLOADS, make_workload  # noqa: E402

HEADERS = ["workload", "plan", "backend", "host ms", "kernel ms", "queued ms", "kernels"]
HOST_STEPS, PROFILED_STEPS = 10, 5
DEVICE = "cuda"  # a CPU dry run of the table code sets "cpu"


def host_ms(step) -> float:
    """Host time of one step, the GPU kept busy so that no launch waits on it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time: the queue never drains while we launch
    t0 = time.perf_counter()
    for _ in range(HOST_STEPS):
        step()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / HOST_STEPS * 1e3


def measure(plan, backend: str) -> list:
    t = plan.num_tokens
    q, k, v = leaves((t, 16, 128), (t, 2, 128), torch.bfloat16, 0)
    resolve_backend(backend, q, plan)  # refuses clearly where the backend cannot run
    step = fwd_bwd(lambda q, k, v: tree_attention(q, k, v, plan, backend=backend), (q, k, v),
                   torch.randn(t, 16, 128, device=DEVICE, dtype=torch.bfloat16))
    for _ in range(3):  # compile / autotune / plan caches
        step()
    host = host_ms(step)
    kinds, _, launched = step_kernels(step, PROFILED_STEPS)
    return [host, sum(kinds.values()), time_ms(step, 3, 10, queued=True), launched]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["varlen", "cudnn", "fa4"])
    p.add_argument("--workloads", nargs="+", default=[w for w in WORKLOADS if w != "grpo-math"], choices=WORKLOADS)
    p.add_argument("--out", help="also write the table (markdown) here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_host.py needs a CUDA GPU")
    rows = []
    for i, name in enumerate(args.workloads):
        print(f"[{i + 1}/{len(args.workloads)}] {name}", file=sys.stderr, flush=True)
        sequences = make_workload(name, seed=0).sequences
        for which, plan in (("tree", plan_prefix_tree(sequences)), ("unshared", plan_unshared(sequences))):
            plan = plan.to(DEVICE)
            for backend in args.backends:
                try:
                    rows.append([name, which, backend, *measure(plan, backend)])
                except ValueError as e:  # a backend this machine cannot run
                    print(f"  {backend}: {e}", file=sys.stderr, flush=True)
                    rows.append([name, which, backend, "-", "-", "-", "-"])
    title = "One tree-attention step, fwd+bwd, bf16, Hq=16, Hkv=2, D=128: host time vs GPU time"
    write_report(f"{title}\n\n{environment()}\n\n{markdown_table(HEADERS, rows)}\n", args.out)


if __name__ == "__main__":
    main()
