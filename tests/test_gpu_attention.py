"""GPU-only backends (varlen, flex; cudnn and fa4 where TE / flash-attn-4 are installed) vs.
per-sequence causal attention, row by row. Skips without CUDA:
``python -m pytest -q tests/test_gpu_attention.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from attention_oracle import compare_with_unshared
from conftest import assert_rows_close, row_errors
from forests import branching_forest, nasty_forests, random_forest

from ps_mcore import plan_prefix_tree
from ps_mcore.attention import resolve_backend
from ps_mcore.attention.fa4 import FA4_HEAD_DIMS

pytestmark = pytest.mark.gpu


def check(plan, backend, hq, hkv, d, dtype, seed=0, tol=1e-2):
    """The tree against the float64 unshared computation, row by row: each output row within
    ``tol`` of the output's largest value, each gradient row of q/k/v within ``2 tol``."""
    out, ref, got, want = compare_with_unshared(plan, backend, hq, hkv, d, dtype, "cuda", seed)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_rows_close(out, ref, tol, "out")
    for name, a, b in zip("qkv", got, want):
        assert_rows_close(a, b, 2 * tol, f"d{name}")


def _te_refusal() -> str | None:
    """Why the cuDNN backend cannot run on this machine (None: TE and CUDA are there)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    from ps_mcore.attention.cudnn import cudnn_static_refusal

    return cudnn_static_refusal("cuda", torch.bfloat16, 128)


needs_te = pytest.mark.skipif(_te_refusal() is not None, reason=f"cuDNN backend: {_te_refusal()}")


def _fa4_refusal() -> str | None:
    """Why the fa4 backend cannot run on this machine (None: the package and an SM90+ GPU are there)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    from ps_mcore.attention.fa4 import fa4_refusal

    return fa4_refusal(torch.zeros(1, 2, 64, device="cuda", dtype=torch.bfloat16))


needs_fa4 = pytest.mark.skipif(_fa4_refusal() is not None, reason=f"fa4 backend: {_fa4_refusal()}")
# The fused kernels beside torch flash: cuDNN through TE, FlashAttention-4 (each skips without its package).
FUSED = [pytest.param("cudnn", marks=needs_te), pytest.param("fa4", marks=needs_fa4)]
ALL = ["varlen", "flex", *FUSED]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name", list(nasty_forests()))
def test_nasty_shapes(name, backend):
    check(plan_prefix_tree(nasty_forests()[name], min_prefix_len=1), backend, 8, 2, 64, torch.bfloat16)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("ratio, d, dtype", [(1, 64, torch.bfloat16), (4, 80, torch.bfloat16),
                                             (7, 128, torch.bfloat16), (8, 128, torch.float16)])
def test_random_forests_gqa_head_dims(backend, ratio, d, dtype):
    rng = np.random.default_rng(ratio * d)
    forests = [random_forest(rng, max_seqs=12, max_len=300) for _ in range(3)]
    forests.append(branching_forest(rng, roots=2, depth=4, fanout=2, node_len=(8, 80)))
    for i, seqs in enumerate(forests):
        plan = plan_prefix_tree(seqs, min_prefix_len=4)
        if backend == "fa4" and d not in FA4_HEAD_DIMS:  # FA4's SM90 backward was wrong there: refused
            with pytest.raises(ValueError, match=f"got {d}"):
                check(plan, backend, 2 * ratio, 2, d, dtype, i)
            continue
        check(plan, backend, 2 * ratio, 2, d, dtype, i)


def test_flex_float32_is_tight():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    out, ref, got, want = compare_with_unshared(plan, "flex", 4, 2, 64, torch.float32, "cuda")
    assert_rows_close(out, ref, 1e-4, "out")
    for name, a, b in zip("qkv", got, want):
        assert_rows_close(a, b, 2e-4, f"d{name}")


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


def test_head_dims_the_flash_kernels_lack():
    """Head dims that are not multiples of 8 (or over 256): auto runs the exact chunked kernel,
    an explicit 'varlen' refuses by name."""
    plan = plan_prefix_tree(random_forest(np.random.default_rng(3), max_seqs=8, max_len=120), min_prefix_len=2)
    for d in (10, 20, 264):
        q = torch.zeros(4, 2, d, device="cuda", dtype=torch.bfloat16)
        assert resolve_backend("auto", q) == "chunked"
        with pytest.raises(ValueError, match=f"head dim {d}"):
            resolve_backend("varlen", q)
    check(plan, "auto", 6, 2, 10, torch.bfloat16)


@pytest.mark.parametrize("backend", ["varlen", pytest.param("fa4", marks=needs_fa4)])
@pytest.mark.parametrize("cascade, min_chunk", [(False, 1024), (True, 1024), (True, 16)])
def test_varlen_gather_and_cascade_layouts(monkeypatch, cascade, min_chunk, backend):
    """Gather-KV (with the fused scatter-add) and the cascade, its level calls in place or
    (min_chunk 16) in chunks with gathered keys, whose filler segments have no key: all exact
    on chains and on forests with many chain levels."""
    monkeypatch.setattr("ps_mcore.attention.layout.cascade_pays", lambda plan, layout: cascade)
    monkeypatch.setattr("ps_mcore.attention.layout.MIN_CHUNK_ROWS", min_chunk)
    step_wise = [list(range(37 * (j + 1))) for j in range(6)]
    check(plan_prefix_tree(step_wise, min_prefix_len=1), backend, 8, 2, 128, torch.bfloat16)
    rng = np.random.default_rng(7)
    for i in range(3):
        seqs = random_forest(rng, max_seqs=16, max_len=400)
        check(plan_prefix_tree(seqs, min_prefix_len=2), backend, 8, 2, 128, torch.bfloat16, i)
    deep = [list(range(600))] + [list(range(40 * j)) + [9999] for j in range(1, 14)]
    check(plan_prefix_tree(deep, min_prefix_len=1), backend, 4, 4, 64, torch.float16)


# ----------------------------------------------------------------------------- cuDNN (TE)


@needs_te
@pytest.mark.parametrize("layout", ["auto", "gather"])
def test_cudnn_layouts_on_chains_and_deep_trees(monkeypatch, layout):
    """Chain forests (one causal call in place, or forced gather-KV) and many-level trees
    (gather-KV with the fused scatter-add), against the float64 unshared computation."""
    from ps_mcore.attention import backends, cudnn

    monkeypatch.setitem(backends.ATTENTION_BACKENDS, "cudnn", dataclasses.replace(
        backends.ATTENTION_BACKENDS["cudnn"],
        attend=lambda q, k, v, plan, s, variant: cudnn.cudnn_tree_attention(q, k, v, plan, s, layout, variant)))
    step_wise = [list(range(37 * (j + 1))) for j in range(6)]
    check(plan_prefix_tree(step_wise, min_prefix_len=1), "cudnn", 8, 2, 128, torch.bfloat16)
    deep = [list(range(600))] + [list(range(40 * j)) + [9999] for j in range(1, 14)]
    check(plan_prefix_tree(deep, min_prefix_len=1), "cudnn", 4, 4, 64, torch.float16)
    rng = np.random.default_rng(7)
    for i in range(3):
        check(plan_prefix_tree(random_forest(rng, max_seqs=16, max_len=400), min_prefix_len=2),
              "cudnn", 8, 2, 128, torch.bfloat16, i)


@needs_te
def test_cudnn_softmax_scale_is_honoured():
    from attention_oracle import random_qkv, unshared_attention

    from ps_mcore import tree_attention

    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1).to("cuda")
    q, k, v = random_qkv(plan, 4, 2, 64, torch.bfloat16, "cuda")
    out = plan.unpack(tree_attention(q, k, v, plan, backend="cudnn", softmax_scale=0.37))
    assert_rows_close(out, unshared_attention(q, k, v, plan, scale=0.37), 1e-2, "out")
    default = unshared_attention(q, k, v, plan)  # the default scale differs
    assert float(row_errors(out, default).max()) > 5e-2 * float(default.abs().max())


@needs_te
@pytest.mark.parametrize("d", [40, 72, 96])
def test_cudnn_other_head_dims_exact_or_refused_clearly(d):
    """cuDNN's head-dim support depends on its version: every multiple of 8 up to 128 either
    runs exactly or is refused by the backend's check with cuDNN's reason (never a crash
    inside the step)."""
    from ps_mcore.attention.cudnn import cudnn_refusal

    q = torch.zeros(8, 4, d, device="cuda", dtype=torch.bfloat16)
    reason = cudnn_refusal(q)
    plan = plan_prefix_tree(nasty_forests()["grpo"], min_prefix_len=1)
    if reason is None:
        check(plan, "cudnn", 4, 2, d, torch.bfloat16)
    else:
        with pytest.raises(ValueError, match="backend 'cudnn'.*unavailable"):
            resolve_backend("cudnn", q)


@needs_te
def test_cudnn_refuses_head_dims_cudnn_cannot_take():
    for d in (100, 192, 256):
        q = torch.zeros(8, 4, d, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="multiple of 8 and at most 128"):
            resolve_backend("cudnn", q)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        resolve_backend("cudnn", torch.zeros(8, 4, 64, device="cuda"))


@pytest.mark.skipif(_te_refusal() is None, reason="transformer-engine is installed")
def test_cudnn_without_te_is_refused_and_auto_stays_flash():
    from ps_mcore.workloads import make_workload

    q = torch.zeros(8, 16, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backend 'cudnn'.*transformer_engine"):
        resolve_backend("cudnn", q)
    plan = plan_prefix_tree(make_workload("grpo-long-prompt", seed=0).sequences).to("cuda")
    assert resolve_backend("auto", q, plan) == "varlen"


@needs_te
def test_auto_picks_cudnn_by_shape():
    """The shape rule on the GPU: the long GRPO prompt and agent-tree run cuDNN gather-KV,
    step-wise the chain's one causal cuDNN call; grpo-wide keeps flash's cascade (memory) and
    no-sharing flash (host cost); without a plan (CP) auto means flash."""
    from ps_mcore.attention import auto_choice
    from ps_mcore.workloads import make_workload

    q = torch.zeros(8, 16, 128, device="cuda", dtype=torch.bfloat16)
    picks = {}
    for name in ("grpo-long-prompt", "grpo-wide", "agent-tree", "step-wise", "no-sharing"):
        plan = plan_prefix_tree(make_workload(name, seed=0).sequences).to("cuda")
        picks[name] = auto_choice(q, plan)
    assert picks == {"grpo-long-prompt": ("cudnn", "gather"), "grpo-wide": ("varlen", "cascade"),
                     "agent-tree": ("cudnn", "gather"), "step-wise": ("cudnn", "cascade"),
                     "no-sharing": ("varlen", "gather")}
    assert resolve_backend("auto", q) == "varlen"


@needs_te
def test_cudnn_kernel_serves_context_parallelism():
    from ps_mcore.attention import cp_kernel
    from ps_mcore.attention.cudnn import CUDNN_KERNEL

    assert cp_kernel("cudnn", torch.zeros(8, 4, 64, device="cuda", dtype=torch.bfloat16)) is CUDNN_KERNEL


@needs_te
def test_schedule_context_calls_run_cudnn():
    """``auto`` runs a cross-micro-batch schedule's long context calls on cuDNN (flash for
    small ones, and without a call shape), and a schedule on cuDNN matches the float64
    unshared run as closely as the same schedule on flash: log-probs and every gradient."""
    import copy

    from test_minibatch import ToyDecoder, _weights, run_schedule, unshared_reference

    from ps_mcore.attention import cp_kernel
    from ps_mcore.attention.cudnn import CUDNN_KERNEL
    from ps_mcore.attention.kernel_choice import CUDNN_MIN_WORK, PlanShape
    from ps_mcore.minibatch import plan_minibatch

    q = torch.zeros(8, 16, 128, device="cuda", dtype=torch.bfloat16)
    pairs_at_threshold = CUDNN_MIN_WORK / (16 * 128)
    shape = lambda pairs: PlanShape(pairs, 8192, 32768, 2, 0, False, 16, 128)  # noqa: E731
    assert cp_kernel("auto", q, purpose="against kept context K/V", shape=shape(2 * pairs_at_threshold)) is CUDNN_KERNEL
    assert cp_kernel("auto", q, purpose="against kept context K/V", shape=shape(pairs_at_threshold / 2)) is not CUDNN_KERNEL
    assert cp_kernel("auto", q) is not CUDNN_KERNEL

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, 200).tolist()
    seqs = [prompt + rng.integers(0, 128, int(rng.integers(10, 40))).tolist() for _ in range(6)]
    weights = _weights(seqs)
    model = ToyDecoder(hidden=256, heads=4, kv_heads=2, max_pos=512).double()
    with torch.no_grad():  # logits of a few units: bf16 log-probs to about 1e-2
        for p in model.parameters():
            p.mul_(0.2)
    ref_lp, _, ref_grads = unshared_reference(model, seqs, weights)
    plan = plan_minibatch(seqs, 160, kv_row_cost=0.1, min_prefix_len=1)
    assert plan.num_steps > 1 and any(len(c.context) for c in plan.calls)
    gpu = copy.deepcopy(model).to("cuda", torch.bfloat16)
    errors = {}
    for backend in ("varlen", "cudnn"):
        lp, _, grads = run_schedule(gpu, plan, weights, backend=backend)
        grad_error = max(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items())
        errors[backend] = ((lp - ref_lp).abs().max().item(), grad_error)
    assert errors["varlen"][0] < 0.05 and errors["varlen"][1] < 0.05, errors
    for stock, got in zip(errors["varlen"], errors["cudnn"]):
        assert got <= 2 * stock + 1e-3, errors


# ----------------------------------------------------------------------------- variants


def variant_check(plan, backend, hq, hkv, d, dtype, seed=0, **variant):
    """The tree against the float64 unshared computation, row by row, next to the stock run:
    the same backend and variant on the unshared batch (every sample its own rows; gradients
    of a shared row summed in float64). Each output row, each gradient row of q/k/v and each
    head's sink gradient: the tree's error is at most twice the stock run's plus one rounding
    of the row (2^-8 of its largest value in bf16, 2^-11 in fp16), and below 2^-5 of the
    largest value of its tensor (so a stock run that is wrong too cannot carry it)."""
    from attention_oracle import random_qkv, random_sinks, unshared_attention

    from ps_mcore import plan_unshared, tree_attention

    plan = plan.to("cuda")
    use_sinks = variant.pop("sinks", False)
    q, k, v = random_qkv(plan, hq, hkv, d, dtype, "cuda", seed)
    sinks = random_sinks(hq, "cuda", seed) if use_sinks else None
    leaves = (q, k, v) + ((sinks,) if use_sinks else ())
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    weight = torch.randn(plan.num_input_tokens, hq, d, generator=g, dtype=torch.float64)

    out = plan.unpack(tree_attention(q, k, v, plan, backend=backend, sinks=sinks, **variant))
    assert out.dtype == dtype and torch.isfinite(out).all()
    tree_grads = torch.autograd.grad((out.double() * weight.cuda()).sum(), leaves)

    base = plan_unshared([[0] * n for n in plan.seq_lens]).to("cuda")
    unpacked = [plan.unpack(x).detach().requires_grad_() for x in (q, k, v)]
    base_sinks = sinks.detach().clone().requires_grad_() if use_sinks else None
    stock = tree_attention(*unpacked, base, backend=backend, sinks=base_sinks, **variant)
    stock_leaves = tuple(unpacked) + ((base_sinks,) if use_sinks else ())
    per_copy = torch.autograd.grad((stock.double() * weight.cuda()).sum(), stock_leaves)
    index = plan.unpack_index.cpu()
    stock_grads = [torch.zeros(x.shape, dtype=torch.float64).index_add_(0, index, gx.double().cpu())
                   for x, gx in zip((q, k, v), per_copy[:3])] + list(per_copy[3:])

    cpu_leaves = [x.detach().cpu().double().requires_grad_() for x in leaves]
    ref = unshared_attention(*cpu_leaves[:3], plan.to("cpu"), sinks=cpu_leaves[3] if use_sinks else None, **variant)
    ref_grads = torch.autograd.grad((ref * weight).sum(), cpu_leaves)

    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    rows = dict(zero_ok=True)  # a window of 1: a row's softmax is 1, dq and dk are 0 in theory
    pairs = [("out", out, stock, ref)] + [
        (f"d{n}", a, b, c) for n, a, b, c in zip(("q", "k", "v", "sinks"), tree_grads, stock_grads, ref_grads)]
    for name, got, base_got, want in pairs:
        if name == "dsinks":
            got, base_got, want = got[:, None], base_got[:, None], want[:, None]
        got, base_got = got.cpu(), base_got.cpu()
        assert_rows_close(got, want, 0.0, f"{name} vs 2 x stock + rounding", row_tol=rounding, baseline=base_got, **rows)
        if float(want.abs().max()) > 0:  # a zero gradient (window of 1) is held by the stock bound above
            assert_rows_close(got, want, 2.0**-5, name)


def _variant_forests(max_len=300):
    """A step-wise chain, a random forest and a tree branching at three nested depths."""
    rng = np.random.default_rng(11)
    step_wise = [list(range(37 * (j + 1))) for j in range(6)]
    tree = branching_forest(rng, roots=1, depth=4, fanout=2, node_len=(8, max_len // 4))
    return [step_wise, random_forest(rng, max_seqs=12, max_len=max_len), tree]


def _runs_head_dim(backend, d):
    return backend != "fa4" or d in FA4_HEAD_DIMS


VARIANT_CASES = [dict(window=1), dict(window=17), dict(window=128), dict(sinks=True),
                 dict(window=64, sinks=True), dict(softcap=20.0), dict(softcap=5.0, sinks=True, window=33)]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("variant", VARIANT_CASES, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
def test_variants_every_backend(backend, variant):
    """Sliding windows (1, shorter than the branches, and 128 inside contexts of up to 300),
    sinks of both signs and softcapping; a backend whose kernel lacks one refuses it by name."""
    from ps_mcore.attention import ATTENTION_BACKENDS
    from ps_mcore.attention.variants import attention_variant

    q = torch.zeros(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    wanted = attention_variant(q, variant.get("window"), 0.0 if variant.get("sinks") else None, variant.get("softcap"))
    refusal = ATTENTION_BACKENDS[backend].variant_refusal(q, wanted)
    if backend == "cudnn" and refusal is None:
        refusal = _cudnn_probe_refusal(8, 128, torch.bfloat16, wanted.window is not None, wanted.sinks is not None)
    for i, seqs in enumerate(_variant_forests()):
        plan = plan_prefix_tree(seqs, min_prefix_len=4)
        if refusal is not None:
            with pytest.raises(ValueError, match="does not implement|refused"):
                variant_check(plan, backend, 8, 2, 128, torch.bfloat16, i, **dict(variant))
            continue
        variant_check(plan, backend, 8, 2, 128, torch.bfloat16, i, **dict(variant))


@pytest.mark.parametrize("backend", ["varlen", "flex", *FUSED])
def test_variants_gqa_head_dims_fp16(backend):
    for hq, hkv, d, dtype in [(7, 1, 64, torch.float16), (4, 4, 96, torch.bfloat16)]:
        if not _runs_head_dim(backend, d):
            continue
        variant = dict(window=40, sinks=True)
        plan = plan_prefix_tree(random_forest(np.random.default_rng(d), max_seqs=10, max_len=200), min_prefix_len=2)
        if backend == "cudnn" and _cudnn_probe_refusal(hq, d, dtype, window=True, sinks=True) is not None:
            # this cuDNN build has no kernel for the case: the backend refuses it by name
            with pytest.raises(ValueError, match="refused"):
                variant_check(plan, backend, hq, hkv, d, dtype, **variant)
            continue
        variant_check(plan, backend, hq, hkv, d, dtype, **variant)


def _cudnn_probe_refusal(hq, d, dtype, window, sinks):
    """cuDNN's probe (what this cuDNN build refuses) at these heads, dims and variant."""
    from ps_mcore.attention.cudnn import cudnn_refusal

    return cudnn_refusal(torch.zeros(1, hq, d, device="cuda", dtype=dtype), window=window, sinks=sinks)


@pytest.mark.parametrize("backend", ["varlen", pytest.param("fa4", marks=needs_fa4)])
@pytest.mark.parametrize("cascade, min_chunk", [(False, 1024), (True, 1024), (True, 16)])
def test_variants_in_both_layouts(monkeypatch, backend, cascade, min_chunk):
    """Sinks added once after the cascade's merges (in place and chunked level calls); a
    window in the chain self call or, with level calls, gather-KV cut to the window."""
    monkeypatch.setattr("ps_mcore.attention.layout.cascade_pays", lambda plan, layout: cascade)
    monkeypatch.setattr("ps_mcore.attention.layout.MIN_CHUNK_ROWS", min_chunk)
    for i, seqs in enumerate(_variant_forests(400)):
        plan = plan_prefix_tree(seqs, min_prefix_len=2)
        variant_check(plan, backend, 8, 2, 128, torch.bfloat16, i, sinks=True)
        variant_check(plan, backend, 8, 2, 128, torch.bfloat16, i, window=50, sinks=True)


def test_auto_runs_softcap_where_the_flash_kernel_has_none():
    from ps_mcore.attention import ATTENTION_BACKENDS
    from ps_mcore.attention.variants import attention_variant

    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    capped = attention_variant(q, softcap=10.0)
    want = "flex" if ATTENTION_BACKENDS["varlen"].variant_refusal(q, capped) else "varlen"
    assert resolve_backend("auto", q, None, capped) == want
    assert resolve_backend("auto", q, None, attention_variant(q, window=8, sinks=0.0)) == "varlen"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_qkv_as_sdpa_does(dtype):
    """fp32 q/k (RoPE under autocast) and a 16-bit v: cast to the autocast dtype, the flash
    path runs, and the result is the one of the cast inputs outside autocast."""
    from attention_oracle import random_qkv

    from ps_mcore import tree_attention

    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1).to("cuda")
    q, k, v = random_qkv(plan, 8, 2, 64, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=dtype):
        got = tree_attention(q, k, v.to(dtype), plan, window=5, sinks=0.0)
    want = tree_attention(q.to(dtype), k.to(dtype), v.to(dtype), plan, window=5, sinks=0.0)
    assert got.dtype == dtype and torch.equal(got, want)
