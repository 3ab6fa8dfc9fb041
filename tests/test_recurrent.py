"""Recurrent kernels over prefix forests (pure torch, CPU, fp32): tree vs each sequence alone.

Oracle: the token-by-token gated delta recurrence and a direct causal convolution, run on every
original sequence separately (its rows gathered from the packed inputs with ``plan.unpack``, so
the gradient into a shared packed row is the sum over the sequences that read it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forests import branching_forest, nasty_forests, random_forest
from mamba_shims import mamba_ssd_reference
from ps_mcore import plan_prefix_tree
from ps_mcore.recurrent import (
    RecurrentTree,
    causal_conv1d_reference,
    chunk_gated_delta_rule_torch,
    chunk_simple_gla_torch,
    gated_delta_rule_recurrent,
    l2norm,
    recurrent_tree,
    simple_gla_recurrent,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    tree_mamba_chunk_scan,
    varlen_gated_delta_rule,
)

FORESTS = {
    **nasty_forests(),
    **{f"random{s}": random_forest(np.random.default_rng(s)) for s in range(2)},
    # branches at three nested depths: a child's state handed over from a handed-over state
    **{f"branching{s}": branching_forest(np.random.default_rng(s), depth=4, fanout=2, node_len=(1, 6)) for s in range(2)},
}
FORESTS["short-nodes"] = [[1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5, 6, 7], [1, 9]]


def _close(a, b, what):
    scale = max(float(b.detach().abs().max()), 1e-3)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=what)


def _split(plan, x):
    """Per-sequence views of packed rows ``x`` (through ``unpack``: differentiable)."""
    return plan.unpack(x).split(list(plan.seq_lens))


def _gdn_inputs(rows, h=2, dk=5, dv=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randn(rows, h, d, generator=gen, requires_grad=True) for d in (dk, dk, dv)]
    g_raw, b_raw = (torch.randn(rows, h, generator=gen, requires_grad=True) for _ in range(2))
    return raw, g_raw, b_raw


def _gdn_args(raw, g_raw, b_raw):
    q, k, v = raw
    return l2norm(q), l2norm(k), v, -F.softplus(g_raw), torch.sigmoid(b_raw)


# ----------------------------------------------------------------------------- node tree


def test_levels_cover_rows_and_parents_are_one_level_up():
    plan = plan_prefix_tree(FORESTS["tree"], min_prefix_len=1)
    tree = RecurrentTree(plan, plan.num_tokens + 3)  # + a padding root
    levels = tree.levels()
    rows = torch.cat([lvl.rows for lvl in levels])
    assert sorted(rows.tolist()) == list(range(plan.num_tokens + 3))
    chains = tree.chains
    assert len(levels) == int(chains.depth.max()) + 1 >= 3
    for d, lvl in enumerate(levels[1:], 1):  # each chain's parent chain is one level up
        parent_chains = chains.heads[chains.chain_of[tree.parent[lvl.nodes]]]
        assert (levels[d - 1].nodes[lvl.parent_slot.numpy()] == parent_chains).all()
    assert tree.parent[-1] == -1 and tree.length[-1] == 3
    assert recurrent_tree(plan, plan.num_tokens) is recurrent_tree(plan, plan.num_tokens)


def test_unary_chains_run_as_one_sequence():
    """A node with one child hands no state over: a step-wise batch (each sample a prefix of the
    next) is one chain, one call over the rows as they are; a fork starts new chains one level down."""
    base = list(range(1, 40))
    steps = plan_prefix_tree([base[:n] for n in (5, 12, 20, 39)], min_prefix_len=1)
    tree = RecurrentTree(steps, steps.num_tokens)
    assert tree.num_nodes >= 4 and tree.is_flat and len(tree.levels()) == 1
    assert tree.levels()[0].cu_seqlens_host.tolist() == [0, steps.num_tokens]

    fork = plan_prefix_tree([base[:5], base[:12], base[:12] + [90, 91], base[:12] + [95]], min_prefix_len=1)
    tree = RecurrentTree(fork, fork.num_tokens)
    levels = tree.levels()
    assert not tree.is_flat and [len(lvl.nodes) for lvl in levels] == [1, 2]
    assert levels[0].cu_seqlens_host.tolist() == [0, 12] and levels[0].has_children.tolist() == [True]
    for lvl in levels:  # each chain's rows are contiguous
        for a, b in zip(lvl.cu_seqlens_host.tolist(), lvl.cu_seqlens_host.tolist()[1:]):
            r = lvl.rows[a:b]
            assert (r.diff() == 1).all()


# ----------------------------------------------------------------------------- kernels alone


@pytest.mark.parametrize("length,chunk", [(1, 64), (13, 4), (70, 64), (9, 16)])
def test_chunked_matches_recurrence_with_initial_state(length, chunk):
    raw, g_raw, b_raw = _gdn_inputs(length, seed=length)
    s0 = torch.randn(2, 5, 3, requires_grad=True)
    args = _gdn_args(raw, g_raw, b_raw)
    out, fin = chunk_gated_delta_rule_torch(*args, initial_state=s0, chunk_size=chunk)
    ref_out, ref_fin = gated_delta_rule_recurrent(*args, initial_state=s0)
    _close(out, ref_out, "out")
    _close(fin, ref_fin, "final state")
    cot = torch.randn_like(out), torch.randn_like(fin)
    leaves = [*raw, g_raw, b_raw, s0]
    got = torch.autograd.grad((out * cot[0]).sum() + (fin * cot[1]).sum(), leaves, retain_graph=True)
    ref = torch.autograd.grad((ref_out * cot[0]).sum() + (ref_fin * cot[1]).sum(), leaves)
    for name, a, b in zip("q k v g beta s0".split(), got, ref):
        _close(a, b, f"d{name}")


def test_shared_initial_state_gradient_is_sum_over_readers():
    """Two sequences start from one state: its gradient is the sum of each one's alone."""
    raw, g_raw, b_raw = _gdn_inputs(11, seed=3)
    args = _gdn_args(raw, g_raw, b_raw)
    s0 = torch.randn(2, 5, 3, requires_grad=True)
    cu = [0, 4, 11]
    out, _ = varlen_gated_delta_rule(*args, torch.tensor(cu), torch.tensor(cu),
                                     s0[None].expand(2, -1, -1, -1), output_final_state=False)
    cot = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * cot).sum(), s0)
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        o, _ = gated_delta_rule_recurrent(*(t[a:b] for t in args), initial_state=s0)
        parts.append(torch.autograd.grad((o * cot[a:b]).sum(), s0, retain_graph=True)[0])
    assert float(parts[0].abs().max()) > 0 and float(parts[1].abs().max()) > 0
    _close(grad, parts[0] + parts[1], "d s0")


@pytest.mark.parametrize("length,chunk", [(1, 64), (13, 4), (70, 64), (9, 16)])
def test_chunked_simple_gla_matches_recurrence_with_initial_state(length, chunk):
    gen = torch.Generator().manual_seed(length)
    leaves = [torch.randn(length, 3, d, generator=gen, requires_grad=True) for d in (4, 4, 5)]
    g_raw = torch.randn(length, 3, generator=gen, requires_grad=True)
    s0 = torch.randn(3, 4, 5, generator=gen, requires_grad=True)
    args = (*leaves, -F.softplus(g_raw))
    out, fin = chunk_simple_gla_torch(*args, scale=0.7, initial_state=s0, chunk_size=chunk)
    ref_out, ref_fin = simple_gla_recurrent(*args, scale=0.7, initial_state=s0)
    _close(out, ref_out, "out")
    _close(fin, ref_fin, "final state")
    cot = torch.randn_like(out), torch.randn_like(fin)
    got = torch.autograd.grad((out * cot[0]).sum() + (fin * cot[1]).sum(), [*leaves, g_raw, s0], retain_graph=True)
    ref = torch.autograd.grad((ref_out * cot[0]).sum() + (ref_fin * cot[1]).sum(), [*leaves, g_raw, s0])
    for name, a, b in zip("q k v g s0".split(), got, ref):
        _close(a, b, f"d{name}")


# ----------------------------------------------------------------------------- tree vs alone


@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("groups,headdim", [(1, 3), (2, 5)])
def test_tree_mamba_chunk_scan_matches_each_sequence(name, groups, headdim):
    """Mamba-2's SSD through the tree (chunk 64 > most nodes, so also one level per chunk)
    vs its recurrence on every sequence alone; one padding row; ngroups 1 and 2. fp64: dA_log
    sums ~100 rows of cancelling terms, which fp32 leaves at ~1e-5 of its scale."""
    seqs = FORESTS[name]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    rows, heads, state = plan.num_tokens + 1, 4, 6
    gen = torch.Generator().manual_seed(len(seqs) + groups)
    f64 = dict(generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(rows, heads, headdim, **f64)
    dt = torch.randn(rows, heads, **f64)
    b_in, c_in = (torch.randn(rows, groups, state, **f64) for _ in range(2))
    a_log = torch.linspace(-1.0, 1.0, heads, dtype=torch.float64).requires_grad_()
    dt_bias, d = (torch.randn(heads, **f64) for _ in range(2))
    z = torch.randn(rows, heads, headdim, **f64)
    leaves = [x, dt, b_in, c_in, a_log, dt_bias, d, z]
    a = -a_log.exp()
    got = plan.unpack(tree_mamba_chunk_scan(x, dt, a, b_in, c_in, recurrent_tree(plan, rows), D=d, z=z,
                                            dt_bias=dt_bias))
    per_seq = zip(*(_split(plan, t[: plan.num_tokens]) for t in (x, F.softplus(dt + dt_bias), b_in, c_in, z)))
    ref = torch.cat([mamba_ssd_reference(xs, dts, a, bs, cs, d) * F.silu(zs) for xs, dts, bs, cs, zs in per_seq])
    _close(got, ref, "y")
    weights = torch.cat([torch.full((n,), 0.5 + i) for i, n in enumerate(plan.seq_lens)])
    cot = torch.randn_like(ref) * weights[:, None, None].double()
    g_tree = torch.autograd.grad((got * cot).sum(), leaves, retain_graph=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), leaves, allow_unused=True)
    for lname, a_, b_ in zip("x dt B C A_log dt_bias D z".split(), g_tree, g_ref):
        if lname in ("x", "dt", "B", "C", "z"):
            assert not a_[plan.num_tokens:].any(), "padding rows must not reach real rows"
            a_, b_ = a_[: plan.num_tokens], b_[: plan.num_tokens]
        _close(a_, b_, f"d{lname}")


@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("padding", [0, 2])
def test_tree_gated_delta_rule_matches_each_sequence(name, padding):
    seqs = FORESTS[name]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    rows = plan.num_tokens + padding
    raw, g_raw, b_raw = _gdn_inputs(rows, seed=len(seqs))
    args = _gdn_args(raw, g_raw, b_raw)
    out = tree_gated_delta_rule(*args, recurrent_tree(plan, rows))
    per_seq = zip(*(_split(plan, t[: plan.num_tokens]) for t in args))
    ref = torch.cat([gated_delta_rule_recurrent(*parts)[0] for parts in per_seq])
    got = plan.unpack(out)
    _close(got, ref, "out")
    weights = torch.cat([torch.full((n,), 0.5 + i) for i, n in enumerate(plan.seq_lens)])
    cot = torch.randn_like(ref) * weights[:, None, None]
    leaves = [*raw, g_raw, b_raw]
    g_tree = torch.autograd.grad((got * cot).sum(), leaves, retain_graph=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), leaves, allow_unused=True)
    for lname, a, b in zip("q k v g beta".split(), g_tree, g_ref):
        _close(a[: plan.num_tokens], b[: plan.num_tokens], f"d{lname}")
        assert not a[plan.num_tokens :].any(), "padding rows must not reach real rows"


@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("kernel_size", [1, 2, 4, 7])
def test_tree_causal_conv1d_matches_each_sequence(name, kernel_size):
    seqs = FORESTS[name]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    rows = plan.num_tokens + 1
    gen = torch.Generator().manual_seed(kernel_size)
    x = torch.randn(rows, 6, generator=gen, requires_grad=True)
    w = torch.randn(6, 1, kernel_size, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    got = plan.unpack(tree_causal_conv1d(x, w, b, recurrent_tree(plan, rows)))
    ref = torch.cat([causal_conv1d_reference(xs, w, b) for xs in _split(plan, x[: plan.num_tokens])])
    _close(got, ref, "out")
    cot = torch.randn_like(ref)
    g_tree = torch.autograd.grad((got * cot).sum(), [x, w, b], retain_graph=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), [x, w, b])
    for lname, a, r in zip("x w b".split(), g_tree, g_ref):
        _close(a, r, f"d{lname}")


def test_rejects_wrong_row_count():
    plan = plan_prefix_tree(FORESTS["grpo"], min_prefix_len=1)
    tree = recurrent_tree(plan, plan.num_tokens)
    with pytest.raises(ValueError, match="rows"):
        tree_gated_delta_rule(*_gdn_args(*_gdn_inputs(plan.num_tokens + 1)), tree)
    with pytest.raises(ValueError, match="recurrent layers need all"):
        RecurrentTree(plan, plan.num_tokens - 1)
