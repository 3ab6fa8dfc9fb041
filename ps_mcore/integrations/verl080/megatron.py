"""verl 0.8.0 Megatron engine glue: tree specs at model build, the tree forward per
micro-batch, and the fallbacks.

Forward (wraps what ``verl.models.mcore.get_mcore_engine_forward_fn`` returns): for each
micro-batch the wrapper plans the nested ``input_ids`` (prompt lengths and ``uid`` for
``prompt_only``), pads the packed rows to a multiple of TP, runs the model once with
:class:`~ps_mcore.layer_specs.TreePackedSeqParams`, and turns the packed output into
verl's jagged tensors (same offsets, row t holds the value for token t+1):

* LM head: ``log_probs`` and ``entropy`` through :func:`ps_mcore.logprobs.token_logprobs`
  (temperature divides the logits first, vocab-parallel over the TP group), as verl's
  ``logits_processor`` does. The last row of every sequence predicts nothing; verl's
  losses never read it (``no_padding_2_padding`` slices ``[off-resp-1, off-1)``) and the
  tree path returns 0 there.
* value head: ``values`` [N] per token.

Model parallelism: TP (+SP) pads the packed rows to a multiple of TP; context parallelism
pads them to ``2*cp*tp`` and feeds this CP rank its 2*cp chunks of the rows
(``TreePackedSeqParams.from_plan(..., cp_size, cp_rank)``, ``cp_shard``); log-probs and
entropy come from :func:`~ps_mcore.layer_specs.cp_token_logprobs` (each CP rank normalises
its own rows, then the ``[N]`` results are summed over CP), values from
:func:`~ps_mcore.layer_specs.gather_cp_rows`; gradients follow verl's stock rule (each CP
rank's loss reaches only its own rows). Pipeline stages (PP, VPP) each plan the micro-batches
themselves; :func:`megatron_prepare` checks with one all-reduce per group, before the
schedule, that every TP / PP / CP rank holds the same plans.

Per micro-batch it runs verl's own forward instead (warning once per reason) when the plan
saves less than ``prefix_grouper.min_saved_fraction`` (default 5%) of the tokens, when the
model was not built with tree specs, and for what the tree path does not support: dynamic
context parallelism (``local_cp_size``), VLM inputs, MTP training outside what
:mod:`~ps_mcore.integrations.verl080.mtp` runs (TP/CP/PP, MoE MTP layers), FP8 attention or
FP8 with MoE (FP8 linears run on the tree: rows padded as verl pads FP8 THD, see
:mod:`ps_mcore.layer_specs.fp8`),
``calculate_sum_pi_squared`` and distillation top-k. Per-sample temperatures run on the tree
(a shared row is normalised once per distinct temperature among its samples). Fused kernels take
verl's fused forward, which is not patched. Under static CP the tree-spec model also runs
verl's stock THD micro-batches (per-sequence CP chunks), so every fallback works there.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable

import torch

from ps_mcore.integrations.env import prefix_sharing_enabled
from ps_mcore.integrations.patching import warn_once
from ps_mcore.integrations.verl080.batch import (
    batch_flag,
    batch_temperature,
    lm_head_batch_reason,
    nested_like,
    plan_batch,
)
from ps_mcore.integrations.verl080.config import resolve_setting
from ps_mcore.integrations.verl080.engine import (
    active_setting,
    current_micro_batch,
    current_step,
    plan_or_stock,
    prefix_aware,
    run_step_with_context,
)

_HAS_TREE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- checks


def _unwrap(model):
    from verl.utils.megatron_utils import unwrap_model

    return unwrap_model(model)


def has_tree_attention(model) -> bool:
    """True when the (unwrapped) model's attention layers are ``TreeCoreAttention``."""
    from ps_mcore.layer_specs import TreeCoreAttention

    inner = _unwrap(model)
    if inner not in _HAS_TREE:
        _HAS_TREE[inner] = any(isinstance(m, TreeCoreAttention) for m in inner.modules())
    return _HAS_TREE[inner]


def megatron_fallback_reason(model, args: dict, batch) -> str | None:
    """Why this micro-batch must take verl's stock forward (None: the tree path runs it)."""
    from ps_mcore.mindspeed import mindspeed_refusal

    reason = mindspeed_refusal()
    if reason is not None:
        return reason
    if args.get("local_cp_size") is not None:
        return "dynamic context parallelism (local_cp_size) is not supported by tree attention"
    if args.get("vision_model") or args.get("multi_modal_inputs"):
        return "vision-language inputs are not supported"
    if args.get("mtp_enable_train"):
        from ps_mcore.integrations.verl080.mtp import mtp_refusal

        mtp_reason = mtp_refusal(_unwrap(model))
        if mtp_reason is not None:
            return f"multi-token prediction (MTP) training: {mtp_reason} is not supported on a tree"
    from ps_mcore.layer_specs.fp8 import fp8_tree_refusal

    fp8_reason = fp8_tree_refusal(_unwrap(model).config)
    if fp8_reason is not None:
        return f"{fp8_reason} is not supported on a tree"
    if not has_tree_attention(model):
        return "the model was not built with tree layer specs (ENABLE_PREFIX_SHARING=0 at build, or a bridge ignored them)"
    from ps_mcore.layer_specs.modules.moe_router import tree_unsupported_reason  # MoE options a tree cannot make exact

    moe_reason = tree_unsupported_reason(_unwrap(model).config)
    if moe_reason is not None:  # the tree router would raise inside the model
        return f"MoE with {moe_reason} cannot be exact on a prefix tree"
    if not args.get("value_model") and args.get("logits_processor") is not None:
        return lm_head_batch_reason(batch)
    return None


# ----------------------------------------------------------------------------- tree forward


def _tp_group():
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_world_size() == 1:
        return None
    return mpu.get_tensor_model_parallel_group()


def tree_packed_params(plan, config=None):
    """The micro-batch's ``TreePackedSeqParams`` on this rank: rows padded as verl pads THD
    (a multiple of TP, of ``2*cp*tp`` under context parallelism, times 128 for an FP8
    ``config``), this CP rank's layout."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.layer_specs import TreePackedSeqParams
    from ps_mcore.layer_specs.fp8 import tree_row_multiple

    tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
    return TreePackedSeqParams.from_plan(
        plan,
        pad_to_multiple_of=tree_row_multiple(config, tp, cp),
        cp_size=cp,
        cp_rank=mpu.get_context_parallel_rank() if cp > 1 else 0,
    )


def _mtp_context(model, plan, input_ids: torch.Tensor, args: dict, engine):
    """The tree MTP loss around the model call when verl trains MTP (else nothing)."""
    if not args.get("mtp_enable_train") or not _unwrap(model).post_process:
        return contextlib.nullcontext()
    from ps_mcore.integrations.verl080.mtp import full_loss_mask, tree_mtp_training

    mtp = getattr(getattr(engine, "model_config", None), "mtp", None)
    detach = bool(getattr(mtp, "detach_encoder", False))
    return tree_mtp_training(_unwrap(model), plan, full_loss_mask(args, input_ids), detach)


def run_tree_forward(model, plan, input_ids: torch.Tensor, args: dict, batch, engine=None) -> Any:
    """One model call on ``plan``; returns what verl's engine forward returns.

    Shapes: model output ``[1, T_pad / cp, V/tp]`` (LM) or ``[1, T_pad / cp, 1]`` (value
    head), this CP rank's rows; returned tensors are jagged ``[B, j]`` with ``input_ids``'s
    offsets, complete on every CP rank.
    """
    from ps_mcore.layer_specs import cp_token_logprobs, gather_cp_rows
    from ps_mcore.mindspeed import set_tree_sequence_state

    device = input_ids.values().device if input_ids.is_nested else input_ids.device
    plan = plan.to(device)
    psp = tree_packed_params(plan, _unwrap(model).config)
    set_tree_sequence_state(psp)  # MindSpeed's global sequence state (no-op without it)
    with _mtp_context(model, plan, input_ids, args, engine):
        output = model(
            input_ids=psp.cp_shard(plan.input_ids)[None],
            attention_mask=None,
            position_ids=psp.cp_shard(psp.position_ids)[None],
            packed_seq_params=psp,
        )
    if not _unwrap(model).post_process:
        return output  # hidden states go to the next pipeline stage as they are
    local = output[0] if psp.cp_layout is not None else output[0, : plan.num_tokens]
    if args.get("value_model") or args.get("logits_processor") is None:
        rows = gather_cp_rows(local, psp)[: plan.num_tokens]  # [T, ...] plan order
        return nested_like(plan.unpack(rows[:, 0] if args.get("value_model") else rows), input_ids)
    logprobs, entropy = cp_token_logprobs(
        local,
        psp,
        temperature=batch_temperature(batch["temperature"]),  # one float, or [B] per sample
        compute_entropy=batch_flag(batch, "calculate_entropy"),
        tp_group=_tp_group(),
    )
    result = {"log_probs": nested_like(logprobs, input_ids)}
    if entropy is not None:
        result["entropy"] = nested_like(entropy, input_ids)
    return result


def tree_engine_forward(stock: Callable) -> Callable:
    """Wrap verl's engine forward function (``gptmodel_forward_model_engine`` signature)."""
    signature = inspect.signature(stock)

    def forward(*call_args, **call_kwargs):
        micro = current_micro_batch()
        if micro is None or not prefix_sharing_enabled():
            return stock(*call_args, **call_kwargs)
        bound = signature.bind(*call_args, **call_kwargs)
        bound.apply_defaults()
        args = dict(bound.arguments)
        model, input_ids = args["model"], args["input_ids"]
        n = int(input_ids.offsets()[-1]) if input_ids.is_nested else int(input_ids.numel())
        reason = megatron_fallback_reason(model, args, micro.batch)
        plan = plan_or_stock("Megatron", micro, micro.setting, micro.batch, n, reason)
        if plan is None:
            return stock(*call_args, **call_kwargs)
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
    from ps_mcore.layer_specs import assert_same_plan

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
    prepare = prefix_aware(stock)

    def prepare_micro_batches(*args, **kwargs):
        micro_batches, indices = prepare(*args, **kwargs)
        step = current_step()
        setting = active_setting(None if step is None else step.engine)
        if setting is not None:
            check_same_plans(step, micro_batches, setting.config)
        return micro_batches, indices

    return prepare_micro_batches


def megatron_get_forward_fn(original: Callable) -> Callable:
    """``verl.models.mcore.get_mcore_engine_forward_fn`` returning the wrapped forward."""

    def get_mcore_engine_forward_fn(hf_config):
        return tree_engine_forward(original(hf_config))

    return get_mcore_engine_forward_fn


def megatron_forward_step(original: Callable) -> Callable:
    """``forward_step`` of the LM / value-head engines, publishing the micro-batch."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        def call(it):
            return original(self, it, model, logits_processor_func, postprocess_micro_batch_func)

        return run_step_with_context(self, batch_iter, call)

    return forward_step


ROPE_FUSION_REASON = (
    "apply_rope_fusion forced to False under MindSpeed: its NPU RoPE kernels are not verified "
    "with the per-token tree positions prefix sharing needs (TE's fused THD RoPE is, and stays on)"
)


def tree_build_refusal(engine) -> str | None:
    """Why the engine's model must be built with stock specs (None: tree specs)."""
    from ps_mcore.mindspeed.state import reset_attention_mask_active

    if reset_attention_mask_active():
        return "MindSpeed's reset-attention-mask"
    if getattr(engine.engine_config, "dynamic_context_parallel", False):
        return "dynamic context parallelism"
    if getattr(engine, "_qat_enabled", False):
        return "QAT (its own layer spec)"
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
    from ps_mcore.layer_specs import to_tree_spec

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
    """Megatron-Bridge: the provider's own spec (instance or class default), converted."""
    from ps_mcore.layer_specs import tree_layer_spec_from

    provider = engine.provider
    stock_spec = provider.transformer_layer_spec
    provider.transformer_layer_spec = tree_layer_spec_from(stock_spec)
    try:
        return original(engine)
    finally:
        provider.transformer_layer_spec = stock_spec


def install_megatron_patches(patcher) -> None:
    """Every Megatron-engine patch of the ``verl080_mcore0161_ms0160`` patchset."""
    import verl.models.mcore as mcore
    from verl.workers.engine.megatron import transformer_impl as impl

    from ps_mcore.integrations.verl080.engine import install_engine_micro_batching

    patcher.wrap(mcore, "get_mcore_engine_forward_fn", megatron_get_forward_fn)
    patcher.wrap(impl.MegatronEngine, "_build_megatron_module", megatron_build_module)
    patcher.wrap(impl.MegatronEngineWithLMHead, "forward_step", megatron_forward_step)
    patcher.wrap(impl.MegatronEngineWithValueHead, "forward_step", megatron_forward_step)
    install_engine_micro_batching(patcher, impl, impl.MegatronEngine, prepare=megatron_prepare)
