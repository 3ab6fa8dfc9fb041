"""Which kernel ``backend="auto"`` runs a plan with on CUDA: torch's flash kernel or cuDNN.

Both compute the same attention exactly (each tested against the unshared float64
computation); they differ in speed by shape, and in host cost. Measured on one H200 (bf16,
Hq=16, Hkv=2, D=128, fwd+bwd, TE 2.20 fused attention, 2026-12-03; ``benchmarks/attention.py``
and ``benchmarks/model.py``, docs/benchmarks.md):

* GPU time: cuDNN's kernels are faster on the tree of every standard workload (ms per
  step, cuDNN vs flash, each in its layout below): grpo-long-prompt 3.53 vs 4.92, grpo-wide 1.88 vs 2.52,
  agent-tree 1.07 vs 1.42, step-wise 0.87 vs 1.04, no-sharing 0.71 vs 0.74.
* Host time: cuDNN's call costs more (1.1-1.4 vs 0.3-1.2 ms per fwd+bwd step), so a step of
  little work timed alone, or a host-bound run, is slower with it.
* Inside the model the host runs ahead and that cost hides: steps queued back to back
  (``model.py``'s default timing, as a training loop runs micro-batches), cuDNN forced for every tree
  layer beat flash on step-wise, agent-tree and grpo-wide in both specs (TE spec 46.7 / 73.0
  / 114 vs 47.1 / 74.2 / 115 ms; local spec 49.5 / 77.7 / 120 vs 50.2 / 78.8 / 123 ms). With
  a sync after every step (the host's start latency in each step) it did not (52.7 / 78.6 /
  120 vs 52.1 / 77.6 / 118 ms, TE spec): that measurement set the earlier, higher constant.

The rule (:func:`prefers_cudnn`, a pure function of shape numbers so it can be tested and
swept without a GPU):

* ``work = pairs * Hq * D`` (query-key pairs of the tree, causal pairs counted once, times
  query heads and head dim: the forward's QK^T multiply-adds) must be at least
  :data:`CUDNN_MIN_WORK`, so that the kernel gain covers cuDNN's host cost. The smallest
  measured shape that gained in the model is step-wise (1.55e10); no-sharing (9.1e9) gains
  0.03 ms of kernel time for 0.4 ms more host time. The constant sits between the two.
* cuDNN runs only the gather-KV layout or, on a chain forest, the single causal self call
  (``cudnn.py``). It is chosen only where flash's own layout choice would not be a cascade with
  level calls (``cascade_pays``), so memory never exceeds what ``varlen`` uses on that plan
  (grpo-wide: cuDNN gather-KV 1.91 vs flash cascade 2.62 ms alone, but 1266 vs 215 MiB).

A call of a cross-micro-batch schedule (:class:`~ps_mcore.minibatch.ContextPlan`) always runs
the gather-KV layout against its kept context, so the work rule alone decides
(:func:`context_plan_shape`): its segments are long (a branch against a history of many
thousand rows), where cuDNN's lead is largest.

``python benchmarks/attention.py --sweep`` prints, per workload and length scale, the shape
numbers, both kernels' times and this rule's pick.
"""

from __future__ import annotations

from dataclasses import dataclass

from ps_mcore.attention.layout import auto_layout, cascade_layout
from ps_mcore.planner import tree_pairs

# Smallest forward work (query-key pairs x query heads x head dim) at which cuDNN is chosen.
CUDNN_MIN_WORK = 1.2e10


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
    return _cached_shape(plan, heads, head_dim, _cascade_numbers)


def _cascade_numbers(host) -> tuple[int, bool]:
    """(cascade chain levels, whether flash would run the cascade layout) of a tree plan."""
    layout = cascade_layout(host)
    return layout.num_levels, auto_layout(host, layout) == "cascade"


def context_plan_shape(plan, heads: int, head_dim: int) -> PlanShape:
    """The :class:`PlanShape` of a gather-KV call (a :class:`~ps_mcore.minibatch.ContextPlan`:
    segments against their whole contexts, no cascade), cached on its host copy."""
    return _cached_shape(plan, heads, head_dim, _no_cascade)


def _no_cascade(host) -> tuple[int, bool]:
    return 0, False


def _cached_shape(plan, heads: int, head_dim: int, layout_numbers) -> PlanShape:
    """The shape numbers of ``plan``'s segments and contexts, with ``layout_numbers(host) ->
    (levels, cascade)``, computed once per plan on its host copy."""
    host = plan.host
    if host.memo.kernel_choice_shape is None:
        cu_q, cu_k = host.cu_seqlens_q.cpu().numpy(), host.cu_seqlens_kv.cpu().numpy()
        host.memo.kernel_choice_shape = (tree_pairs(cu_q, cu_k), host.num_tokens, int(cu_k[-1]),
                                         int(cu_q.size - 1), *layout_numbers(host))
    return PlanShape(*host.memo.kernel_choice_shape, heads, head_dim)
