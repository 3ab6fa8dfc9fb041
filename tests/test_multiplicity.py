"""``TreePlan.multiplicity``: samples sharing each packed row, checked against an independent
count from the raw sequences (how many of them start with the row's root-to-row token path),
never against the planner's own formula (a bincount of its unpack index)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings

from forests import forests, nasty_forests
from ps_mcore import plan_prefix_tree


def _row_paths(plan) -> list[tuple[int, ...]]:
    """Each packed row's token path: the tokens of its node's context up to the row."""
    ids = plan.input_ids.tolist()
    cu_q, cu_kv, kv = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist(), plan.kv_index.tolist()
    paths = []
    for v in range(plan.num_nodes):
        ctx = kv[cu_kv[v]:cu_kv[v + 1]]
        own = cu_q[v + 1] - cu_q[v]
        paths += [tuple(ids[r] for r in ctx[: len(ctx) - own + i + 1]) for i in range(own)]
    return paths


def _samples_per_path(seqs) -> Counter:
    """How many sequences hold each token path: every sample's rows counted from the raw
    sequences (a path = a sample's tokens up to one of its positions)."""
    return Counter(tuple(int(t) for t in s[: p + 1]) for s in seqs for p in range(len(s)))


def _count_by_paths(plan, seqs) -> list[int]:
    """Row r's multiplicity when every shared prefix is one node chain (min_prefix_len=1): the
    number of sequences having its path as a prefix."""
    held = _samples_per_path(seqs)
    return [held[path] for path in _row_paths(plan)]


@settings(max_examples=60, deadline=None)
@given(forests())
def test_multiplicity_counts_samples_sharing_each_row(seqs):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    assert plan.multiplicity.dtype == torch.int64
    assert plan.multiplicity.tolist() == _count_by_paths(plan, seqs)
    assert int(plan.multiplicity.sum()) == plan.num_input_tokens


@pytest.mark.parametrize("name", sorted(nasty_forests(0)))
def test_multiplicity_with_thresholds_and_groups(name):
    """Thresholds and group labels duplicate shared runs: rows with the same path then split
    its samples between them. Over all rows of one path the counts add up to the samples that
    hold it (so does every per-token statistic: those rows compute the same values), and each
    row counts at least the one sample it was made for."""
    seqs = nasty_forests(0)[name]
    held = _samples_per_path(seqs)
    for kw in (dict(min_prefix_len=4, min_group_size=2), dict(min_prefix_len=1, group_ids=[i % 2 for i in range(len(seqs))])):
        plan = plan_prefix_tree(seqs, **kw)
        per_path = Counter()
        for path, m in zip(_row_paths(plan), plan.multiplicity.tolist()):
            per_path[path] += m
        assert per_path == held, kw
        assert (plan.multiplicity >= 1).all()
    unshared = plan_prefix_tree(seqs, group_ids=range(len(seqs)))
    assert unshared.multiplicity.tolist() == [1] * unshared.num_tokens


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_multiplicity_sharded_like_rows(cp):
    pytest.importorskip("megatron.core")
    from ps_mcore.layer_specs import TreePackedSeqParams

    seqs = nasty_forests(1)["tree"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    total = 0
    for rank in range(cp):
        psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=2 * cp * 2, cp_size=cp, cp_rank=rank)
        local = psp.local_multiplicity()
        assert torch.equal(local, psp.cp_shard(psp.pad_rows(plan.multiplicity)))
        assert (local[psp.cp_shard(torch.arange(psp.num_rows)) >= plan.num_tokens] == 0).all()
        total += int(local.sum())
    assert total == plan.num_input_tokens
