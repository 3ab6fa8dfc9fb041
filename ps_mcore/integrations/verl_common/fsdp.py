"""verl FSDP engine glue (patchsets ``verl080_fsdp``, ``verl091_fsdp``): the tree forward per
micro-batch for ``FSDPEngineWithLMHead`` and ``FSDPEngineWithValueHead``, and the fallbacks.

The engine's own seams are patched, so verl's ``forward_step`` (autocast, loss call,
metrics) runs unchanged around them:

* ``prepare_model_inputs``: plans the micro-batch's nested ``input_ids`` (prompt lengths and
  ``uid`` for ``prompt_only``, exactly as the Megatron glue) and returns model inputs for one
  packed row: ``input_ids = plan.input_ids[None]``, ``position_ids = plan.position_ids[None]``
  (tree depths, so HF RoPE needs no patch), ``attention_mask=None`` and
  ``tree_call=TreeCall(plan)``, which the ``"prefix_tree"`` attention of
  :mod:`ps_mcore.fsdp_bridge` reads (FSDP2's input cast of verl's mixed-precision policy
  passes it through unchanged). The model's decoder is switched to that attention on first
  use (unshared calls keep its own one; the patchset's uninstall switches it back).
* ``prepare_model_outputs``: LM head -> ``log_probs`` / ``entropy`` / ``sum_pi_squared`` / the
  top-k distillation outputs through :func:`ps_mcore.logprobs.token_statistics` and
  :mod:`~ps_mcore.integrations.verl_common.statistics` with verl's temperature (one float, or
  per sample: a shared row is normalised once per distinct temperature); value head (token
  classification, ``num_labels=1``) -> ``values``. Both as jagged tensors with
  ``input_ids``'s offsets, row t holding the value for token t+1 (log-probs) or token t
  (values), as verl's stock code returns them. The last row of every sequence predicts
  nothing; verl's losses never read it and the tree path returns 0 there (stock returns the
  log-prob of the next sequence's first token).
* ``use_fused_kernels``: verl's fused forward (torch or Triton backend) runs the decoder on
  the tree and its kernel on the plan's distinct (row, next-token) pairs
  (:mod:`ps_mcore.integrations.verl_common.fused`); log-probs and entropy come from the kernel.
  Under Ulysses SP each rank runs the kernel on the pairs whose row it holds.

``use_remove_padding`` only changes how verl's stock path lays the batch out (one packed row
vs. a padded ``[B, S]`` batch); the tree path is packed either way and returns the same
layout. ``use_dynamic_bsz``: verl's ``prepare_micro_batches`` in the FSDP engine module is
replaced by the shared prefix-aware one (:mod:`ps_mcore.integrations.verl_common.microbatch`).

A mini-batch with nothing to share is verl's own run (verl's micro-batches and forward, no
checks or plans per micro-batch). Otherwise, per micro-batch, verl's stock code runs instead
(warning once per reason) when the plan saves less than
``prefix_grouper.min_saved_fraction`` of the tokens (the Megatron glue's rule) and for what
the tree path does not support: top-k distillation behind a logits processor other than
verl's ``distillation_ppo_loss``, position ids other than ``0..len-1``, active dropout of a training model
(attention dropout always; residual / classifier / LoRA dropouts unless
``prefix_grouper.shared_dropout``), trl value-head wrappers, engine subclasses that override
these seams (VeOmni), VLM inputs other than Qwen2-VL / Qwen2.5-VL images, and fused kernels
without ``use_remove_padding`` on verl 0.8.0 (its fused output is response-padded), behind a
model's own fused forward (the VLM ones), with a temperature tensor,
``calculate_sum_pi_squared`` or top-k distillation. When a whole batch is known to fall back
(fused kernels without remove-padding on verl 0.8.0), micro-batching stays verl's, so the
stock forward keeps the raw-token budget it was sized for.

Ulysses sequence parallelism (``ulysses_sequence_parallel_size > 1``): the packed tree rows
are split over the SP ranks and the ``"prefix_tree"`` attention runs an all-to-all around
tree attention (:mod:`ps_mcore.fsdp_bridge.sequence_parallel`); log-probs, entropy and values
(fused kernels too) come back complete on every SP rank with verl's gradient scaling. A
vision-language model gets all packed rows and images on every SP rank and its text model takes
the rank's rows after the embedding, as verl's VLM path does
(:mod:`~ps_mcore.integrations.verl_common.vision`).

Cross-micro-batch schedules (``prefix_grouper.cross_microbatch``): sharing units larger than
the token budget are planned as one forest whose steps are the first micro-batches
(:mod:`ps_mcore.integrations.verl_common.schedule`). A step's ``forward_step`` runs
:func:`fsdp_schedule_step`: verl's device move, autocast and loss call around the step's calls
(:func:`ps_mcore.fsdp_bridge.hf_call`); verl's ``loss.backward()`` follows; the last releases
run when ``forward_backward_batch`` returns. Ranks make different numbers of model calls, so
with several data-parallel ranks and FSDP2, when any rank schedules (one all-reduce per engine
step), every rank runs the step with parameters gathered once and gradients reduced once
(:func:`ps_mcore.fsdp_bridge.lockstep.gathered_once`; memory: the full parameters and
gradients on each rank during that step); verl 0.9.1's deferred gradient sync is left off
inside it (:func:`sync_deferred_unless_gathered`). :func:`fsdp_schedule_refusal` names what a schedule
cannot run (several data-parallel ranks under FSDP1, Ulysses SP, fused kernels, VLM inputs,
per-sample temperatures, active dropout, and every per-micro-batch fallback): those units are
split, as before, with one warning.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from ps_mcore.fsdp_bridge import (
    TreeCall,
    enable_tree_attention,
    hf_call,
    hf_dropout_refusal,
    hf_kv_row_cost,
    hf_schedule_refusal,
    unwrap_model,
)
from ps_mcore.fsdp_bridge.hf_attention import ATTN_NAME, base_implementation
from ps_mcore.fsdp_bridge.lockstep import fsdp1_wrapped, fsdp2_modules, gathered_once, is_gathered
from ps_mcore.fsdp_bridge.sequence_parallel import (
    sequence_parallel_plan,
    sp_gather_pairs,
    sp_gather_rows,
    sp_token_statistics,
)
from ps_mcore.integrations.env import distribution_version
from ps_mcore.integrations.verl_common.batch import (
    batch_flag,
    batch_temperature,
    nested_like,
    sequence_lengths,
    sequences,
)
from ps_mcore.integrations.verl_common.config import SHARED_DROPOUT_OPT_IN
from ps_mcore.integrations.verl_common.engine import (
    active_setting,
    current_micro_batch,
    current_step,
    install_engine_micro_batching,
    plan_or_stock,
    prefix_aware,
    run_step_with_context,
)
from ps_mcore.integrations.verl_common.fused import (
    FUSED_ROWS_KWARG,
    enable_tree_fused_forward,
    fused_forward_refusal,
    labelled_statistics,
)
from ps_mcore.integrations.verl_common.schedule import lm_schedule_refusal, run_schedule_step, scheduler_for
from ps_mcore.integrations.verl_common.statistics import LMHeadRequest, lm_head_batch_refusal
from ps_mcore.integrations.verl_common.vision import (
    engine_image_tokens,
    is_vision_batch,
    record_hf_attention_forwards,
    route_sp_input_slicing,
    route_tree_attention,
    tree_vision_inputs,
    vlm_refusal,
)
from ps_mcore.logprobs import labelled_rows, token_statistics
from ps_mcore.multimodal import with_tokens

# output_args keys carrying the tree path from prepare_model_inputs to prepare_model_outputs
PLAN_KEY = "ps_mcore_tree_plan"
TEMPERATURE_KEY = "ps_mcore_temperature"
_SEAMS = ("forward_step", "prepare_model_inputs", "prepare_model_outputs")
SP_PLAN_KEY = "ps_mcore_sp_plan"
SP_PAIRS_KEY = "ps_mcore_sp_pairs"  # the fused kernel's pairs of this call (this SP rank's share)


def _impl():
    from verl.workers.engine.fsdp import transformer_impl

    return transformer_impl


# ----------------------------------------------------------------------------- checks


def batch_flags_refusal(batch) -> str | None:
    """Why every micro-batch of ``batch`` takes verl's stock path, judged from the batch's
    own flags (so micro-batching can stay stock too); None if nothing rules it out."""
    if (batch_flag(batch, "use_fused_kernels") and not batch_flag(batch, "use_remove_padding", True)
            and fused_output_is_response_padded()):
        return (
            "use_fused_kernels=True with use_remove_padding=False on verl 0.8.0 (its fused forward returns "
            "the last max_response_length columns of the right-padded batch, padding rows included, "
            "which a tree does not compute; set use_remove_padding=True to share)"
        )
    return None


def fused_output_is_response_padded() -> bool:
    """verl 0.8.0's fused forward without remove-padding returns ``[B, max_response_length]``
    columns of the padded batch; verl 0.9.1's returns the per-token jagged layout (the tree's)."""
    version = distribution_version("verl")
    return version is None or version.startswith("0.8.")  # an unknown verl: assume the padded layout (refuse)


def _is_value_engine(engine) -> bool:
    return isinstance(engine, _impl().FSDPEngineWithValueHead)


def _overrides_seams(engine) -> bool:
    """True for a subclass (e.g. VeOmni's engines) that redefines a patched seam: it expects
    verl's own model inputs/outputs."""
    impl = _impl()
    base = impl.FSDPEngineWithValueHead if _is_value_engine(engine) else impl.FSDPEngineWithLMHead
    return any(getattr(type(engine), name) is not getattr(base, name) for name in _SEAMS)


def _positions_are_offsets(batch) -> bool:
    """``position_ids`` is ``0..len-1`` in every sequence (what the plan's depths are)."""
    pos = batch["position_ids"]
    offsets = pos.offsets()
    lens = offsets.diff()
    start = torch.repeat_interleave(offsets[:-1], lens)
    expected = torch.arange(int(offsets[-1]), device=offsets.device) - start
    values = pos.values()[0] if pos.dim() == 3 else pos.values()  # 4-row VLM positions: the text row
    return torch.equal(values, expected.to(values.dtype))


def fsdp_batch_refusal(engine, batch, loss_function=None) -> str | None:
    """Why this micro-batch must take verl's stock path (None: the tree path runs it);
    ``loss_function``: the step's loss (verl's distillation logits processor)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    if _overrides_seams(engine):
        return f"{type(engine).__name__} overrides the FSDP engine's model input/output methods"
    reason = batch_flags_refusal(batch)
    if reason is not None:
        return reason
    if tu.get_non_tensor_data(batch, key="pad_mode", default=DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        return "only verl's no-padding batch layout is supported"
    if not (batch["input_ids"].is_nested and batch["position_ids"].is_nested):
        return "input_ids / position_ids are not jagged nested tensors"
    if is_vision_batch(batch):
        reason = vlm_refusal(engine, batch)
        if reason is not None:
            return reason
    if not _positions_are_offsets(batch):
        return "position_ids other than 0..len-1 per sequence are not supported"
    if not _is_value_engine(engine):
        reason = lm_head_batch_refusal(batch, loss_function)
        if reason is not None:
            return reason
        if batch_flag(batch, "use_fused_kernels"):
            reason = _fused_refusal(engine, batch)
            if reason is not None:
                return reason
    setting = active_setting(engine)
    return _model_refusal(engine.module, setting is not None and setting.config.shared_dropout)


def _fused_refusal(engine, batch) -> str | None:
    """Why verl's fused forward cannot run this LM micro-batch on the tree (None: it can)."""
    if isinstance(batch["temperature"], torch.Tensor):
        return "use_fused_kernels=True with a temperature tensor (verl's fused forward refuses it)"
    if batch_flag(batch, "calculate_sum_pi_squared"):  # verl raises for it (no full logits)
        return "use_fused_kernels=True with calculate_sum_pi_squared (verl's fused forward refuses it)"
    if batch_flag(batch, "distillation_use_topk"):
        return "use_fused_kernels=True with distillation top-k (only VeOmni's fused kernels compute it)"
    return fused_forward_refusal(engine.module)


def _model_refusal(module, shared_dropout: bool = False) -> str | None:
    if hasattr(module, "v_head"):
        return "trl value-head wrappers (AutoModelForCausalLMWithValueHead) are not supported"
    try:
        unwrap_model(module)
    except ValueError as err:
        return str(err)
    return hf_dropout_refusal(module, shared_dropout, SHARED_DROPOUT_OPT_IN)


# ----------------------------------------------------------------------------- tree path


def _switch_attention(module: torch.nn.Module, patcher) -> None:
    """``enable_tree_attention`` on the engine's model, recorded in the patchset's patcher
    so that uninstalling gives the model its own implementation back."""
    for config in enable_tree_attention(module):
        config._attn_implementation_internal = base_implementation(config)
        patcher.set(config, "_attn_implementation_internal", ATTN_NAME)


def tree_model_inputs(
    micro_batch, plan, temperature: float | torch.Tensor, fused: bool = False, sp_group=None,
    slice_after_embedding: bool = False,
) -> tuple[dict, dict]:
    """(model inputs, output args) for one forward over ``plan``'s packed forest; ``fused``:
    for verl's fused forward (its kernel runs on the plan's labelled rows); ``sp_group``: the
    Ulysses group whose ranks split the packed rows; ``slice_after_embedding``: every SP rank
    gets all rows and the model slices after its embedding (vision-language models, as verl).

    Shapes: ``input_ids`` / ``position_ids`` ``[1, T]`` (``[1, ceil(T / sp)]`` under SP,
    ``[1, T_pad]`` when sliced after the embedding).
    """
    plan = plan.to(micro_batch["input_ids"].device)
    sp_plan = None
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        sp_plan = sequence_parallel_plan(plan, sp_group)
    rows = (lambda x: x) if sp_plan is None else sp_plan.padded if slice_after_embedding else sp_plan.local
    model_inputs = {
        "input_ids": rows(plan.input_ids)[None],
        "attention_mask": None,
        "position_ids": rows(plan.position_ids)[None],
        "tree_call": TreeCall(plan if sp_plan is None else sp_plan),
    }
    output_args = {PLAN_KEY: plan, TEMPERATURE_KEY: temperature, SP_PLAN_KEY: sp_plan}
    if fused:
        pairs = labelled_rows(plan)
        local = pairs if sp_plan is None else sp_plan.local_pairs(pairs)
        model_inputs.update({FUSED_ROWS_KWARG: local, "temperature": temperature, "return_dict": True})
        output_args[FUSED_ROWS_KWARG] = pairs
        output_args[SP_PAIRS_KEY] = local
    return model_inputs, output_args


def fsdp_prepare_model_inputs(original: Callable, patcher) -> Callable:
    """``FSDPEngineWithLMHead.prepare_model_inputs`` planning the micro-batch (the value-head
    engine inherits it)."""

    def prepare_model_inputs(self, micro_batch):
        setting = active_setting(self)
        if setting is None:
            return original(self, micro_batch)
        micro = current_micro_batch()
        micro = micro if micro is not None and micro.engine is self else None
        if micro is not None and micro.unshared:
            return original(self, micro_batch)
        # plan from forward_step's batch (before its .to(device)): no device sync
        source = micro.batch if micro is not None else micro_batch
        reason = fsdp_batch_refusal(self, source, None if micro is None else micro.loss_function)
        images = engine_image_tokens(self) if reason is None and is_vision_batch(source) else None

        def count() -> int:
            return int(sequence_lengths(source).sum())

        plan = plan_or_stock("FSDP", micro, setting, source, count, reason, images)
        if plan is None:
            return original(self, micro_batch)
        _switch_attention(self.module, patcher)
        if images is not None:
            plan = with_tokens(plan, sequences(source))  # planned on image keys
            route_tree_attention(self.module, patcher)
        fused = batch_flag(source, "use_fused_kernels") and not _is_value_engine(self)
        if fused:
            enable_tree_fused_forward(self.module, patcher)
        sp_group = getattr(self, "ulysses_parallel_group", None) if getattr(self, "use_ulysses_sp", False) else None
        vision_model = engine_image_tokens(self) is not None
        inputs, output_args = tree_model_inputs(
            micro_batch, plan, batch_temperature(source["temperature"]), fused, sp_group, vision_model
        )
        sp_plan = output_args[SP_PLAN_KEY]
        if sp_plan is not None and vision_model:
            route_sp_input_slicing(self.module, patcher)
        if images is not None:
            inputs.update(tree_vision_inputs(source, plan, images, inputs["input_ids"].device, sp_plan))
        return inputs, output_args

    return prepare_model_inputs


def tree_lm_outputs(output, output_args: dict, micro_batch, loss_function=None) -> dict[str, torch.Tensor]:
    """``log_probs`` (and ``entropy``, ``sum_pi_squared``, the top-k distillation outputs)
    ``[B, j]`` jagged from the packed logits ``[1, T, V]``, or from the fused kernel's ``[1, U]``
    results per labelled row."""
    request = LMHeadRequest.of(micro_batch, loss_function)
    rows = output_args.get(FUSED_ROWS_KWARG)
    sp_plan = output_args[SP_PLAN_KEY]
    temperature = output_args[TEMPERATURE_KEY]
    if rows is not None:  # the fused path refuses the other statistics
        log_probs, entropy = output.log_probs[0], output.entropy[0] if request.entropy else None
        if sp_plan is not None:
            log_probs, entropy = (None if x is None else sp_gather_pairs(x, output_args[SP_PAIRS_KEY], sp_plan)
                                  for x in (log_probs, entropy))
        stats = labelled_statistics(rows, log_probs, entropy)
    elif sp_plan is not None:
        stats = sp_token_statistics(output.logits[0], sp_plan, temperature, request.entropy, **request.statistics_kwargs())
    else:
        stats = token_statistics(
            output.logits[0], output_args[PLAN_KEY], temperature, request.entropy, **request.statistics_kwargs()
        )
    return request.outputs(stats, micro_batch["input_ids"])


def tree_value_outputs(output, output_args: dict, micro_batch, loss_function=None) -> dict[str, torch.Tensor]:
    """``values`` ``[B, j]`` jagged from a token-classification head's ``[1, T, 1]`` logits."""
    plan, sp_plan, values = output_args[PLAN_KEY], output_args[SP_PLAN_KEY], output.logits[0].squeeze(-1)
    if sp_plan is not None:
        values = sp_gather_rows(values, sp_plan)
    values = plan.unpack(values)
    return {"values": nested_like(values, micro_batch["input_ids"])}


def fsdp_prepare_model_outputs(original: Callable, tree_outputs: Callable) -> Callable:
    """``prepare_model_outputs`` reading the tree path's outputs when its inputs planned them."""

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if PLAN_KEY not in output_args:
            return original(self, output, output_args, micro_batch, logits_processor_func)
        return tree_outputs(output, output_args, micro_batch, logits_processor_func)

    return prepare_model_outputs


def fsdp_forward_step(original: Callable) -> Callable:
    """``forward_step`` publishing its micro-batch to ``prepare_model_inputs`` and adding the
    ``prefix_sharing/*`` token counts to its metrics.

    :func:`run_step_with_context` is shaped for Megatron's ``(output, postprocess)`` pairs;
    the FSDP step's ``(loss, output)`` travels as the postprocess thunk, so the shared
    token-metric wrapper applies to it unchanged.
    """

    def forward_step(self, micro_batch, loss_function, forward_only):
        def call(batch_iter):
            batch = next(batch_iter)
            micro = current_micro_batch()
            if micro is not None:  # the distillation logits processor, for the tree path's refusal
                micro.loss_function = loss_function
            if micro is not None and micro.schedule_step is not None:
                result = fsdp_schedule_step(self, micro, batch, loss_function, forward_only)
            else:
                result = original(self, batch, loss_function, forward_only)
            return None, lambda: result

        _, step_result = run_step_with_context(self, iter([micro_batch]), call)
        return step_result()

    return forward_step


def fsdp_schedule_refusal(engine, data) -> str | None:
    """Why this FSDP engine cannot run ``data``'s units larger than the token budget as a
    cross-micro-batch schedule (None: it can). Per-micro-batch fallbacks cannot apply inside a
    schedule, so they refuse it here; so does what would not be exact across calls."""
    if engine.get_data_parallel_size() > 1 and not fsdp2_modules(engine.module):
        kind = "FSDP1 (strategy fsdp)" if fsdp1_wrapped(engine.module) else "a model without FSDP2"
        return (
            f"{kind} with more than one data-parallel rank (its collectives run per model call, "
            "and a schedule's calls differ in number between ranks; the fsdp2 strategy runs it)"
        )
    if getattr(engine, "use_ulysses_sp", False):
        return "Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1)"
    if batch_flag(data, "use_fused_kernels"):
        return "use_fused_kernels=True (verl's fused forward runs no schedule step)"
    if is_vision_batch(data):
        return "vision-language inputs"
    reason = None if _is_value_engine(engine) else lm_schedule_refusal(data)
    if reason is None:
        reason = fsdp_batch_refusal(engine, data)
    return reason if reason is not None else hf_schedule_refusal(engine.module)


def fsdp_scheduler(step, setting, data):
    """The engine step's cross-micro-batch scheduler (None when ``cross_microbatch`` is off)."""
    if not setting.config.cross_microbatch:
        return None
    engine, training = step.engine, not step.forward_only
    dtype_bytes = 4 if getattr(engine, "_autocast_dtype", torch.bfloat16) == torch.float32 else 2
    return scheduler_for(
        setting.config, training, lambda: hf_kv_row_cost(engine.module, training, dtype_bytes),
        lambda: fsdp_schedule_refusal(engine, data),
    )


def fsdp_schedule_step(engine, micro, micro_batch, loss_function, forward_only) -> tuple:
    """verl's ``forward_step`` for a micro-batch that is a schedule step: the same device move,
    autocast, loss call and output, with the step's calls (:func:`hf_call` on the engine's
    module) in place of the one model call."""
    from verl.utils.device import get_device_id, get_device_name

    device_name = get_device_name()
    micro_batch = micro_batch.to(get_device_id())
    value = _is_value_engine(engine)
    entropy = not value and batch_flag(micro.batch, "calculate_entropy")
    with engine_autocast(engine):
        model_output = run_schedule_step(
            current_step().schedule, micro, micro_batch["input_ids"], value,
            lambda temperature: hf_call(engine.module, temperature, entropy, value_head=value),
        )
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group()
            )
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss, metrics = torch.tensor(1.0, device=device_name), {}
        return loss, {"model_output": model_output, "loss": loss.detach().item(), "metrics": metrics}


def engine_autocast(engine):
    """The autocast verl's ``forward_step`` runs the model in (none for fp32 parameters)."""
    from verl.utils.device import get_device_name

    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=get_device_name(), dtype=dtype)


def _reduction_pass(engine) -> Callable[[], torch.Tensor]:
    """A one-token forward of the engine's model in its autocast (for :func:`gathered_once`)."""
    from verl.utils.device import get_device_id

    def run():
        with engine_autocast(engine):
            out = engine.module(input_ids=torch.zeros(1, 1, dtype=torch.long, device=get_device_id()), use_cache=False)
        return out.logits.float().sum()

    return run


def gather_once_if_scheduled(step, dp_group) -> None:
    """With several data-parallel ranks and FSDP2: when any rank runs a schedule this engine
    step (one all-reduce over ``dp_group``), every rank runs the step's micro-batches with
    parameters gathered once and gradients reduced once (:func:`gathered_once`, left when
    ``forward_backward_batch`` ends), so the ranks' different call counts issue no
    collectives."""
    if dp_group is None or dist.get_world_size(dp_group) == 1 or not fsdp2_modules(step.engine.module):
        return
    from verl.utils.device import get_device_id

    flag = torch.tensor([int(step.schedule is not None)], device=get_device_id())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dp_group)
    if flag.item():
        step.contexts.enter_context(
            gathered_once(step.engine.module, not step.forward_only, _reduction_pass(step.engine))
        )


def sync_deferred_unless_gathered(original: Callable) -> Callable:
    """verl 0.9.1's ``FSDPEngine._gradient_sync_context``: verl's (gradient sync off for all
    but the last micro-batch, then on again), except inside :func:`gathered_once`, where sync
    is already off until the one reduction on leaving; turning it on there would make each
    rank's last micro-batch and schedule releases reduce-scatter, as many times as that rank
    makes calls, and the ranks would hang on each other."""

    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        if is_gathered(self.module):
            return contextlib.nullcontext()
        return original(self, is_last_micro_batch=is_last_micro_batch)

    return _gradient_sync_context


def prefix_aware_unless_stock(stock: Callable) -> Callable:
    """The FSDP module's ``prepare_micro_batches``: prefix-aware (the shared one), except for
    batches whose every micro-batch runs verl's stock forward (their token budget must
    count raw tokens); then :func:`gather_once_if_scheduled`."""
    aware = prefix_aware(stock, fsdp_scheduler, images_of=engine_image_tokens)

    def prepare_micro_batches(data, *args, **kwargs):
        if batch_flags_refusal(data) is not None:
            return stock(data, *args, **kwargs)
        result = aware(data, *args, **kwargs)
        step = current_step()
        setting = active_setting(None if step is None else step.engine)
        if (setting is not None and setting.config.cross_microbatch and step.contexts is not None
                and batch_flag(data, "use_dynamic_bsz")):
            dp_group = kwargs.get("dp_group", args[0] if args else None)
            gather_once_if_scheduled(step, dp_group)
        return result

    return prepare_micro_batches


# ----------------------------------------------------------------------------- install


def install_verl_fsdp_patches(patcher) -> None:
    """Every FSDP-engine patch (patchsets ``verl080_fsdp`` and ``verl091_fsdp``: the seams are
    the same in both releases, plus verl 0.9.1's gradient sync context)."""
    record_hf_attention_forwards()  # before verl patches a VLM's attention classes
    impl = _impl()
    lm, value = impl.FSDPEngineWithLMHead, impl.FSDPEngineWithValueHead
    patcher.wrap(lm, "forward_step", fsdp_forward_step)
    patcher.wrap(lm, "prepare_model_inputs", lambda original: fsdp_prepare_model_inputs(original, patcher))
    patcher.wrap(lm, "prepare_model_outputs", lambda original: fsdp_prepare_model_outputs(original, tree_lm_outputs))
    patcher.wrap(
        value, "prepare_model_outputs", lambda original: fsdp_prepare_model_outputs(original, tree_value_outputs)
    )
    install_engine_micro_batching(patcher, impl, impl.FSDPEngine, prefix_aware_unless_stock)
    if hasattr(impl.FSDPEngine, "_gradient_sync_context"):  # verl 0.9.1 (0.8.0 syncs every backward)
        patcher.wrap(impl.FSDPEngine, "_gradient_sync_context", sync_deferred_unless_gathered)
