"""The Ascend ``npu`` backend on CPU, against an EMULATION of torch_npu's documented contract.

No NPU exists here. ``emulated_npu_fusion_attention`` / ``emulated_npu_fusion_attention_grad``
implement what torch_npu 26.0.0 documents (Ascend/op-plugin branch 26.0.0,
``docs/en/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``): TND layout,
``actual_seq_qlen``/``actual_seq_kvlen`` cumulative without a leading 0, sparse_mode 3 =
rightDownCausal with the 2048x2048 compressed mask, GQA with ``head_num`` = Nq,
softmax_max/softmax_sum handed to the grad with ``attention_in``. Two details the doc leaves
open are taken from elsewhere: query head i reads kv head ``i // (Nq//Nkv)`` (Huawei's msprobe
golden ``npu_fusion_attention``; MindSpeed feeds Megatron's grouped heads unchanged) and the
stats are ``[T, N, 8]`` fp32 (op-plugin's meta registration); the adapter treats them as
opaque.
They are patched in as a fake ``torch_npu`` module inside each test, so the real kernel adapter
runs end to end. This proves our arguments under the documented contract, not the kernel.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from attention_oracle import compare_with_unshared, random_qkv
from forests import forests, nasty_forests
from hypothesis import given, settings

from ps_mcore import plan_prefix_tree, tree_attention
from ps_mcore.attention import npu as npu_mod
from ps_mcore.attention import resolve_backend
from ps_mcore.attention.npu import (
    SPARSE_MODE_RIGHT_DOWN_CAUSAL,
    compressed_causal_mask,
    npu_fusion_args,
)

# ----------------------------------------------------------------------------- the emulation

_DOC_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _emulated_segments(query, key, head_num, input_layout, atten_mask, keep_prob,
                       actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse):
    """Validate the documented TND contract; return ``[(q0, q1, k0, k1)]`` per batch."""
    if input_layout != "TND":
        raise NotImplementedError(f"emulation covers input_layout TND only, got {input_layout}")
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError("TND takes [T, N, D] tensors")
    if head_num != query.size(1) or query.size(1) % key.size(1):
        raise ValueError(f"head_num={head_num} must be Nq={query.size(1)}, a multiple of Nkv")
    if sparse_mode not in (2, 3):
        raise NotImplementedError(f"emulation covers sparse modes 2 and 3, got {sparse_mode}")
    # Modes 2/3/4 need exactly the compressed lower-triangular mask, else results are wrong.
    if atten_mask is None or atten_mask.dtype != torch.bool or not torch.equal(
        atten_mask.cpu(), _DOC_MASK
    ):
        raise ValueError("sparse modes 2/3 need atten_mask = triu(ones(2048, 2048, bool), 1)")
    if keep_prob != 1.0 or pse is not None:
        raise NotImplementedError("emulation covers keep_prob=1 without pse")
    for name, lens in (("actual_seq_qlen", actual_seq_qlen),
                       ("actual_seq_kvlen", actual_seq_kvlen)):
        if not isinstance(lens, (list, tuple)) or not all(type(x) is int for x in lens):
            raise TypeError(f"{name} must be a host List[int], got {type(lens).__name__}")
    if len(actual_seq_qlen) != len(actual_seq_kvlen) or not actual_seq_qlen:
        raise ValueError("actual_seq_qlen and actual_seq_kvlen need one entry per batch")
    segs, pq, pk = [], 0, 0
    for eq, ek in zip(actual_seq_qlen, actual_seq_kvlen):
        if eq == 0 and ek == 0 and pq > 0:  # documented: trailing zeros = batches skipped
            break
        if eq < pq or ek < pk:
            raise ValueError("actual_seq_* are cumulative (non-decreasing)")
        if sparse_mode == 3 and ek - pk < eq - pq:
            raise ValueError("rightDownCausal with Sq > Skv leaves fully masked rows")
        segs.append((pq, eq, pk, ek))
        pq, pk = eq, ek
    if pq != query.size(0) or pk != key.size(0):
        raise ValueError(f"cumulative lengths end at {pq}/{pk}, tensors have "
                         f"{query.size(0)}/{key.size(0)} rows")
    return segs


def _emulated_scores(q, k, scale, sparse_mode):
    """q ``[Sq, N, D]``, k ``[Skv, N2, D]`` -> masked scores ``[N, Sq, Skv]`` (float64)."""
    group = q.size(1) // k.size(1)
    qs = q.double().transpose(0, 1)
    ks = k.double().repeat_interleave(group, 1).transpose(0, 1)
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    sq, skv = q.size(0), k.size(0)
    shift = skv - sq if sparse_mode == 3 else 0  # 3: bottom-right origin; 2: top-left
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    return s.masked_fill(j > i + shift, float("-inf"))


def emulated_npu_fusion_attention(query, key, value, head_num, input_layout, pse=None,
                                  padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                                  pre_tockens=2147483647, next_tockens=2147483647,
                                  inner_precise=0, prefix=None, actual_seq_qlen=None,
                                  actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                  sync=False):
    segs = _emulated_segments(query, key, head_num, input_layout, atten_mask, keep_prob,
                              actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse)
    group = query.size(1) // key.size(1)
    out = torch.zeros(query.shape, dtype=torch.float64)
    smax = torch.zeros(query.size(0), head_num, 8, dtype=torch.float32)
    ssum = torch.zeros(query.size(0), head_num, 8, dtype=torch.float32)
    for q0, q1, k0, k1 in segs:
        if q1 == q0:
            continue
        s = _emulated_scores(query[q0:q1], key[k0:k1], scale, sparse_mode)
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        vs = value[k0:k1].double().repeat_interleave(group, 1).transpose(0, 1)
        out[q0:q1] = torch.matmul(e / z, vs).transpose(0, 1)
        smax[q0:q1] = m.squeeze(-1).transpose(0, 1)[..., None].float().expand(-1, -1, 8)
        ssum[q0:q1] = z.squeeze(-1).transpose(0, 1)[..., None].float().expand(-1, -1, 8)
    FAKE_CALLS["forward"] += 1
    return out.to(query.dtype), smax, ssum, torch.empty(0), 0, 0, 0


def emulated_npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *,
                                       pse=None, padding_mask=None, atten_mask=None,
                                       softmax_max=None, softmax_sum=None, softmax_in=None,
                                       attention_in=None, scale_value=1.0, keep_prob=1.0,
                                       pre_tockens=2147483647, next_tockens=2147483647,
                                       inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                                       actual_seq_qlen=None, actual_seq_kvlen=None,
                                       sparse_mode=0, gen_mask_parallel=True, sync=False):
    segs = _emulated_segments(query, key, head_num, input_layout, atten_mask, keep_prob,
                              actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse)
    stats_shape = (query.size(0), head_num, 8)
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise ValueError("the grad needs the forward's softmax_max, softmax_sum and attention_in")
    if tuple(softmax_max.shape) != stats_shape or tuple(softmax_sum.shape) != stats_shape:
        raise ValueError(f"softmax stats must be {stats_shape}, got {tuple(softmax_max.shape)}")
    hkv, d = key.size(1), key.size(2)
    group = head_num // hkv
    dq = torch.zeros(query.shape, dtype=torch.float64)
    dk = torch.zeros(key.shape, dtype=torch.float64)
    dv = torch.zeros(value.shape, dtype=torch.float64)
    for q0, q1, k0, k1 in segs:
        if q1 == q0:
            continue
        s = _emulated_scores(query[q0:q1], key[k0:k1], scale_value, sparse_mode)
        # P rebuilt from the forward's stats (as the kernel does), not recomputed.
        m = softmax_max[q0:q1, :, 0].double().transpose(0, 1)[..., None]
        z = softmax_sum[q0:q1, :, 0].double().transpose(0, 1)[..., None]
        p = torch.exp(s - m) / z
        qs = query[q0:q1].double().transpose(0, 1)
        ks = key[k0:k1].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = value[k0:k1].double().repeat_interleave(group, 1).transpose(0, 1)
        do = dy[q0:q1].double().transpose(0, 1)
        o = attention_in[q0:q1].double().transpose(0, 1)
        ds = p * (torch.matmul(do, vs.transpose(1, 2)) - (do * o).sum(-1, keepdim=True))
        ds = ds * scale_value
        dq[q0:q1] = torch.matmul(ds, ks).transpose(0, 1)
        # Each kv head's gradient sums over the query heads of its group.
        dks = torch.matmul(ds.transpose(1, 2), qs).view(hkv, group, -1, d).sum(1)
        dvs = torch.matmul(p.transpose(1, 2), do).view(hkv, group, -1, d).sum(1)
        dk[k0:k1], dv[k0:k1] = dks.transpose(0, 1), dvs.transpose(0, 1)
    FAKE_CALLS["backward"] += 1
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None


FAKE_CALLS = {"forward": 0, "backward": 0}


@pytest.fixture
def emulated_torch_npu(monkeypatch):
    """A fake ``torch_npu`` exposing only the emulated ops, for the duration of one test."""
    fake = types.ModuleType("torch_npu")
    fake.npu_fusion_attention = emulated_npu_fusion_attention
    fake.npu_fusion_attention_grad = emulated_npu_fusion_attention_grad
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    FAKE_CALLS.update(forward=0, backward=0)
    return FAKE_CALLS


# ----------------------------------------------------------------------------- argument checks


def test_args_convention_cumulative_without_leading_zero():
    mask = compressed_causal_mask("cpu")
    (call,) = npu_fusion_args(torch.tensor([0, 3, 5, 9], dtype=torch.int32),
                              torch.tensor([0, 3, 8, 12], dtype=torch.int32), 6, 0.25, mask)
    kw = call.kwargs
    assert kw["actual_seq_qlen"] == [3, 5, 9] and kw["actual_seq_kvlen"] == [3, 8, 12]
    assert all(type(x) is int for x in kw["actual_seq_qlen"] + kw["actual_seq_kvlen"])
    assert kw["sparse_mode"] == SPARSE_MODE_RIGHT_DOWN_CAUSAL == 3
    assert call.head_num == 6 and call.input_layout == "TND"
    assert kw["scale"] == 0.25 and kw["keep_prob"] == 1.0 and kw["pse"] is None
    assert kw["atten_mask"] is mask and torch.equal(mask, _DOC_MASK)
    assert (call.q_rows, call.kv_rows) == (slice(0, 9), slice(0, 12))
    sm, ss, out = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    gk = call.grad_kwargs(sm, ss, out)
    assert "scale" not in gk and gk["scale_value"] == 0.25
    assert gk["softmax_max"] is sm and gk["softmax_sum"] is ss and gk["attention_in"] is out
    assert gk["actual_seq_qlen"] == [3, 5, 9] and gk["sparse_mode"] == 3
    assert "scale" in kw  # grad_kwargs does not mutate the forward's kwargs


@pytest.mark.parametrize("name", sorted(nasty_forests()))
def test_args_from_real_plans(name):
    plan = plan_prefix_tree(nasty_forests()[name])
    calls = npu_fusion_args(plan.cu_seqlens_q, plan.cu_seqlens_kv, 4, 1.0, None)
    assert len(calls) == 1
    assert calls[0].kwargs["actual_seq_qlen"] == plan.cu_seqlens_q[1:].tolist()
    assert calls[0].kwargs["actual_seq_kvlen"] == plan.cu_seqlens_kv[1:].tolist()
    assert calls[0].kwargs["actual_seq_kvlen"][-1] == plan.kv_index.numel()


def test_args_split_into_calls_within_limits():
    plan = plan_prefix_tree(nasty_forests()["deep-chain"] + nasty_forests()["tree"])
    bq, bk = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist()
    calls = npu_fusion_args(bq, bk, 2, 1.0, None, max_segments=3, max_tokens=60)
    assert len(calls) > 2
    # Calls tile q rows and gathered kv rows in order; lengths restart in each call.
    assert [c.q_rows.start for c in calls[1:]] == [c.q_rows.stop for c in calls[:-1]]
    assert [c.kv_rows.start for c in calls[1:]] == [c.kv_rows.stop for c in calls[:-1]]
    assert calls[0].q_rows.start == 0 and calls[-1].q_rows.stop == bq[-1]
    assert calls[-1].kv_rows.stop == bk[-1]
    seg_q, seg_k = [], []
    for c in calls:
        lq, lk = c.kwargs["actual_seq_qlen"], c.kwargs["actual_seq_kvlen"]
        assert len(lq) <= 3 and lq[-1] <= 60 and lk[-1] <= 60 and lq[0] > 0
        assert lq[-1] == c.q_rows.stop - c.q_rows.start
        assert lk[-1] == c.kv_rows.stop - c.kv_rows.start
        seg_q += list(np.diff([0] + lq))
        seg_k += list(np.diff([0] + lk))
    assert seg_q == list(np.diff(bq)) and seg_k == list(np.diff(bk))


@pytest.mark.parametrize(
    "cu_q, cu_k, kw, err, match",
    [
        ([3, 5], [3, 5], {}, ValueError, "leading|boundaries"),
        ([0, 4, 2], [0, 4, 6], {}, ValueError, "non-decreasing"),
        ([0, 4], [0, 3], {}, ValueError, "only 3 keys"),
        ([0, 2, 4], [0, 2], {}, ValueError, "segments"),
        ([0, 8], [0, 8], {"max_tokens": 5}, NotImplementedError, "at most 5 tokens"),
    ],
)
def test_args_refuse_bad_boundaries(cu_q, cu_k, kw, err, match):
    with pytest.raises(err, match=match):
        npu_fusion_args(cu_q, cu_k, 2, 1.0, None, **kw)


# ----------------------------------------------------------------------------- backend selection


def test_npu_without_torch_npu_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]])
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="backend 'npu' needs torch_npu"):
        tree_attention(q, k, v, plan, backend="npu")


def test_auto_picks_npu_on_npu_device_only():
    npu_q = types.SimpleNamespace(device=types.SimpleNamespace(type="npu"), is_cuda=False,
                                  dtype=torch.bfloat16)
    assert resolve_backend("auto", npu_q) == "npu"
    assert resolve_backend("auto", torch.zeros(1, 1, 1)) == "chunked"


def test_kernel_refuses_head_dim_over_documented_limit(emulated_torch_npu):
    plan = plan_prefix_tree([[1, 2, 3]])
    q, k, v = random_qkv(plan, 1, 1, 769, torch.float32)
    with pytest.raises(NotImplementedError, match="head dim <= 768"):
        tree_attention(q, k, v, plan, backend="npu")


# ----------------------------------------------------------------------------- end to end


def _assert_npu_matches(plan, hq, hkv, d, dtype=torch.float32, seed=0, tol=(1e-5, 1e-5)):
    out, ref, got, want = compare_with_unshared(plan, "npu", hq, hkv, d, dtype, seed=seed)
    torch.testing.assert_close(out.double(), ref, rtol=tol[0], atol=tol[1])
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol[0], atol=tol[1],
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("name", sorted(nasty_forests()))
@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 16), (6, 2, 12), (3, 1, 7)])
def test_npu_matches_unshared_on_nasty_forests(emulated_torch_npu, name, hq, hkv, d):
    _assert_npu_matches(plan_prefix_tree(nasty_forests()[name]), hq, hkv, d)
    assert emulated_torch_npu["forward"] >= 1 and emulated_torch_npu["backward"] >= 1


@settings(max_examples=15, deadline=None)
@given(seqs=forests())
def test_npu_matches_chunked_on_random_forests(seqs):
    fake = types.ModuleType("torch_npu")
    fake.npu_fusion_attention = emulated_npu_fusion_attention
    fake.npu_fusion_attention_grad = emulated_npu_fusion_attention_grad
    saved = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = fake  # hypothesis forbids function-scoped fixtures
    try:
        plan = plan_prefix_tree(seqs)
        results = {}
        for backend in ("npu", "chunked"):
            q, k, v = random_qkv(plan, 4, 2, 8, torch.float32, seed=3)
            out = tree_attention(q, k, v, plan, backend=backend)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            results[backend] = (out.detach(), *torch.autograd.grad((out * w).sum(), (q, k, v)))
    finally:
        if saved is None:
            del sys.modules["torch_npu"]
        else:
            sys.modules["torch_npu"] = saved
    for a, b in zip(results["npu"], results["chunked"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_npu_split_calls_match_unshared(emulated_torch_npu, monkeypatch):
    monkeypatch.setattr(npu_mod, "NPU_MAX_SEGMENTS", 2)
    monkeypatch.setattr(npu_mod, "NPU_MAX_TOKENS", 50)
    nasty = nasty_forests()
    plan = plan_prefix_tree(nasty["deep-chain"] + nasty["tree"] + nasty["single-tokens"])
    assert len(npu_fusion_args(plan.cu_seqlens_q, plan.cu_seqlens_kv, 1, 1.0, None, 2, 50)) > 3
    _assert_npu_matches(plan, 4, 2, 8)
    assert emulated_torch_npu["forward"] > 3 and emulated_torch_npu["backward"] > 3


def test_npu_bf16_matches_chunked(emulated_torch_npu):
    plan = plan_prefix_tree(nasty_forests()["tree"])
    outs = []
    for backend in ("npu", "chunked"):
        q, k, v = random_qkv(plan, 4, 2, 16, torch.bfloat16, seed=1)
        outs.append(tree_attention(q, k, v, plan, backend=backend).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_emulation_distinguishes_causal_alignment():
    """The emulation would catch a wrong sparse mode: top-left (2) differs from bottom-right
    (3) whenever a segment has more keys than queries, and agrees when they are equal."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=g) for n in (3, 7, 7))
    mask = compressed_causal_mask("cpu")
    kw = dict(atten_mask=mask, scale=0.3, actual_seq_qlen=[3], actual_seq_kvlen=[7])
    br = emulated_npu_fusion_attention(q, k, v, 2, "TND", sparse_mode=3, **kw)[0]
    tl = emulated_npu_fusion_attention(q, k, v, 2, "TND", sparse_mode=2, **kw)[0]
    assert not torch.allclose(br, tl)
    kw.update(actual_seq_kvlen=[3])
    sq = [emulated_npu_fusion_attention(q, k[:3], v[:3], 2, "TND", sparse_mode=m, **kw)[0]
          for m in (2, 3)]
    torch.testing.assert_close(sq[0], sq[1])
