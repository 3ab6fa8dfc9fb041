"""Megatron-core layer specs for prefix-tree batches.

Swap one spec and the same GPTModel trains on prefix forests::

    spec = get_gpt_layer_local_tree_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config, spec, ...)            # RoPE fusion may stay on
    psp = TreePackedSeqParams.from_plan(plan)
    logits = model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)      # [1, T, V]
    logprobs, _ = token_logprobs(logits[0], plan)                   # [N]

Model parallelism: TP and SP need nothing extra (pad to the TP multiple for SP). Under pipeline
parallelism every stage plans the same tokens (check with ``assert_same_plan(plan, pp_group)``)
and only the last stage computes log-probs. Context parallelism::

    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=2 * cp * tp, cp_size=cp, cp_rank=r)
    logits = model(input_ids=psp.cp_shard(plan.input_ids)[None],
                   position_ids=psp.cp_shard(psp.position_ids)[None],
                   attention_mask=None, packed_seq_params=psp)              # [1, T_pad/cp, V]
    logprobs, _ = cp_token_logprobs(logits[0], psp, tp_group=tp, cp_group=cp_group)  # [N]

The same model also runs ordinary THD batches (standard ``PackedSeqParams``) and plain
causal sbhd batches. Importing this package imports megatron-core (nothing else of ps_mcore
does). Hybrid models: ``ps_mcore.layer_specs.modules.gdn.TreeGatedDeltaNet`` and
``ps_mcore.layer_specs.modules.mamba.TreeMambaMixer`` (imported on demand, so megatron-core
versions without ``megatron.core.ssm.gated_delta_net`` and machines without triton still import
this package).

Vision-language models (Megatron-Bridge's Qwen2.5-VL): :func:`vision_language_tree_forward`
runs the vision tower on the images of the packed rows and the language model on the tree,
with the mrope positions of every packed row.

Inside: ``conversion/`` turns stock specs into tree specs, ``modules/`` holds the tree modules
those specs build, ``parallel/`` context and pipeline parallelism, and ``packed_params``
the :class:`TreePackedSeqParams` every layer reads its batch from.
"""

from ps_mcore.layer_specs.conversion.bridge import (
    provider_spec_field,
    tree_hybrid_stack_spec_from,
    tree_layer_spec,
    tree_layer_spec_from,
    tree_provider_spec,
)
from ps_mcore.layer_specs.conversion.bridge_attention import provider_attention_refusal
from ps_mcore.layer_specs.conversion.gpt import (
    get_gpt_decoder_block_tree_spec,
    get_gpt_layer_local_tree_spec,
    get_gpt_layer_with_tree_attention_spec,
    to_tree_spec,
)
from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention, TreeCoreAttentionTEState
from ps_mcore.layer_specs.modules.dropout import megatron_dropout_refusal
from ps_mcore.layer_specs.modules.self_attention import TreeSelfAttention
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.parallel.context_parallel import gather_cp_rows
from ps_mcore.layer_specs.parallel.cp_layout import CPLayout, cp_chunk_rows
from ps_mcore.layer_specs.parallel.cp_logprobs import cp_token_logprobs, cp_token_statistics
from ps_mcore.layer_specs.parallel.pipeline import assert_same_plan, plan_fingerprint
from ps_mcore.layer_specs.vision import vision_language_tree_forward, vision_language_tree_refusal
from ps_mcore.logprobs import token_logprobs

__all__ = [
    "CPLayout",
    "TreeCoreAttention",
    "TreeCoreAttentionTEState",
    "TreePackedSeqParams",
    "TreeSelfAttention",
    "assert_same_plan",
    "cp_chunk_rows",
    "cp_token_logprobs",
    "cp_token_statistics",
    "gather_cp_rows",
    "get_gpt_decoder_block_tree_spec",
    "get_gpt_layer_local_tree_spec",
    "get_gpt_layer_with_tree_attention_spec",
    "megatron_dropout_refusal",
    "plan_fingerprint",
    "provider_attention_refusal",
    "provider_spec_field",
    "to_tree_spec",
    "token_logprobs",
    "tree_hybrid_stack_spec_from",
    "tree_layer_spec",
    "tree_layer_spec_from",
    "tree_provider_spec",
    "vision_language_tree_forward",
    "vision_language_tree_refusal",
]
