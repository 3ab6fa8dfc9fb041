"""Engine-agnostic glue shared by the Megatron and FSDP patchsets: one context variable for
the running engine step (set around ``forward_backward_batch``; it carries the plans the
micro-batcher made and the micro-batch being run), prefix-aware ``prepare_micro_batches`` /
``postprocess_batch_func`` replacements, the tree-or-stock decision of one micro-batch
(:func:`plan_or_stock`), and the per micro-batch token counts that become the
``prefix_sharing/*`` metrics."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable

from ps_mcore.integrations.env import prefix_sharing_enabled
from ps_mcore.integrations.patching import info_once, warn_once
from ps_mcore.integrations.verl_common.batch import batch_flag, plan_batch, saved_fraction
from ps_mcore.integrations.verl_common.config import PrefixSharingSetting, resolve_setting
from ps_mcore.integrations.verl_common.microbatch import prefix_aware_prepare_micro_batches, restore_order
from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED
from ps_mcore.planner import TreePlan


def active_setting(engine: Any) -> PrefixSharingSetting | None:
    """The engine's enabled setting, or None (off, or ``ENABLE_PREFIX_SHARING=0`` now)."""
    if engine is None or not prefix_sharing_enabled():
        return None
    return resolve_setting(getattr(engine, "engine_config", None))


@dataclass
class MicroBatchContext:
    """What the patched model forward of one micro-batch needs from the engine."""

    engine: Any
    batch: Any
    setting: PrefixSharingSetting
    tokens: tuple[int, int] | None = None  # (N, T) once the forward decided
    plan: TreePlan | None = None  # made while sizing micro-batches, when the micro-batcher ran
    schedule_step: int | None = None  # the cross-micro-batch schedule step this batch runs
    loss_function: Any = None  # the step's loss (verl's logits processor for distillation)
    unshared: bool = False  # its mini-batch shares nothing: verl's forward runs it, unplanned

    def record(self, n: int, t: int) -> None:
        self.tokens = (int(n), int(t))


@dataclass
class EngineStep:
    """One ``forward_backward_batch`` call of one engine (the one context variable).

    Attributes:
        engine: the engine running it.
        plans: ``id(micro-batch) -> (micro-batch, TreePlan)`` made by the micro-batcher while
            sizing (:meth:`carried_plan` checks the identity).
        unshared: ``id(micro-batch) -> (micro-batch, N)`` for the micro-batches of a mini-batch
            that shares nothing (verl's own micro-batches; N their input tokens).
        micro: the micro-batch whose ``forward_step`` runs now (None between steps).
        forward_only: the step computes no gradients (a log-prob pass).
        schedule: the cross-micro-batch schedule of the units larger than the token budget
            (:mod:`ps_mcore.integrations.verl_common.schedule`), when the micro-batcher made one.
        contexts: contexts entered during the step (e.g. by the micro-batcher) and left when
            ``forward_backward_batch`` ends, after the schedule's last releases.
    """

    engine: Any
    plans: dict[int, tuple[Any, TreePlan]] = field(default_factory=dict)
    unshared: dict[int, tuple[Any, int]] = field(default_factory=dict)
    micro: MicroBatchContext | None = None
    forward_only: bool = False
    schedule: Any = None
    contexts: contextlib.ExitStack | None = None

    def carried_plan(self, batch) -> TreePlan | None:
        """The plan the micro-batcher made for exactly this micro-batch object (or None)."""
        return _carried(self.plans, batch)

    def unshared_tokens(self, batch) -> int | None:
        """N of exactly this micro-batch when its mini-batch shares nothing (else None)."""
        return _carried(self.unshared, batch)


def _carried(table: dict, batch):
    """``table[id(batch)]``'s value when its entry holds this very object (ids are reused)."""
    entry = table.get(id(batch))
    return entry[1] if entry is not None and entry[0] is batch else None


_STEP: contextvars.ContextVar[EngineStep | None] = contextvars.ContextVar("ps_mcore_engine_step", default=None)


def current_step() -> EngineStep | None:
    """The running engine step (None outside ``forward_backward_batch``)."""
    return _STEP.get()


def current_micro_batch() -> MicroBatchContext | None:
    step = _STEP.get()
    return None if step is None else step.micro


def with_engine_context(original: Callable) -> Callable:
    """Wrap ``forward_backward_batch`` so helpers called inside know the engine."""

    def forward_backward_batch(self, *args, **kwargs):
        # verl's signature: (data, loss_function, forward_only=False)
        forward_only = kwargs.get("forward_only", args[2] if len(args) > 2 else False)
        step = EngineStep(engine=self, forward_only=bool(forward_only))
        token = _STEP.set(step)
        try:
            with contextlib.ExitStack() as step.contexts:
                result = original(self, *args, **kwargs)
                if step.schedule is not None:  # the last releases (no-op where the schedule ran them)
                    step.schedule.finish()
            return result
        finally:
            _STEP.reset(token)

    return forward_backward_batch


def prefix_aware(
    stock: Callable,
    scheduler_for: Callable | None = None,
    images_of: Callable[[Any], Any] | None = None,
) -> Callable:
    """Replacement for an engine module's ``prepare_micro_batches`` name (verl's signature).

    ``scheduler_for(step, setting, data)`` gives the engine step's cross-micro-batch scheduler
    (:class:`~ps_mcore.integrations.verl_common.schedule.MiniBatchScheduler`) or None;
    ``images_of(engine)`` the engine model's image placeholder layout (vision-language), or None."""

    def prepare_micro_batches(
        data,
        dp_group=None,
        num_batches_divided_by=None,
        same_micro_num_in_dp=True,
        min_num_micro_batch=None,
        use_dynamic_bsz_balance=True,
    ):
        options = dict(
            dp_group=dp_group,
            num_batches_divided_by=num_batches_divided_by,
            same_micro_num_in_dp=same_micro_num_in_dp,
            min_num_micro_batch=min_num_micro_batch,
            use_dynamic_bsz_balance=use_dynamic_bsz_balance,
        )
        step = _STEP.get()
        setting = active_setting(None if step is None else step.engine)
        if setting is None:
            return stock(data=data, **options)
        images = None if images_of is None else images_of(step.engine)
        scheduler = None if scheduler_for is None else scheduler_for(step, setting, data)
        result = prefix_aware_prepare_micro_batches(
            data, setting.config, stock, plans=step.plans, images=images, scheduler=scheduler,
            unshared=step.unshared, **options
        )
        if scheduler is not None and scheduler.schedule is not None and scheduler.schedule.batches:
            step.schedule = scheduler.schedule
        return result

    return prepare_micro_batches


def restoring(stock: Callable) -> Callable:
    """Replacement for ``postprocess_batch_func`` that also restores fixed-size batches the
    micro-batcher reordered (verl restores only dynamic ones)."""

    def postprocess_batch_func(output_lst, indices, data):
        return restore_order(stock(output_lst=output_lst, indices=indices, data=data), indices, data)

    return postprocess_batch_func


def with_token_metrics(postprocess: Callable, tokens: tuple[int, int]) -> Callable:
    """Add the micro-batch's (N, T) to the metrics its postprocess function returns: verl's
    ``(loss, output)``, or ``(loss_sum, num_tokens, output)`` under Megatron's per-token loss
    (verl 0.9.1 with ``calculate_per_token_loss``)."""

    def postprocess_micro_batch(*args, **kwargs):
        result = postprocess(*args, **kwargs)
        output = result[-1]
        metrics = dict(output.get("metrics") or {})
        metrics[TOKENS_IN], metrics[TOKENS_PACKED] = tokens
        output["metrics"] = metrics
        return result

    return postprocess_micro_batch


def run_step_with_context(engine, batch_iter, call: Callable[[Any], tuple]):
    """Run one ``forward_step`` with its micro-batch published to the model forward.

    ``call(batch_iter)`` runs the stock step; returns its ``(output, postprocess)`` with
    the token counts added to the postprocess metrics when the forward recorded them.
    """
    setting = active_setting(engine)
    if setting is None:
        return call(batch_iter)
    batch = next(batch_iter)
    step = _STEP.get()
    if step is None or step.engine is not engine:  # a forward_step called on its own
        step = EngineStep(engine=engine)
    micro = MicroBatchContext(engine=engine, batch=batch, setting=setting, plan=step.carried_plan(batch))
    unshared = step.unshared_tokens(batch)
    if unshared is not None:  # no refusal checks, no plan: nothing would be shared
        micro.unshared = True
        micro.record(unshared, unshared)
    if step.schedule is not None:
        micro.schedule_step = step.schedule.step_of(batch)
    previous = step.micro
    step.micro = micro
    token = _STEP.set(step)
    try:
        output, postprocess = call(iter([batch]))
    finally:
        _STEP.reset(token)
        step.micro = previous
    if micro.tokens is not None:
        postprocess = with_token_metrics(postprocess, micro.tokens)
    elif batch_flag(batch, "use_fused_kernels"):
        warn_once(
            "fused-kernels",
            "use_fused_kernels=True: verl's fused forward runs these micro-batches without "
            "prefix sharing (set actor_rollout_ref.model.use_fused_kernels=False to share)",
        )
    return output, postprocess


def plan_or_stock(
    engine_name: str,
    micro: MicroBatchContext | None,
    setting: PrefixSharingSetting,
    batch,
    count_input_tokens: Callable[[], int],
    reason: str | None,
    images=None,
) -> TreePlan | None:
    """The tree-or-stock decision of one micro-batch, for every engine.

    Args:
        engine_name: ``"Megatron"`` / ``"FSDP"`` (messages and warning keys).
        micro: the published micro-batch (its token counts are recorded; its carried plan is
            used), or None when the forward runs outside ``forward_step``.
        setting: the engine's enabled setting.
        batch: the micro-batch to plan when no plan was carried.
        count_input_tokens: N, the micro-batch's tokens, called only when it runs stock (to
            record N; a plan knows its own, and counting device tensors would sync).
        reason: why the micro-batch cannot take the tree path (None: it can).
        images: a vision-language model's image placeholder layout (plans key images by content).

    Returns:
        The plan to run the tree forward with, or None: run verl's stock forward (after one
        warning for an unsupported batch, one info line for a plan that saves too little).
    """
    key = engine_name.lower()
    if reason is not None:
        warn_once(f"{key}:{reason}", f"{engine_name} micro-batch runs verl's stock forward: {reason}")
        plan = None
    else:
        carried = micro.plan if micro is not None else None
        plan = carried if carried is not None else plan_batch(batch, setting.config, images)
        if saved_fraction(plan) < setting.config.min_saved_fraction:
            info_once(
                f"{key}:small-savings",
                "micro-batches whose plan saves less than min_saved_fraction of their tokens "
                "run verl's stock forward",
            )
            plan = None
    if micro is not None:
        if plan is None:
            n = count_input_tokens()
            micro.record(n, n)
        else:
            micro.record(plan.num_input_tokens, plan.num_tokens)
    return plan


def install_engine_micro_batching(patcher, engine_module, engine_cls, prepare: Callable | None = None) -> None:
    """The wiring every verl engine patchset shares: the micro-batch context around
    ``engine_cls.forward_backward_batch``, prefix-aware ``prepare_micro_batches`` where
    ``engine_module`` imported it by name (``prepare`` wraps the stock one; default
    :func:`prefix_aware`), and outputs restored to batch order."""
    patcher.wrap(engine_cls, "forward_backward_batch", with_engine_context)
    patcher.wrap(engine_module, "prepare_micro_batches", prepare or prefix_aware)
    patcher.wrap(engine_module, "postprocess_batch_func", restoring)
