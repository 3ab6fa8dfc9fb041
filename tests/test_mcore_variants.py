"""megatron-core's attention variants on trees (CPU, real megatron-core, gloo world 1): sliding
windows (``window_size`` + ``window_attn_skip_freq``) and attention sinks (``softmax_type``
``learnable`` / ``off-by-one``) through ``TreeCoreAttention``.

Models: a GPT-OSS-like one (Megatron-Bridge's GPT-OSS settings at tiny scale: windowed and
full layers alternating, learnable sinks, MoE with router bias, GQA) and a Gemma-3-like one
(5 local : 1 global), built from megatron-core's own ``get_gpt_decoder_block_spec(config,
use_transformer_engine=False)`` and converted with ``to_tree_spec``. Oracle: the stock model
(megatron's ``DotProductAttention`` with its own window mask and ``SoftmaxOne``) with the same
weights, run one sequence at a time. Forests: contexts several windows long, windows crossing
branch points, a window of 1, sinks of both signs, the nasty shapes; outputs, log-probs and
every parameter gradient (sink logits included) of a per-sample-weighted loss, fp32 and fp64.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import grads_of  # noqa: E402
from forests import nasty_forests, window_forest  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, allow_local_expert_bias_backward, build_gpt, causal_mask, enable_cpu_moe,
    enable_cpu_sliding_window, init_cpu_megatron, randomize_, reference_logprobs, stock_forward,
    te_like_core_attention, tiny_config, with_core_attention,
)

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

init_cpu_megatron(1)
enable_cpu_moe()
enable_cpu_sliding_window()
allow_local_expert_bias_backward()

from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

from ps_mcore.layer_specs import TreeCoreAttention, TreePackedSeqParams, to_tree_spec  # noqa: E402
from ps_mcore.layer_specs.modules.core_attention import (  # noqa: E402
    TreeCoreAttentionTEState, layer_window, megatron_attention_refusal,
)

FP32 = dict(rtol=1e-5, atol=1e-5)
FP64 = dict(rtol=1e-10, atol=1e-10)


def _window(cfg) -> int:
    return cfg.window_size[0] + 1


def _block_spec(cfg, te_like: bool = False):
    spec = stock_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    if not te_like:
        return spec
    core = te_like_core_attention()  # TE's checkpoint behaviour on megatron's local attention
    return dataclasses.replace(spec, layer_specs=[with_core_attention(layer, core) for layer in spec.layer_specs])


def _pair(kind: str, dtype=torch.float32, te_like: bool = False, seed: int = 3, **overrides):
    """(stock model, tree model) of a tiny config with identical weights; sink logits spread
    over both signs (some dominating their rows)."""
    if dtype == torch.float64:
        overrides.update(params_dtype=torch.float64, attention_softmax_in_fp32=False)
    cfg = tiny_config(kind, **overrides)
    spec = _block_spec(cfg, te_like)
    stock = build_gpt(cfg, spec).to(dtype)
    randomize_(stock, seed=seed)
    with torch.no_grad():
        for layer in stock.decoder.layers:
            offset = getattr(layer.self_attention.core_attention, "softmax_offset", None)
            if isinstance(offset, torch.nn.Parameter):
                offset.copy_(torch.linspace(-3.0, 3.0, offset.numel()))
    tree = build_gpt(cfg, to_tree_spec(spec)).to(dtype)
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock, tree


def _weights(seqs, dtype):
    w = np.random.default_rng(len(seqs)).uniform(0.2, 2.0, len(seqs))
    return torch.from_numpy(np.repeat(w, [len(s) for s in seqs])).to(dtype)


def stock_reference(stock, seqs):
    """Per-sequence stock logits, log-probs and the gradients of the weighted loss."""
    w = _weights(seqs, next(stock.parameters()).dtype)
    logits = [stock_forward(stock, s) for s in seqs]
    lp = reference_logprobs(logits, seqs)
    probe = torch.randn(len(w), VOCAB, generator=torch.Generator().manual_seed(1)).to(w.dtype)
    ((w * lp).sum() + 1e-2 * (torch.cat(logits) * probe).sum()).backward()
    return torch.cat(logits).detach(), lp.detach(), grads_of(stock), probe


def tree_run(tree, seqs, probe, pad_to: int = 1):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to)
    logits = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                  attention_mask=None, packed_seq_params=psp)[0][: plan.num_tokens]
    lp, _ = token_logprobs(logits, plan)
    w = _weights(seqs, lp.dtype)
    ((w * lp).sum() + 1e-2 * (plan.unpack(logits) * probe).sum()).backward()
    return plan.unpack(logits).detach(), lp.detach(), grads_of(tree), plan


def assert_matches_stock(stock, tree, seqs, tol=FP32, pad_to: int = 1):
    ref_logits, ref_lp, ref_grads, probe = stock_reference(stock, seqs)
    logits, lp, grads, plan = tree_run(tree, seqs, probe, pad_to)
    torch.testing.assert_close(logits, ref_logits, **tol)
    torch.testing.assert_close(lp, ref_lp, **tol)
    assert grads.keys() == ref_grads.keys()
    for name, r in ref_grads.items():
        scale = float(r.abs().max())
        if scale == 0:  # an expert no token was routed to
            assert float(grads[name].abs().max()) == 0, name
            continue
        torch.testing.assert_close(grads[name], r, rtol=10 * tol["rtol"], atol=tol["atol"] * scale, msg=name)
    sinks = [n for n in ref_grads if n.endswith("softmax_offset")]
    assert all(float(ref_grads[n].abs().min()) > 0 for n in sinks)  # every sink logit is trained
    return plan


# ----------------------------------------------------------------------------- layer windows


@pytest.mark.parametrize("window_size, skip, layers", [
    ((4, 0), 2, 4), ((3, 0), 6, 6), ((2, 0), [1, 0, 0, 1, 1], 5), ((0, 0), None, 2), ((-1, 0), 3, 3),
])
def test_layer_windows_are_megatrons(window_size, skip, layers):
    """Each tree layer's window W is the one megatron's own DotProductAttention of that layer
    applies (its softmax module's ``window_size``), W = left + 1."""
    cfg = tiny_config("qwen2", num_layers=layers, window_size=window_size, window_attn_skip_freq=skip)
    stock, tree = _pair("qwen2", num_layers=layers, window_size=window_size, window_attn_skip_freq=skip)
    for s, t in zip(stock.decoder.layers, tree.decoder.layers):
        stock_window = s.self_attention.core_attention.scale_mask_softmax.window_size
        expected = None if stock_window is None or stock_window[0] < 0 else stock_window[0] + 1
        assert t.self_attention.core_attention.window == expected
        assert layer_window(cfg, t.layer_number) == expected
    windows = [t.self_attention.core_attention.window for t in tree.decoder.layers]
    if skip == 6:  # Gemma 3: five local layers, then one global
        assert windows == [4] * 5 + [None]
    if skip == 2:  # GPT-OSS: windowed and full layers alternate, the first windowed
        assert windows == [5, None, 5, None]


# ----------------------------------------------------------------------------- GPT-OSS-like


def _gpt_oss_forests() -> dict:
    window = _window(tiny_config("gpt-oss"))
    nasty = nasty_forests(2)
    return {**{f"window-{i}": window_forest(i, window, vocab=VOCAB) for i in range(3)},
            **{name: nasty[name] for name in ("grpo", "deep-chain", "prefix-of-another", "single-tokens")}}


@pytest.fixture(scope="module")
def gpt_oss():
    return _pair("gpt-oss")


@pytest.mark.parametrize("forest", sorted(_gpt_oss_forests()))
def test_gpt_oss_like_tree_equals_stock_per_sequence(gpt_oss, forest):
    stock, tree = gpt_oss
    seqs = _gpt_oss_forests()[forest]
    plan = assert_matches_stock(stock, tree, seqs, pad_to=4 if forest == "window-1" else 1)
    if forest.startswith("window-"):
        assert plan.max_seqlen_kv >= 3 * _window(stock.config)  # several windows of context
        assert plan.num_tokens < plan.num_input_tokens


def test_gpt_oss_like_model_is_what_megatron_builds(gpt_oss):
    stock, tree = gpt_oss
    layers = tree.decoder.layers
    assert all(type(l.self_attention.core_attention) is TreeCoreAttention for l in layers)
    assert [l.self_attention.core_attention.window for l in layers] == [5, None, 5, None]
    assert type(layers[0].mlp).__name__ == "MoELayer" and layers[0].mlp.router.bias is not None
    sinks = layers[0].self_attention.core_attention.softmax_offset
    assert isinstance(sinks, torch.nn.Parameter) and sinks.shape == (4,)
    assert list(tree.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("window", [1, 2])
def test_window_of_one_and_two_with_sinks(window):
    """``window_size=(0, 0)``: each token sees itself only, against its sink."""
    stock, tree = _pair("gpt-oss", window_size=(window - 1, 0), seed=5)
    assert_matches_stock(stock, tree, window_forest(10 + window, 3, vocab=VOCAB))


def test_gpt_oss_like_float64():
    """Dense (megatron's MoE routing softmax runs in float32 whatever the model's dtype):
    windows, sinks, GQA, biases and the clamped GLU agree to float64 precision."""
    stock, tree = _pair("gpt-oss", torch.float64, seed=6, num_moe_experts=None, moe_ffn_hidden_size=None)
    assert_matches_stock(stock, tree, window_forest(4, _window(stock.config), vocab=VOCAB), tol=FP64)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "vanilla"])
def test_off_by_one_and_vanilla_softmax(softmax_type):
    stock, tree = _pair("gpt-oss", softmax_type=softmax_type, seed=7)
    offset = tree.decoder.layers[0].self_attention.core_attention.softmax_offset
    assert (offset is None) == (softmax_type == "vanilla")
    assert not any("softmax_offset" in n for n, _ in tree.named_parameters())
    assert_matches_stock(stock, tree, window_forest(5, 5, vocab=VOCAB))


def test_reference_backend():
    stock, tree = _pair("gpt-oss", seed=8)
    for layer in tree.decoder.layers:
        layer.self_attention.core_attention.backend = "reference"
    assert_matches_stock(stock, tree, window_forest(6, 5, vocab=VOCAB))


# ----------------------------------------------------------------------------- Gemma-3-like


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemma3_like_5_local_1_global(dtype):
    stock, tree = _pair("gemma3", dtype, seed=9)
    assert [l.self_attention.core_attention.window for l in tree.decoder.layers] == [4] * 5 + [None]
    for seed in (0, 1):
        assert_matches_stock(stock, tree, window_forest(seed, 4, vocab=VOCAB),
                             tol=FP64 if dtype == torch.float64 else FP32)


def test_list_pattern_with_sinks_of_a_dense_model():
    stock, tree = _pair("qwen3", num_layers=3, window_size=(2, 0), window_attn_skip_freq=[0, 1, 1],
                        softmax_type="learnable", seed=10)
    assert [l.self_attention.core_attention.window for l in tree.decoder.layers] == [None, 3, 3]
    assert_matches_stock(stock, tree, window_forest(2, 3, vocab=VOCAB))


# ----------------------------------------------------------------------------- other batches


def test_ordinary_thd_and_sbhd_batches_on_the_tree_model(gpt_oss):
    """The tree model also runs megatron's standard THD packing and plain sbhd batches (verl's
    fallback paths) with the layer's window and sinks, equal to stock per sequence."""
    stock, tree = gpt_oss
    seqs = window_forest(8, 5, vocab=VOCAB)[:4]
    with torch.no_grad():
        ref = [stock_forward(stock, s) for s in seqs]
        lens = [len(s) for s in seqs]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        ids = torch.as_tensor(np.concatenate(seqs))[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        thd = tree(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp)[0]
        torch.testing.assert_close(thd, torch.cat(ref), **FP32)
        n = min(lens)  # sbhd: a batch of equal-length sequences
        batch = torch.stack([torch.as_tensor(s[:n]) for s in seqs])
        sbhd = tree(input_ids=batch, position_ids=torch.arange(n)[None].expand(len(seqs), n),
                    attention_mask=causal_mask(n))
        torch.testing.assert_close(sbhd, torch.stack([r[:n] for r in ref]), **FP32)


# ----------------------------------------------------------------------------- TE flavour


def test_te_flavoured_spec_keys_sinks_and_exactness():
    """Where ``to_tree_spec`` replaces a TE core attention it builds ``TreeCoreAttentionTEState``:
    TE's checkpoint keys (``softmax_offset`` and ``_extra_state``), strict loads both ways, the
    sink logits as TE creates them (float32 zeros), sharded like TE's."""
    stock, tree = _pair("gpt-oss", te_like=True, seed=11)
    core = tree.decoder.layers[0].self_attention.core_attention
    assert type(core) is TreeCoreAttentionTEState
    fresh = build_gpt(tree.config, to_tree_spec(_block_spec(tree.config, te_like=True)))
    offset = fresh.decoder.layers[0].self_attention.core_attention.softmax_offset
    assert offset.dtype == torch.float32 and not offset.any()
    assert list(tree.state_dict()) == list(stock.state_dict())
    assert any(k.endswith("core_attention._extra_state") for k in tree.state_dict())
    stock.load_state_dict(tree.state_dict(), strict=True)
    _assert_same_sharding(stock, tree)
    assert_matches_stock(stock, tree, window_forest(9, 5, vocab=VOCAB))


def _assert_same_sharding(stock, tree):
    ref, got = stock.sharded_state_dict(), tree.sharded_state_dict()
    assert ref.keys() == got.keys()
    for key in (k for k in ref if "softmax_offset" in k):
        a, b = ref[key], got[key]
        assert (a.key, a.global_shape, a.global_offset, a.axis_fragmentations, a.replica_id) == (
            b.key, b.global_shape, b.global_offset, b.axis_fragmentations, b.replica_id), key


def test_local_spec_sharded_state_dict_is_megatrons(gpt_oss):
    stock, tree = gpt_oss
    _assert_same_sharding(stock, tree)
    assert any("softmax_offset" in k for k in tree.sharded_state_dict())


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides, words", [
    (dict(window_size=(4, 2)), "right window"),
    (dict(window_size=(-1, -1)), "right window"),
    (dict(window_size=(-3, 0)), "left window"),
    (dict(window_size=4), "(left, right) pair"),
    (dict(fp8_dot_product_attention=True), "fp8_dot_product_attention"),
])
def test_what_has_no_tree_form_is_refused_by_name(overrides, words):
    cfg = tiny_config("qwen2")
    for key, value in overrides.items():  # some of these the config's own checks would reject
        object.__setattr__(cfg, key, value)
    assert words in megatron_attention_refusal(cfg)
    with pytest.raises(NotImplementedError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TreeCoreAttention(cfg, 1)


def test_unknown_softmax_type_and_supported_ones():
    cfg = tiny_config("qwen2")
    object.__setattr__(cfg, "softmax_type", "sigmoid")
    assert "softmax_type='sigmoid'" in megatron_attention_refusal(cfg)
    for kind in ("gpt-oss", "gemma3"):
        assert megatron_attention_refusal(tiny_config(kind)) is None


def test_mbridge_gemma3_masked_windows_are_refused():
    """mbridge's Gemma 3 applies its windows through attention masks and a second RoPE table
    in its own layers: converting its spec would silently drop them, so it is refused."""
    gemma3 = pytest.importorskip("mbridge.models.gemma3.transformer_config")
    cfg = dataclasses.asdict(tiny_config("qwen2"))
    cfg = gemma3.Gemma3TransformerConfig(**{k: v for k, v in cfg.items() if k in {
        f.name for f in dataclasses.fields(gemma3.Gemma3TransformerConfig) if f.init}})
    assert "sliding_window_pattern" in megatron_attention_refusal(cfg)
    with pytest.raises(NotImplementedError, match="mbridge's Gemma 3"):
        TreeCoreAttention(cfg, 1)
