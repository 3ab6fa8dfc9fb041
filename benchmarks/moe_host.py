"""Where an MoE model step's host time goes, on the tree and on the unshared plan.

    python benchmarks/moe_host.py [--arch gpt-oss-20b] [--workloads agent-tree step-wise no-sharing]
    python benchmarks/moe_host.py --tiny      # CPU dry run: local spec, tiny dims, workloads at 1/32

The ``--spec te`` tree model of ``benchmarks/model.py`` (TE linear layers and grouped experts,
tree core attention), one fwd+bwd step per micro-batch, on the unshared batch as a plan without
sharing ("unshared") and on the prefix tree ("tree"). Per step, medians:

* wall ms: the step from an idle GPU to its end (a sync after each step);
* blocked ms: the host waiting for the GPU inside the step (CUDA event and stream syncs: the
  alltoall token dispatcher waits for its tokens-per-expert copy in every MoE layer's forward)
  and in the final sync; syncs: how many such waits;
* busy ms: wall - blocked, the host's own work (Python, autograd, launches); a step whose busy
  ms is close to its wall ms is host-bound;
* kernel ms, kernels: the CUDA kernels' summed time and number;
* aten ops: non-view torch ops, by the innermost project frame that issued them (TE's extension
  calls, e.g. its grouped GEMMs, are not torch ops and not counted);
* the same wall/busy ms with megatron's per-expert bias loop (``TEGroupedMLP._apply_bias``,
  GPT-OSS's expert biases: two ops per expert forward, four backward) replaced by one gathered
  bias add ("one bias add": the same forward values, checked; the bias gradients are summed in
  another order, so they may differ in the last bits; a timing experiment, not a product path).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from common import add_run_arguments, environment, markdown_table, step_kernels, write_report  # noqa: E402
from model import ARCHS, Steps, arch_shape, build_model, init_parallel  # noqa: E402

from ps_mcore.workloads import make_workload  # noqa: E402

VIEWS = frozenset((
    "view", "_unsafe_view", "transpose", "t", "unsqueeze", "squeeze", "slice", "select", "expand", "permute",
    "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk", "narrow", "unbind", "reshape",
    "view_as", "_reshape_alias", "unfold", "diagonal", "lift_fresh", "resolve_conj", "resolve_neg",
))
COMPONENTS = (  # path fragment -> component; the innermost matching frame names the op's source
    ("/ps_mcore/", "ps_mcore"),
    ("megatron/core/transformer/moe/", "megatron MoE"),
    ("megatron/", "megatron other"),
    ("transformer_engine/", "transformer_engine"),
)


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops run under it, by component."""

    def __init__(self):
        super().__init__()
        self.by_component: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in VIEWS:
            self.by_component[_component(sys._getframe(1))] += 1
        return func(*args, **(kwargs or {}))


def _component(frame) -> str:
    while frame is not None:
        name = frame.f_code.co_filename
        for fragment, component in COMPONENTS:
            if fragment in name:
                return component
        frame = frame.f_back
    return "autograd engine / other"


class SyncClock:
    """Time the host spends in CUDA event and stream synchronisation (patched in while on)."""

    def __init__(self):
        self.ms, self.count, self._patched = 0.0, 0, []

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms += (time.perf_counter() - t0) * 1e3
                self.count += 1
        return timed

    def __enter__(self):
        if torch.cuda.is_available():
            for cls in (torch.cuda.Event, torch.cuda.Stream):
                self._patched.append((cls, cls.synchronize))
                cls.synchronize = self._wrap(cls.synchronize)
        return self

    def __exit__(self, *exc):
        for cls, fn in self._patched:
            cls.synchronize = fn
        self._patched.clear()


def host_split(step, iters: int) -> tuple[float, float, float]:
    """Median (wall, blocked, syncs inside the step) of ``step`` from an idle GPU to its end."""
    walls, blocked, syncs = [], [], []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with SyncClock() as clock:
            t0 = time.perf_counter()
            step()
            inside = clock.count
            t1 = time.perf_counter()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t2 = time.perf_counter()
        walls.append((t2 - t0) * 1e3)
        blocked.append(clock.ms + (t2 - t1) * 1e3)
        syncs.append(inside)
    return statistics.median(walls), statistics.median(blocked), statistics.median(syncs)


def _gathered_bias(intermediate_parallel, bias_parallel, tokens_per_expert, permuted_probs):
    """``TEGroupedMLP._apply_bias`` in one pass: each row gets its expert's bias times its
    probability (the same elementwise ops on the same operands, so the same forward values;
    backward sums each bias's gradient through ``index_select``'s scatter-add instead)."""
    if bias_parallel is None:
        return intermediate_parallel
    shape = intermediate_parallel.shape
    x = intermediate_parallel.view(-1, shape[-1])
    bias = torch.stack(list(bias_parallel)) if isinstance(bias_parallel, (list, tuple)) else bias_parallel
    expert = torch.repeat_interleave(torch.arange(len(tokens_per_expert)), torch.tensor(tokens_per_expert))
    return (x + bias.index_select(0, expert.to(x.device)) * permuted_probs).view(shape).to(intermediate_parallel.dtype)


BIAS_CHECKS: list[bool] = []  # one bias add's output == megatron's loop's, bitwise (first call of each run)


@contextlib.contextmanager
def one_bias_add():
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    stock = TEGroupedMLP.__dict__["_apply_bias"]
    checked = []

    def gathered(*args):
        out = _gathered_bias(*args)
        if not checked:
            with torch.no_grad():
                checked.append(torch.equal(out, stock.__func__(*args)))
            BIAS_CHECKS.append(checked[0])
        return out

    TEGroupedMLP._apply_bias = staticmethod(gathered)
    try:
        yield
    finally:
        TEGroupedMLP._apply_bias = stock


def rows_for(model, shape, workload: str, args, device: str) -> list[list]:
    w = make_workload(workload, seed=args.seed, scale=1 / 32 if args.tiny else 1.0, vocab=shape.vocab)
    steps = Steps(model, w.sequences, device)
    rows = []
    for plan, step in (("unshared", steps.base_step), ("tree", steps.tree_step)):
        for _ in range(args.warmup):
            step()
        wall, blocked, syncs = host_split(step, args.iters)
        if torch.cuda.is_available():
            kinds, _, kernels = step_kernels(step, iters=2)
            kernel_ms = sum(kinds.values())
        else:
            kernel_ms, kernels = float("nan"), 0
        ops = OpCounter()
        try:
            with ops:
                step()
        except Exception as e:  # a counting failure leaves the timing columns standing
            print(f"  aten op count failed: {type(e).__name__}: {e}", flush=True)
            ops.by_component.clear()
        with one_bias_add():
            step()
            wall_b, blocked_b, _ = host_split(step, args.iters)
        by = ops.by_component
        rows.append([workload, plan, steps.plan.num_tokens if plan == "tree" else steps.flat.num_tokens,
                     wall, blocked, wall - blocked, syncs, kernel_ms, kernels, sum(by.values()),
                     by["ps_mcore"], by["megatron MoE"], by["megatron other"], by["transformer_engine"],
                     by["autograd engine / other"], wall_b, wall_b - blocked_b])
        print("  " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    return rows


HEADERS = ["workload", "plan", "rows", "wall ms", "blocked ms", "busy ms", "syncs", "kernel ms", "kernels",
           "aten ops", "ps_mcore", "megatron MoE", "megatron other", "TE", "autograd/other",
           "one bias add: wall ms", "one bias add: busy ms"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt-oss-20b", choices=[a for a in ARCHS if "experts" in ARCHS[a].dims])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--workloads", nargs="+", default=["agent-tree", "step-wise", "no-sharing"])
    add_run_arguments(p, "CPU dry run: local spec, tiny dims, workloads at 1/32")
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("moe_host.py needs a CUDA GPU with transformer-engine (or --tiny for a CPU dry run)")
    device = "cpu" if args.tiny else "cuda"
    init_parallel(device)
    if args.tiny:  # megatron's local experts on the CPU need the test-only shims
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from megatron_shims import allow_local_expert_bias_backward, enable_cpu_moe

        enable_cpu_moe(), allow_local_expert_bias_backward()
        args.warmup, args.iters = 1, 2
    shape = arch_shape(args.arch, args.layers, args.tiny)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        model = build_model(shape, device, dtype, False, arch=args.arch, tiny=True)
    else:
        stock, model = build_model(shape, device, dtype, False, spec="te", arch=args.arch)
        del stock
        torch.cuda.empty_cache()
    rows = []
    for workload in args.workloads:
        print(f"[+] {workload}", flush=True)
        rows += rows_for(model, shape, workload, args, device)
    title = (f"MoE step host time, {args.arch} ({shape.layers} layers, {shape.experts} experts top-{shape.topk}), "
             f"{'local spec, CPU, tiny' if args.tiny else 'TE tree model, bf16'}; unshared = the same model on "
             f"the plan without sharing; one bias add's output equal to megatron's per-expert loop's in "
             f"{sum(BIAS_CHECKS)} of {len(BIAS_CHECKS)} checked runs; {environment()}")
    write_report(f"{title}\n\n{markdown_table(HEADERS, rows)}", args.out)


if __name__ == "__main__":
    main()
