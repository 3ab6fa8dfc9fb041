"""Real mbridge 0.15.1 code on CPU: its Qwen2 bridge builds the GPTModel through its own
``_model_provider`` / ``_get_transformer_layer_spec``; the verl glue converts that spec with
``to_tree_spec``. Only TE is shimmed: mbridge hard-codes ``use_transformer_engine=True``, so its
``get_gpt_decoder_block_spec`` call is redirected to the local layers (TE needs CUDA; the GPU
run with TE and HF weight loading: docs/verl.md, "Which Megatron-Bridge").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("einops")
mbridge = pytest.importorskip("mbridge")
transformers = pytest.importorskip("transformers")

from megatron_shims import (  # noqa: E402
    VOCAB, assert_tree_matches_stock, enable_cpu_sliding_window, init_cpu_megatron, randomize_,
)

init_cpu_megatron(1)
enable_cpu_sliding_window()

from mbridge.core import llm_bridge  # noqa: E402

from ps_mcore.layer_specs import TreeCoreAttention, megatron_dropout_refusal, to_tree_spec  # noqa: E402


# megatron's attention variants set on mbridge's config (mbridge 0.15.1 builds no GPT-OSS; its
# Gemma 3 keeps its windows in masks and is refused: tests/test_mcore_variants.py)
VARIANTS = dict(window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable")


@pytest.fixture
def bridge(monkeypatch):
    stock_block_spec = llm_bridge.get_gpt_decoder_block_spec

    def local_layers(config, use_transformer_engine, **kwargs):  # the TE shim, nothing else
        assert use_transformer_engine  # mbridge asks for TE
        return stock_block_spec(config, False, **kwargs)

    monkeypatch.setattr(llm_bridge, "get_gpt_decoder_block_spec", local_layers)
    hf = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, attention_dropout=0.0)
    hf.rope_theta = 1e6  # mbridge 0.15.1 reads it; transformers 5 keeps it in rope_parameters
    bridge = mbridge.AutoBridge.from_config(hf)
    bridge.config.use_cpu_initialization = True
    bridge.config.params_dtype = torch.float32
    bridge.config.bf16 = bridge.config.fp16 = False  # fp32 on the CPU (the oracle tolerance)
    for name in ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                 "gradient_accumulation_fusion", "apply_rope_fusion"):
        setattr(bridge.config, name, False)
    return bridge


@pytest.mark.parametrize("variants", [{}, VARIANTS])
def test_mbridge_qwen2_tree_model_matches_its_stock_model(bridge, variants):
    """mbridge's own Qwen2 build; with ``variants`` as verl's
    ``override_transformer_config`` would set them on mbridge's config: megatron's sliding
    window in every other layer and learnable sinks (the tree model's sink logits are the
    stock ``softmax_offset`` parameters, loaded strictly)."""
    for key, value in variants.items():
        setattr(bridge.config, key, value)
    stock = bridge._model_provider([])(True, True)
    randomize_(stock, seed=2)
    stock_spec = bridge._get_transformer_layer_spec
    bridge._get_transformer_layer_spec = lambda vp_stage=None: to_tree_spec(stock_spec(vp_stage))
    tree = bridge._model_provider([])(True, True)
    assert type(tree.decoder.layers[0].self_attention.core_attention) is TreeCoreAttention
    assert list(tree.state_dict()) == list(stock.state_dict())
    tree.load_state_dict(stock.state_dict(), strict=True)
    if variants:
        cores = [layer.self_attention.core_attention for layer in tree.decoder.layers]
        assert [c.window for c in cores] == [4, None]
        assert all(isinstance(c.softmax_offset, torch.nn.Parameter) for c in cores)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 12)
    seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (5, 2, 9)]
    assert_tree_matches_stock(stock, tree, seqs)


def test_verl_default_build_has_no_active_dropout(bridge):
    """verl's default Megatron build goes through mbridge, which maps the HF config's dropouts
    (Qwen2: attention_dropout 0.0, no hidden_dropout -> 0.0) over megatron-core's 0.1
    defaults: a training tree model has nothing the dropout check refuses."""
    assert bridge.config.hidden_dropout == 0.0 and bridge.config.attention_dropout == 0.0
    stock_spec = bridge._get_transformer_layer_spec
    bridge._get_transformer_layer_spec = lambda vp_stage=None: to_tree_spec(stock_spec(vp_stage))
    tree = bridge._model_provider([])(True, True).train()
    assert megatron_dropout_refusal(tree) is None
