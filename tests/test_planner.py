"""Planner invariants against independent counts over the raw sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forests import forests, nasty_forests
from hypothesis import given, settings

from ps_mcore import TreePlan, plan_prefix_tree
from ps_mcore.workloads import WORKLOADS, make_workload


def check_invariants(plan: TreePlan, seqs) -> None:
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    t, n = plan.num_tokens, plan.num_input_tokens
    assert n == len(flat) and plan.seq_lens == tuple(len(s) for s in seqs)
    assert t <= n
    # Unpacking restores the original tokens and positions exactly.
    assert torch.equal(plan.input_ids[plan.unpack_index], flat)
    assert torch.equal(plan.position_ids[plan.unpack_index], positions)
    # Every packed row is used by some original token.
    assert torch.equal(torch.unique(plan.unpack_index), torch.arange(t))
    # DFS pre-order: parents precede children; node rows are contiguous and subtrees nested.
    starts, parent = plan.cu_seqlens_q.long(), plan.node_parent
    assert torch.all(parent < torch.arange(plan.num_nodes))
    node_of_row = torch.repeat_interleave(torch.arange(plan.num_nodes), starts.diff())
    sub_end = plan.subtree_end[starts[:-1]]
    for v in range(plan.num_nodes):
        rows = slice(int(starts[v]), int(starts[v + 1]))
        assert torch.all(plan.subtree_end[rows] == sub_end[v])
        if parent[v] >= 0:
            p = int(parent[v])
            assert starts[p] < starts[v] and sub_end[v] <= sub_end[p]
            # A child continues its parent's positions.
            assert plan.position_ids[starts[v]] == plan.position_ids[starts[p + 1] - 1] + 1
        else:
            assert plan.position_ids[starts[v]] == 0
    # Each node's context is its root path: positions 0..ctx-1, rows of ancestors-or-self.
    kv_bounds = plan.cu_seqlens_kv.long()
    for v in range(plan.num_nodes):
        ctx_rows = plan.kv_index[kv_bounds[v] : kv_bounds[v + 1]]
        assert torch.equal(plan.position_ids[ctx_rows], torch.arange(len(ctx_rows)))
        assert torch.equal(ctx_rows[-(starts[v + 1] - starts[v]) :], torch.arange(starts[v], starts[v + 1]))
        anc = set(node_of_row[ctx_rows].tolist())
        u, path = v, set()
        while u >= 0:
            path.add(u)
            u = int(parent[u])
        assert anc == path
    assert plan.max_seqlen_q == int(starts.diff().max())
    assert plan.max_seqlen_kv == int(kv_bounds.diff().max())
    # Labels: the next token in the same sequence.
    nxt = torch.tensor([x for s in seqs for x in (list(s[1:]) + [0])], dtype=torch.long)
    assert torch.equal(plan.next_token_ids, nxt)
    assert plan.next_token_mask.sum() == n - len(seqs)


def distinct_prefixes(seqs, groups=None) -> int:
    groups = groups if groups is not None else [0] * len(seqs)
    return len({(g, tuple(s[: i + 1])) for g, s in zip(groups, seqs) for i in range(len(s))})


@settings(max_examples=150, deadline=None)
@given(forests())
def test_full_sharing_packs_every_distinct_prefix_once(seqs):
    plan = plan_prefix_tree(seqs, min_prefix_len=1, min_group_size=1)
    check_invariants(plan, seqs)
    assert plan.num_tokens == distinct_prefixes(seqs)


@settings(max_examples=60, deadline=None)
@given(forests())
def test_group_ids_confine_sharing(seqs):
    groups = [i % 2 for i in range(len(seqs))]
    plan = plan_prefix_tree(seqs, min_prefix_len=1, group_ids=[f"uid{g}" for g in groups])
    check_invariants(plan, seqs)
    assert plan.num_tokens == distinct_prefixes(seqs, groups)


def _thresholded_tokens(seqs, min_len, min_group) -> int:
    """Independent count: a token is shared between sequences iff it lies in a run (maximal
    block of positions passed by the same set of sequences) long and wide enough, counted
    from the nearest kept ancestor run."""
    from collections import defaultdict

    total, n = 0, len(seqs)

    def rec(members, depth, anchor):
        nonlocal total
        # Extend while the member set stays the same and nobody ends.
        d = depth
        while True:
            if any(len(seqs[i]) == d for i in members):
                break
            nxt = defaultdict(list)
            for i in members:
                nxt[seqs[i][d]].append(i)
            if len(nxt) != 1:
                break
            d += 1
        shared = len(members) > 1
        keep = (not shared) or (d - anchor >= min_len and len(members) >= min_group)
        enders = sum(len(seqs[i]) == d for i in members)
        # A kept run is packed once; a dissolved one is copied into every sequence ending
        # there, and its children absorb it (they count from the same anchor).
        total += (d - anchor) if keep else enders * (d - anchor)
        anchor_next = d if keep else anchor
        rest = defaultdict(list)
        for i in members:
            if len(seqs[i]) > d:
                rest[seqs[i][d]].append(i)
        for child in rest.values():
            rec(child, d, anchor_next)

    roots = defaultdict(list)
    for i in range(n):
        roots[seqs[i][0]].append(i)
    for members in roots.values():
        rec(members, 0, 0)
    return total


@settings(max_examples=150, deadline=None)
@given(forests())
def test_thresholds_match_independent_count(seqs):
    for min_len, min_group in ((1, 3), (4, 2), (6, 3)):
        plan = plan_prefix_tree(seqs, min_prefix_len=min_len, min_group_size=min_group)
        check_invariants(plan, seqs)
        assert plan.num_tokens == _thresholded_tokens(seqs, min_len, min_group)


@pytest.mark.parametrize("name", list(nasty_forests()))
def test_nasty_shapes(name):
    seqs = nasty_forests()[name]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    check_invariants(plan, seqs)
    assert plan.num_tokens == distinct_prefixes(seqs)
    expected = {
        "single-sequence": 17,
        "identical-duplicates": 15,
        "deep-chain": 40,
    }
    if name in expected:
        assert plan.num_tokens == expected[name]
    if name == "no-sharing":
        assert plan.is_trivial
        assert torch.equal(plan.unpack_index, torch.arange(plan.num_tokens))


def test_thresholds_suppress_sharing():
    seqs = nasty_forests()["grpo"]
    assert plan_prefix_tree(seqs, min_prefix_len=13).is_trivial  # shared prompt is 12 long
    assert not plan_prefix_tree(seqs, min_prefix_len=12).is_trivial
    dup = [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2
    assert plan_prefix_tree(dup, min_group_size=3).is_trivial
    assert plan_prefix_tree(dup, min_group_size=2).num_tokens == 9


def test_prompt_only_shares_whole_identical_prompts():
    rng = np.random.default_rng(1)
    prompt = list(rng.integers(0, 9, 10))
    resp = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    seqs = [prompt + resp, prompt + resp, prompt + [4], prompt[:6] + resp, prompt + resp]
    plens = [10, 10, 10, 6, 10]
    plan = plan_prefix_tree(seqs, mode="prompt_only", prompt_lens=plens, min_prefix_len=1)
    check_invariants(plan, seqs)
    # The 10-token prompt once, every response separately (even identical ones), the
    # sequence with a shorter prompt alone.
    assert plan.num_tokens == 10 + 9 + 9 + 1 + 15 + 9
    arbitrary = plan_prefix_tree(seqs, min_prefix_len=1)
    assert arbitrary.num_tokens < plan.num_tokens
    # Groups split identical prompts too.
    split = plan_prefix_tree(
        seqs, mode="prompt_only", prompt_lens=plens, min_prefix_len=1, group_ids=[0, 0, 0, 0, 1]
    )
    assert split.num_tokens == plan.num_tokens + 10


@pytest.mark.parametrize("name", WORKLOADS)
def test_standard_workloads(name):
    w = make_workload(name, scale=1 / 16)
    plan = plan_prefix_tree(w.sequences)
    check_invariants(plan, [s.tolist() for s in w.sequences])
    stats = plan.stats()
    assert stats["N"] == w.num_tokens and stats["T"] == plan.num_tokens
    assert (stats["dedup"] > 1.2) == (name != "no-sharing")
    assert stats["attn_flop_ratio"] >= 1.0


def test_inputs_of_every_kind_agree():
    seqs = nasty_forests()["tree"]
    ref = plan_prefix_tree(seqs)
    for variant in (
        [np.array(s, dtype=np.int32) for s in seqs],
        [torch.tensor(s) for s in seqs],
        torch.nested.nested_tensor([torch.tensor(s) for s in seqs]),
    ):
        other = plan_prefix_tree(variant)
        assert torch.equal(other.input_ids, ref.input_ids)
        assert torch.equal(other.unpack_index, ref.unpack_index)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sequences=[]), "empty batch"),
        (dict(sequences=[[1, 2], []]), "sequence 1 is empty"),
        (dict(sequences=[[1.5, 2.0]]), "integers"),
        (dict(sequences=[torch.tensor([1.0, 2.0])]), "integers"),
        (dict(sequences=[[1, -2]]), "non-negative"),
        (dict(sequences=torch.ones(2, 3, dtype=torch.long)), "1-D"),
        (dict(sequences=[[[1, 2], [3, 4]]]), "1-D"),
        (dict(sequences=[[1, 2]], mode="prompt_only"), "prompt_lens"),
        (dict(sequences=[[1, 2]], mode="prompt_only", prompt_lens=[1, 1]), "2 entries"),
        (dict(sequences=[[1, 2]], mode="prompt_only", prompt_lens=[3]), "outside"),
        (dict(sequences=[[1, 2]], mode="bogus"), "unknown mode"),
        (dict(sequences=[[1, 2]], min_prefix_len=0), "min_prefix_len"),
        (dict(sequences=[[1, 2]], min_group_size=-1), "min_group_size"),
        (dict(sequences=[[1, 2]], group_ids=[1, 2]), "group_ids"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_prefix_tree(**kwargs)


def test_unpack_backward_sums_shared_rows():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    x = torch.zeros(plan.num_tokens, 2, requires_grad=True)
    w = torch.arange(8.0)[:, None].expand(8, 2)
    (plan.unpack(x) * w).sum().backward()
    expected = torch.zeros(plan.num_tokens)
    expected.index_add_(0, plan.unpack_index, torch.arange(8.0))
    assert torch.equal(x.grad[:, 0], expected)
    assert x.grad[0, 0] == 0 + 4  # the shared first token collects both samples
    with pytest.raises(ValueError, match="rows"):
        plan.unpack(torch.zeros(2))


@settings(max_examples=40, deadline=None)
@given(forests())
def test_plan_unshared_is_the_batch_as_is(seqs):
    from ps_mcore import plan_unshared

    plan = plan_unshared(seqs)
    check_invariants(plan, seqs)
    assert plan.is_trivial and plan.num_nodes == len(seqs)
    assert torch.equal(plan.unpack_index, torch.arange(plan.num_tokens))
