"""Cross-micro-batch schedules on Megatron GPT models with tree specs.

A :class:`~ps_mcore.minibatch.MiniBatchPlan` cuts a mini-batch's prefix forest into calls and
steps under a token budget; :class:`~ps_mcore.schedule.ScheduleRunner` runs them with exact
gradients. Here the Megatron side:

* :func:`gpt_call`: one call on a ``GPTModel`` (``TreePackedSeqParams`` of the call's
  :class:`~ps_mcore.minibatch.ContextPlan`; every ``TreeCoreAttention`` reads the kept context
  K/V by its ``layer_number``), log-probs / entropy of the call's tokens, or values.
* Hybrid models: ``TreeGatedDeltaNet`` and ``TreeMambaMixer`` layers keep, besides the
  attention layers' K/V, their recurrent state and conv window where a kept call's rows are
  continued by later calls (see :mod:`ps_mcore.schedule`); plan with ``state_cost``
  (:func:`recurrent_state_cost`) so the budget counts them.
* :func:`forward_backward_schedule`: every step through megatron-core's
  ``forward_backward_func`` (one step = one micro-batch, PP = 1: the no-pipelining schedule).
  A step's releases run when the next step's forward starts; the last ones just before
  ``config.finalize_model_grads_func`` (the data-parallel gradient reduction), so every
  gradient is complete when it is reduced. Gradient accumulation over steps is Megatron's own
  (``main_grad``), and activation recompute (``recompute_granularity``) works inside calls.

What does not run (:func:`schedule_refusal` names it): pipeline parallelism (a release would
need a backward through every stage outside the pipeline schedule), context parallelism (the
kept K/V are not CP-sharded), expert parallelism (a data-dependent number of calls per rank
would desynchronise the experts' all-to-all), DDP's ``overlap_grad_reduce`` (the last step's
backward starts reducing gradients that the releases still add to), MTP, and recurrent layers
that are not the tree modules (a stock ``GatedDeltaNet`` / ``MambaMixer`` runs no tree batch:
convert the spec with ``to_tree_spec``). Those models keep units that fit the budget (or split
them, as before).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.minibatch import ContextPlan, MiniBatchPlan, Step, kept_kv_row_cost, kept_state_cost, token_activation_bytes
from ps_mcore.schedule import RunCall, ScheduleRunner, call_outputs


def schedule_refusal(model) -> str | None:
    """Why ``model`` (a GPTModel, possibly wrapped) cannot run a cross-micro-batch schedule,
    or None when it can."""
    inner = _unwrap(model)
    config = inner.config
    if getattr(config, "pipeline_model_parallel_size", 1) > 1:
        return "pipeline parallelism (pipeline_model_parallel_size > 1)"
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism (context_parallel_size > 1)"
    if getattr(config, "num_moe_experts", None) and getattr(config, "expert_model_parallel_size", 1) > 1:
        return "expert parallelism (expert_model_parallel_size > 1)"
    if getattr(config, "mtp_num_layers", None):
        return "multi-token prediction (mtp_num_layers)"
    ddp = getattr(model, "ddp_config", None)
    if ddp is not None and getattr(ddp, "overlap_grad_reduce", False):
        return "DDP overlap_grad_reduce=True"
    for module in inner.modules():
        name = type(module).__name__
        if name in ("GatedDeltaNet", "MambaMixer"):
            return f"stock {name} layers (convert the layer spec with to_tree_spec)"
    return None


def _token_shape(inner, training: bool) -> dict:
    """The arguments of :func:`~ps_mcore.minibatch.token_activation_bytes` (and of
    :func:`~ps_mcore.minibatch.kept_kv_row_cost`) for a Megatron GPT model's config."""
    c = inner.config
    heads = c.num_attention_heads
    vocab = getattr(inner, "vocab_size", None) or getattr(getattr(inner, "output_layer", None), "output_size", 0)
    return dict(
        layers=c.num_layers, hidden=c.hidden_size, heads=heads, kv_heads=c.num_query_groups or heads,
        head_dim=c.kv_channels or c.hidden_size // heads, ffn=c.ffn_hidden_size, vocab=int(vocab or 0),
        training=training, full_recompute=getattr(c, "recompute_granularity", None) == "full",
        dtype_bytes=2 if (c.bf16 or c.fp16) else 4,
    )


def gpt_kv_row_cost(model, training: bool = True) -> float:
    """``kv_row_cost`` for :func:`~ps_mcore.minibatch.schedule_tree`:
    :func:`~ps_mcore.minibatch.kept_kv_row_cost` of ``model``'s config (activation dtype from
    its ``bf16`` / ``fp16``)."""
    return kept_kv_row_cost(**_token_shape(_unwrap(model), training))


def recurrent_state_cost(model, training: bool = True) -> float:
    """``state_cost`` for :func:`~ps_mcore.minibatch.schedule_tree`: budget tokens one kept
    node's recurrent states cost in ``model`` (every ``TreeGatedDeltaNet`` / ``TreeMambaMixer``
    layer's state and conv window, per tensor-parallel rank) against one token's activations
    (:func:`~ps_mcore.minibatch.token_activation_bytes` of the model's config); 0 without
    recurrent layers."""
    inner = _unwrap(model)
    state = window = 0
    for module in inner.modules():
        kinds = {k.__name__ for k in type(module).__mro__}  # mamba's module needs triton to import
        if "TreeGatedDeltaNet" in kinds:
            heads = module.num_value_heads // module.tp_size
            state += heads * module.key_head_dim * module.value_head_dim
            weight = module.conv1d.weight
        elif "TreeMambaMixer" in kinds:
            state += module.cp.nheads_local_tpcp * module.headdim * module.d_state
            weight = module.cp.get_conv1d_weight()
        else:
            continue
        window += weight.size(0) * (weight.size(-1) - 1)
    if not state:
        return 0.0
    shape = _token_shape(inner, training)
    return kept_state_cost(state, window, token_activation_bytes(**shape), training, shape["dtype_bytes"])


def _unwrap(model):
    inner = model
    while hasattr(inner, "module") and not hasattr(inner, "decoder"):
        inner = inner.module
    return inner


def gpt_call(
    model,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
    pad_to_multiple_of: int = 1,
    value_head: bool = False,
) -> RunCall:
    """``run_call`` for :class:`~ps_mcore.schedule.ScheduleRunner` on a Megatron GPT model.

    Args:
        model: the GPTModel (with tree specs; may be DDP/Float16-wrapped).
        temperature, compute_entropy, tp_group: as :func:`ps_mcore.logprobs.token_logprobs`.
        pad_to_multiple_of: pad the call's rows (the TP size under sequence parallelism).
        value_head: the model's output is a value per row (``[1, R, 1]``): return
            ``{"values": [n]}`` instead of log-probs.

    Returns:
        ``run_call(plan) -> {"log_probs": [n], "entropy": [n]}`` (entropy when asked) or
        ``{"values": [n]}``, in the call's token order.
    """

    def run_call(plan: ContextPlan) -> dict[str, torch.Tensor]:
        device = next(_unwrap(model).parameters()).device
        plan = plan.to(device)
        psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad_to_multiple_of)
        output = model(
            input_ids=psp.pad_rows(plan.input_ids)[None],
            position_ids=psp.position_ids[None],
            attention_mask=None,
            packed_seq_params=psp,
        )
        return call_outputs(output[0, : plan.num_tokens], plan, value_head, temperature, compute_entropy, tp_group)

    return run_call


StepLoss = Callable[[Step, dict[str, torch.Tensor]], tuple]


def forward_backward_schedule(
    model,
    plan: MiniBatchPlan,
    run_call: RunCall,
    loss_func: StepLoss,
    forward_only: bool = False,
    forward_backward_func: Callable | None = None,
    **kwargs: Any,
) -> list:
    """Run every step of ``plan`` through megatron-core's ``forward_backward_func``.

    Args:
        model: the model (or a one-element list of it), as Megatron's schedule takes it.
        plan: the mini-batch plan (``plan.training`` must be ``not forward_only``).
        run_call: e.g. :func:`gpt_call` of ``model``.
        loss_func: ``loss_func(step, outputs) -> (loss, num_tokens, report)`` or ``(loss,
            report)``, Megatron's loss-function contract, where ``outputs`` are the step's
            samples' per-token outputs (``{"log_probs": [N_step], ...}``, sample order
            ``step.samples``).
        forward_only: no backward (e.g. log-probs of an old policy).
        forward_backward_func: defaults to ``get_forward_backward_func()`` (PP = 1: the
            no-pipelining schedule).
        kwargs: passed on (``seq_length``, ``micro_batch_size`` default to 1).

    Returns:
        What the schedule returns (the reports of ``loss_func``, one per step).
    """
    refusal = schedule_refusal(model[0] if isinstance(model, list) else model)
    if refusal is not None:
        raise NotImplementedError(f"a cross-micro-batch schedule cannot run with {refusal}")
    if plan.training == forward_only:
        raise ValueError(
            f"the plan was made with training={plan.training} but forward_only={forward_only}; "
            "plan forward-only passes with schedule_tree(..., training=False)"
        )
    if forward_backward_func is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_backward_func = get_forward_backward_func()
    runner = ScheduleRunner(plan, run_call, training=not forward_only)

    def forward_step(data_iterator, _model):
        index = next(data_iterator)
        return runner.forward(index), functools.partial(loss_func, plan.steps[index])

    kwargs.setdefault("seq_length", 1)
    kwargs.setdefault("micro_batch_size", 1)
    with releases_before_grad_sync(model, runner.finish, forward_only):
        result = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=iter(range(plan.num_steps)),
            model=model,
            num_microbatches=plan.num_steps,
            forward_only=forward_only,
            **kwargs,
        )
    runner.finish()  # no-op when the gradient reduction already ran them
    return result


@contextlib.contextmanager
def releases_before_grad_sync(model, finish: Callable[[], None], forward_only: bool):
    """Within the block, ``config.finalize_model_grads_func`` (the data-parallel gradient
    reduction at the end of Megatron's schedule) first calls ``finish()``: a schedule's last
    releases, so the reduction sees complete gradients."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0] if isinstance(model, list) else model)
    original = config.finalize_model_grads_func
    if original is None or forward_only:
        yield
        return

    def finalize_model_grads(*args, **kwargs):
        finish()
        return original(*args, **kwargs)

    config.finalize_model_grads_func = finalize_model_grads
    try:
        yield
    finally:
        config.finalize_model_grads_func = original
