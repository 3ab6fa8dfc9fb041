"""``ps-mcore analyze --max-tokens N``: what a mini-batch computes under a micro-batch token
budget, three ways.

* unshared (verl's stock dynamic batching): every token of every sample;
* split: samples sharing a prefix are packed together and a sharing unit larger than the
  budget is split into pieces, each recomputing the prefix its samples share (the verl
  glue's within-micro-batch sharing);
* schedule: the whole mini-batch's prefix forest cut into steps across micro-batches
  (:mod:`ps_mcore.minibatch`): every row computed once, plus the forwards a K/V-kept prefix
  runs again before its backward.

Micro-batch counts of the first two are first-fit-decreasing bin packings of their pieces;
the schedule's are its steps. A sample longer than the budget cannot run unshared or split.
"""

from __future__ import annotations

import numpy as np

from ps_mcore.analyze.read import Rollouts
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.integrations.verl_common.microbatch import split_unit_tokens
from ps_mcore.minibatch import schedule_tree
from ps_mcore.planner import plan_prefix_tree
from ps_mcore.table import format_table


def first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Item indices per bin of ``capacity``, first-fit decreasing (an item over capacity gets
    a bin of its own)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, room in enumerate(free):
            if sizes[i] <= room:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(capacity - sizes[i])
    return [sorted(b) for b in bins]


def first_fit_bins(sizes: list[int], capacity: int) -> int:
    """How many bins :func:`first_fit` packs ``sizes`` into."""
    return len(first_fit(sizes, capacity))


def mini_batches(r: Rollouts, size: int | None) -> list[list[int]]:
    """Sample indices per mini-batch: the whole file, or chunks of ``size`` samples with
    ``uid`` groups kept together (groups ordered by first appearance)."""
    order = list(range(len(r.sequences)))
    if r.groups is not None:
        first: dict = {}
        for i, g in enumerate(r.groups):
            first.setdefault(g, i)
        order.sort(key=lambda i: first[r.groups[i]])
    if size is None:
        return [order]
    return [order[a:a + size] for a in range(0, len(order), size)]


def budget_table(files: list[Rollouts], max_tokens: int, mini_batch_size: int | None,
                 min_prefix_len: int, min_group_size: int, kv_row_cost: float) -> str:
    """One row per way of computing the mini-batches under ``max_tokens`` (see the module)."""
    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=min_prefix_len,
                                 min_group_size=min_group_size)
    n = stock_bins = split_tokens = split_bins = tree_tokens = recomputed = steps = 0
    too_long = 0
    batches = 0
    for r in files:
        for idx in mini_batches(r, mini_batch_size):
            batches += 1
            seqs = [np.asarray(r.sequences[i], dtype=np.int64) for i in idx]
            lens = [int(s.size) for s in seqs]
            n += sum(lens)
            too_long += sum(length > max_tokens for length in lens)
            stock_bins += first_fit_bins(lens, max_tokens)
            pieces = split_unit_tokens(seqs, config, max_tokens)
            split_tokens += sum(pieces)
            split_bins += first_fit_bins(pieces, max_tokens)
            tree = plan_prefix_tree(seqs, "arbitrary_prefix", min_prefix_len, min_group_size)
            plan = schedule_tree(tree, max_tokens, kv_row_cost=kv_row_cost)
            tree_tokens += plan.computed_tokens
            recomputed += plan.recomputed_tokens
            steps += plan.num_steps
    runs = too_long == 0
    rows = [
        ["unshared (stock)", n if runs else "-", 1.0 if runs else "-", "-", stock_bins if runs else "-"],
        ["split sharing units", split_tokens if runs else "-", n / split_tokens if runs else "-", "-",
         split_bins if runs else "-"],
        ["schedule across micro-batches", tree_tokens, n / tree_tokens, recomputed, steps],
    ]
    headers = ["way", "tokens computed", "vs unshared", "recomputed fwd", "micro-batches"]
    scope = "whole files" if mini_batch_size is None else f"{mini_batch_size} samples each"
    notes = [
        f"{batches} mini-batch(es) ({scope}), micro-batch budget {max_tokens} tokens, arbitrary_prefix, "
        f"min_prefix_len {min_prefix_len}, min_group_size {min_group_size}, kv_row_cost {kv_row_cost:g}",
        "split: a sharing unit larger than the budget is cut into pieces that each recompute their "
        "shared prefix; schedule: every row once across micro-batches (recomputed fwd: forwards a "
        "K/V-kept prefix runs again before its backward).",
    ]
    if not runs:
        notes.append(f"{too_long} sample(s) are longer than the budget: unshared and split cannot run them.")
    return format_table(headers, rows) + "\n" + "\n".join(notes)
