"""Context parallelism (CP) for tree batches: Megatron's 2*cp chunk layout over the packed rows.

The T_pad packed rows (plan order, padding last) are one THD sequence cut into ``2*cp`` equal
chunks; CP rank r holds chunks r and 2cp-1-r (Megatron's / verl's load-balanced layout, so
Megatron's THD RoPE slices the per-token rotary table the same way). Attention cannot stay
local in a tree (a query needs all its ancestors' K/V), so every layer all-gathers K/V over the
CP group (backward: reduce-scatter of dK/dV) and runs the gather-KV kernel for the local
queries only, against the global rows: query row q of node v attends to v's ancestor chain and
to v's own rows up to q, exactly as without CP.

Outputs (logits, values) stay in this rank's rows: :func:`cp_token_logprobs` computes the
log-probs of the original tokens whose row is local and combines them over CP into ``[N]``;
:func:`gather_cp_rows` gathers any per-row tensor into plan order. Both assume every CP rank
then computes the same loss from the gathered result (the gradient of each local row is that
loss's gradient, not summed over ranks); parameter gradients are summed over CP afterwards, as
Megatron's DDP does over its data-and-context-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ps_mcore.attention.backends import cp_backend_names, cp_kernel
from ps_mcore.attention.gather_kv import gather_kv_attention
from ps_mcore.logprobs import token_logprobs
from ps_mcore.planner import TreePlan, ragged_arange

# Backends that run local queries against all-gathered K/V (a gather-KV kernel): read from
# the backend table (ps_mcore.attention.backends), which also gives ``cp_kernel``.
CP_BACKENDS = cp_backend_names()


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


def build_cp_layout(plan: TreePlan, num_rows: int, cp_size: int, cp_rank: int) -> CPLayout:
    """The layout of CP rank ``cp_rank`` for ``plan`` padded to ``num_rows`` rows."""
    t = plan.num_tokens
    if num_rows < t:
        raise ValueError(f"num_rows={num_rows} < T={t} plan tokens")
    rows = cp_chunk_rows(num_rows, cp_size, cp_rank)
    c = num_rows // (2 * cp_size)
    chunks = [(int(rows[0]), int(rows[0]) + c), (int(rows[c]), int(rows[c]) + c)]
    seg_len, ctx_start, ctx_len = _local_segments(plan, chunks)
    gathered = np.concatenate([cp_chunk_rows(num_rows, cp_size, r) for r in range(cp_size)])
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


# ----------------------------------------------------------------------------- collectives


def _check_group(layout: CPLayout, group) -> None:
    if group is None:
        raise ValueError(
            f"a CP layout (cp_size={layout.cp_size}) needs the context-parallel process group"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (layout.cp_size, layout.cp_rank):
        raise ValueError(
            f"the packed params were built for CP rank {layout.cp_rank} of {layout.cp_size}, but "
            f"this is rank {rank} of a CP group of {size}; pass cp_size/cp_rank of the model's "
            "CP group to TreePackedSeqParams.from_plan"
        )


def _all_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[t, ...]`` on every rank -> ``[size * t, ...]`` rank-major."""
    x = x.contiguous()
    out = x.new_empty((size * x.size(0),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


class _AllGatherKV(torch.autograd.Function):
    """Rank-major all-gather; backward reduce-scatters (each rank's dK/dV is partial: it comes
    from its own queries only)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        return _all_gather(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.size(0) // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None


class _GatherRows(torch.autograd.Function):
    """``[t, ...]`` on every CP rank -> ``[T_pad, ...]`` in plan order; backward keeps this
    rank's rows of the gradient (every rank computed the same loss from the result)."""

    @staticmethod
    def forward(ctx, x, layout, group):
        ctx.layout = layout
        return _all_gather(x, group, layout.cp_size).index_select(0, layout.plan_order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.layout.local_rows), None, None


class _SumDisjoint(torch.autograd.Function):
    """All-reduce (sum) of per-rank tensors with disjoint supports; backward: identity (every
    rank computed the same loss from the combined result)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ----------------------------------------------------------------------------- attention


def cp_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    group,
    backend: str,
    softmax_scale: float,
) -> torch.Tensor:
    """Tree attention of this CP rank's rows.

    Args:
        q: ``[t, Hq, D]`` local queries (layout order); k/v: ``[t, Hkv, D]`` local keys/values.
        layout: this rank's :class:`CPLayout`; group: the CP process group.

    Returns:
        ``[t, Hq, D]``: each local row's tree attention over the global rows (padding rows 0).
    """
    _check_group(layout, group)
    if q.size(0) != layout.num_local_rows or k.size(0) != layout.num_local_rows:
        raise ValueError(
            f"q/k have {q.size(0)}/{k.size(0)} rows but this CP rank holds {layout.num_local_rows}"
        )
    hkv = k.size(1)
    kv = _AllGatherKV.apply(torch.cat([k, v], 1), group, layout.cp_size)  # one collective for both
    if layout.query_rows.numel() == 0:  # only padding here: stay in the backward's reduce-scatter
        return q.new_zeros(q.shape) + 0 * kv.sum()
    kernel = cp_kernel(backend, q)
    queries = q if layout.all_rows_real else q.index_select(0, layout.query_rows)
    out = gather_kv_attention(queries, kv[:, :hkv], kv[:, hkv:], layout, softmax_scale, kernel)
    if layout.all_rows_real:
        return out
    return q.new_zeros(q.shape).index_copy(0, layout.query_rows, out)


# ----------------------------------------------------------------------------- outputs


def _cp_group_or_default(cp_group):
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def gather_cp_rows(x: torch.Tensor, packed_seq_params, cp_group=None) -> torch.Tensor:
    """This CP rank's rows ``[t, ...]`` (e.g. logits, values) -> ``[T_pad, ...]`` in plan order.

    Without CP it returns ``x``. Backward keeps this rank's rows of the gradient: every CP rank
    must compute the same loss from the result. ``cp_group`` defaults to Megatron's CP group.
    """
    layout = packed_seq_params.cp_layout
    if layout is None:
        return x
    group = _cp_group_or_default(cp_group)
    _check_group(layout, group)
    if x.size(0) != layout.num_local_rows:
        raise ValueError(f"expected {layout.num_local_rows} local rows, got shape {tuple(x.shape)}")
    return _GatherRows.apply(x, layout, group)


def _local_rows_plan(plan: TreePlan, layout: CPLayout) -> TreePlan:
    """A plan view over the local rows for ``token_logprobs``, which reads only the row count,
    ``unpack_index`` and the next-token labels: original token ``token_index[i]`` reads local
    row ``token_rows[i]``."""
    dev = layout.local_rows.device
    return replace(
        plan,
        input_ids=torch.zeros(layout.num_local_rows, dtype=torch.long, device=dev),
        unpack_index=layout.token_rows,
        next_token_ids=plan.next_token_ids.to(dev).index_select(0, layout.token_index),
        next_token_mask=plan.next_token_mask.to(dev).index_select(0, layout.token_index),
        _cache={},
    )


def cp_token_logprobs(
    logits: torch.Tensor,
    packed_seq_params,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`ps_mcore.token_logprobs` from this CP rank's logits.

    Args:
        logits: ``[t, V_local]`` this rank's LM-head rows (a vocab shard under TP).
        packed_seq_params: the batch's ``TreePackedSeqParams`` (built with ``cp_size``).
        tp_group: the vocab-parallel group; cp_group: the CP group (default: Megatron's).

    Returns:
        ``logprobs [N]`` and ``entropy [N]`` or None, on every CP rank: each rank normalises
        only its own rows (no ``[T_pad, V]`` gather), then the ``[N]`` results are combined.
        Backward: every CP rank must compute the same loss from them.
    """
    plan, layout = packed_seq_params.plan, packed_seq_params.cp_layout
    if layout is None:
        return token_logprobs(logits, plan, temperature, compute_entropy, tp_group)
    group = _cp_group_or_default(cp_group)
    _check_group(layout, group)
    if logits.dim() != 2 or logits.size(0) != layout.num_local_rows:
        raise ValueError(
            f"cp_token_logprobs expects logits [{layout.num_local_rows}, V] (this CP rank's "
            f"rows), got {tuple(logits.shape)}"
        )
    lp, ent = token_logprobs(logits, _local_rows_plan(plan, layout), temperature, compute_entropy, tp_group)

    def combine(x: torch.Tensor) -> torch.Tensor:
        full = x.new_zeros(plan.num_input_tokens).index_copy(0, layout.token_index, x)
        return _SumDisjoint.apply(full, group)

    return combine(lp), (combine(ent) if compute_entropy else None)
