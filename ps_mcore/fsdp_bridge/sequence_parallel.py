"""DeepSpeed-Ulysses sequence parallelism (SP) on a prefix tree.

The ``T`` packed rows of a plan are padded to a multiple of the SP size and split into equal
contiguous chunks, one per SP rank (verl's ``ulysses_pad_and_slice_inputs`` layout on the
packed rows). Everything outside attention runs on the local chunk. In each attention call an
all-to-all turns ``[c rows, all heads]`` into ``[all rows, heads / sp]`` (key/value heads
repeated first when there are fewer than SP ranks, as verl does), so every rank holds the
whole forest for its heads and tree attention runs unchanged; a second all-to-all turns the
output back. Per-token outputs: each rank scores the original tokens whose row is local and
an all-reduce of the disjoint ``[N]`` pieces gives every rank the full result.

Gradients follow verl's Ulysses convention: every SP rank computes the same loss from the
gathered outputs, and the gather's backward scales by the SP size (verl's ``Gather`` with
``grad_scaler``), so averaging gradients over the data x SP ranks gives the batch gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ps_mcore.logprobs import LabelledRows, LocalTokenRows, TokenStatistics, token_statistics, token_temperatures
from ps_mcore.planner import TreePlan


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(x, size, scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim).contiguous()


class AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` over the group, concatenate what arrives along ``gather_dim``;
    backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _SumScaled(torch.autograd.Function):
    """All-reduce (sum) of per-rank tensors with disjoint supports; backward: the gradient
    times ``scale`` (every rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, x, group, scale: float):
        ctx.scale = scale
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


@dataclass(frozen=True, eq=False)
class SequenceParallelPlan:
    """A :class:`TreePlan` whose packed rows are split over a sequence-parallel group.

    Shapes: ``T`` plan rows padded to ``T_pad = size * c``; this rank holds rows
    ``[rank * c, (rank + 1) * c)``.

    Attributes:
        plan: the micro-batch's plan (every SP rank plans the same micro-batch).
        group: the SP process group; size, rank: its size and this rank.
    """

    plan: TreePlan
    group: Any
    size: int
    rank: int

    @property
    def rows_per_rank(self) -> int:
        return -(-self.plan.num_tokens // self.size)

    @property
    def row_range(self) -> tuple[int, int]:
        c = self.rows_per_rank
        return self.rank * c, (self.rank + 1) * c

    def padded(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``x`` with ``T`` (or already ``T_pad``) rows along ``dim`` -> ``T_pad`` rows (zeros
        appended): the rows the ranks split."""
        pad = self.size * self.rows_per_rank - x.size(dim)
        if not pad:
            return x
        shape = list(x.shape)
        shape[dim] = pad
        return torch.cat([x, x.new_zeros(shape)], dim=dim)

    def local(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``[T, ...]`` (or ``T_pad`` rows) in plan order along ``dim`` -> ``[c, ...]`` this
        rank's rows (padding zeros)."""
        lo, hi = self.row_range
        return self.padded(x, dim).narrow(dim, lo, hi - lo)

    @functools.cached_property
    def token_rows(self) -> LocalTokenRows:
        """The original tokens whose packed row is on this rank (host arrays, no sync)."""
        lo, hi = self.row_range
        rows = self.plan.host.unpack_index.cpu().numpy()
        index = np.nonzero((rows >= lo) & (rows < hi))[0]
        token_index = torch.from_numpy(index)
        local = LocalTokenRows.select(self.plan.host, token_index, torch.from_numpy(rows[index] - lo), hi - lo)
        return local.to(self.plan.device)

    def local_pairs(self, pairs: LabelledRows) -> "LocalPairs":
        """The pairs of ``pairs`` (the whole plan's) whose row is on this rank (no device sync)."""
        lo, hi = (min(r, self.plan.num_tokens) for r in self.row_range)
        start, stop = int(pairs.row_offsets[lo]), int(pairs.row_offsets[hi])
        return LocalPairs(pairs.rows[start:stop] - lo, pairs.labels[start:stop], start, pairs.num_pairs)

    def attend(self, attention: Callable, module, query, key, value, attention_mask, **kwargs):
        """Run ``attention`` (the tree attention function, HF signature; ``kwargs`` carry the
        whole plan's call, ``tree_call=TreeCall(self.plan, ...)``) on the whole forest for
        this rank's heads. query ``[1, Hq, c, D]``, key/value ``[1, Hkv, c, D]`` -> output
        ``[1, c, Hq, D]``."""
        hq, hkv = query.size(1), key.size(1)
        if hq % self.size:
            raise ValueError(f"Ulysses SP of {self.size} ranks needs the query heads ({hq}) to divide by it")
        if hkv % self.size and self.size % hkv:
            raise ValueError(f"Ulysses SP of {self.size} ranks needs kv heads ({hkv}) to divide it or by it")
        repeats = max(self.size // hkv, 1)
        if repeats > 1:  # every rank needs whole kv heads; GQA still maps query heads to groups
            key, value = (x.repeat_interleave(repeats, dim=1) for x in (key, value))
        t = self.plan.num_tokens
        # [1, H, c, D] -> [1, H / sp, T_pad, D]: all rows for this rank's heads
        q, k, v = (AllToAll.apply(x, 1, 2, self.group)[:, :, :t] for x in (query, key, value))
        kwargs["position_ids"] = self.plan.position_ids[None]
        out, _ = attention(module, q, k, v, attention_mask, **kwargs)  # [1, T, H / sp, D]
        pad = self.size * self.rows_per_rank - t
        if pad:
            out = torch.cat([out, out.new_zeros((1, pad) + tuple(out.shape[2:]))], dim=1)
        return AllToAll.apply(out, 1, 2, self.group), None  # [1, c, H, D]


@dataclass(frozen=True, eq=False)
class LocalPairs:
    """One SP rank's share of a plan's :class:`~ps_mcore.logprobs.LabelledRows`: pairs
    ``[start, start + u)`` of the ``U``, those whose packed row is on this rank.

    Attributes:
        rows: ``[u]`` each pair's row among this rank's ``c`` rows.
        labels: ``[u]`` each pair's label.
        start: the first pair's index among the ``U``; num_pairs: ``U``.
    """

    rows: torch.Tensor
    labels: torch.Tensor
    start: int
    num_pairs: int


def sequence_parallel_plan(plan: TreePlan, group) -> SequenceParallelPlan:
    """``plan`` split over the SP ``group`` (this process's rank in it)."""
    return SequenceParallelPlan(plan, group, dist.get_world_size(group), dist.get_rank(group))


def sp_token_statistics(
    logits: torch.Tensor, sp_plan: SequenceParallelPlan, temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False, **statistics,
) -> TokenStatistics:
    """:func:`ps_mcore.logprobs.token_statistics` from this SP rank's logits ``[c, V]``: each
    rank scores the tokens whose row is local; returns every statistic per original token
    (``[N]`` / ``[N, K]``; ``label_ids`` given ``[N, K]`` for the whole plan) on every rank."""
    plan, local = sp_plan.plan, sp_plan.token_rows
    if isinstance(temperature, torch.Tensor):
        temperature = token_temperatures(plan, temperature)[local.token_index.cpu()]
    if statistics.get("label_ids") is not None:  # this rank's tokens' ids
        ids = statistics["label_ids"]
        statistics["label_ids"] = ids.index_select(0, local.token_index.to(ids.device))
    stats = token_statistics(logits, local, temperature, compute_entropy, **statistics)
    return stats.map(lambda x: _combine(x, local.token_index.to(x.device), plan.num_input_tokens, sp_plan))


def _combine(x: torch.Tensor, index: torch.Tensor, total: int, sp_plan: SequenceParallelPlan) -> torch.Tensor:
    """``[n, ...]`` this rank's entries ``index`` of ``total`` (disjoint over the SP ranks)
    -> ``[total, ...]`` on every rank (backward: this rank's entries, times the SP size)."""
    full = x.new_zeros((total,) + tuple(x.shape[1:])).index_copy(0, index, x)
    return _SumScaled.apply(full, sp_plan.group, float(sp_plan.size))


def sp_gather_rows(x: torch.Tensor, sp_plan: SequenceParallelPlan) -> torch.Tensor:
    """``[c, ...]`` this rank's rows -> ``[T, ...]`` every row in plan order, on every rank
    (backward: this rank's rows of the gradient, times the SP size)."""
    lo, hi = sp_plan.row_range
    full = _combine(x, torch.arange(lo, hi, device=x.device), sp_plan.size * (hi - lo), sp_plan)
    return full[: sp_plan.plan.num_tokens]


def sp_gather_pairs(x: torch.Tensor, local: LocalPairs, sp_plan: SequenceParallelPlan) -> torch.Tensor:
    """``[u]`` per pair of this rank (:meth:`SequenceParallelPlan.local_pairs`) -> ``[U]``
    every pair, on every rank (backward: this rank's pairs, times the SP size)."""
    index = torch.arange(local.start, local.start + x.size(0), device=x.device)
    return _combine(x, index, local.num_pairs, sp_plan)
