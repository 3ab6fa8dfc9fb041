"""Which kernel ``backend="auto"`` runs a plan with on CUDA: torch's flash kernel or cuDNN.

Both compute the same attention exactly (each tested against the unshared float64
computation); they differ in speed by shape. Measured on one H200 (bf16, Hq=16, Hkv=2, D=128,
gather-KV layout, fwd+bwd, issue 15): cuDNN (TE 2.20 fused attention) 4.25 vs flash 5.36 ms on
grpo-long-prompt, 2.69 vs 3.04 on grpo-wide, 1.83 vs 1.68 on agent-tree, 1.58 vs 1.31 on
step-wise. Those four fit ``cudnn_ms = 0.71 + 0.66 * flash_ms`` within 0.02 ms: cuDNN's
kernels are a third faster but each call pays a fixed ~0.7 ms more, so cuDNN wins once flash
would take more than ~2.1 ms, i.e. once the call has enough attention work.

The rule (:func:`prefers_cudnn`, a pure function of shape numbers so it can be tested and
swept without a GPU):

* ``work = pairs * Hq * D`` (query-key pairs of the tree, causal pairs counted once, times
  query heads and head dim: the forward's QK^T multiply-adds) must be at least
  :data:`CUDNN_MIN_WORK`. The measured crossover lies between agent-tree (2.0e10, flash faster)
  and grpo-wide (4.0e10, cuDNN faster); the fit above puts it at ~2.7e10 (flash ~2.1 ms,
  work interpolated log-log over the four). The constant sits just above, so a call near the
  crossover keeps today's kernel.
* cuDNN runs only the gather-KV layout or, on a chain forest, the single causal self call
  (``cudnn.py``). It is chosen only where flash's own layout choice would not be a cascade with
  level calls (``cascade_pays``), so memory never exceeds what ``varlen`` uses on that plan.

Those timings synced the GPU after every step, so cuDNN's larger host cost per call was in
them. Timed with the steps queued (2026-12-03, session 5), cuDNN's kernels are faster on every
sharing workload (gather-KV 1.10 vs 1.43 ms on agent-tree, 0.83 vs 1.03 on step-wise), but the
whole TE-spec model with cuDNN forced for every tree layer was not faster than this rule's pick
(52.7 vs 52.1 ms step-wise, 78.6 vs 77.6 agent-tree, 120 vs 118 grpo-wide: attention is ~6 % of
those steps and the host cost remains), so the rule stands (docs/benchmarks.md, issue 15).

``python benchmarks/attention.py --sweep`` prints, per workload and length scale, the shape
numbers, both kernels' times and this rule's pick: the evidence for the constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_mcore.planner import tree_pairs

# Smallest forward work (query-key pairs x query heads x head dim) at which cuDNN is chosen.
CUDNN_MIN_WORK = 2.8e10


@dataclass(frozen=True)
class PlanShape:
    """The numbers of one attention call the kernel choice reads.

    pairs: query-key pairs of the tree (per head); rows: T; context_rows: C (sum of node
    contexts, the gather-KV key rows); segments: nodes; levels: cascade chain levels;
    cascade: whether flash would run the cascade layout (``layout.cascade_pays``)."""

    pairs: float
    rows: int
    context_rows: int
    segments: int
    levels: int
    cascade: bool
    heads: int
    head_dim: int

    @property
    def work(self) -> float:
        return self.pairs * self.heads * self.head_dim


def prefers_cudnn(shape: PlanShape, min_work: float = CUDNN_MIN_WORK) -> bool:
    """Whether ``auto`` should run ``shape`` with cuDNN rather than torch flash (module docstring)."""
    if shape.cascade and shape.levels > 0:
        return False  # flash's cascade (no K/V copy) stays: cuDNN would gather, using more memory
    return shape.work >= min_work


def plan_shape(plan, heads: int, head_dim: int) -> PlanShape:
    """The :class:`PlanShape` of ``plan`` for ``heads`` query heads of ``head_dim`` (host
    numbers cached on the plan's host copy: no device sync per layer)."""
    from ps_mcore.attention.layout import auto_layout, cascade_layout

    host = plan.host
    if "kernel_choice_shape" not in host._cache:
        cu_q, cu_k = host.cu_seqlens_q.cpu().numpy(), host.cu_seqlens_kv.cpu().numpy()
        layout = cascade_layout(host)
        host._cache["kernel_choice_shape"] = (
            tree_pairs(cu_q, cu_k), host.num_tokens, int(cu_k[-1]), int(cu_q.size - 1),
            layout.num_levels, auto_layout(host, layout) == "cascade",
        )
    pairs, rows, ctx, segs, levels, cascade = host._cache["kernel_choice_shape"]
    return PlanShape(pairs, rows, ctx, segs, levels, cascade, heads, head_dim)
