"""``TreePlan.multiplicity``: samples sharing each packed row, checked against an independent
count (how many sequences start with the row's root-to-row token path)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from forests import forests, nasty_forests
from ps_mcore import plan_prefix_tree


def _count_by_paths(plan, seqs) -> list[int]:
    """Row r's path = the tokens of its node's context up to r; its multiplicity is the number
    of sequences having that path as a prefix (with min_prefix_len=1 every shared prefix is one
    node chain)."""
    prefixes = Counter(tuple(s[: p + 1]) for s in seqs for p in range(len(s)))
    ids = plan.input_ids.tolist()
    cu_q, cu_kv, kv = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist(), plan.kv_index.tolist()
    out = []
    for v in range(plan.num_nodes):
        ctx = kv[cu_kv[v]:cu_kv[v + 1]]
        own = cu_q[v + 1] - cu_q[v]
        for i in range(own):
            path = tuple(ids[r] for r in ctx[: len(ctx) - own + i + 1])
            out.append(prefixes[path])
    return out


@settings(max_examples=60, deadline=None)
@given(forests())
def test_multiplicity_counts_samples_sharing_each_row(seqs):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    assert plan.multiplicity.dtype == torch.int64
    assert plan.multiplicity.tolist() == _count_by_paths(plan, seqs)
    assert int(plan.multiplicity.sum()) == plan.num_input_tokens


@pytest.mark.parametrize("name", sorted(nasty_forests(0)))
def test_multiplicity_with_thresholds_and_groups(name):
    seqs = nasty_forests(0)[name]
    plan = plan_prefix_tree(seqs, min_prefix_len=4, min_group_size=2)
    # rows duplicated by the thresholds each count their own samples only
    expected = np.bincount(plan.unpack_index.numpy(), minlength=plan.num_tokens)
    assert plan.multiplicity.tolist() == expected.tolist()
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
