"""Cascade layout of a :class:`TreePlan`: tree attention as a few varlen calls with no copy.

Rows are in DFS pre-order, so every subtree is a contiguous row range and an only child
directly follows its parent. A *chain* is a maximal run of nodes each the only child of the one
before it: its rows are contiguous and every row's context inside the chain is exactly the rows
before it (causal). A query row then attends to

* its own chain, causally, and
* all rows of every ancestor chain (full attention: they all precede it in the sequence).

Self call: one causal varlen call with one segment per chain (q = k = the chain's rows).
Level calls: for each depth d of the chain forest, one non-causal varlen call with, for every
chain u at depth d that has descendants, the segment q = rows of u's strict descendants
``[end(u), subtree_end(u))``, k = u's own rows ``[start(u), end(u))``. Both ranges are
contiguous in the packed tensors, so nothing is gathered; filler segments with an empty q or
an empty k range keep both cumulative arrays monotone and cover every row (the kernels write
out 0 / dK 0 there). The partial outputs merge by their log-sum-exp (``cascade.py``).

A step-wise batch (one chain) is a single causal segment; a GRPO group is its chain-causal
self call plus one level call in which all responses attend to the whole prompt as one segment.
Pure numpy at plan time; built once per plan and cached per device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps_mcore.planner import TreePlan, host_built, ragged_arange, unary_chains

# Beyond this many chain levels the cascade's launches and merges cost more than copying the
# contexts: tree_attention falls back to the gather-KV layout (see cascade_pays).
MAX_CASCADE_LEVELS = 8
# Level calls with fewer key blocks (of KEY_BLOCK rows) than this split their queries into
# chunks of at least MIN_CHUNK_ROWS rows, each with a copy of its keys (see _level_call).
KEY_BLOCK = 128
MIN_LEVEL_KEY_BLOCKS = 32
MIN_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call over the packed rows (q and k/v both the whole ``[T, H, D]``).

    cu_q, cu_k: ``[S+1]`` int32 segment boundaries (monotone; cu_q ends at T, cu_k at T or,
        with kv_index, at its length).
    rows: ``[T]`` bool, rows whose segment has at least one key (None: every row).
    kv_index: ``[C]`` rows of K/V to gather for this call (None: K/V in place, cu_k ends at T).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    rows: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None

    def to(self, device: torch.device) -> "VarlenCall":
        def mv(x):
            return None if x is None else x.to(device, non_blocking=True)

        return VarlenCall(
            mv(self.cu_q), mv(self.cu_k), self.max_q, self.max_k, self.causal, mv(self.rows), mv(self.kv_index)
        )


@dataclass(frozen=True)
class CascadeLayout:
    """``calls[0]`` is the causal self call over chains; ``calls[1:]`` one per chain level."""

    calls: tuple[VarlenCall, ...]
    num_chains: int

    @property
    def num_levels(self) -> int:
        return len(self.calls) - 1

    def to(self, device: torch.device) -> "CascadeLayout":
        return CascadeLayout(tuple(c.to(device) for c in self.calls), self.num_chains)


def _cu32(lengths: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def chains(plan: TreePlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per chain (:func:`~ps_mcore.planner.unary_chains`), in row order: ``start, end,
    subtree_end`` rows and ``depth`` (roots 0)."""
    bounds = plan.cu_seqlens_q.cpu().numpy().astype(np.int64)
    c = unary_chains(plan.node_parent.cpu().numpy(), bounds[:-1], plan.num_tokens)
    subtree_end = plan.subtree_end.cpu().numpy().astype(np.int64)[c.start]
    return c.start, c.end, subtree_end, c.depth


def _level_call(t: int, start, end, subtree_end) -> VarlenCall:
    """Chains u (row order) -> segments q = [end(u), subtree_end(u)), k = [start(u), end(u)),
    interleaved with q-only and k-only fillers so both boundary arrays are monotone over T.

    A flash backward runs one program per (key block, head) and loops over the query blocks:
    a level whose chains are short against their descendants (a 256-token prompt under 6000
    response rows) would run a handful of long programs. Then each chain's query range is cut
    into chunks and every chunk gets its own copy of the chain's K/V rows (``kv_index``: cheap,
    K/V are the small GQA side), so the backward has ``MIN_LEVEL_KEY_BLOCKS`` key blocks."""
    k_len, q_len = end - start, subtree_end - end
    blocks = int(np.sum(-(-k_len // KEY_BLOCK)))
    chunks = np.ones_like(k_len)
    if blocks < MIN_LEVEL_KEY_BLOCKS:
        want = -(-MIN_LEVEL_KEY_BLOCKS // blocks)
        chunks = np.clip(np.minimum(want, q_len // MIN_CHUNK_ROWS), 1, None)
    rows = np.zeros(t, dtype=bool)
    rows[ragged_arange(end, q_len)] = True
    if (chunks == 1).all():
        return _inplace_level_call(t, start, end, subtree_end, rows)
    q_lens, k_lens, kv = [], [], []
    prev_q = 0
    for s0, e0, se, n in zip(start.tolist(), end.tolist(), subtree_end.tolist(), chunks.tolist()):
        q_lens.append(e0 - prev_q), k_lens.append(0)  # rows with no key in this level
        cuts = e0 + ((se - e0) * np.arange(n + 1)) // n
        q_lens.extend(np.diff(cuts).tolist()), k_lens.extend([e0 - s0] * n)
        kv.extend([np.arange(s0, e0)] * n)
        prev_q = se
    q_lens.append(t - prev_q), k_lens.append(0)
    q_len_a, k_len_a = np.asarray(q_lens), np.asarray(k_lens)
    keep = (q_len_a > 0) | (k_len_a > 0)
    q_len_a, k_len_a = q_len_a[keep], k_len_a[keep]
    return VarlenCall(
        _cu32(q_len_a), _cu32(k_len_a), int(q_len_a.max()), int(k_len_a.max()), False,
        torch.from_numpy(rows), torch.from_numpy(np.concatenate(kv).astype(np.int64)),
    )


def _inplace_level_call(t, start, end, subtree_end, rows) -> VarlenCall:
    qs, qe, ks, ke = end, subtree_end, start, end
    prev_q = np.concatenate([[0], qe[:-1]])
    prev_k = np.concatenate([[0], ke[:-1]])
    zero = np.zeros_like(qs)
    # Per chain: (q filler, no k), (no q, k filler), (descendants, chain rows).
    q_len = np.stack([qs - prev_q, zero, qe - qs], 1).reshape(-1)
    k_len = np.stack([zero, ks - prev_k, ke - ks], 1).reshape(-1)
    q_len = np.concatenate([q_len, [t - qe[-1], 0]])
    k_len = np.concatenate([k_len, [0, t - ke[-1]]])
    keep = (q_len > 0) | (k_len > 0)
    q_len, k_len = q_len[keep], k_len[keep]
    return VarlenCall(
        _cu32(q_len), _cu32(k_len), int(q_len.max()), int(k_len.max()), False, torch.from_numpy(rows)
    )


def build_cascade_layout(plan: TreePlan) -> CascadeLayout:
    """The plan's cascade layout on the CPU (see the module docstring)."""
    t = plan.num_tokens
    start, end, subtree_end, depth = chains(plan)
    lens = end - start
    calls = [VarlenCall(_cu32(lens), _cu32(lens), int(lens.max()), int(lens.max()), True)]
    inner = subtree_end > end
    for d in np.unique(depth[inner]):
        sel = inner & (depth == d)
        calls.append(_level_call(t, start[sel], end[sel], subtree_end[sel]))
    return CascadeLayout(tuple(calls), int(start.size))


def cascade_layout(plan: TreePlan, device: torch.device | None = None) -> CascadeLayout:
    """The plan's cascade layout on ``device`` (default: the plan's), cached on the plan.

    Built from the plan's host copy when there is one (``TreePlan.to`` keeps it), so a plan
    already on the GPU costs no device-to-host sync here."""
    return host_built(
        plan, lambda memo: memo.cascade_layouts, plan.device if device is None else device,
        build_cascade_layout, CascadeLayout.to,
    )


def cascade_pays(plan: TreePlan, layout: CascadeLayout) -> bool:
    """Whether the cascade should beat gather-KV on this plan (``layout="auto"``).

    Both run the same attention FLOPs; what differs is the traffic around the kernel. Each
    cascade call costs query-sized passes over all T rows (the kernel's dO.O and dQ
    conversion, the merge, the dQ sum); gather-KV costs passes over the C = sum-of-contexts
    rows (the K/V copies, the kernel's GQA-expanded dK/dV, the fused scatter-add). Measured
    on one H200 (docs/benchmarks.md), ``(1 + 2 * levels) * T <= 0.75 * C`` picks the faster
    layout on the standard workloads: the cascade for step-wise (one chain, no level call;
    15% faster) and grpo-wide (a tie on time, half the memory); gather-KV for grpo-long-prompt
    (2% faster), many short prompts (grpo-math, 25%) and bushy multi-level trees (agent-tree,
    40%). Without sharing both run the plain batch."""
    if layout.num_levels > MAX_CASCADE_LEVELS:
        return False
    return 4 * (1 + 2 * layout.num_levels) * plan.num_tokens <= 3 * plan.kv_index.numel()


def auto_layout(plan: TreePlan, layout: CascadeLayout, level_calls: bool = True) -> str:
    """The layout ``layout="auto"`` runs, ``"cascade"`` or ``"gather"``: the cascade where it
    pays (:func:`cascade_pays`); for a kernel that cannot run the cascade's level calls
    (``level_calls=False``: cuDNN) only its single self call, on chain forests."""
    if not level_calls:
        return "gather" if layout.num_levels else "cascade"
    return "cascade" if cascade_pays(plan, layout) else "gather"
