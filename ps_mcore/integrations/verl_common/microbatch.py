"""Prefix-aware micro-batching for verl's engines.

verl's ``prepare_micro_batches`` balances raw token counts and scatters samples that share
a prefix across micro-batches, so nothing is left to share. Here samples are first grouped
into *units* (the samples that would share: same prompt within a ``uid`` for
``prompt_only``, a common prefix of at least ``min_prefix_len`` tokens for
``arbitrary_prefix``) and units are kept whole:

* dynamic batch size: the token budget counts the deduplicated tokens T of each unit (exact:
  the unit's plan), so more samples fit; units are balanced by T over as few micro-batches
  as the budget allows, the count is synced over DP and rounded as verl does, and the
  workload ordering (``use_dynamic_bsz_balance``) is verl's. Units larger than the budget
  run as one cross-micro-batch schedule when the engine's scheduler takes them (its steps
  come first, in order; :mod:`ps_mcore.integrations.verl_common.schedule`), else each is split
  in its sorted order into balanced pieces (its pieces still share within themselves).
* fixed micro-batch size: samples are ordered unit by unit before verl's chunking (a unit
  larger than the micro-batch is split at the chunk boundary); when that order is the
  batch's own order (verl's GRPO batches), the result is exactly verl's.

The returned index lists map every micro-batch back to batch positions; outputs are put
back in batch order (``postprocess_batch_func`` for dynamic batches, the patched one here
for reordered fixed-size batches).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ps_mcore.integrations.verl_common.batch import (
    VERL_TOKEN_WORKLOAD,
    group_ids,
    plan_sequences,
    prompt_lengths,
    sequence_lengths,
    sharing_sequences,
)
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.minibatch import CALL_OVERHEAD_FRACTION
from ps_mcore.planner import common_prefix_len


# ----------------------------------------------------------------------------- units


def sharing_units(
    seqs: list[np.ndarray],
    config: PrefixGrouperConfig,
    prompts: np.ndarray | None,
    groups: list[Any] | None,
) -> list[list[int]]:
    """Samples that would share, as sorted index lists ordered by their first index.

    ``arbitrary_prefix`` lists each unit in lexicographic order (so a split keeps
    neighbours, which share most, together); ``prompt_only`` in batch order.
    """
    n = len(seqs)
    if config.mode == "prompt_only":
        if prompts is None:
            raise ValueError("prefix_grouper.mode=prompt_only needs prompt lengths ('prompts')")
        labels = groups if groups is not None else [None] * n
        by_key: dict[Any, list[int]] = {}
        for i in range(n):
            p = int(prompts[i])
            key = (labels[i], seqs[i][:p].tobytes()) if p >= config.min_prefix_len else ("single", i)
            by_key.setdefault(key, []).append(i)
        units = list(by_key.values())
    else:
        order = sorted(range(n), key=lambda i: seqs[i].astype(">i8").tobytes())
        units, current = [], [order[0]] if order else []
        for a, b in zip(order, order[1:]):
            if common_prefix_len(seqs[a], seqs[b]) >= config.min_prefix_len:
                current.append(b)
            else:
                units.append(current)
                current = [b]
        if current:
            units.append(current)
    units.sort(key=min)
    return units


class _Units:
    """Units with their exact deduplicated token count and a verl-style workload."""

    def __init__(self, seqs, config, prompts, groups):
        self.seqs, self.config, self.prompts, self.groups = seqs, config, prompts, groups
        self.members = sharing_units(seqs, config, prompts, groups)
        self.tokens = [self._tokens(m) for m in self.members]

    def _tokens(self, members: list[int]) -> int:
        if len(members) == 1:
            return int(self.seqs[members[0]].size)
        plan = plan_sequences(
            [self.seqs[i] for i in members],
            self.config,
            None if self.prompts is None else self.prompts[members],
            None if self.groups is None else [self.groups[i] for i in members],
        )
        return plan.num_tokens

    def workload(self, u: int) -> int:
        # verl's calculate_workload (24576 * L + L^2) on the unit's packed length.
        t = self.tokens[u]
        return VERL_TOKEN_WORKLOAD * t + t * t

    def subset(self, unit_ids: list[int]) -> "_Units":
        """The units ``unit_ids`` alone (same samples, same sequences)."""
        sub = object.__new__(_Units)
        sub.seqs, sub.config, sub.prompts, sub.groups = self.seqs, self.config, self.prompts, self.groups
        sub.members = [list(self.members[u]) for u in unit_ids]
        sub.tokens = [self.tokens[u] for u in unit_ids]
        return sub

    def split_larger_than(self, budget: int) -> None:
        """Split every unit larger than ``budget`` into consecutive pieces that fit."""
        for u in reversed(range(len(self.tokens))):
            if self.tokens[u] > budget:
                self.split(u, budget)

    def split(self, u: int, budget: int | None) -> None:
        """Split unit ``u`` into consecutive pieces of at most ``budget`` tokens (or in two
        halves when ``budget`` is None).

        Pieces are filled from single samples, or from whole subtrees (a cut between two of
        them repeats only the prefix they hang from, e.g. the chat header every GRPO group of
        a batch shares), each up to the budget and again into as many pieces of balanced size
        (balanced micro-batches); the fill kept computes the fewest rows, counting
        :data:`~ps_mcore.minibatch.CALL_OVERHEAD_FRACTION` of the budget per piece. Fills are
        sized with :class:`_RunTokens` (no planning); each piece is then planned once and, in
        the rare case the planner shares less than estimated, split again by exact counts."""
        members = self.members[u]
        if budget is None:
            pieces = [members[: len(members) // 2], members[len(members) // 2 :]]
        else:
            run = _RunTokens(self, members)
            fills = []
            for blocks in (run.subtrees(0, len(members), budget), [(j, j + 1) for j in range(len(members))]):
                full = run.fill(blocks, budget)
                if len(full) > 1:
                    balanced = run.fill(blocks, budget, share=sum(run.tokens(*p) for p in full) / len(full))
                    if len(balanced) <= len(full):
                        fills.append(balanced)
                fills.append(full)
            overhead = CALL_OVERHEAD_FRACTION * budget
            best = min(fills, key=lambda fill: sum(run.tokens(*p) for p in fill) + overhead * len(fill))
            pieces = [piece for a, b in best for piece in self._fit(members[a:b], budget)]
        self.members[u : u + 1] = pieces
        self.tokens[u : u + 1] = [self._tokens(p) for p in pieces]

    def _fit(self, members: list[int], budget: int) -> list[list[int]]:
        """``members`` as one piece if its plan fits ``budget``, else consecutive pieces filled
        by exact counts (the planner dissolved a shared run the estimate counted once)."""
        if self._tokens(members) <= budget:
            return [members]
        pieces, current = [], []
        for i in members:
            if current and self._tokens(current + [i]) > budget:
                pieces.append(current)
                current = []
            current.append(i)
        return pieces + [current]


class _RunTokens:
    """Estimated deduplicated tokens of consecutive members of a unit, in O(1) per run.

    Consecutive members ``[a, b)`` (in the unit's order: sorted for ``arbitrary_prefix``, one
    prompt for ``prompt_only``) hold ``sum(len) - sum(shared with the previous member)``
    distinct tokens, as a prefix tree of sorted sequences does; the planner's
    ``min_prefix_len`` / ``min_group_size`` may dissolve a shared run, so a piece's plan can
    only be larger (:meth:`_Units._fit` checks)."""

    def __init__(self, units: _Units, members: list[int]):
        seqs, config = units.seqs, units.config
        lens = np.array([seqs[i].size for i in members], dtype=np.int64)
        if config.mode == "prompt_only":
            shared = [int(units.prompts[i]) for i in members[1:]]
        else:
            shared = [common_prefix_len(seqs[a], seqs[b]) for a, b in zip(members, members[1:])]
        self.shared = np.array(shared, dtype=np.int64)  # [n - 1]: member j+1 with member j
        self.len_sum = np.concatenate([[0], np.cumsum(lens)])
        self.shared_sum = np.concatenate([[0], np.cumsum(self.shared)])

    def tokens(self, a: int, b: int) -> int:
        return int(self.len_sum[b] - self.len_sum[a] - (self.shared_sum[b - 1] - self.shared_sum[a]))

    def subtrees(self, a: int, b: int, budget: int) -> list[tuple[int, int]]:
        """``[a, b)`` cut where neighbours share the least: the subtrees under its shallowest
        branching; those larger than ``budget`` are cut again the same way."""
        pieces, stack = [], [(a, b)]
        while stack:  # depth-first, in order: a unit nests as deep as its chain of branchings
            lo, hi = stack.pop()
            if hi - lo == 1 or ((lo, hi) != (a, b) and self.tokens(lo, hi) <= budget):
                pieces.append((lo, hi))
                continue
            inner = self.shared[lo : hi - 1]
            cuts = [lo + 1 + j for j in np.flatnonzero(inner == inner.min()).tolist()]
            stack.extend(reversed(list(zip([lo] + cuts, cuts + [hi]))))
        return pieces

    def fill(self, blocks: list[tuple[int, int]], budget: int, share: float | None = None) -> list[tuple[int, int]]:
        """Consecutive ``blocks`` packed into runs of at most ``budget`` tokens (a block is
        never cut); with ``share``, a run closes at the block boundary nearest ``share``."""
        pieces, start = [], None
        for a, b in blocks:
            if start is None:
                start = a
            elif self.tokens(start, b) > budget or (
                share is not None and self.tokens(start, b) > share
                and share - self.tokens(start, a) < self.tokens(start, b) - share
            ):
                pieces.append((start, a))
                start = a
            if share is not None and self.tokens(start, b) >= share:
                pieces.append((start, b))
                start = None
        if start is not None:
            pieces.append((start, blocks[-1][1]))
        return pieces


def split_units(
    seqs: list[np.ndarray],
    config: PrefixGrouperConfig,
    budget: int,
    prompts: np.ndarray | None = None,
    groups: list[Any] | None = None,
) -> list[list[int]]:
    """Sample index lists of the sharing units once those larger than ``budget`` are split
    into pieces (each piece recomputes the prefix its samples share): what within-micro-batch
    sharing packs under a token budget."""
    return [sorted(m) for m in _split_units(seqs, config, budget, prompts, groups).members]


def split_unit_tokens(
    seqs: list[np.ndarray],
    config: PrefixGrouperConfig,
    budget: int,
    prompts: np.ndarray | None = None,
    groups: list[Any] | None = None,
) -> list[int]:
    """Deduplicated tokens of each piece of :func:`split_units`."""
    return list(_split_units(seqs, config, budget, prompts, groups).tokens)


def _split_units(seqs, config, budget, prompts, groups) -> _Units:
    units = _Units(seqs, config, prompts, groups)
    units.split_larger_than(budget)
    return units


# ----------------------------------------------------------------------------- partitions


def _balanced(weights: list[int], k: int) -> list[list[int]]:
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    return get_seqlen_balanced_partitions(weights, k_partitions=k, equal_size=False)


def _fits(parts: list[list[int]], tokens: list[int], budget: int) -> bool:
    return all(sum(tokens[u] for u in p) <= budget for p in parts)


def _local_count(units: _Units, budget: int) -> int:
    """Fewest micro-batches whose balanced partition respects ``budget``."""
    k = max(1, math.ceil(sum(units.tokens) / budget))
    while k < len(units.tokens) and not _fits(_balanced(units.tokens, k), units.tokens, budget):
        k += 1
    return min(k, len(units.tokens))


def _sync_count(k: int, dp_group, same_micro_num_in_dp: bool, divided_by: int | None) -> int:
    import torch
    import torch.distributed as dist

    # A data-parallel group of one has nothing to agree on: no all-reduce, no host sync.
    if dist.is_initialized() and same_micro_num_in_dp and dp_group is not None and dist.get_world_size(dp_group) > 1:
        from verl.utils.device import get_device_name

        t = torch.tensor([k], device=get_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(t.cpu().item())
    if divided_by is not None:
        k = math.ceil(k / divided_by) * divided_by
    return k


def dynamic_partitions(
    units: _Units,
    budget: int,
    dp_group=None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
) -> list[list[int]]:
    """Sample index lists per micro-batch (dynamic batch size, dedup-token budget)."""
    units.split_larger_than(budget)
    k = _local_count(units, budget)
    if min_num_micro_batch is not None:
        k = max(k, min_num_micro_batch)
    k = _sync_count(k, dp_group, same_micro_num_in_dp, num_batches_divided_by)
    return partition_units(units, k, use_dynamic_bsz_balance)


def budget_partitions(units: _Units, budget: int, scheduler=None, **options) -> tuple[list[list[int]], Any]:
    """Sample index lists per micro-batch under a deduplicated-token budget: ``scheduler``'s
    (the schedule's steps first) where it takes the units larger than the budget, else
    :func:`dynamic_partitions`. Returns ``(parts, scheduler)``, the scheduler None unless its
    schedule runs."""
    if scheduler is not None and any(t > budget for t in units.tokens):
        parts = scheduler.partitions(units, budget, options)
        if parts is not None:
            return parts, scheduler
    return dynamic_partitions(units, budget, **options), None


def partition_units(units: _Units, k: int, use_dynamic_bsz_balance: bool = True) -> list[list[int]]:
    """Sample index lists of ``k`` micro-batches balancing the units' deduplicated tokens."""
    samples = sum(len(m) for m in units.members)
    if k > samples:
        raise ValueError(
            f"{k} micro-batches requested (after DP sync / rounding) but the batch has only "
            f"{samples} samples"
        )
    while len(units.tokens) < k:  # more micro-batches than units: split the largest
        largest = max(range(len(units.tokens)), key=lambda u: (len(units.members[u]) > 1, units.tokens[u]))
        units.split(largest, None)
    parts = _balanced(units.tokens, k)
    if use_dynamic_bsz_balance:
        work = [sum(units.workload(u) for u in p) for p in parts]
        order = sorted(range(k), key=lambda j: (work[j], min(parts[j])), reverse=True)
        parts = [parts[j] for j in order]
        parts = parts[::2][::-1] + parts[1::2]  # verl: small micro-batches at both ends
    return [sorted(i for u in p for i in units.members[u]) for p in parts]


def fixed_order(units: _Units) -> list[int]:
    """Batch positions ordered unit by unit (units by first index, members ascending)."""
    return [i for m in units.members for i in sorted(m)]


# ----------------------------------------------------------------------------- entry


def prefix_aware_prepare_micro_batches(
    data,
    config: PrefixGrouperConfig,
    stock: Callable,
    plans: dict | None = None,
    images=None,
    scheduler=None,
    unshared: dict | None = None,
    **options,
):
    """Drop-in for verl's ``prepare_micro_batches`` keeping sharing units together; a batch
    whose samples share nothing gets verl's own micro-batches.

    Args:
        data: the worker batch (TensorDict).
        config: the engine's ``prefix_grouper`` config.
        stock: verl's ``prepare_micro_batches`` (used when its result is already right).
        plans: when given, ``id(micro_batch) -> (micro_batch, TreePlan)`` is filled for every
            micro-batch built here, planned from the sequences already read for sizing, so the
            forward uses that plan instead of planning the micro-batch again (same plan:
            :func:`~ps_mcore.integrations.verl_common.batch.plan_batch` of the micro-batch). The
            entry holds the micro-batch, so its id cannot be reused while the entry lives.
        images: a vision-language model's :class:`~ps_mcore.integrations.verl_common.batch.ImageTokens`
            (image placeholders are keyed by content, so units follow what can really be shared).
        scheduler: with a token budget, plans the units larger than it as one
            cross-micro-batch schedule (its ``partitions(units, budget, options)`` returns the
            micro-batches, the schedule's steps first, or None to split those units as before;
            ``bind(micro_batches)`` is told the micro-batches built from them).
        unshared: when given and the batch has nothing to share (no unit's plan saves a
            token), ``id(micro_batch) -> (micro_batch, N)`` is filled for verl's own
            micro-batches, N their input tokens: the forward runs them as verl does, unplanned.
        options: verl's keywords: ``dp_group``, ``num_batches_divided_by``,
            ``same_micro_num_in_dp``, ``min_num_micro_batch``, ``use_dynamic_bsz_balance``.

    Returns ``(micro_batches, indices)`` like verl: ``indices`` is None only when the
    result is verl's own (fixed size, batch already in unit order).
    """
    from verl.utils import tensordict_utils as tu

    stock_args = dict(data=data, **options)
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return stock(**stock_args)  # reward-model pairs: verl's own grouping rule
    seqs = sharing_sequences(data, images)
    prompts = prompt_lengths(data)
    if config.mode == "prompt_only" and prompts is None:
        return stock(**stock_args)
    units = _Units(seqs, config, prompts, group_ids(data))
    if sum(units.tokens) == sum(int(s.size) for s in seqs):  # nothing to share: verl's run
        micro_batches, indices = stock(**stock_args)
        if unshared is not None:
            lengths = sequence_lengths(data)
            parts = indices if indices is not None else np.split(
                np.arange(len(lengths)), np.cumsum([len(b) for b in micro_batches])[:-1])
            for batch, part in zip(micro_batches, parts):
                unshared[id(batch)] = batch, int(lengths[list(part)].sum())
        return micro_batches, indices
    use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    if use_dynamic_bsz:
        sp_size = tu.get_non_tensor_data(data=data, key="sp_size", default=1)
        budget = int(data["max_token_len_per_gpu"]) * sp_size
        longest = max(int(s.size) for s in seqs)
        if budget < longest:
            raise ValueError(
                f"max_token_len ({budget}) is smaller than the longest sequence ({longest})"
            )
        parts, scheduler = budget_partitions(units, budget, scheduler, **options)
    else:
        scheduler = None
        order = fixed_order(units)
        if order == list(range(len(seqs))):
            return stock(**stock_args)
        mbs = int(data["micro_batch_size_per_gpu"])
        if len(order) % mbs:
            raise ValueError(f"data size {len(order)} is not divisible by micro_batch_size_per_gpu {mbs}")
        parts = [order[a : a + mbs] for a in range(0, len(order), mbs)]
    micro_batches = [tu.index_select_tensor_dict(data, p) for p in parts]
    if scheduler is not None:
        scheduler.bind(micro_batches)
    if plans is not None:
        groups = group_ids(data)
        for batch, part in zip(micro_batches, parts):
            if scheduler is not None and scheduler.owns(batch):
                continue  # its calls are planned by the schedule
            plans[id(batch)] = batch, plan_sequences(
                [seqs[i] for i in part],
                config,
                None if prompts is None else prompts[part],
                None if groups is None else [groups[i] for i in part],
            )
    return micro_batches, parts


def restore_order(output: dict, indices, data) -> dict:
    """Put ``model_output`` of a reordered fixed-size batch back in batch order (verl
    restores only dynamic batches)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    if indices is None or tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return output
    model_output = output.get("model_output", {})
    for key in list(model_output):
        model_output[key] = restore_dynamic_batch(model_output[key], indices)
    return output
