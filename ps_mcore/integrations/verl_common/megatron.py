"""verl Megatron engine glue (0.8.0 and 0.9.1): tree specs at model build, the tree forward per
micro-batch, and the fallbacks.

Forward (wraps what ``verl.models.mcore.get_mcore_engine_forward_fn`` returns): for each
micro-batch the wrapper plans the nested ``input_ids`` (prompt lengths and ``uid`` for
``prompt_only``), pads the packed rows to a multiple of TP, runs the model once with
:class:`~ps_mcore.layer_specs.TreePackedSeqParams`, and turns the packed output into
verl's jagged tensors (same offsets, row t holds the value for token t+1):

* LM head: ``log_probs``, ``entropy``, ``sum_pi_squared`` and the top-k distillation outputs
  through :func:`ps_mcore.logprobs.token_statistics` and
  :mod:`~ps_mcore.integrations.verl_common.statistics` (temperature divides the logits first,
  vocab-parallel over the TP group), as verl's ``logits_processor`` does. The last row of every sequence predicts nothing; verl's
  losses never read it (``no_padding_2_padding`` slices ``[off-resp-1, off-1)``) and the
  tree path returns 0 there.
* value head: ``values`` [N] per token.

A vision-language model (Megatron-Bridge's Qwen2.5-VL) is planned on image-keyed sequences and
runs :func:`~ps_mcore.layer_specs.vision_language_tree_forward` for the call: the vision tower
once per image of the packed rows, the language model on the tree with every packed row's
mrope positions (:func:`vision_tree_inputs`).

Model parallelism: TP (+SP) pads the packed rows to a multiple of TP; context parallelism
pads them to ``2*cp*tp`` and feeds this CP rank its 2*cp chunks of the rows
(``TreePackedSeqParams.from_plan(..., cp_size, cp_rank)``, ``cp_shard``); log-probs and
entropy come from :func:`~ps_mcore.layer_specs.cp_token_statistics` (each CP rank normalises
its own rows, then the ``[N]`` results are summed over CP), values from
:func:`~ps_mcore.layer_specs.gather_cp_rows`; gradients follow verl's stock rule (each CP
rank's loss reaches only its own rows). Pipeline stages (PP, VPP) each plan the micro-batches
themselves; :func:`megatron_prepare` checks with one all-reduce per group, before the
schedule, that every TP / PP / CP rank holds the same plans.

A mini-batch with nothing to share is verl's own run: verl's micro-batches and forward, no
checks or plans per micro-batch. Otherwise, per micro-batch it runs verl's own forward instead
(warning once per reason) when the plan saves less than ``prefix_grouper.min_saved_fraction``
(default 5%) of the tokens, when the model was not built with tree specs, and for what the
tree path does not support: dynamic context parallelism (``local_cp_size``), VLM inputs
other than a Megatron-Bridge Qwen2.5-VL's images (videos, mbridge's VLM models, a VLM under CP / PP / SP), MTP training outside what
:mod:`~ps_mcore.integrations.verl_common.mtp` runs (TP/CP/PP, MoE or hybrid-pattern MTP layers), FP8 attention or
FP8 with MoE (FP8 linears run on the tree: rows padded as verl pads FP8 THD, see
:mod:`ps_mcore.layer_specs.fp8`), top-k distillation behind a logits processor other than
verl's ``distillation_ppo_loss``, active
dropout of a training model (megatron-core's ``hidden_dropout`` default 0.1, unless
``prefix_grouper.shared_dropout``; attention dropout always), and in verl 0.9.1 ``pad_to_length``
buckets, the contiguous CP layout and distillation-only passes. Per-sample temperatures run on
the tree (a shared row is normalised once per distinct temperature among its samples). Fused
kernels (``use_fused_kernels``) run on the tree too: verl's fused GPTModel forward on the
packed rows with its kernel on the plan's labelled rows (:func:`run_tree_fused_forward`;
under TP every TP rank runs the vocab-parallel kernel on the same labelled rows, under PP the
last stage does); with context parallelism, MTP layers or a vision-language model they take
verl's stock fused forward (:func:`megatron_fused_refusal`). Under static CP the tree-spec model also runs
verl's stock THD micro-batches (per-sequence CP chunks), so every fallback works there.

``ps_mcore.layer_specs`` is imported where it is used, when an engine builds or runs its
model: on NPUs its tree modules then subclass the megatron classes MindSpeed's ``repatch``
(run by the engine before it builds the model) has bound, not those of install time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Any, Callable

import torch

from ps_mcore.integrations.env import prefix_sharing_enabled
from ps_mcore.integrations.patching import warn_once
from ps_mcore.integrations.verl_common.batch import (
    ImageTokens,
    batch_flag,
    batch_temperature,
    nested_like,
    plan_batch,
    sample_images,
    sequences,
)
from ps_mcore.integrations.verl_common.config import SHARED_DROPOUT_OPT_IN, resolve_setting
from ps_mcore.integrations.verl_common.engine import (
    active_setting,
    current_micro_batch,
    current_step,
    install_engine_micro_batching,
    plan_or_stock,
    prefix_aware,
    run_step_with_context,
)
from ps_mcore.integrations.verl_common.fused import labelled_statistics, on_labelled_rows, same_function
from ps_mcore.integrations.verl_common.mtp import full_loss_mask, mtp_refusal, tree_mtp_training
from ps_mcore.integrations.verl_common.vision import images_refusal, multi_modal_inputs_refusal, packed_images
from ps_mcore.integrations.verl_common.schedule import lm_schedule_refusal, run_schedule_step, scheduler_for
from ps_mcore.integrations.verl_common.statistics import LMHeadRequest, lm_head_batch_refusal
from ps_mcore.logprobs import labelled_rows
from ps_mcore.mindspeed import mindspeed_refusal, set_tree_sequence_state
from ps_mcore.mindspeed.state import reset_attention_mask_active
from ps_mcore.multimodal import row_values, with_tokens

_HAS_TREE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- checks


def _unwrap(model):
    from verl.utils.megatron_utils import unwrap_model

    return unwrap_model(model)


_TREE_MODULES = "ps_mcore.layer_specs.modules."


def has_tree_attention(model) -> bool:
    """True when the (unwrapped) model has tree token mixers: ``TreeCoreAttention`` or, in a
    hybrid model, the tree Mamba / Gated DeltaNet mixers."""
    inner = _unwrap(model)
    if inner not in _HAS_TREE:
        _HAS_TREE[inner] = any(type(m).__module__.startswith(_TREE_MODULES) for m in inner.modules())
    return _HAS_TREE[inner]


def image_tokens_of(model) -> ImageTokens | None:
    """The image placeholder layout of a vision-language model (Megatron-Bridge's Qwen2.5-VL:
    ``image_token_id`` and the vision tower's merge on its config), None otherwise."""
    config = getattr(_unwrap(model), "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "image_token_id", None) is None:
        return None
    return ImageTokens(int(config.image_token_id), int(vision.spatial_merge_size))


def megatron_image_tokens(engine) -> ImageTokens | None:
    modules = getattr(engine, "module", None)
    return image_tokens_of(modules[0]) if modules else None


def _is_vision(model, args: dict) -> bool:
    return bool(args.get("vision_model") or args.get("multi_modal_inputs")) or image_tokens_of(model) is not None


def vision_batch_refusal(model, batch) -> str | None:
    """Why a vision-language model's micro-batch must take verl's stock forward (None: the
    tree runs it, :func:`~ps_mcore.layer_specs.vision_language_tree_forward`)."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.layer_specs import vision_language_tree_refusal  # after MindSpeed's repatch

    reason = vision_language_tree_refusal(_unwrap(model))
    if reason is None and image_tokens_of(model) is None:
        reason = f"{type(_unwrap(model)).__name__} has no image_token_id / vision_config"
    if reason is None and mpu.get_pipeline_model_parallel_world_size() > 1:
        reason = "pipeline parallelism is not verified for them on a tree"
    if reason is not None:
        return f"vision-language inputs: {reason}"
    return multi_modal_inputs_refusal(batch) or images_refusal(batch, image_tokens_of(model))


def megatron_batch_refusal(model, args: dict, batch, loss_function=None) -> str | None:
    """Why this micro-batch must take verl's stock forward (None: the tree path runs it);
    ``loss_function``: the step's loss (verl's distillation logits processor)."""
    reason = mindspeed_refusal()
    if reason is not None:
        return reason
    if args.get("local_cp_size") is not None:
        return "dynamic context parallelism (local_cp_size) is not supported by tree attention"
    if args.get("cp_layout", "zigzag") != "zigzag":  # verl 0.9.1: contiguous CP rows (DeepSeek-V4)
        return f"context-parallel layout {args['cp_layout']!r} is not supported (tree rows use the zigzag layout)"
    if args.get("pad_to_length_bucket") is not None:  # verl 0.9.1's static padding (pad_to_length)
        return "pad_to_length (padding micro-batches to fixed length buckets) is not supported"
    if _is_vision(model, args):
        reason = vision_batch_refusal(model, batch)
        if reason is not None:
            return reason
    if args.get("mtp_enable_train"):
        mtp_reason = mtp_refusal(_unwrap(model))
        if mtp_reason is not None:
            return f"multi-token prediction (MTP) training: {mtp_reason} is not supported on a tree"
    from ps_mcore.layer_specs.fp8 import fp8_tree_refusal  # after MindSpeed's repatch

    fp8_reason = fp8_tree_refusal(_unwrap(model).config)
    if fp8_reason is not None:
        return f"{fp8_reason} is not supported on a tree"
    if not has_tree_attention(model):
        return "the model was not built with tree layer specs (ENABLE_PREFIX_SHARING=0 at build, or a bridge ignored them)"
    from ps_mcore.layer_specs.modules.moe_router import moe_refusal  # after MindSpeed's repatch

    refusal = moe_refusal(_unwrap(model).config)
    if refusal is not None:  # the tree router would raise inside the model
        return f"MoE with {refusal} cannot be exact on a prefix tree"
    if not args.get("value_model") and args.get("logits_processor") is not None:
        refusal = lm_head_batch_refusal(batch, loss_function)
        if refusal is not None:
            return refusal
    return _dropout_refusal(model, args)


def _dropout_refusal(model, args: dict) -> str | None:
    """Active dropout of the training model (megatron-core's hidden_dropout defaults to 0.1;
    mbridge and Megatron-Bridge set it to 0 for Qwen / Llama), named with verl's keys."""
    from ps_mcore.layer_specs import megatron_dropout_refusal  # after MindSpeed's repatch

    micro = current_micro_batch()
    shared = micro is not None and micro.setting.config.shared_dropout
    role = "critic" if args.get("value_model") else "actor_rollout_ref.actor"
    return megatron_dropout_refusal(
        _unwrap(model), shared, SHARED_DROPOUT_OPT_IN, key_prefix=f"+{role}.megatron.override_transformer_config."
    )


# ----------------------------------------------------------------------------- tree forward


def _tp_group():
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_world_size() == 1:
        return None
    return mpu.get_tensor_model_parallel_group()


def tree_packed_params(plan, config=None, shared_dropout: bool = False):
    """The micro-batch's ``TreePackedSeqParams`` on this rank: rows padded as verl pads THD
    (a multiple of TP, of ``2*cp*tp`` under context parallelism, times 128 for an FP8
    ``config``), this CP rank's layout; ``shared_dropout``: ``prefix_grouper.shared_dropout``."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.layer_specs import TreePackedSeqParams  # after MindSpeed's repatch
    from ps_mcore.layer_specs.fp8 import tree_row_multiple

    tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
    return TreePackedSeqParams.from_plan(
        plan,
        pad_to_multiple_of=tree_row_multiple(config, tp, cp),
        cp_size=cp,
        cp_rank=mpu.get_context_parallel_rank() if cp > 1 else 0,
        shared_dropout=shared_dropout,
    )


def _mtp_context(model, plan, input_ids: torch.Tensor, args: dict, engine, shared_dropout: bool):
    """The tree MTP loss around the model call when verl trains MTP (else nothing)."""
    if not args.get("mtp_enable_train") or not _unwrap(model).post_process:
        return contextlib.nullcontext()
    mtp = getattr(getattr(engine, "model_config", None), "mtp", None)
    detach = bool(getattr(mtp, "detach_encoder", False))
    return tree_mtp_training(_unwrap(model), plan, full_loss_mask(args, input_ids), detach, shared_dropout,
                             args.get("mtp_loss_normalization_factor"))


def vision_tree_inputs(model, batch, plan, psp) -> dict:
    """A vision-language micro-batch's inputs beyond the packed rows: ``position_ids [3, 1,
    T_pad]`` (every packed row's mrope positions, from each sample's ``get_rope_index`` as the
    model's own forward computes them) and the images of the packed rows in row order."""
    inner, images = _unwrap(model), image_tokens_of(model)
    device = psp.position_ids.device
    positions = []
    for seq, sample in zip(sequences(batch), sample_images(batch)):
        ids = torch.from_numpy(seq)[None]
        grid = torch.tensor([g for _, g in sample]) if sample else None
        rows, _ = inner.get_rope_index(ids, (ids == images.image_token_id).int(), grid)  # [3, 1, L]
        positions.append(rows[:, 0])
    rows = row_values(plan, torch.cat(positions, dim=1)).to(device)  # [3, T]
    inputs = {"position_ids": psp.pad_rows(rows.T).T[:, None]}
    inputs.update(packed_images(batch, plan, images, device))
    return inputs


@contextlib.contextmanager
def _vision_forward(model, args: dict):
    """For a vision-language model, its forward is :func:`~ps_mcore.layer_specs.
    vision_language_tree_forward` for the call (a wrapper's own forward, e.g. the bf16
    module's, still runs around it); yields whether it is one."""
    if not _is_vision(model, args):
        yield False
        return
    from ps_mcore.layer_specs import vision_language_tree_forward  # after MindSpeed's repatch

    inner = _unwrap(model)
    own = inner.__dict__.get("forward")  # an instance-level forward someone set: put back after
    inner.forward = functools.partial(vision_language_tree_forward, inner)
    try:
        yield True
    finally:
        if own is None:
            del inner.forward
        else:
            inner.forward = own


def tree_model_inputs(model, plan, input_ids: torch.Tensor):
    """(plan on ``input_ids``'s device, its ``TreePackedSeqParams``, the model call's inputs:
    this CP rank's packed rows ``[1, T_pad / cp]``)."""
    device = input_ids.values().device if input_ids.is_nested else input_ids.device
    plan = plan.to(device)
    micro = current_micro_batch()
    shared_dropout = micro is not None and micro.setting.config.shared_dropout
    psp = tree_packed_params(plan, _unwrap(model).config, shared_dropout)
    set_tree_sequence_state(psp)  # MindSpeed's global sequence state (no-op without it)
    inputs = dict(input_ids=psp.cp_shard(plan.input_ids)[None], attention_mask=None,
                  position_ids=psp.cp_shard(psp.position_ids)[None], packed_seq_params=psp)
    return plan, psp, inputs


def run_tree_forward(model, plan, input_ids: torch.Tensor, args: dict, batch, engine=None) -> Any:
    """One model call on ``plan``; returns what verl's engine forward returns.

    Shapes: model output ``[1, T_pad / cp, V/tp]`` (LM) or ``[1, T_pad / cp, 1]`` (value
    head), this CP rank's rows; returned tensors are jagged ``[B, j]`` with ``input_ids``'s
    offsets, complete on every CP rank.
    """
    from ps_mcore.layer_specs import cp_token_statistics, gather_cp_rows  # after MindSpeed's repatch

    plan, psp, inputs = tree_model_inputs(model, plan, input_ids)
    micro = current_micro_batch()
    with _mtp_context(model, plan, input_ids, args, engine, psp.shared_dropout), _vision_forward(model, args) as vision:
        if vision:
            inputs.update(vision_tree_inputs(model, batch, plan, psp))
        output = model(**inputs)
    if not _unwrap(model).post_process:
        return output  # hidden states go to the next pipeline stage as they are
    local = output[0] if psp.cp_layout is not None else output[0, : plan.num_tokens]
    if args.get("value_model") or args.get("logits_processor") is None:
        rows = gather_cp_rows(local, psp)[: plan.num_tokens]  # [T, ...] plan order
        return nested_like(plan.unpack(rows[:, 0] if args.get("value_model") else rows), input_ids)
    request = LMHeadRequest.of(batch, None if micro is None else micro.loss_function)
    stats = cp_token_statistics(
        local,
        psp,
        temperature=batch_temperature(batch["temperature"]),  # one float, or [B] per sample
        compute_entropy=request.entropy,
        tp_group=_tp_group(),
        **request.statistics_kwargs(),
    )
    return request.outputs(stats, input_ids)


def megatron_fused_refusal(model, args: dict) -> str | None:
    """Why verl's fused forward must run this micro-batch stock (None: it runs on the tree)."""
    from megatron.core import parallel_state as mpu

    if mpu.get_context_parallel_world_size() > 1:
        return "use_fused_kernels=True with context parallelism (the kernel would see one CP rank's share of the tree rows)"
    if _is_vision(model, args):
        return "use_fused_kernels=True with a vision-language model (its fused forward packs the images itself)"
    if getattr(_unwrap(model).config, "mtp_num_layers", None):  # verl turns fused kernels off with MTP
        return "use_fused_kernels=True with MTP layers (their loss needs the labels of every row)"
    if verl_fused_call_kwargs(model, 1.0) is None:
        return (f"use_fused_kernels=True with {type(_unwrap(model)).__name__}, whose forward is not verl's "
                "fused GPTModel forward (patch_fused_forward)")
    return None


def verl_fused_call_kwargs(model, temperature: float) -> dict | None:
    """The keywords verl's fused engine forward adds to the model call (None: ``model`` has no
    fused forward of verl's): megatron-core's output-processor hook (verl 0.9.1 on megatron-core
    >= 0.18) or the temperature of the patched ``_fused_GPTModel_forward``."""
    from verl.models.mcore import model_forward_fused as fused

    inner = _unwrap(model)
    mode_attr = getattr(fused, "_FUSED_FORWARD_MODE_ATTR", None)
    if mode_attr is not None and getattr(inner, mode_attr, None) == getattr(fused, "_HOOK_MODE", None):
        return dict(output_processor=fused.fused_output_processor,
                    output_processor_context=fused.FusedOutputProcessorContext(temperature=temperature))
    if same_function(getattr(inner.__dict__.get("forward"), "__func__", None), fused._fused_GPTModel_forward):
        return dict(temperature=temperature)
    return None


@contextlib.contextmanager
def _fused_kernel_on_rows(rows):
    """verl's fused GPTModel forward (or output processor), for the call, runs its kernel
    (``linear_cross_entropy``, looked up in its module) on ``rows`` (:func:`~ps_mcore.integrations.verl_common.fused.on_labelled_rows`)."""
    from verl.models.mcore import model_forward_fused

    kernel = model_forward_fused.linear_cross_entropy
    model_forward_fused.linear_cross_entropy = on_labelled_rows(kernel, rows)
    try:
        yield
    finally:
        model_forward_fused.linear_cross_entropy = kernel


def run_tree_fused_forward(model, plan, input_ids: torch.Tensor, args: dict) -> Any:
    """One call of verl's fused GPTModel forward on ``plan``; returns what verl's fused engine
    forward returns: ``log_probs`` (and ``entropy`` when ``calculate_entropy``) jagged
    ``[B, j]`` with ``input_ids``'s offsets.

    The decoder runs the packed rows ``[T_pad]``; the kernel gets the ``[U]`` labelled rows
    (:func:`~ps_mcore.logprobs.labelled_rows`), each token then reads its own pair.
    """
    plan, _, inputs = tree_model_inputs(model, plan, input_ids)
    rows = labelled_rows(plan)
    with _fused_kernel_on_rows(rows):
        output = model(**inputs, labels=None, **verl_fused_call_kwargs(model, args["temperature"]))
    if not _unwrap(model).post_process:
        return output
    entropy = bool(args["calculate_entropy"])
    stats = labelled_statistics(rows, output.log_probs, output.entropy if entropy else None)
    return LMHeadRequest(entropy=entropy).outputs(stats, input_ids)


def megatron_schedule_refusal(engine, model, data) -> str | None:
    """Why this Megatron engine cannot run a cross-micro-batch schedule on ``data`` (None: it
    can). Per-micro-batch fallbacks cannot apply inside a schedule, so they refuse it here."""
    from ps_mcore.layer_specs import megatron_dropout_refusal  # after MindSpeed's repatch
    from ps_mcore.layer_specs.modules.moe_router import moe_refusal
    from ps_mcore.layer_specs.schedule import schedule_refusal

    reason = mindspeed_refusal()
    if reason is not None:
        return reason
    if "multi_modal_inputs" in data.keys() or image_tokens_of(model) is not None:
        return "vision-language inputs or model (the vision tower and mrope positions run per micro-batch)"
    if getattr(_unwrap(model).config, "fp8", None):
        return "fp8 (a schedule's calls are padded to the TP size only, not to FP8's 128-row multiple)"
    if batch_flag(data, "use_fused_kernels"):
        return "use_fused_kernels=True (verl's fused forward, which runs no schedule step)"
    if not isinstance(engine, _value_engine_class()):
        reason = lm_schedule_refusal(data)
        if reason is not None:
            return reason
    if len(engine.module) > 1:
        return "virtual pipeline parallelism (several model chunks)"
    if not has_tree_attention(model):  # also what tree_build_refusal kept stock (dynamic CP, QAT, ...)
        return "the model was not built with tree layer specs"
    config = engine.engine_config
    if getattr(config, "pad_to_length", False) and config.use_remove_padding:  # verl 0.9.1's static padding
        return "pad_to_length (padding micro-batches to fixed length buckets)"
    if megatron_dropout_refusal(_unwrap(model)) is not None:  # shared_dropout or not
        return ("active dropout (a K/V-kept prefix runs its forward again at its release, which "
                "would draw other dropout masks)")
    refusal = schedule_refusal(model)
    if refusal is None:
        moe = moe_refusal(_unwrap(model).config)
        refusal = None if moe is None else f"MoE with {moe}"
    return refusal


def _value_engine_class():
    from verl.workers.engine.megatron import transformer_impl as impl

    return impl.MegatronEngineWithValueHead


def megatron_scheduler(step, setting, data):
    """The engine step's cross-micro-batch scheduler (None when ``cross_microbatch`` is off)."""
    if not setting.config.cross_microbatch:
        return None
    model = step.engine.module[0]
    training = not step.forward_only
    from ps_mcore.layer_specs.schedule import gpt_kv_row_cost, recurrent_state_cost  # after MindSpeed's repatch

    return scheduler_for(
        setting.config, training, lambda: gpt_kv_row_cost(model, training),
        lambda: megatron_schedule_refusal(step.engine, model, data),
        lambda: recurrent_state_cost(model, training),
    )


def megatron_schedule_step(model, micro, input_ids: torch.Tensor, args: dict) -> Any:
    """Step ``micro.schedule_step`` of the engine step's schedule; returns what verl's engine
    forward returns (jagged ``[B, j]`` with ``input_ids``'s offsets)."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.layer_specs.schedule import gpt_call  # after MindSpeed's repatch

    value = bool(args.get("value_model"))
    if not value and args.get("logits_processor") is None:
        raise NotImplementedError(
            "a cross-micro-batch schedule step returns log-probs or values; this forward asked "
            "for raw logits (no logits_processor)"
        )

    def make_run_call(temperature):
        return gpt_call(
            model,
            temperature=temperature,
            compute_entropy=not value and batch_flag(micro.batch, "calculate_entropy"),
            tp_group=_tp_group(),
            pad_to_multiple_of=mpu.get_tensor_model_parallel_world_size(),
            value_head=value,
        )

    out = run_schedule_step(current_step().schedule, micro, input_ids, value, make_run_call)
    return out["values"] if value else out


def tree_engine_forward(stock: Callable, fused: bool = False) -> Callable:
    """Wrap verl's engine forward function (``gptmodel_forward_model_engine`` signature), or
    with ``fused`` its fused one (``fused_forward_model_engine``'s)."""
    signature = inspect.signature(stock)

    def forward(*call_args, **call_kwargs):
        micro = current_micro_batch()
        if micro is None or micro.unshared or not prefix_sharing_enabled():
            return stock(*call_args, **call_kwargs)
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        args = dict(bound.arguments)
        model, input_ids = args["model"], args["input_ids"]
        if micro.schedule_step is not None:
            return megatron_schedule_step(model, micro, input_ids, args)
        def count() -> int:  # only for a micro-batch that runs stock: the offsets are on the device
            return int(input_ids.offsets()[-1]) if input_ids.is_nested else int(input_ids.numel())

        reason = megatron_fused_refusal(model, args) if fused else None
        reason = reason or megatron_batch_refusal(model, args, micro.batch, micro.loss_function)
        images = image_tokens_of(model) if reason is None and _is_vision(model, args) else None
        plan = plan_or_stock("Megatron", micro, micro.setting, micro.batch, count, reason, images)
        if plan is None:
            return stock(*call_args, **call_kwargs)
        if fused:
            return run_tree_fused_forward(model, plan, input_ids, args)
        if images is not None:
            plan = with_tokens(plan, sequences(micro.batch))  # planned on image keys
        return run_tree_forward(model, plan, input_ids, args, micro.batch, micro.engine)

    return forward


# ----------------------------------------------------------------------------- patches


def _plan_check_groups() -> list:
    """The groups whose ranks must hold the same plans: TP x PP (Megatron's model-parallel
    group) and CP, those of more than one rank."""
    from megatron.core import parallel_state as mpu

    groups = []
    if mpu.get_tensor_model_parallel_world_size() * mpu.get_pipeline_model_parallel_world_size() > 1:
        groups.append(mpu.get_model_parallel_group())
    if mpu.get_context_parallel_world_size() > 1:
        groups.append(mpu.get_context_parallel_group())
    return groups


def check_same_plans(step, micro_batches, config) -> None:
    """Plan every micro-batch not planned yet (kept in ``step.plans`` for the forward) and
    raise unless every TP / PP / CP rank holds the same plans (one all-reduce per group,
    before the schedule: stages run a micro-batch at different times)."""
    from ps_mcore.layer_specs import assert_same_plan  # after MindSpeed's repatch

    groups = _plan_check_groups()
    if not groups or not micro_batches:
        return
    plans = []
    for batch in micro_batches:
        plan = step.carried_plan(batch)
        if plan is None:
            plan = plan_batch(batch, config)
            step.plans[id(batch)] = batch, plan
        plans.append(plan)
    errors = []
    for group in groups:  # every group's collective runs before raising: no rank left waiting
        try:
            assert_same_plan(plans, group)
        except RuntimeError as error:
            errors.append(error)
    if errors:
        raise errors[0]


def megatron_prepare(stock: Callable) -> Callable:
    """The Megatron engine's ``prepare_micro_batches``: :func:`prefix_aware`, then the plan
    check of every micro-batch over the model-parallel ranks (:func:`check_same_plans`)."""
    prepare = prefix_aware(stock, megatron_scheduler, images_of=megatron_image_tokens)

    def prepare_micro_batches(*args, **kwargs):
        micro_batches, indices = prepare(*args, **kwargs)
        step = current_step()
        setting = active_setting(None if step is None else step.engine)
        if setting is not None:
            check_same_plans(step, micro_batches, setting.config)
        return micro_batches, indices

    return prepare_micro_batches


def megatron_get_forward_backward_func(original: Callable) -> Callable:
    """``get_forward_backward_func`` (as the Megatron engine module imported it) returning a
    schedule whose last cross-micro-batch releases run before the gradient reduction."""

    def get_forward_backward_func(*get_args, **get_kwargs):
        schedule_fn = original(*get_args, **get_kwargs)

        def forward_backward_func(*args, **kwargs):
            step = current_step()
            if step is None or step.schedule is None:
                return schedule_fn(*args, **kwargs)
            from ps_mcore.layer_specs.schedule import releases_before_grad_sync  # after MindSpeed's repatch

            with releases_before_grad_sync(kwargs.get("model"), step.schedule.finish, kwargs.get("forward_only", False)):
                result = schedule_fn(*args, **kwargs)
            step.schedule.finish()
            return result

        return forward_backward_func

    return get_forward_backward_func


def megatron_get_forward_fn(original: Callable) -> Callable:
    """``verl.models.mcore.get_mcore_engine_forward_fn`` returning the wrapped forward."""

    def get_mcore_engine_forward_fn(hf_config):
        return tree_engine_forward(original(hf_config))

    return get_mcore_engine_forward_fn


def megatron_get_fused_forward_fn(original: Callable) -> Callable:
    """``verl.models.mcore.get_mcore_forward_fused_model_engine_fn`` returning the wrapped
    fused forward."""

    def get_mcore_forward_fused_model_engine_fn(hf_config):
        return tree_engine_forward(original(hf_config), fused=True)

    return get_mcore_forward_fused_model_engine_fn


def megatron_forward_step(original: Callable) -> Callable:
    """``forward_step`` of the LM / value-head engines, publishing the micro-batch."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        def call(it):
            micro = current_micro_batch()
            if micro is not None:  # the distillation logits processor, for the tree forward
                micro.loss_function = logits_processor_func
            return original(self, it, model, logits_processor_func, postprocess_micro_batch_func)

        return run_step_with_context(self, batch_iter, call)

    return forward_step


ROPE_FUSION_REFUSAL = (
    "apply_rope_fusion forced to False under MindSpeed: its NPU RoPE kernels are not verified "
    "with the per-token tree positions prefix sharing needs (TE's fused THD RoPE is, and stays on)"
)


def tree_build_refusal(engine) -> str | None:
    """Why the engine's model must be built with stock specs (None: tree specs)."""
    if reset_attention_mask_active():
        return "MindSpeed's reset-attention-mask"
    if getattr(engine.engine_config, "dynamic_context_parallel", False):
        return "dynamic context parallelism"
    if getattr(engine, "_qat_enabled", False):
        return "QAT (its own layer spec)"
    config = getattr(engine, "tf_config", None) or getattr(engine, "provider", None)  # Megatron-Bridge: the provider
    if config is not None:
        from ps_mcore.layer_specs.conversion.bridge_attention import provider_attention_refusal  # after MindSpeed's repatch

        return provider_attention_refusal(config)  # per layer where Bridge's layers rewrite it (Gemma 3)
    return None


def tree_build(
    original: Callable,
    key: str,
    refusal: Callable[[Any], str | None],
    build: Callable[[Any, Callable], Any],
    no_tree_message: str,
) -> Callable:
    """The ``_build_megatron_module`` wrapper of every Megatron-family engine.

    When prefix sharing is on for the engine (and ``ENABLE_PREFIX_SHARING`` is not 0):
    ``refusal(engine)`` names why the model must keep stock specs (one warning, stock build),
    else ``build(engine, original)`` builds it with tree specs; a model that still has no tree
    attention warns once with ``no_tree_message`` (its forward then falls back to stock).
    """

    def _build_megatron_module(self):
        if resolve_setting(self.engine_config) is None or not prefix_sharing_enabled():
            return original(self)
        reason = refusal(self)
        if reason is not None:
            warn_once(f"{key}:{reason}", f"model built with stock specs: {reason}")
            return original(self)
        module = build(self, original)
        if not any(has_tree_attention(m) for m in module):
            warn_once(f"{key}:no-tree", no_tree_message)
        return module

    return _build_megatron_module


def _megatron_refusal(engine) -> str | None:
    refusal = tree_build_refusal(engine)
    return None if refusal is None else f"{refusal} is not supported by tree attention"


def _megatron_tree_build(engine, original: Callable):
    if engine.provider is not None:
        return _build_with_bridge_provider(engine, original)
    return _build_with_mbridge(engine, original)


def megatron_build_module(original: Callable) -> Callable:
    """``MegatronEngine._build_megatron_module`` building the model with tree specs."""
    return tree_build(
        original,
        "build",
        _megatron_refusal,
        _megatron_tree_build,
        "the bridge built the model without our tree layer spec; prefix sharing falls "
        "back to verl's stock forward for this model",
    )


def _build_with_mbridge(engine, original: Callable):
    """mbridge: ``to_tree_spec`` on the spec its ``_get_transformer_layer_spec`` builds."""
    from ps_mcore.layer_specs import to_tree_spec  # after MindSpeed's repatch

    bridge = engine.bridge
    stock_spec = bridge._get_transformer_layer_spec

    def _get_transformer_layer_spec(vp_stage=None):
        return to_tree_spec(stock_spec(vp_stage))

    bridge._get_transformer_layer_spec = _get_transformer_layer_spec  # this instance only
    try:
        return original(engine)
    finally:
        del bridge._get_transformer_layer_spec


def _build_with_bridge_provider(engine, original: Callable):
    """Megatron-Bridge: the provider's own spec (instance or class default), converted: the
    layer spec of a GPT provider, the stack spec of a hybrid one (Mamba / GDN layers too)."""
    from ps_mcore.layer_specs import provider_spec_field, tree_provider_spec  # after MindSpeed's repatch

    provider = engine.provider
    field = provider_spec_field(provider)
    stock_spec = getattr(provider, field)
    setattr(provider, field, tree_provider_spec(provider))
    try:
        return original(engine)
    finally:
        setattr(provider, field, stock_spec)


def install_forward_fn_patch(patcher) -> None:
    """The forward function verl's Megatron engine looks up per step (``verl.models.mcore``)."""
    import verl.models.mcore as mcore

    patcher.wrap(mcore, "get_mcore_engine_forward_fn", megatron_get_forward_fn)
    patcher.wrap(mcore, "get_mcore_forward_fused_model_engine_fn", megatron_get_fused_forward_fn)


def install_megatron_patches(patcher) -> None:
    """The Megatron-engine class patches of patchsets ``verl080_mcore0161_ms0160`` and
    ``verl091_mcore019`` (with :func:`install_forward_fn_patch`, all of them; the engine seams
    are the same in both releases)."""
    from verl.workers.engine.megatron import transformer_impl as impl

    patcher.wrap(impl, "get_forward_backward_func", megatron_get_forward_backward_func)
    patcher.wrap(impl.MegatronEngine, "_build_megatron_module", megatron_build_module)
    patcher.wrap(impl.MegatronEngineWithLMHead, "forward_step", megatron_forward_step)
    patcher.wrap(impl.MegatronEngineWithValueHead, "forward_step", megatron_forward_step)
    install_engine_micro_batching(patcher, impl, impl.MegatronEngine, prepare=megatron_prepare)
