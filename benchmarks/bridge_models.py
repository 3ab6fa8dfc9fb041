"""The stock and tree models of ``benchmarks/model.py --builder bridge``: built by
Megatron-Bridge from a Hugging Face checkpoint, as verl 0.9.1's Megatron engine builds them.

A Qwen2 config with the benchmark's shapes (random weights, bf16) is written to a temporary
folder; ``AutoBridge.from_hf_pretrained`` makes the provider (its own TE spec and defaults, only
``gradient_accumulation_fusion`` off: it needs the DDP wrapper's main grads); the stock model is
the provider's, the tree model the provider with ``tree_provider_spec``; Bridge loads the
checkpoint into both, and every parameter is checked to be written (NaN before the load).
"""

from __future__ import annotations

import tempfile

import torch

from ps_mcore.flops import DecoderShape


def _write_checkpoint(shape: DecoderShape, layers: int, path: str) -> None:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=1 << 15, rope_theta=1_000_000.0, tie_word_embeddings=False,
    )
    assert config.hidden_size // config.num_attention_heads == shape.head_dim
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def _load_all(bridge, model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    bridge.load_hf_weights([model])
    missing = [n for n, p in model.named_parameters() if torch.isnan(p).any()]
    if missing:
        raise RuntimeError(f"Megatron-Bridge did not load {missing}")


def bridge_model_pair(shape: DecoderShape, layers: int, backend: str, rope_fusion: bool = False):
    """``(stock model, tree model, "megatron-bridge X, megatron-core Y")`` on the GPU, train mode.
    ``rope_fusion``: both with ``apply_rope_fusion=True`` (the Qwen2 provider's default is off:
    Megatron's unfused THD RoPE, which verl 0.9.1 keeps; mbridge's config sets it on)."""
    import importlib.metadata as md

    from megatron.bridge import AutoBridge

    from ps_mcore.layer_specs import provider_spec_field, tree_provider_spec

    with tempfile.TemporaryDirectory() as path:
        _write_checkpoint(shape, layers, path)
        bridge = AutoBridge.from_hf_pretrained(path)
        provider = bridge.to_megatron_provider(load_weights=False)
        provider.gradient_accumulation_fusion = False
        provider.apply_rope_fusion = rope_fusion or provider.apply_rope_fusion
        provider.tree_attention_backend = backend  # read by TreeCoreAttention (the stock model ignores it)
        provider.finalize()

        def build():
            model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=True, mixed_precision_wrapper=None)[0]
            _load_all(bridge, model)
            return model.train()

        stock = build()
        setattr(provider, provider_spec_field(provider), tree_provider_spec(provider))
        tree = build()
    versions = f"megatron-bridge {md.version('megatron-bridge')}, megatron-core {md.version('megatron-core')}"
    return stock, tree, versions
