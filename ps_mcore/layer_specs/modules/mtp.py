"""megatron-core's multi-token prediction (MTP) layers run on a prefix tree.

``MultiTokenPredictionLayer.forward`` rolls ``input_ids`` / ``position_ids`` left by one per
depth inside each packed sequence; on a tree the token after a shared row depends on the
branch, so the rows of each depth come from :func:`ps_mcore.multi_token.depth_plans` instead
and the layer's own parts run on them: the embedding of each depth-k row's token, its source
row of the previous depth, ``_proj_and_transformer_layer`` (eh-projection, the tree-spec
transformer layer on the depth's own prefix forest, final norm), recompute as the stock
forward does it.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu

from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.multi_token import DepthPlan
from ps_mcore.planner import TreePlan


def tree_mtp_refusal(model) -> str | None:
    """Why ``model``'s MTP block cannot run on a tree (None: it can)."""
    config = model.config
    if mpu.get_tensor_model_parallel_world_size() > 1 or mpu.get_context_parallel_world_size() > 1:
        return "MTP with tensor or context parallelism"
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        return "MTP with pipeline parallelism"
    if getattr(config, "num_moe_experts", None):
        return "MTP with MoE layers (stock routes the rows past each sequence's end too)"
    mtp = getattr(model, "mtp", None)
    if mtp is None or not any(isinstance(m, TreeCoreAttention) for m in mtp.modules()):
        return "an MTP block without tree layer specs"
    return None


def tree_mtp_hidden_states(
    model,
    hidden_states: torch.Tensor,
    plan: TreePlan,
    depths: list[DepthPlan],
    rotary_pos_emb=None,
    detach_inputs: bool = False,
    shared_dropout: bool = False,
) -> list[torch.Tensor]:
    """Outputs of ``model.mtp``'s layers on the tree.

    Args:
        model: the (unwrapped) GPTModel with an MTP block.
        hidden_states: ``[T_pad, 1, h]`` the decoder's output on the packed rows.
        plan: the micro-batch's plan; depths: its :class:`DepthPlan` per MTP layer (on the
            model's device).
        rotary_pos_emb: the model's rotary table (tree attention indexes it per row).
        detach_inputs: verl's ``mtp.detach_encoder``: detach every depth's embeddings and the
            decoder's hidden states fed to depth 1, so the MTP loss does not reach the decoder
            or the embedding. (verl's patch detaches its hidden-state input only when that is a
            view: the decoder's output chunk is, a previous MTP layer's viewless output is not,
            so depth k >= 2 still trains depth k-1.)
        shared_dropout: the micro-batch's opt-in to shared dropout masks
            (``TreePackedSeqParams.shared_dropout``), given to each depth's packed params.

    Returns:
        ``[T_k, 1, h]`` per depth: row q is the depth-k row ``depths[k-1].plan`` row q.
    """
    outputs = []
    previous = hidden_states[: plan.num_tokens]
    for layer, depth in zip(model.mtp.layers, depths):
        rows = depth.rows
        decoder_input = model.embedding(
            input_ids=plan.input_ids[rows][None], position_ids=plan.position_ids[rows][None]
        )
        source = previous.index_select(0, depth.source)
        if detach_inputs:
            decoder_input = decoder_input.detach()
            if depth.depth == 1:
                source = source.detach().requires_grad_()
        # every keyword in the parameters' order: megatron's recompute passes them positionally
        layer_kwargs = dict(
            hidden_states=source,
            decoder_input=decoder_input,
            attention_mask=None,
            context=None,
            context_mask=None,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=None,
            rotary_pos_sin=None,
            attention_bias=None,
            inference_params=None,
            packed_seq_params=TreePackedSeqParams.from_plan(depth.plan, shared_dropout=shared_dropout),
            sequence_len_offset=None,
        )
        if model.config.recompute_granularity == "full" and layer.training:
            out = layer._checkpointed_forward(layer._proj_and_transformer_layer, **layer_kwargs)
        else:
            out = layer._proj_and_transformer_layer(**layer_kwargs)
        outputs.append(out)
        previous = out
    return outputs
