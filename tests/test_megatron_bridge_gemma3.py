"""Megatron-Bridge 0.6.2's Gemma 3 on prefix trees (megatron-core 0.19, CPU, gloo world 1, fp32).

Bridge builds Gemma 3 from its own layer spec: ``Gemma3SelfAttention`` picks, per layer, the
local (sliding window, RoPE base ``rope_local_base_freq``) or global (full, ``rope_theta``) table
of the stacked RoPE ``Gemma3RotaryEmbedding`` computes, and ``Gemma3TEDotProductAttention``
rewrites the layer's config to its window (5 local : 1 global). ``to_tree_spec`` converts both
(``conversion.bridge_attention.BRIDGE_SELF_ATTENTIONS``). The test writes a tiny Gemma 3 HF checkpoint
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

import pickle

import numpy as np
import pytest
import torch
from bridge_helpers import require_bridge

require_bridge()

from bridge_helpers import GEMMA3_WINDOW as WINDOW, bridge_and_provider, build, cpu_bridge, load_strictly, write_hf_checkpoint  # noqa: E402,F401,E501
from forests import small_nasty_forests, window_forest  # noqa: E402
from test_megatron_bridge import _weights, assert_stock_equals_hugging_face, assert_tree_equals_stock  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreeSelfAttention, provider_attention_refusal, to_tree_spec, tree_provider_spec)
from ps_mcore.layer_specs.modules.core_attention import megatron_attention_refusal  # noqa: E402

FORESTS = {**small_nasty_forests(), **{f"windows-{s}": window_forest(s, WINDOW) for s in (1, 2)}}


@pytest.fixture(scope="module")
def provider_and_models(tmp_path_factory):
    """(provider, HF model, stock model, tree model, (stock, tree) in fp64), every Megatron model
    loaded from one checkpoint."""
    from te_cpu_shims import use_cpu_gemma3_spec

    path = tmp_path_factory.mktemp("gemma3")
    with pytest.MonkeyPatch.context() as patch:
        use_cpu_gemma3_spec(patch)
        hf, _ = write_hf_checkpoint("gemma3", path, seed=11)
        assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        provider, stock, tree = _stock_and_tree(path)
        assert provider.window_size == WINDOW and tuple(provider.rotary_base) == (10_000.0, 1_000_000.0)
        fp64 = _stock_and_tree(path, params_dtype=torch.float64, pipeline_dtype=torch.float64)[1:]
    return provider, hf, stock, tree, fp64


def _stock_and_tree(path, **overrides):
    """(provider, stock model, tree model) made by Bridge from the checkpoint at ``path`` (the
    CPU Gemma 3 spec must be in place)."""
    bridge, provider = bridge_and_provider(path, **overrides)
    stock = build(provider)
    load_strictly(bridge, stock, _tensors(path))
    provider.transformer_layer_spec = tree_provider_spec(provider)
    tree = build(provider)
    load_strictly(bridge, tree, _tensors(path))
    return provider, stock[0], tree[0]


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def models(provider_and_models):
    return provider_and_models[1:4]


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
    tree_cls = type(tree_layers[0].self_attention)
    assert pickle.loads(pickle.dumps(tree_cls)) is tree_cls


def test_each_rope_table_is_indexed_once_per_micro_batch(models):
    """Gemma 3's layers pick views of the local and the global table: two tree tables."""
    from ps_mcore import plan_prefix_tree
    from ps_mcore.layer_specs import TreePackedSeqParams

    _, _, tree = models
    plan = plan_prefix_tree(FORESTS["windows-1"], min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    with torch.no_grad():
        tree(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None], attention_mask=None,
             packed_seq_params=psp)
    assert len(psp.rotary_tables) == 2
    local, full = (t for t, _ in psp.rotary_tables)
    assert not torch.equal(local, full)  # two RoPE bases


def test_stock_provider_model_equals_hugging_face(models):
    """The loaded checkpoint means the same model on both sides (an independent reference):
    sequences several windows long, so the local layers' windows and RoPE base matter."""
    hf, stock, _ = models
    # Bridge builds the post-attention / post-MLP norms with TENorm's default eps (1e-5), HF with
    # rms_norm_eps (1e-6): logits up to 2.5e-5 apart (measured; 9e-6 with HF's eps in the shim)
    assert_stock_equals_hugging_face(hf, stock, (1, 5, 17), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("forest", list(FORESTS))
def test_tree_run_equals_stock_provider_model(models, forest):
    _, stock, tree = models
    assert_tree_equals_stock(stock, tree, [list(s) for s in FORESTS[forest]])


def _loss64(logits, seqs, weights):
    """The per-sample-weighted log-prob loss from unshared logits ``[N, V]``, in fp64."""
    logp = torch.log_softmax(logits, -1)
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    return sum((logp[a: b - 1].gather(-1, torch.as_tensor(s[1:])[:, None])[:, 0] * w.double()).sum()
               for a, b, s, w in zip(offsets[:-1], offsets[1:], seqs, weights))


@pytest.mark.parametrize("forest", ["windows-1", "windows-2", "tree", "duplicates-and-prefix"])
def test_tree_run_equals_stock_in_fp64(provider_and_models, forest):
    """In fp64 (the stock CPU attention too) the tree model equals the stock one to rounding:
    logits and every gradient to ~1e-12, so the fp32 comparisons above differ by rounding only."""
    from test_megatron_bridge import _stock_thd_logits

    from ps_mcore import plan_prefix_tree
    from ps_mcore.layer_specs import TreePackedSeqParams

    stock, tree = provider_and_models[4]
    assert next(tree.parameters()).dtype == torch.float64
    seqs = [list(s) for s in FORESTS[forest]]
    weights = _weights(seqs)
    for m in (stock, tree):
        m.zero_grad(set_to_none=True)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    logits = plan.unpack(tree(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                              attention_mask=None, packed_seq_params=psp)[0][: plan.num_tokens])
    ref = _stock_thd_logits(stock, seqs)
    assert logits.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(logits, ref, rtol=1e-12, atol=1e-11)
    _loss64(logits, seqs, weights).backward()
    _loss64(ref, seqs, weights).backward()
    stock_grads = dict(stock.named_parameters())
    for pname, p in tree.named_parameters():
        g_ref = stock_grads[pname].grad
        scale = float(g_ref.abs().max())
        assert scale > 0, pname
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-10, atol=1e-11 * scale, msg=lambda m: f"{pname}: {m}")


@pytest.mark.parametrize("core", ["gemma.gemma2_provider.Gemma2FlexDotProductAttention",
                                  "gemma.gemma2_provider.Gemma2DotProductAttention"])
def test_bridge_core_attentions_of_their_own_are_refused(core):
    """Bridge's other core attentions (here Gemma 2's, with softcapping; its TE-derived ones,
    e.g. Ministral 3's, are placeholders without TE) under megatron's SelfAttention: refused,
    naming the class."""
    import importlib

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    module, name = core.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"megatron.bridge.models.{module}"), name)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = cls
    with pytest.raises(NotImplementedError, match=name):
        to_tree_spec(spec)
