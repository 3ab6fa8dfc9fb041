"""Context-parallel (CP) layout of a tree batch: Megatron's 2*cp chunk layout over the packed rows.

The T_pad packed rows (plan order, padding last) are one THD sequence cut into ``2*cp`` equal
chunks; CP rank r holds chunks r and 2cp-1-r (Megatron's / verl's load-balanced layout, so
Megatron's THD RoPE slices the per-token rotary table the same way). :class:`CPLayout` is one
rank's share: its rows, its query segments and their contexts as rows of the rank-major K/V
all-gather, and the original tokens whose row is local. Built once per micro-batch by
``TreePackedSeqParams.from_plan`` (:mod:`ps_mcore.layer_specs.packed_params`).

An ordinary THD batch under CP (verl's stock path: every sequence padded to ``2*cp*tp`` and
chunked on its own) gets the same kind of layout with per-sequence chunks
(:func:`thd_cp_rows`, ``build_cp_layout(..., cu_seqlens=...)``), so a tree-spec model also runs
the micro-batches that fall back to verl's stock forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps_mcore.planner import TreePlan, ragged_arange


def cp_chunk_rows(num_rows: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """Global rows of CP rank ``cp_rank``: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of
    ``num_rows`` rows cut into ``2*cp_size`` equal chunks (``[num_rows // cp_size]``)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if num_rows % (2 * cp_size):
        raise ValueError(
            f"{num_rows} rows cannot be cut into 2*cp_size={2 * cp_size} equal chunks; pad the "
            "packed rows to a multiple of 2*cp*tp (TreePackedSeqParams.from_plan(pad_to_multiple_of=...))"
        )
    c = num_rows // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return np.concatenate([np.arange(first, first + c), np.arange(second, second + c)])


@dataclass(frozen=True, eq=False)
class CPLayout:
    """One CP rank's share of a tree batch (tensors on the plan's device).

    Shapes: ``T_pad`` packed rows (``T`` plan tokens + padding), ``t = T_pad / cp`` local rows,
    ``Q <= t`` local rows holding plan tokens, ``S`` query segments, ``n`` original tokens whose
    row is local.

    Attributes:
        cp_size, cp_rank: the layout's CP group size and this rank.
        num_rows: T_pad.
        local_rows: ``[t]`` global row of each local row.
        gathered_rows: ``[cp * t]`` global row of each row of a rank-major all-gather.
        plan_order: ``[T_pad]`` position in the rank-major all-gather of every global row.
        query_rows: ``[Q]`` local rows holding plan tokens (the others are padding).
        cu_seqlens_q: ``[S+1]`` int32 segments of the local queries: a node's rows within one
            chunk.
        cu_seqlens_kv: ``[S+1]`` int32 boundaries of each segment's context in ``kv_index``.
        kv_index: each segment's context (the node's ancestor chain, then its own rows up to
            the segment's last query) as rows of the rank-major all-gather, so K/V are used as
            gathered, never reordered.
        max_seqlen_q, max_seqlen_kv: longest segment and context.
        token_index: ``[n]`` original tokens whose packed row is local.
        token_rows: ``[n]`` their local rows.

    ``gather_kv_attention`` reads the sub-plan attributes (``kv_index``, ``cu_seqlens_*``,
    ``max_seqlen_*``, ``is_trivial``) directly, so a layout is its own attention plan.
    """

    cp_size: int
    cp_rank: int
    num_rows: int
    local_rows: torch.Tensor
    gathered_rows: torch.Tensor
    plan_order: torch.Tensor
    query_rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    token_index: torch.Tensor
    token_rows: torch.Tensor

    @property
    def is_trivial(self) -> bool:  # the gather is never skipped: contexts are global rows
        return False

    @property
    def num_local_rows(self) -> int:
        return int(self.local_rows.numel())

    @property
    def all_rows_real(self) -> bool:
        return self.query_rows.numel() == self.local_rows.numel()


def _local_segments(plan: TreePlan, chunks: list[tuple[int, int]]):
    """Query segments (a node's rows within one chunk, in local order) and their contexts."""
    cu_q = plan.cu_seqlens_q.cpu().numpy().astype(np.int64)
    cu_kv = plan.cu_seqlens_kv.cpu().numpy().astype(np.int64)
    start, end = cu_q[:-1], cu_q[1:]
    ancestors = np.diff(cu_kv) - (end - start)
    seg_len, ctx_start, ctx_len = [], [], []
    for g0, g1 in chunks:
        g1 = min(g1, plan.num_tokens)
        if g0 >= g1:
            continue
        v = np.arange(np.searchsorted(end, g0, side="right"), np.searchsorted(start, g1, side="left"))
        a, b = np.maximum(start[v], g0), np.minimum(end[v], g1)
        seg_len.append(b - a)
        ctx_start.append(cu_kv[v])
        # bottom-right causal alignment: query a+i sees the context up to its own row
        ctx_len.append(ancestors[v] + (b - start[v]))
    if not seg_len:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(seg_len), np.concatenate(ctx_start), np.concatenate(ctx_len)


def thd_cp_rows(cu_seqlens, cp_size: int, cp_rank: int) -> np.ndarray:
    """Global rows of CP rank ``cp_rank`` of an ordinary THD batch under CP: every sequence
    (``cu_seqlens`` padded boundaries, each length a multiple of ``2*cp_size``) is cut into
    ``2*cp_size`` chunks and the rank holds chunks r and 2cp-1-r of each, sequence by sequence
    (verl's ``preprocess_thd_engine`` / TE's THD layout)."""
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    return np.concatenate(
        [a + cp_chunk_rows(int(b - a), cp_size, cp_rank) for a, b in zip(bounds[:-1], bounds[1:])]
        or [np.zeros(0, dtype=np.int64)]
    )


def _chunks_of(rows: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """``rows`` (runs of ``chunk`` consecutive global rows) as ``(start, end)`` ranges."""
    return [(int(rows[i]), int(rows[i]) + chunk) for i in range(0, rows.size, chunk)]


def build_cp_layout(
    plan: TreePlan, num_rows: int, cp_size: int, cp_rank: int, cu_seqlens=None
) -> CPLayout:
    """The layout of CP rank ``cp_rank`` for ``plan`` padded to ``num_rows`` rows.

    ``cu_seqlens`` None: the rows are one THD sequence (a tree batch). Otherwise the padded
    boundaries of an ordinary THD batch (``[B+1]``, ending at ``num_rows``): each sequence is
    chunked on its own (:func:`thd_cp_rows`), as verl's stock THD path lays rows out.
    """
    t = plan.num_tokens
    if num_rows < t:
        raise ValueError(f"num_rows={num_rows} < T={t} plan tokens")
    if cu_seqlens is None:
        cu_seqlens = [0, num_rows]
    cu_seqlens = np.asarray(cu_seqlens, dtype=np.int64)
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != num_rows:
        raise ValueError(f"cu_seqlens must run from 0 to num_rows={num_rows}, got {cu_seqlens.tolist()}")

    def rows_of(rank: int) -> np.ndarray:
        return thd_cp_rows(cu_seqlens, cp_size, rank)

    rows = rows_of(cp_rank)
    chunks = [
        piece
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])
        for piece in _chunks_of(a + cp_chunk_rows(int(b - a), cp_size, cp_rank), int(b - a) // (2 * cp_size))
        if b > a
    ]
    seg_len, ctx_start, ctx_len = _local_segments(plan, chunks)
    gathered = np.concatenate([rows_of(r) for r in range(cp_size)])
    plan_order = np.argsort(gathered)
    kv_index = plan_order[plan.kv_index.cpu().numpy()[ragged_arange(ctx_start, ctx_len)]]
    global_to_local = np.full(num_rows, -1, dtype=np.int64)
    global_to_local[rows] = np.arange(rows.size)
    token_row = global_to_local[plan.unpack_index.cpu().numpy()]
    token_index = np.flatnonzero(token_row >= 0)
    dev = plan.device

    def long(x):
        return torch.as_tensor(np.asarray(x, dtype=np.int64), device=dev)

    def cu(lengths):
        return torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=dev)

    return CPLayout(
        cp_size=int(cp_size), cp_rank=int(cp_rank), num_rows=int(num_rows),
        local_rows=long(rows), gathered_rows=long(gathered), plan_order=long(plan_order),
        query_rows=long(np.flatnonzero(rows < t)),
        cu_seqlens_q=cu(seg_len), cu_seqlens_kv=cu(ctx_len), kv_index=long(kv_index),
        max_seqlen_q=int(seg_len.max(initial=0)), max_seqlen_kv=int(ctx_len.max(initial=0)),
        token_index=long(token_index), token_rows=long(token_row[token_index]),
    )
