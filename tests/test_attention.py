"""CPU tree-attention backends vs. per-sequence causal attention: outputs and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_oracle import compare_with_unshared, random_qkv
from conftest import assert_rows_close
from forests import forests, nasty_forests, random_forest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_mcore import plan_prefix_tree, tree_attention
from ps_mcore.attention import resolve_backend

CPU_BACKENDS = ("reference", "chunked")


def assert_matches(plan, backend, hq, hkv, d, dtype=torch.float32, seed=0, tol=None, **variant):
    """``variant``: ``window=``, ``softcap=``, ``sinks=True`` (random per-head sink logits,
    whose gradient is compared too)."""
    out, ref, got, want = compare_with_unshared(plan, backend, hq, hkv, d, dtype, seed=seed, **variant)
    rtol, atol = tol or (1e-5, 1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    assert len(got) == (4 if variant.get("sinks") else 3)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=f"d{name} differs")


@settings(max_examples=40, deadline=None)
@given(
    seqs=forests(),
    backend=st.sampled_from(CPU_BACKENDS),
    gqa=st.sampled_from([(2, 2), (8, 2), (7, 1)]),
    d=st.sampled_from([8, 24]),
    min_prefix_len=st.sampled_from([1, 3, 8]),
)
def test_random_forests(seqs, backend, gqa, d, min_prefix_len):
    plan = plan_prefix_tree(seqs, min_prefix_len=min_prefix_len)
    assert_matches(plan, backend, *gqa, d)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", list(nasty_forests()))
def test_nasty_shapes(name, backend):
    plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
    assert_matches(plan, backend, 4, 1, 16)


@pytest.mark.parametrize("ratio", [1, 4, 7])
@pytest.mark.parametrize("d", [64, 80])
def test_gqa_ratios_and_head_dims(ratio, d):
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    for backend in CPU_BACKENDS:
        assert_matches(plan, backend, 2 * ratio, 2, d, seed=ratio + d)


# float64 inputs compute in float64 (kernels, merges and dK/dV sums): agreement with the
# unshared float64 computation is at float64 precision, not float32's ~1e-7.
FP64_TOL = (1e-10, 1e-10)


@settings(max_examples=15, deadline=None)
@given(
    seqs=forests(),
    backend=st.sampled_from(CPU_BACKENDS),
    gqa=st.sampled_from([(2, 2), (6, 2)]),
    min_prefix_len=st.sampled_from([1, 3]),
)
def test_float64_random_forests_at_float64_precision(seqs, backend, gqa, min_prefix_len):
    plan = plan_prefix_tree(seqs, min_prefix_len=min_prefix_len)
    assert_matches(plan, backend, *gqa, 24, dtype=torch.float64, tol=FP64_TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", list(nasty_forests()))
def test_float64_nasty_shapes_at_float64_precision(name, backend):
    plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
    out, ref, got, want = compare_with_unshared(plan, backend, 4, 2, 16, torch.float64)
    assert out.dtype == torch.float64 and all(g.dtype == torch.float64 for g in got)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12 * ref.abs().max().item())
    for name_, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name_} differs")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("variant", [dict(window=3, sinks=True, softcap=2.0), dict(sinks=True), dict(softcap=1.5)])
def test_float64_variants_at_float64_precision(monkeypatch, backend, variant):
    """Windows, sinks and softcap keep float64 too (the sink softmax's log-sum-exp and the
    sink gradient included), in the cascade and in gather-KV."""
    for cascade in (True, False):
        monkeypatch.setattr("ps_mcore.attention.layout.cascade_pays", lambda plan, layout: cascade)
        for name in ("tree", "grpo", "prefix-of-another", "deep-chain", "single-tokens"):
            plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
            assert_matches(plan, backend, 4, 2, 16, dtype=torch.float64, tol=FP64_TOL, **variant)


def test_float32_is_float32_precision():
    """The float64 tolerance is not trivially met: float32 inputs miss it (the check can fail)."""
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    out, ref, _, _ = compare_with_unshared(plan, "chunked", 4, 2, 16, torch.float32, grads=False)
    assert (out.double() - ref).abs().max() > 1e-9


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bfloat16(backend):
    """Each row within a few bf16 roundings (2^-8) of its tensor's largest value."""
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    out, ref, got, want = compare_with_unshared(plan, backend, 4, 2, 64, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got)
    assert_rows_close(out, ref, 1e-2, "out")
    for name, a, b in zip("qkv", got, want):
        assert_rows_close(a, b, 2e-2, f"d{name}")


def test_flex_forward_on_cpu():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    with torch.no_grad():
        out, ref, _, _ = compare_with_unshared(plan, "flex", 4, 2, 16, torch.float32, grads=False)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # flex's CPU path computes in the input dtype: fp64 stays fp64
        out, ref, _, _ = compare_with_unshared(plan, "flex", 4, 2, 16, torch.float64, grads=False)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    q, k, v = random_qkv(plan, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="forward only"):
        tree_attention(q, k, v, plan, backend="flex")


def test_trivial_plan_equals_plain_varlen_causal():
    seqs = nasty_forests()["no-sharing"]
    plan = plan_prefix_tree(seqs)
    assert plan.is_trivial
    assert_matches(plan, "chunked", 4, 2, 16)


def test_softmax_scale_is_honoured():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    a = tree_attention(q, k, v, plan, backend="chunked", softmax_scale=0.3)
    b = tree_attention(q * (0.3 * np.sqrt(8)), k, v, plan, backend="reference")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_on_cpu_is_exact_math():
    q = torch.zeros(3, 2, 8)
    assert resolve_backend("auto", q) == "chunked"


def test_backend_resolved_once_per_plan_and_input_kind(monkeypatch):
    """Every layer of a micro-batch runs tree_attention on one plan with the same kind of
    inputs: the backend is resolved (checks, kernel-choice rule) for the first and kept on the
    plan; another dtype, head count, variant or plan resolves again, and an explicit name that
    cannot run still raises at every call."""
    import ps_mcore.attention as attention

    calls = []
    resolve = attention.resolve_backend
    monkeypatch.setattr(attention, "resolve_backend", lambda *a, **k: calls.append(a[0]) or resolve(*a, **k))
    plan = plan_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
    outs = [tree_attention(q, k, v, plan) for _ in range(3)]
    assert calls == ["auto"]
    assert all(torch.equal(o, outs[0]) for o in outs)
    tree_attention(q.double(), k.double(), v.double(), plan)
    tree_attention(q[:, :2], k, v, plan)
    tree_attention(q, k, v, plan, window=2)
    tree_attention(q, k, v, plan_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5]], min_prefix_len=1))
    assert calls == ["auto"] * 5
    for _ in range(2):
        with pytest.raises(ValueError, match="varlen"):
            tree_attention(q, k, v, plan, backend="varlen")
    assert calls == ["auto"] * 5 + ["varlen"] * 2


def test_flash_head_dims():
    from ps_mcore.attention.gather_kv import flash_head_dim_refusal

    assert [d for d in (8, 10, 64, 80, 96, 100, 256, 264) if flash_head_dim_refusal(d) is None] == [8, 64, 80, 96, 256]
    assert "head dim 10" in flash_head_dim_refusal(10)


def test_bad_inputs():
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]], min_prefix_len=1)
    t = plan.num_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    cases = [
        ((q[None], k, v, plan), "expects q"),
        ((q, k, v[:, :1], plan), "rows/heads differ"),
        ((q[:-1], k, v, plan), "T=4"),
        ((q[..., :4], k, v, plan), "head dims"),
        ((torch.randn(t, 3, 8), k, v, plan), "Hq % Hkv"),
        ((q.double(), k, v, plan), "dtype"),
        ((q.long(), k.long(), v.long(), plan), "floating"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            tree_attention(*args)
    with pytest.raises(ValueError, match="unknown tree attention backend"):
        tree_attention(q, k, v, plan, backend="magic")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan, backend="varlen")
    with pytest.raises(TypeError, match="TreePlan"):
        tree_attention(q, k, v, "plan")


def test_tree_attention_inside_a_compiled_function():
    """tree_attention called from torch.compile'd code runs between the graphs (its layouts are
    numpy, built on the host): results and gradients equal eager, and new plans (other
    sequence counts and lengths) reuse the graphs."""
    from torch._dynamo.utils import counters, is_frozen_dataclass

    torch._dynamo.reset()

    def block(q, k, v, plan):
        return tree_attention(torch.tanh(q), k * 2, v, plan, backend="chunked").square().sum()

    compiled = torch.compile(block, backend="eager", dynamic=True)
    graphs, counts = [], set()
    for name in ("tree", "grpo", "deep-chain"):
        plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
        counts.add(plan.num_sequences)
        q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
        got = torch.autograd.grad(compiled(q, k, v, plan), (q, k, v))
        want = torch.autograd.grad(block(q, k, v, plan), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(counts) == 3  # every plan has its own number of sequences
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs
    # Dynamo wraps a frozen dataclass field by field and guards on the fields (torch 2.11:
    # len(seq_lens)); the plan must reach it as a plain object, on every torch version.
    assert not is_frozen_dataclass(plan)


def test_gathered_kv_is_not_saved_for_backward():
    """Activation memory must scale with T: the custom function saves q/k/v/out, not the
    gathered per-node contexts."""
    seqs = [[1] * 64 + [i] * 8 for i in range(2, 10)]  # 8 leaves under a 64-token prompt
    plan = plan_prefix_tree(seqs)
    q, k, v = random_qkv(plan, 2, 2, 8, torch.float32)
    saved = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        tree_attention(q, k, v, plan, backend="chunked")
    contexts = plan.kv_index.numel()
    assert contexts > 4 * plan.num_tokens
    assert max(saved) <= plan.num_tokens * 2 * 8 < contexts * 2 * 8


# ----------------------------------------------------------------------------- variants

# window / sinks / softcap combinations every CPU backend runs
VARIANTS = [
    dict(window=1), dict(window=3), dict(window=9), dict(sinks=True), dict(softcap=1.5),
    dict(window=4, sinks=True), dict(window=2, softcap=2.0), dict(window=5, sinks=True, softcap=3.0),
]


@settings(max_examples=30, deadline=None)
@given(
    seqs=forests(max_len=40),
    backend=st.sampled_from(CPU_BACKENDS),
    variant=st.sampled_from(VARIANTS),
    gqa=st.sampled_from([(2, 2), (6, 2), (3, 1)]),
    min_prefix_len=st.sampled_from([1, 3]),
)
def test_variants_on_random_forests(seqs, backend, variant, gqa, min_prefix_len):
    """Contexts of up to 40 positions: windows far shorter than them, crossing branch points,
    shorter than single nodes; per-head sinks of both signs; gradients into the sinks."""
    plan = plan_prefix_tree(seqs, min_prefix_len=min_prefix_len)
    assert_matches(plan, backend, *gqa, 8, **variant)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", list(nasty_forests()))
def test_variants_on_nasty_shapes(name, backend):
    plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
    assert_matches(plan, backend, 4, 1, 16, window=3, sinks=True, softcap=2.0)


@pytest.mark.parametrize("cascade", [True, False])
@pytest.mark.parametrize("variant", [dict(sinks=True), dict(softcap=1.5, sinks=True), dict(window=6, sinks=True)])
def test_variants_in_both_layouts(monkeypatch, cascade, variant):
    """Sinks added once after the cascade's merges (level calls in place and chunked with
    gathered keys); a window runs the cascade only on chain forests, gather-KV elsewhere."""
    monkeypatch.setattr("ps_mcore.attention.layout.cascade_pays", lambda plan, layout: cascade)
    monkeypatch.setattr("ps_mcore.attention.layout.MIN_CHUNK_ROWS", 4)
    rng = np.random.default_rng(5)
    step_wise = [list(range(9 * (j + 1))) for j in range(5)]
    for seqs in [step_wise] + [random_forest(rng, 10, 50) for _ in range(3)]:
        assert_matches(plan_prefix_tree(seqs, min_prefix_len=1), "chunked", 6, 2, 8, **variant)


def test_windowed_contexts_hold_only_rows_inside_the_window():
    """Gather-KV with a window copies, per node, only the last W-1 rows before it on its path
    and its own rows: ancestors entirely outside every row's window are skipped."""
    from ps_mcore.attention.gather_kv import gather_context

    rng = np.random.default_rng(2)
    plan = plan_prefix_tree(random_forest(rng, 12, 60), min_prefix_len=1)
    assert not plan.is_trivial
    for window in (1, 4, 16):
        ctx = gather_context(plan, window, torch.device("cpu"))
        cu_q, cu_k = plan.cu_seqlens_q.numpy(), plan.cu_seqlens_kv.numpy()
        q_len, k_len = np.diff(cu_q), np.diff(cu_k)
        want = q_len + np.minimum(k_len - q_len, window - 1)
        assert np.array_equal(np.diff(ctx.cu_k.numpy()), want)
        depth = plan.position_ids.numpy()
        for node in range(plan.num_nodes):
            rows = ctx.kv_index[ctx.cu_k[node]:ctx.cu_k[node + 1]].numpy()
            first = depth[cu_q[node]]
            assert np.array_equal(depth[rows], np.arange(first - (want[node] - q_len[node]), first + q_len[node]))
    pairs = plan.stats(window=4)["attn_pairs_tree_window"]
    assert pairs < plan.stats()["attn_pairs_tree"]


def test_a_window_as_long_as_every_context_is_plain_attention():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
    plain = tree_attention(q, k, v, plan, backend="chunked")
    wide = tree_attention(q, k, v, plan, backend="chunked", window=plan.max_seqlen_kv)
    assert torch.equal(plain, wide)


def test_off_by_one_sinks_as_a_number():
    """``sinks=0.0`` is Megatron's off-by-one softmax (a zero logit in every denominator)."""
    from attention_oracle import unshared_attention

    plan = plan_prefix_tree(nasty_forests()["grpo"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
    out = plan.unpack(tree_attention(q, k, v, plan, backend="chunked", sinks=0.0))
    ref = unshared_attention(q, k, v, plan, sinks=torch.zeros(4))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_flex_variants_forward_on_cpu():
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    for variant in (dict(window=3), dict(softcap=2.0), dict(sinks=True, window=5)):
        with torch.no_grad():
            out, ref, _, _ = compare_with_unshared(plan, "flex", 4, 2, 16, torch.float32, grads=False, **variant)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_bad_variant_arguments():
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
    for kwargs, match in [
        (dict(window=0), "window must be a positive int"),
        (dict(window=True), "window must be a positive int"),
        (dict(window=2.5), "window must be a positive int"),
        (dict(sinks=torch.zeros(3)), r"shape \[Hq\] = \[4\]"),
        (dict(sinks=torch.zeros(4, dtype=torch.long)), "float tensor"),
        (dict(softcap=-1.0), "softcap must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=match):
            tree_attention(q, k, v, plan, backend="chunked", **kwargs)
    assert torch.equal(tree_attention(q, k, v, plan, backend="chunked", softcap=0),
                       tree_attention(q, k, v, plan, backend="chunked"))  # 0 = off, as HF passes it


def test_backends_refuse_variants_by_name():
    """A backend whose kernel lacks a variant refuses it naming the backends that have it."""
    from ps_mcore.attention import ATTENTION_BACKENDS, AttentionBackend, register_backend
    from ps_mcore.attention.gather_kv import MATH_KERNEL, VarlenKernel
    from ps_mcore.attention.variants import attention_variant

    plan = plan_prefix_tree(nasty_forests()["grpo"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 8, torch.float32)
    lacking = VarlenKernel("no-softcap", MATH_KERNEL.forward, MATH_KERNEL.backward, frozenset({"window"}),
                           missing=(("softcap", "this kernel has none"),))
    register_backend(AttentionBackend("test-no-softcap", gather_kv_kernel=lambda device: lacking))
    try:
        tree_attention(q, k, v, plan, backend="test-no-softcap", window=2)  # what it has runs
        with pytest.raises(ValueError, match=r"'test-no-softcap' does not implement logit softcapping "
                                             r"\(softcap=\): this kernel has none\. Backends that do on cpu: "
                                             r"reference, chunked, flex"):
            tree_attention(q, k, v, plan, backend="test-no-softcap", softcap=2.0)
    finally:
        del ATTENTION_BACKENDS["test-no-softcap"]
    npu = ATTENTION_BACKENDS["npu"].variant_refusal(q, attention_variant(q, window=4, sinks=torch.zeros(4)))
    assert "sliding-window attention (window=): npu_fusion_attention's band mode" in npu
    assert "attention sinks (sinks=)" in npu and "Backends that do on cpu: reference, chunked, flex" in npu
    assert ATTENTION_BACKENDS["npu"].variant_refusal(q, attention_variant(q)) is None


def test_autocast_casts_qkv_as_sdpa_does():
    """Under autocast RoPE hands over fp32 q/k and a bf16 v; the tree casts all three to the
    autocast dtype (as SDPA's autocast policy does) and computes exactly what it computes on
    the cast inputs outside autocast."""
    plan = plan_prefix_tree(nasty_forests()["tree"], min_prefix_len=1)
    q, k, v = random_qkv(plan, 4, 2, 16, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            got = tree_attention(q, k, v.to(dtype), plan, backend="chunked", window=3, sinks=0.5)
        want = tree_attention(q.to(dtype), k.to(dtype), v.to(dtype), plan, backend="chunked", window=3, sinks=0.5)
        assert got.dtype == dtype and torch.equal(got, want)
        got.float().sum().backward()
        assert q.grad.dtype == torch.float32  # gradients flow back through the cast
        q.grad = None
