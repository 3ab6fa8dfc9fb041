"""Megatron-core layer specs for prefix-tree batches.

Swap one spec and the same GPTModel trains on prefix forests::

    spec = get_gpt_layer_local_tree_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config, spec, ...)            # config.apply_rope_fusion = False
    psp = TreePackedSeqParams.from_plan(plan)
    logits = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)      # [1, T, V]
    logprobs, _ = token_logprobs(logits[0], plan)                   # [N]

The same model also runs ordinary THD batches (standard ``PackedSeqParams``) and plain
causal sbhd batches. Importing this package imports megatron-core (nothing else of ps_mcore
does).
"""

from ps_mcore.layer_specs.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.self_attention import TreeSelfAttention
from ps_mcore.layer_specs.specs import (
    get_gpt_decoder_block_tree_spec,
    get_gpt_layer_local_tree_spec,
    get_gpt_layer_with_tree_attention_spec,
    to_tree_spec,
    tree_layer_spec,
    tree_layer_spec_from,
)
from ps_mcore.logprobs import token_logprobs

__all__ = [
    "TreeCoreAttention",
    "TreePackedSeqParams",
    "TreeSelfAttention",
    "get_gpt_decoder_block_tree_spec",
    "get_gpt_layer_local_tree_spec",
    "get_gpt_layer_with_tree_attention_spec",
    "to_tree_spec",
    "token_logprobs",
    "tree_layer_spec",
    "tree_layer_spec_from",
]
