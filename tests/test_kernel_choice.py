"""CPU tests of the cuDNN backend's plumbing: the kernel-choice rule (a pure function of shape
numbers), the clear refusal without TE/CUDA, and the cuDNN wrapper's layouts and autograd
with TE's two functions stood in by the float32 math kernel (same signatures), so the
wiring is checked here and only the kernel itself on the GPU (tests/test_gpu_attention.py)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
from attention_oracle import random_qkv, unshared_attention
from forests import nasty_forests, random_forest

from ps_mcore import plan_prefix_tree, plan_unshared, tree_attention
from ps_mcore.attention import auto_choice, backends, cudnn, fa4, kernel_choice, resolve_backend
from ps_mcore.attention.gather_kv import MATH_KERNEL
from ps_mcore.attention.kernel_choice import CUDNN_MIN_WORK, PlanShape, plan_shape, prefers_cudnn
from ps_mcore.planner import tree_pairs
from ps_mcore.workloads import make_workload


def shape(pairs, cascade=False, levels=1, heads=16, head_dim=128):
    return PlanShape(pairs, 100, 400, 5, levels, cascade, heads, head_dim)


def test_rule_threshold_is_on_work():
    at = CUDNN_MIN_WORK / (16 * 128)
    assert prefers_cudnn(shape(at)) and not prefers_cudnn(shape(at * 0.99))
    # work counts heads and head dim: half the heads need twice the pairs
    assert not prefers_cudnn(shape(at, heads=8)) and prefers_cudnn(shape(2 * at, heads=8))
    assert prefers_cudnn(shape(1.0, head_dim=1), min_work=1.0)


def test_rule_keeps_flash_cascade_with_level_calls():
    big = 100 * CUDNN_MIN_WORK
    assert not prefers_cudnn(shape(big, cascade=True, levels=1))
    # a chain forest's "cascade" is one causal call, which cuDNN runs in place too
    assert prefers_cudnn(shape(big, cascade=True, levels=0))
    assert prefers_cudnn(shape(big, cascade=False, levels=3))


def test_tree_pairs_counts_causal_pairs_once():
    # node 0: 3 rows, context 3 (root); node 1: 2 rows after 3 context rows -> 2*5 - 1
    assert tree_pairs([0, 3, 5], [0, 3, 8]) == 6 + 9
    plan = plan_unshared([[1, 2, 3, 4], [5, 6]])
    assert plan_shape(plan, 2, 8).pairs == 10 + 3


def test_rule_on_the_standard_workloads():
    """The measured H200 evidence the constant encodes (kernel_choice docstring): cuDNN wherever
    it gained inside the queued model (grpo-long-prompt, agent-tree, step-wise), flash for the
    cascade that grpo-wide runs (memory) and for no-sharing's small work (host cost)."""
    picks = {}
    for name in ("grpo-long-prompt", "grpo-wide", "agent-tree", "step-wise", "no-sharing"):
        plan = plan_prefix_tree(make_workload(name, seed=0).sequences)
        picks[name] = prefers_cudnn(plan_shape(plan, 16, 128))
    assert picks == {"grpo-long-prompt": True, "grpo-wide": False, "agent-tree": True,
                     "step-wise": True, "no-sharing": False}


def test_plan_shape_is_cached_on_the_host_plan():
    plan = plan_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5, 6]], min_prefix_len=1)
    s = plan_shape(plan, 4, 64)
    assert (s.rows, s.context_rows, s.segments) == (plan.num_tokens, plan.kv_index.numel(), plan.num_nodes)
    assert plan.memo.kernel_choice_shape is not None and plan_shape(plan, 4, 64) == s


def test_cudnn_refuses_clearly_off_cuda():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'cudnn'.*unavailable: it needs a CUDA device"):
        tree_attention(q, k, v, plan, backend="cudnn")


def test_fa4_refuses_clearly_off_cuda_and_auto_never_picks_it():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'fa4' .*FlashAttention-4.*unavailable: it needs a CUDA device"):
        tree_attention(q, k, v, plan, backend="fa4")
    assert resolve_backend("auto", q, plan) == "chunked"


@pytest.mark.parametrize("d", [72, 80, 112, 48])
def test_fa4_refuses_head_dims_whose_gradients_it_got_wrong(d):
    # Measured on the H200: FA4 4.0.0b40's SM90 backward is wrong for 72, 80 and 112; 48 untested.
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, d, torch.bfloat16)
    with pytest.raises(ValueError, match=f"runs head dims 64, 96, 128, 160, 192, 256 \\(got {d}"):
        tree_attention(q, k, v, plan, backend="fa4")
    assert fa4.fa4_refusal(q.float()).startswith("it needs fp16 or bf16")


def test_static_refusals_name_the_problem(monkeypatch):
    bf16 = torch.bfloat16
    assert "fp16 or bf16" in cudnn.cudnn_static_refusal("cuda", torch.float32, 128)
    assert "multiple of 8" in cudnn.cudnn_static_refusal("cuda", bf16, 100)
    assert "at most 128" in cudnn.cudnn_static_refusal("cuda", bf16, 192)
    monkeypatch.setattr(cudnn, "_te_fused_attn", lambda: "transformer_engine's fused attention is not importable (X)")
    assert "transformer_engine" in cudnn.cudnn_static_refusal("cuda", bf16, 128)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed")
def test_without_te_the_refusal_says_so():
    assert "transformer_engine" in cudnn.cudnn_static_refusal("cuda", torch.bfloat16, 128)
    with pytest.raises(RuntimeError, match="cuDNN tree attention: transformer_engine"):
        cudnn._te()


def test_auto_never_picks_cudnn_off_cuda():
    plan = plan_prefix_tree(make_workload("grpo-long-prompt", seed=0).sequences)
    q = torch.zeros(plan.num_tokens, 16, 128, dtype=torch.bfloat16)
    assert resolve_backend("auto", q, plan) == "chunked" and auto_choice(q, plan)[0] == "chunked"


# ----------------------------------------------------------------------------- wrapper wiring


def _fake_te_fwd(is_training, max_q, max_k, cu_q, cu_k, q, k, v, dtype, backend, **kw):
    assert kw["qkv_layout"] == "thd_thd_thd" and kw["o_format"] == "thd" and is_training
    assert kw["cu_seqlens_q_padded"] is cu_q and cu_q.dtype == torch.int32
    causal = kw["attn_mask_type"] == "padding_causal_bottom_right"
    assert kw["window_size"] == ((-1, 0) if causal else (-1, -1))
    out, aux = MATH_KERNEL.forward(q, k, v, cu_q, cu_k, max_q, max_k, kw["attn_scale"], causal=causal)
    return out, [aux[0], torch.zeros(2, dtype=torch.int64)]  # stats, "rng state"


def _fake_te_bwd(max_q, max_k, cu_q, cu_k, q, k, v, o, d_o, dtype, aux, backend, **kw):
    assert kw["dqkv_layout"] == "thd_thd_thd" and kw["do_format"] == "thd" and len(aux) == 2
    causal = kw["attn_mask_type"] == "padding_causal_bottom_right"
    return list(MATH_KERNEL.backward(d_o, q, k, v, o, tuple(aux), cu_q, cu_k, max_q, max_k, kw["attn_scale"], causal=causal))


@pytest.fixture
def fake_te(monkeypatch):
    import inspect

    params = lambda f: frozenset(inspect.signature(f).parameters)  # noqa: E731
    found = (_fake_te_fwd, _fake_te_bwd, "F16_arbitrary_seqlen", params(_fake_te_fwd) | {
        "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "o_format", "attn_bias_type",
        "attn_mask_type", "window_size", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"},
        params(_fake_te_bwd) | {"attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "o_format", "do_format",
                                "dqkv_layout", "attn_bias_type", "attn_mask_type", "window_size",
                                "cu_seqlens_q_padded", "cu_seqlens_kv_padded"})
    monkeypatch.setattr(cudnn, "_te_fused_attn", lambda: found)
    cudnn_entry = backends.ATTENTION_BACKENDS["cudnn"]  # its check wants CUDA
    monkeypatch.setitem(backends.ATTENTION_BACKENDS, "cudnn", dataclasses.replace(cudnn_entry, check=None))
    return found


def _check_exact(plan, hq, hkv, d, seed=0, layout="auto", scale=None):
    q, k, v = random_qkv(plan, hq, hkv, d, torch.float32, seed=seed)
    s = scale if scale is not None else d**-0.5
    out = plan.unpack(cudnn.cudnn_tree_attention(q, k, v, plan, s, layout=layout))
    ref = unshared_attention(q, k, v, plan, scale=s)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(nasty_forests()))
def test_cudnn_wrapper_layouts_exact(fake_te, name):
    plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
    _check_exact(plan, 4, 2, 16)
    _check_exact(plan, 4, 1, 16, layout="gather", scale=0.3)


def test_cudnn_wrapper_random_forests_and_backend_entry(fake_te):
    rng = np.random.default_rng(3)
    for i in range(3):
        plan = plan_prefix_tree(random_forest(rng, max_seqs=8, max_len=40), min_prefix_len=2)
        _check_exact(plan, 6, 2, 8, seed=i)
    plan = plan_prefix_tree(nasty_forests()["deep-chain"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    a = tree_attention(q, k, v, plan, backend="cudnn")  # the table entry, chain forest in place
    torch.testing.assert_close(plan.unpack(a).double(), unshared_attention(q, k, v, plan), rtol=1e-4, atol=1e-5)


def test_cudnn_cascade_refused_on_branching_plans(fake_te):
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="chain forests"):
        cudnn.cudnn_tree_attention(q, k, v, plan, 0.3, layout="cascade")
    assert kernel_choice.plan_shape(plan, 2, 8).levels > 0
