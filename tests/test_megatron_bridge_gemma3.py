"""Megatron-Bridge 0.6.2's Gemma 3 on prefix trees (megatron-core 0.19, CPU, gloo world 1, fp32).

Bridge builds Gemma 3 from its own layer spec: ``Gemma3SelfAttention`` picks, per layer, the
local (sliding window, RoPE base ``rope_local_base_freq``) or global (full, ``rope_theta``) table
of the stacked RoPE ``Gemma3RotaryEmbedding`` computes, and ``Gemma3TEDotProductAttention``
rewrites the layer's config to its window (5 local : 1 global). ``to_tree_spec`` converts both
(``conversion.bridge.BRIDGE_SELF_ATTENTIONS``). The test writes a tiny Gemma 3 HF checkpoint
(6 layers: 5 local with a window of 4, then 1 global; two RoPE bases; ``query_pre_attn_scalar``
not the head dim; qk-norms, pre and post norms, scaled embeddings), Bridge loads it strictly into
the stock model and the tree model. Checked: the stock model equals ``Gemma3ForCausalLM``
(eager: its own windows and RoPE tables) per sequence; the tree model on branching forests whose
contexts are several windows long, and the nasty shapes, equals the stock model on the unshared
batch (logits, and every gradient of a per-sample-weighted log-prob loss).

Test-only shims (TE needs a GPU; tests/te_cpu_shims.py): Bridge's Gemma 3 spec with its TE
modules as CPU modules with TE's parameter names (``gemma3_cpu_layer_spec``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bridge_helpers import require_bridge

require_bridge()

from bridge_helpers import GEMMA3_WINDOW as WINDOW, bridge_and_provider, build, cpu_bridge, load_strictly, write_hf_checkpoint  # noqa: E402,F401,E501
from forests import small_nasty_forests, window_forest  # noqa: E402
from test_megatron_bridge import _stock_logits, _stock_loss, _tree_loss, _weights  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreeSelfAttention, provider_attention_refusal, to_tree_spec, tree_provider_spec)
from ps_mcore.layer_specs.modules.core_attention import megatron_attention_refusal  # noqa: E402

FORESTS = {**small_nasty_forests(), **{f"windows-{s}": window_forest(s, WINDOW) for s in (1, 2)}}


@pytest.fixture(scope="module")
def provider_and_models(tmp_path_factory):
    """(provider, HF model, stock model, tree model), both Megatron models loaded from one
    checkpoint."""
    from te_cpu_shims import use_cpu_gemma3_spec

    path = tmp_path_factory.mktemp("gemma3")
    with pytest.MonkeyPatch.context() as patch:
        use_cpu_gemma3_spec(patch)
        hf, tensors = write_hf_checkpoint("gemma3", path, seed=11)
        assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        bridge, provider = bridge_and_provider(path)
        assert provider.window_size == WINDOW and tuple(provider.rotary_base) == (10_000.0, 1_000_000.0)
        stock = build(provider)
        load_strictly(bridge, stock, tensors)
        provider.transformer_layer_spec = tree_provider_spec(provider)
        tree = build(provider)
        load_strictly(bridge, tree, tensors)
    return provider, hf, stock[0], tree[0]


@pytest.fixture(scope="module")
def models(provider_and_models):
    return provider_and_models[1:]


def test_the_provider_runs_on_trees_layer_by_layer(provider_and_models):
    """Gemma 3's provider keeps one int window for its local layers: megatron's own reading
    (window_size pairs) refuses it, the per-layer configs its layers run with do not; the
    vision-language variant (windows in attention biases) is refused, naming why."""
    import copy

    provider = provider_and_models[0]
    assert "window_size=4" in megatron_attention_refusal(provider)
    assert provider_attention_refusal(provider) is None
    vision = copy.copy(provider)
    vision.is_vision_language = True
    assert "attention biases" in provider_attention_refusal(vision)


def test_other_self_attention_subclasses_stay_refused():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    class Custom(SelfAttention):
        pass

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.module = Custom
    with pytest.raises(NotImplementedError, match="Custom"):
        to_tree_spec(spec)


def test_tree_layers_take_the_stock_windows_and_keys(models):
    _, stock, tree = models
    assert list(tree.state_dict()) == list(stock.state_dict())
    stock_layers, tree_layers = stock.decoder.layers, tree.decoder.layers
    for s, t in zip(stock_layers, tree_layers):
        assert isinstance(t.self_attention, TreeSelfAttention)
        assert isinstance(t.self_attention, type(s.self_attention))  # Gemma3SelfAttention's RoPE choice
        assert isinstance(t.self_attention.core_attention, TreeCoreAttention)
        left = s.self_attention.core_attention.window_size
        assert t.self_attention.core_attention.window == (None if left is None else left[0] + 1)
    assert [t.self_attention.core_attention.window for t in tree_layers] == [WINDOW] * 5 + [None]


def test_stock_provider_model_equals_hugging_face(models):
    """The loaded checkpoint means the same model on both sides (an independent reference):
    sequences several windows long, so the local layers' windows and RoPE base matter."""
    hf, stock, _ = models
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for length in (1, 5, 17):
            seq = rng.integers(0, 128, length)
            ref = hf(input_ids=torch.as_tensor(seq)[None], use_cache=False).logits[0]
            torch.testing.assert_close(_stock_logits(stock, seq), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("forest", list(FORESTS))
def test_tree_run_equals_stock_provider_model(models, forest):
    _, stock, tree = models
    seqs = [list(s) for s in FORESTS[forest]]
    weights = _weights(seqs)
    for m in (stock, tree):
        m.zero_grad(set_to_none=True)
    plan, logits, tree_total = _tree_loss(tree, seqs, weights)
    ref, stock_total = _stock_loss(stock, seqs, weights)
    torch.testing.assert_close(plan.unpack(logits), ref, rtol=1e-5, atol=2e-5)
    if all(len(s) == 1 for s in seqs):
        return  # nothing to predict
    tree_total.backward()
    stock_total.backward()
    stock_grads = dict(stock.named_parameters())
    for pname, p in tree.named_parameters():
        g_ref = stock_grads[pname].grad
        assert g_ref is not None and p.grad is not None, pname
        scale = float(g_ref.abs().max()) or 1.0
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-4, atol=2e-5 * scale, msg=lambda m: f"{pname}: {m}")
