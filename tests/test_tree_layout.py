"""Cascade layout (attention/layout.py): every tree pair covered exactly once, no copies, and the
cascade and gather-KV layouts both exact against the unshared computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.utils import _apply_to_tensors
from torch.utils import _pytree
from attention_oracle import random_qkv, unshared_attention
from forests import forests, nasty_forests, random_forest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ps_mcore import plan_prefix_tree
from ps_mcore.attention import layout as layout_mod
from ps_mcore.attention.cascade import tree_varlen_attention
from ps_mcore.attention.gather_kv import MATH_KERNEL
from ps_mcore.attention.layout import build_cascade_layout, cascade_layout
from ps_mcore.workloads import make_workload


def covered_pairs(plan, layout) -> np.ndarray:
    """``[T, T]`` count of how often each (query, key) pair is computed by the layout's calls."""
    t = plan.num_tokens
    count = np.zeros((t, t), dtype=np.int64)
    for call in layout.calls:
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        key_rows = np.arange(t) if call.kv_index is None else call.kv_index.numpy()
        for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
            assert q1 >= q0 and k1 >= k0
            if call.causal:
                assert q1 - q0 == k1 - k0 and q0 == k0, "self segments are diagonal blocks"
                count[q0:q1, k0:k1] += np.tril(np.ones((q1 - q0, k1 - k0), dtype=np.int64))
            else:
                np.add.at(count, (slice(q0, q1), key_rows[k0:k1]), 1)
        # Every row is covered (kernels leave no row of out/dQ/dK unwritten).
        assert cq[-1] == t and ck[-1] == key_rows.size
        assert max(np.diff(cq)) == call.max_q and max(np.diff(ck)) == call.max_k
        if call.rows is not None:
            has_key = np.zeros(t, dtype=bool)
            for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
                has_key[q0:q1] |= k1 > k0
            np.testing.assert_array_equal(call.rows.numpy(), has_key)
    return count


def tree_mask(plan) -> np.ndarray:
    t = plan.num_tokens
    se = plan.subtree_end.numpy()
    qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
    return ((ki <= qi) & (qi < se[None, :])).astype(np.int64)


@pytest.fixture(params=["in-place", "chunked"])
def level_calls(request, monkeypatch):
    """Level calls in place (production sizes never chunk these tiny trees) or with their
    queries cut into chunks of 2+ rows, each with a gathered copy of its keys."""
    if request.param == "chunked":
        monkeypatch.setattr(layout_mod, "MIN_CHUNK_ROWS", 2)
    return request.param


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=forests(max_seqs=10, max_len=30), min_prefix_len=st.sampled_from([1, 2, 8]))
def test_every_tree_pair_exactly_once(level_calls, seqs, min_prefix_len):
    plan = plan_prefix_tree(seqs, min_prefix_len=min_prefix_len)
    np.testing.assert_array_equal(covered_pairs(plan, build_cascade_layout(plan)), tree_mask(plan))


@pytest.mark.parametrize("name", list(nasty_forests()))
def test_nasty_shapes_pairs(level_calls, name):
    plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
    np.testing.assert_array_equal(covered_pairs(plan, build_cascade_layout(plan)), tree_mask(plan))


def test_standard_workload_shapes():
    """Step-wise is one causal segment (no level call); a GRPO group is one level call in which
    all responses attend to the prompt as one segment; no sharing is the plain batch."""
    def lay(name):
        return build_cascade_layout(plan_prefix_tree(make_workload(name, scale=1 / 16).sequences))

    step = lay("step-wise")
    assert step.num_levels == 0 and step.num_chains == 1
    grpo = lay("grpo-wide")
    assert grpo.num_levels == 1
    real = [(a, b) for a, b in zip(np.diff(grpo.calls[1].cu_q.numpy()), np.diff(grpo.calls[1].cu_k.numpy())) if a and b]
    assert len(real) == 1
    assert lay("agent-tree").num_levels == 3
    plain = lay("no-sharing")
    assert plain.num_levels == 0 and plain.num_chains == 8


def check_exact(plan, layout, hq=4, hkv=2, d=8, seed=0, dtype=torch.float32):
    """Float32 inputs to float32 precision; float64 inputs (computed in float64 throughout:
    kernel, merges, dK/dV sums) to float64 precision."""
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    q, k, v = random_qkv(plan, hq, hkv, d, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(plan.num_input_tokens, hq, d, generator=g, dtype=torch.float64)
    out = plan.unpack(tree_varlen_attention(q, k, v, plan, 1 / np.sqrt(d), MATH_KERNEL, layout=layout))
    ref = unshared_attention(q, k, v, plan)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    got = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=f"d{name} differs")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seqs=forests(), layout=st.sampled_from(["cascade", "gather"]), gqa=st.sampled_from([(2, 2), (6, 2)]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_both_layouts_exact_on_random_forests(level_calls, seqs, layout, gqa, dtype):
    check_exact(plan_prefix_tree(seqs, min_prefix_len=1), layout, *gqa, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_level_calls_are_used_and_exact(level_calls, dtype):
    plan = plan_prefix_tree(make_workload("agent-tree", scale=1 / 64).sequences, min_prefix_len=1)
    lay = build_cascade_layout(plan)
    assert lay.num_levels == 3
    assert any(c.kv_index is not None for c in lay.calls[1:]) == (level_calls == "chunked")
    for layout in ("cascade", "gather"):
        check_exact(plan, layout, 6, 2, 8, dtype=dtype)


def test_auto_layout_follows_cascade_pays(monkeypatch):
    """``auto`` gathers where the cascade does not pay; forcing the cascade stays exact at any
    depth (11 chain levels here, more than MAX_CASCADE_LEVELS)."""
    seqs = [list(range(50))] + [list(range(4 * i)) + [99] for i in range(1, 12)]  # 11 branch points
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    lay = build_cascade_layout(plan)
    assert lay.num_levels == 11 > layout_mod.MAX_CASCADE_LEVELS
    assert not layout_mod.cascade_pays(plan, lay)
    calls = []
    monkeypatch.setattr(
        "ps_mcore.attention.cascade.gather_kv_attention",
        lambda *a, **k: calls.append(1) or torch.zeros_like(a[0]),
    )
    q, k, v = random_qkv(plan, 2, 1, 8, torch.float32)
    tree_varlen_attention(q, k, v, plan, 0.3, MATH_KERNEL)
    assert calls == [1]
    monkeypatch.setattr(layout_mod, "cascade_pays", lambda plan, layout: True)
    tree_varlen_attention(q, k, v, plan, 0.3, MATH_KERNEL)
    assert calls == [1]
    monkeypatch.undo()
    check_exact(plan, "cascade", seed=5)


def test_cascade_pays_on_the_standard_workloads():
    """The measured choice (docs/benchmarks.md): cascade for chains and wide one-prompt GRPO
    groups, gather-KV for the rest; without sharing both run the plain batch (gather-KV's
    no-sharing fast path)."""
    want = {"grpo-long-prompt": False, "grpo-wide": True, "step-wise": True, "grpo-math": False,
            "agent-tree": False, "no-sharing": False}
    for name, pays in want.items():
        plan = plan_prefix_tree(make_workload(name).sequences)
        assert layout_mod.cascade_pays(plan, build_cascade_layout(plan)) == pays, name


def test_layout_is_cached_and_built_from_the_host_copy():
    """A plan moved to another device builds its layout from the host plan: no device read."""
    plan = plan_prefix_tree(random_forest(np.random.default_rng(0), 8, 40), min_prefix_len=1)
    moved = plan.to("meta")  # meta tensors cannot be read: any D2H access would raise
    lay = cascade_layout(moved)
    assert lay is cascade_layout(moved)
    assert all(c.cu_q.device.type == "meta" for c in lay.calls)
    assert plan.memo.cascade_layouts[torch.device("cpu")] is cascade_layout(plan)
    assert moved.memo.host is plan and moved.host.memo is plan.memo  # one host build


def test_a_replaced_plan_shares_its_memo_only_with_the_same_values():
    """``dataclasses.replace`` with the same values (torch's input casting rebuilds dataclass
    inputs so) keeps what was derived; with other values the new plan derives afresh."""
    import dataclasses

    plan = plan_prefix_tree([[1, 2, 3, 4], [1, 2, 5]], min_prefix_len=1)
    lay = cascade_layout(plan)
    assert plan.max_token_id == 5 and plan.to("meta") is plan.to("meta")
    same = dataclasses.replace(plan, seq_lens=tuple(plan.seq_lens))  # equal, not the same object
    assert same.memo is plan.memo and cascade_layout(same) is lay
    other = dataclasses.replace(plan, input_ids=plan.input_ids + 10)
    assert other.memo is not plan.memo and not other.memo.cascade_layouts and not other.memo.moved
    assert other.max_token_id == 15


def test_input_walkers_stop_at_the_memo():
    """Wrappers walk a forward's inputs: FSDP's mixed-precision input cast
    (``_apply_to_tensors``: dataclasses rebuilt field by field with ``dataclasses.replace``),
    FSDP2's collection of tensors needing gradients (dataclass fields too), pytree (a plan is
    a leaf). A plan and its moved copy link each other through their memos: a walk must not
    follow that link (it recursed without end), and a rebuilt plan keeps the memo."""
    plan = plan_prefix_tree(random_forest(np.random.default_rng(3), 6, 30), min_prefix_len=1)
    moved = plan.to("meta")  # plan.memo.moved -> moved, moved.memo.host -> plan
    lay = cascade_layout(plan)

    def cast(t):  # FSDP's _cast_fp_tensor to bf16
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    for p in (plan, moved):
        rebuilt = _apply_to_tensors(cast, {"kwargs": [p]})["kwargs"][0]
        assert rebuilt is not p and rebuilt.memo is p.memo and rebuilt.host.memo is plan.memo
        assert all(getattr(rebuilt, f) is getattr(p, f) for f in ("input_ids", "kv_index", "subtree_end"))
    assert cascade_layout(_apply_to_tensors(cast, plan)) is lay
    assert _pytree.tree_leaves({"plan": moved, "x": [plan]}) == [moved, plan]
    try:
        from torch.distributed.fsdp._common_utils import collect_grad_tensors
    except ImportError:  # older torch collects through pytree (a plan is a leaf there)
        return
    x = torch.zeros(2, requires_grad=True)
    assert collect_grad_tensors(((x,), {"plan": moved, "host": plan})) == (x,)


def test_cascade_saves_no_per_call_output():
    """Backward needs q, k, v, the merged output and logsumexp only (memory ~ T, not calls)."""
    plan = plan_prefix_tree(make_workload("agent-tree", scale=1 / 64).sequences, min_prefix_len=1)
    assert cascade_layout(plan).num_levels == 3
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        tree_varlen_attention(q, k, v, plan, 0.3, MATH_KERNEL)
    assert sum(saved) <= 3 * q.numel() + 2 * k.numel()
