"""verl MTP training (``actor_rollout_ref.model.mtp.enable_train``) on a prefix tree.

verl's stock forward hands the model ``labels`` and the full-length ``loss_mask`` and its
patched ``GPTModel._postprocess`` (``verl.models.mcore.mtp_patch``) runs megatron's MTP block,
rolling ids, labels and mask inside each packed sequence, and adds each depth's loss to the
backward through ``MTPLossAutoScaler``. On the tree the same postprocess runs without labels
(plain logits) and, before it, :func:`attach_tree_mtp_loss` runs the MTP layers on the depth
plans (:mod:`ps_mcore.multi_token`) and adds the same loss per depth: each original token
reads its own depth-k row and label, so a shared row counts once per sample behind it and
once per distinct continuation at a branch.

Which loss is "the same" depends on the installed megatron-core (:func:`megatron_mtp_loss`):

* megatron-core 0.16: verl's own loss, ``scale * sum(mask * CE) / sum(mask)`` per depth, the
  output layer detached, the mean logged with ``save_loss_to_tracker``;
* megatron-core 0.19: verl calls megatron's ``process_mtp_loss``: the output layer is trained
  (detached only under ``mtp_detach_heads``), MuP scales the logits, the token count is
  clamped to 1, ``calculate_per_token_loss`` rescales each depth to the main loss's token
  count (times verl 0.9.1's ``mtp_loss_normalization_factor``), and the logged metrics add
  acceptance counts (argmax == label over the masked tokens).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ps_mcore.logprobs import token_logprobs
from ps_mcore.multi_token import DepthPlan, depth_plans, rolled_mask
from ps_mcore.planner import TreePlan


def megatron_mtp_loss() -> bool:
    """True where megatron-core has ``process_mtp_loss`` (0.19), which verl's MTP postprocess
    (0.8.0 and 0.9.1) then calls instead of its own loss."""
    from megatron.core.transformer import multi_token_prediction

    return hasattr(multi_token_prediction, "process_mtp_loss")


def mtp_refusal(inner) -> str | None:
    """Why MTP training of the unwrapped model cannot run on a tree (None: it can)."""
    from ps_mcore.layer_specs.modules.mtp import tree_mtp_refusal  # after MindSpeed's repatch

    if "_postprocess" not in vars(inner):
        return "MTP training without verl's MTP postprocess patch"
    return tree_mtp_refusal(inner)


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


def vocab_shards(model, runtime_gather_output):
    """The TP group whose ranks hold vocab shards of ``model.output_layer``'s logits (None: each
    rank's logits cover the whole vocab)."""
    from megatron.core import parallel_state

    gather = model.output_layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _depth_logits(model, hidden: torch.Tensor, runtime_gather_output, megatron_loss: bool) -> torch.Tensor:
    """``[T_k, 1, V]`` logits (a vocab shard under TP, all rows under sequence parallelism) of one depth's rows through the output layer as the stock loss
    calls it: megatron's ``process_mtp_loss`` trains the output layer unless
    ``mtp_detach_heads`` and applies MuP's logit scale; verl's own loss never trains it."""
    config = model.config
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if megatron_loss:
        if config.mtp_detach_heads:
            weight = (model.output_layer.weight if weight is None else weight).detach()
        logits, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
        return model._scale_logits(logits) if getattr(config, "use_mup", False) else logits
    frozen = {name: p.detach() for name, p in model.output_layer.named_parameters()}
    frozen.update(dict(model.output_layer.named_buffers()))
    logits, _ = torch.func.functional_call(
        model.output_layer, frozen, args=(hidden,),
        kwargs={"weight": None if weight is None else weight.detach(), "runtime_gather_output": runtime_gather_output},
    )
    return logits


def _log_depth(config, depth: DepthPlan, logits, mtp_loss, mask, num_tokens, tp_group) -> None:
    """The depth's metrics into megatron's MTP tracker, as the stock loss logs them: the mean
    loss (megatron-core 0.16), or the mean loss and the acceptance counts (0.19)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    index, layers = depth.depth - 1, config.mtp_num_layers
    if not hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        MTPLossLoggingHelper.save_loss_to_tracker(mtp_loss.sum() / num_tokens, index, layers, avg_group=group)
        return
    with torch.no_grad():
        valid = mask.bool()
        predicted = _argmax(logits[: depth.num_rows, 0], tp_group)[depth.tokens.unpack_index]
        correct = ((predicted == depth.tokens.next_token_ids) & valid).sum().float()
        loss = mtp_loss.sum() * (num_tokens > 0).to(mtp_loss.dtype) / num_tokens.clamp(min=1)
    MTPLossLoggingHelper.save_metrics_to_tracker(loss, correct, valid.sum().float(), index, layers, avg_group=group)


def _argmax(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """``[T]`` argmax over the vocab of ``[T, V_local]`` logits, as megatron-core 0.19 counts
    accepted tokens (its vocab-parallel argmax where the ranks hold vocab shards)."""
    if tp_group is None:
        return logits.argmax(-1)
    from megatron.core.transformer.multi_token_prediction import _vocab_parallel_argmax

    return _vocab_parallel_argmax(logits, tp_group, torch.distributed.get_world_size(tp_group))


def attach_tree_mtp_loss(
    model, hidden_states: torch.Tensor, plan: TreePlan, depths: list[DepthPlan], loss_mask: torch.Tensor,
    rotary_pos_emb=None, runtime_gather_output=None, detach_inputs: bool = False, shared_dropout: bool = False,
    normalization_factor: float | None = None,
) -> torch.Tensor:
    """``hidden_states`` ``[T_pad, 1, h]`` carrying every MTP depth's loss into the backward
    (``MTPLossAutoScaler``), each depth's metrics logged as the stock loss logs them.

    ``loss_mask`` ``[N]``: the mask of each original token (1 where its loss counts); depth k
    masks token ``(s, i)`` by the mask of the token it predicts, ``(s, i + k + 1)``.
    ``normalization_factor``: verl 0.9.1's ``mtp_loss_normalization_factor`` (scales the loss
    under ``calculate_per_token_loss`` on megatron's ``process_mtp_loss``).
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from ps_mcore.layer_specs.modules.mtp import tree_mtp_hidden_states  # after MindSpeed's repatch

    config = model.config
    megatron_loss = megatron_mtp_loss()
    per_token = config.calculate_per_token_loss
    outputs = tree_mtp_hidden_states(model, hidden_states, plan, depths, rotary_pos_emb, detach_inputs, shared_dropout)
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    if megatron_loss and per_token and normalization_factor is not None:
        if normalization_factor <= 0:  # verl's own check
            raise ValueError(f"MTP loss normalization factor must be positive, got {normalization_factor}")
        scale *= normalization_factor
    main_tokens = loss_mask.sum()  # process_mtp_loss rescales each depth to the main loss's count
    tp_group = vocab_shards(model, runtime_gather_output)
    for depth, hidden in zip(depths, outputs):
        logits = _depth_logits(model, hidden, runtime_gather_output, megatron_loss)
        logprobs, _ = token_logprobs(logits[:, 0], depth.tokens, tp_group=tp_group)
        mask = rolled_mask(loss_mask, plan.seq_lens, depth.depth + 1) * depth.tokens.next_token_mask
        mtp_loss = -logprobs * mask
        num_tokens = mask.sum()
        if model.training:
            _log_depth(config, depth, logits, mtp_loss, mask, num_tokens, tp_group)
        if megatron_loss:
            safe = num_tokens.clamp(min=1)
            weighted = mtp_loss * (main_tokens / safe) if per_token else mtp_loss / safe
        else:
            weighted = mtp_loss if per_token else mtp_loss / num_tokens
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * weighted)
    return hidden_states


@contextlib.contextmanager
def tree_mtp_training(
    inner, plan: TreePlan, loss_mask: torch.Tensor, detach_inputs: bool, shared_dropout: bool = False,
    normalization_factor: float | None = None,
):
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
                normalization_factor=normalization_factor,
            )
        kwargs.update(labels=None, mtp_in_postprocess=False)
        return stock(hidden_states=hidden_states, **kwargs)

    inner._postprocess = _postprocess
    try:
        yield
    finally:
        inner._postprocess = stock
