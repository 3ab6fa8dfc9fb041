"""GPU-only backends (varlen, flex) vs. per-sequence causal attention. Skips without CUDA;
run on the device: ``python -m pytest -q tests/test_gpu_attention.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_oracle import compare_with_unshared
from forests import nasty_forests, random_forest

from ps_mcore import plan_prefix_tree
from ps_mcore.attention import resolve_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(plan, backend, hq, hkv, d, dtype, seed=0, tol=1e-2):
    out, ref, got, want = compare_with_unshared(plan, backend, hq, hkv, d, dtype, "cuda", seed)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out, ref) < tol, f"output rel err {rel(out, ref)}"
    for name, a, b in zip("qkv", got, want):
        assert rel(a, b) < 2 * tol, f"d{name} rel err {rel(a, b)}"


@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("name", list(nasty_forests()))
def test_nasty_shapes(name, backend):
    check(plan_prefix_tree(nasty_forests()[name], min_prefix_len=1), backend, 8, 2, 64, torch.bfloat16)


@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("ratio, d", [(1, 64), (4, 80), (7, 128)])
def test_random_forests_gqa_head_dims(backend, ratio, d):
    rng = np.random.default_rng(ratio * d)
    for i in range(4):
        seqs = random_forest(rng, max_seqs=12, max_len=300)
        check(plan_prefix_tree(seqs, min_prefix_len=4), backend, 2 * ratio, 2, d, torch.bfloat16, i)


def test_flex_float32_is_tight():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    check(plan, "flex", 4, 2, 64, torch.float32, tol=1e-4)


def test_fused_scatter_add_matches_index_add():
    from ps_mcore.attention.scatter import _BROKEN, copies_csr, scatter_sum_kv

    plan = plan_prefix_tree(random_forest(np.random.default_rng(1), 16, 300), min_prefix_len=1).to("cuda")
    c, t = plan.kv_index.numel(), plan.num_tokens
    dkg, dvg = torch.randn(c, 3, 80, device="cuda"), torch.randn(c, 3, 80, device="cuda")
    dk, dv = scatter_sum_kv(dkg.bfloat16(), dvg.bfloat16(), plan.kv_index, copies_csr(plan, "cuda"), (t, 3, 80), torch.bfloat16)
    assert not _BROKEN
    want = torch.zeros(t, 3, 80, device="cuda").index_add_(0, plan.kv_index, dkg.bfloat16().float())
    torch.testing.assert_close(dk.float(), want.bfloat16().float(), rtol=1e-2, atol=1e-2)
    want = torch.zeros(t, 3, 80, device="cuda").index_add_(0, plan.kv_index, dvg.bfloat16().float())
    torch.testing.assert_close(dv.float(), want.bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_auto_picks_varlen_for_bf16():
    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert resolve_backend("auto", q) == "varlen"
    assert resolve_backend("auto", q.float()) == "flex"


@pytest.mark.parametrize("cascade, min_chunk", [(False, 1024), (True, 1024), (True, 16)])
def test_varlen_gather_and_cascade_layouts(monkeypatch, cascade, min_chunk):
    """Gather-KV (with the fused scatter-add) and the cascade, its level calls in place or
    (min_chunk 16) in chunks with gathered keys: all exact on forests with many chain levels."""
    monkeypatch.setattr("ps_mcore.attention.layout.cascade_pays", lambda plan, layout: cascade)
    monkeypatch.setattr("ps_mcore.attention.layout.MIN_CHUNK_ROWS", min_chunk)
    rng = np.random.default_rng(7)
    for i in range(3):
        seqs = random_forest(rng, max_seqs=16, max_len=400)
        check(plan_prefix_tree(seqs, min_prefix_len=2), "varlen", 8, 2, 128, torch.bfloat16, i)
    deep = [list(range(600))] + [list(range(40 * j)) + [9999] for j in range(1, 14)]
    check(plan_prefix_tree(deep, min_prefix_len=1), "varlen", 4, 4, 64, torch.float16)
