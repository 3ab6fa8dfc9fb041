"""verl MTP training (``actor_rollout_ref.model.mtp.enable_train``) on a prefix tree.

verl's stock forward hands the model ``labels`` and the full-length ``loss_mask`` and its
patched ``GPTModel._postprocess`` (``verl.models.mcore.mtp_patch``) runs megatron's MTP block,
rolling ids, labels and mask inside each packed sequence, and adds each depth's loss
``scale * sum(mask * CE) / sum(mask)`` to the backward through ``MTPLossAutoScaler`` (the
output layer detached, as verl's patch does). On the tree the same postprocess runs
without labels (plain logits) and, before it, :func:`attach_tree_mtp_loss` runs the MTP
layers on the depth plans (:mod:`ps_mcore.multi_token`) and adds the same loss per depth:
each original token reads its own depth-k row and label, so a shared row counts once per
sample behind it and once per distinct continuation at a branch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ps_mcore.logprobs import token_logprobs
from ps_mcore.multi_token import DepthPlan, depth_plans, rolled_mask
from ps_mcore.planner import TreePlan


def mtp_loss_api_refusal() -> str | None:
    """Why the installed megatron-core's MTP loss cannot be mirrored on a tree (None: it can).

    megatron-core 0.19 has ``process_mtp_loss``, which verl's MTP postprocess (0.8.0 and 0.9.1)
    then calls instead of its own loss: the output layer is detached only under
    ``mtp_detach_heads``, ``calculate_per_token_loss`` rescales by token counts and it logs
    acceptance counts; the tree loss here is the one verl computes on megatron-core 0.16."""
    from megatron.core.transformer import multi_token_prediction

    if hasattr(multi_token_prediction, "process_mtp_loss"):
        return "megatron-core's process_mtp_loss (megatron-core 0.19)"
    return None


def mtp_refusal(inner) -> str | None:
    """Why MTP training of the unwrapped model cannot run on a tree (None: it can)."""
    from ps_mcore.layer_specs.modules.mtp import tree_mtp_refusal  # after MindSpeed's repatch

    if "_postprocess" not in vars(inner):
        return "MTP training without verl's MTP postprocess patch"
    return mtp_loss_api_refusal() or tree_mtp_refusal(inner)


def full_loss_mask(args: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32 loss mask over prompt + response tokens (prompt 0), as verl builds it
    for MTP (``_build_mtp_loss_mask_nested``)."""
    from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested

    processor_args = args.get("logits_processor_args") or {}
    lengths = input_ids.offsets().diff().tolist()
    mask = _build_mtp_loss_mask_nested(
        processor_args["loss_mask"], lengths, processor_args.get("response_attention_mask")
    )
    return mask.values().to(torch.float32)


def attach_tree_mtp_loss(
    model, hidden_states: torch.Tensor, plan: TreePlan, depths: list[DepthPlan], loss_mask: torch.Tensor,
    rotary_pos_emb=None, runtime_gather_output=None, detach_inputs: bool = False, shared_dropout: bool = False,
) -> torch.Tensor:
    """``hidden_states`` ``[T_pad, 1, h]`` carrying every MTP depth's loss into the backward
    (``MTPLossAutoScaler``), each depth's mean loss logged as megatron does.

    ``loss_mask`` ``[N]``: the mask of each original token (1 where its loss counts); depth k
    masks token ``(s, i)`` by the mask of the token it predicts, ``(s, i + k + 1)``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    from ps_mcore.layer_specs.modules.mtp import tree_mtp_hidden_states  # after MindSpeed's repatch

    config = model.config
    outputs = tree_mtp_hidden_states(model, hidden_states, plan, depths, rotary_pos_emb, detach_inputs, shared_dropout)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    # verl's patch: the MTP loss does not train the output layer
    frozen = {name: p.detach() for name, p in model.output_layer.named_parameters()}
    frozen.update(dict(model.output_layer.named_buffers()))
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for depth, hidden in zip(depths, outputs):
        logits, _ = torch.func.functional_call(
            model.output_layer, frozen, args=(hidden,),
            kwargs={"weight": None if weight is None else weight.detach(), "runtime_gather_output": runtime_gather_output},
        )
        logprobs, _ = token_logprobs(logits[:, 0], depth.tokens)
        mask = rolled_mask(loss_mask, plan.seq_lens, depth.depth + 1) * depth.tokens.next_token_mask
        mtp_loss = -logprobs * mask
        num_tokens = mask.sum()
        if model.training:
            MTPLossLoggingHelper.save_loss_to_tracker(
                mtp_loss.sum() / num_tokens, depth.depth - 1, config.mtp_num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            )
        per_token = mtp_loss if config.calculate_per_token_loss else mtp_loss / num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * per_token)
    return hidden_states


@contextlib.contextmanager
def tree_mtp_training(inner, plan: TreePlan, loss_mask: torch.Tensor, detach_inputs: bool, shared_dropout: bool = False):
    """While active, ``inner``'s ``_postprocess`` (verl's MTP patch) adds the tree MTP loss and
    returns plain logits (its own MTP needs labels, which the tree forward does not pass)."""
    depths = [d.to(plan.device) for d in depth_plans(plan, inner.config.mtp_num_layers)]
    stock = vars(inner)["_postprocess"]

    def _postprocess(hidden_states, **kwargs: Any):
        if kwargs.get("mtp_in_postprocess") and depths:
            hidden_states = attach_tree_mtp_loss(
                inner, hidden_states, plan, depths, loss_mask.to(hidden_states.device),
                rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                runtime_gather_output=kwargs.get("runtime_gather_output"),
                detach_inputs=detach_inputs,
                shared_dropout=shared_dropout,
            )
        kwargs.update(labels=None, mtp_in_postprocess=False)
        return stock(hidden_states=hidden_states, **kwargs)

    inner._postprocess = _postprocess
    try:
        yield
    finally:
        inner._postprocess = stock
