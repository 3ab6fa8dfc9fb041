"""Cross-micro-batch schedules in verl's engines (0.8.0 and 0.9.1).

With a token budget (``use_dynamic_bsz``), the micro-batcher hands the sharing units larger
than the budget to a :class:`MiniBatchScheduler` (``prefix_grouper.cross_microbatch``, on by
default). It plans them as one prefix forest and cuts it into steps
(:func:`ps_mcore.minibatch.schedule_tree`): every row computed once, each prefix's K/V kept
for the micro-batches that continue it. Its steps become the first micro-batches, in order
(a step's samples are the ones whose loss it computes); the units that fit are micro-batched
as before after them. The data-parallel micro-batch count is synced as verl does: a rank with
fewer micro-batches splits its small units further, then the schedule's steps at sample ends.

In the forward, a step's micro-batch runs its calls through one
:class:`~ps_mcore.schedule.ScheduleRunner` per engine step (made at the first step, with the
engine's model call); the runner runs the releases of a step when the next one starts and the
last ones before the gradient reduction (Megatron: first thing in
``finalize_model_grads_func``; FSDP: when ``forward_backward_batch`` returns). Log-prob
passes (``forward_only``) plan without gradients: kept K/V only, nothing recomputed.

A unit larger than the budget that the engine cannot schedule (its ``refusal`` names why:
pipeline or context parallelism, a hybrid model, ...) is split into pieces as before, with
one warning. Units are also split, silently, where that costs less than the schedule
(:func:`~ps_mcore.minibatch.split_cost`): the pieces repeat only a short prefix (a chat header
every group shares), while each kept prefix of a schedule is one more model call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ps_mcore.integrations.patching import info_once, warn_once
from ps_mcore.integrations.verl_common.batch import batch_flag, batch_temperature, nested_like, plan_sequences
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.integrations.verl_common.statistics import lm_head_batch_refusal
from ps_mcore.integrations.verl_common.microbatch import _local_count, _sync_count, _Units, partition_units
from ps_mcore.minibatch import MiniBatchPlan, plan_cost, schedule_tree, split_cost
from ps_mcore.schedule import RunCall, ScheduleRunner


@dataclass
class VerlSchedule:
    """One engine step's schedule: the plan, its step micro-batches and (once the first step
    runs) its runner."""

    plan: MiniBatchPlan
    training: bool
    batches: list = field(default_factory=list)
    runner: ScheduleRunner | None = None

    def step_of(self, batch) -> int | None:
        """The step ``batch`` (a micro-batch object built by the micro-batcher) runs, or None."""
        for index, candidate in enumerate(self.batches):
            if candidate is batch:
                return index
        return None

    def runner_with(self, make_run_call: Callable[[], RunCall]) -> ScheduleRunner:
        """The runner, made with ``make_run_call()`` at the first step."""
        if self.runner is None:
            self.runner = ScheduleRunner(self.plan, make_run_call(), training=self.training)
        return self.runner

    def finish(self) -> None:
        """The last releases (after every step ran; nothing to do before the first)."""
        if self.runner is not None and not self.runner.done:
            self.runner.finish()

    def step_tokens(self, index: int) -> tuple[int, int]:
        """(N, rows computed) of step ``index``: its samples' tokens and its calls' rows."""
        step = self.plan.steps[index]
        n = int(sum(self.plan.tree.seq_lens[s] for s in step.samples))
        return n, int(sum(self.plan.calls[c].num_rows for c in step.calls))


class MiniBatchScheduler:
    """The micro-batcher's scheduler for one engine step (see the module docstring).

    Args:
        config: the role's ``prefix_grouper`` config.
        training: plan for forward + backward (False: a log-prob pass).
        kv_row_cost: budget tokens per kept K/V row.
        refusal: why this engine cannot run a schedule (units larger than the budget are
            then split, with one warning), or None.
        state_cost: budget tokens per kept node's recurrent states (hybrid models; see
            :func:`~ps_mcore.minibatch.schedule_tree`).

    Each of the three may be given as a function of no arguments, called at most once and only
    when a unit is larger than the budget: finding them walks the model, which most engine
    steps, whose units all fit, need not pay for.
    """

    def __init__(self, config: PrefixGrouperConfig, training: bool, kv_row_cost: float | Callable[[], float],
                 refusal: str | None | Callable[[], str | None] = None,
                 state_cost: float | Callable[[], float] = 0.0):
        self.config = config
        self.training = training
        self._given = dict(kv_row_cost=kv_row_cost, refusal=refusal, state_cost=state_cost)
        self.schedule: VerlSchedule | None = None

    def _value(self, name: str):
        value = self._given[name]
        if callable(value):
            value = self._given[name] = value()
        return value

    @property
    def refusal(self) -> str | None:
        return self._value("refusal")

    @property
    def kv_row_cost(self) -> float:
        return self._value("kv_row_cost")

    @property
    def state_cost(self) -> float:
        return self._value("state_cost")

    def partitions(self, units: _Units, budget: int, options: dict) -> list[list[int]] | None:
        """Micro-batches (sample index lists): the schedule's steps, then the small units'; or
        None where splitting the large units costs less (:func:`~ps_mcore.minibatch.split_cost`;
        ``units`` are then left split) or the engine refuses a schedule."""
        if self.refusal is not None:
            warn_once(
                f"schedule:{self.refusal}",
                "sharing units larger than the token budget are split into pieces that each "
                f"recompute their shared prefix (no cross-micro-batch schedule): {self.refusal}",
            )
            return None
        big = [u for u, t in enumerate(units.tokens) if t > budget]
        members = np.array(sorted(i for u in big for i in units.members[u]), dtype=np.int64)
        tree = plan_sequences(
            [units.seqs[i] for i in members],
            self.config,
            None if units.prompts is None else units.prompts[members],
            None if units.groups is None else [units.groups[i] for i in members],
        )
        plan = schedule_tree(tree, budget, self.kv_row_cost, self.training, state_cost=self.state_cost)
        split = units.subset(range(len(units.tokens)))
        split.split_larger_than(budget)
        in_big = set(members.tolist())
        pieces = split.subset([p for p, m in enumerate(split.members) if m[0] in in_big])
        if split_cost(pieces.tokens, _local_count(pieces, budget), budget, self.training) < plan_cost(plan):
            info_once(
                "schedule:pieces",
                "sharing units larger than the token budget run as pieces that repeat a short shared "
                f"prefix ({sum(pieces.tokens) - tree.num_tokens} rows here): less than a cross-micro-batch "
                "schedule's kept-prefix calls would cost",
            )
            units.members, units.tokens = split.members, split.tokens  # split once: the caller's finds none left
            return None
        small = units.subset([u for u in range(len(units.tokens)) if units.tokens[u] <= budget])
        k_small = _local_count(small, budget)
        k = plan.num_steps + k_small
        if options.get("min_num_micro_batch") is not None:
            k = max(k, options["min_num_micro_batch"])
        k = _sync_count(k, options.get("dp_group"), options.get("same_micro_num_in_dp", True),
                        options.get("num_batches_divided_by"))
        small_samples = sum(len(m) for m in small.members)
        k_small = min(k - plan.num_steps, small_samples)
        if plan.num_steps + k_small < k:  # other ranks need more micro-batches: split steps
            plan = schedule_tree(tree, budget, self.kv_row_cost, self.training, min_steps=k - k_small,
                                 state_cost=self.state_cost)
        step_parts = [members[list(step.samples)].tolist() for step in plan.steps]
        small_parts = partition_units(small, k_small, options.get("use_dynamic_bsz_balance", True)) if k_small else []
        self.schedule = VerlSchedule(plan, self.training)
        return step_parts + small_parts

    def bind(self, micro_batches: list) -> None:
        self.schedule.batches = list(micro_batches[: self.schedule.plan.num_steps])

    def owns(self, batch) -> bool:
        return self.schedule is not None and self.schedule.step_of(batch) is not None


def scheduler_for(config: PrefixGrouperConfig, training: bool, estimate: Callable[[], float],
                  refusal: Callable[[], str | None], state_cost: Callable[[], float] | None = None
                  ) -> MiniBatchScheduler | None:
    """The scheduler of one engine step (None when ``cross_microbatch`` is off).
    ``estimate``: the model's ``kv_row_cost``; ``refusal``: why the engine cannot schedule;
    ``state_cost``: the model's kept recurrent state cost (hybrid models). Each is called only
    when a unit is larger than the budget, the costs only where the engine can schedule."""
    if not config.cross_microbatch:
        return None
    cost = config.kv_row_cost if config.kv_row_cost is not None else estimate
    return MiniBatchScheduler(config, training, cost, refusal, 0.0 if state_cost is None else state_cost)


def schedule_temperature(data) -> float | torch.Tensor:
    """The temperature a schedule scores ``data`` with (one float), or its ``[B]`` per-sample
    tensor (which a schedule refuses: its calls score every row at one temperature)."""
    return batch_temperature(data["temperature"] if "temperature" in data.keys() else None)


def lm_schedule_refusal(data) -> str | None:
    """Why an LM-head engine cannot run ``data`` as a schedule for reasons of the batch itself
    (every engine), or None."""
    if isinstance(schedule_temperature(data), torch.Tensor):
        return "per-sample temperatures (a schedule's calls score every row at one temperature)"
    for flag in ("calculate_sum_pi_squared", "distillation_use_topk"):
        if batch_flag(data, flag):
            return f"{flag} (a schedule's calls return log-probs and entropy only)"
    return lm_head_batch_refusal(data)


def run_schedule_step(
    schedule: VerlSchedule, micro, input_ids: torch.Tensor, value: bool, make_run_call: Callable[[float], RunCall]
) -> dict[str, torch.Tensor]:
    """Step ``micro.schedule_step`` of ``schedule`` (its releases first), as verl's engines
    return a forward's outputs: ``{name: [B, j]}`` jagged with ``input_ids``'s offsets, the
    step's samples in order. ``make_run_call(temperature)`` builds the engine's model call
    (the LM head's temperature; 1.0 for a value head); the step's token counts are recorded
    for the metrics."""
    reason = None if value else lm_schedule_refusal(micro.batch)
    if reason is not None:
        raise NotImplementedError(f"a cross-micro-batch schedule step cannot run: {reason}")
    temperature = 1.0 if value else schedule_temperature(micro.batch)
    out = schedule.runner_with(lambda: make_run_call(temperature)).forward(micro.schedule_step)
    micro.record(*schedule.step_tokens(micro.schedule_step))
    return {name: nested_like(tensor, input_ids) for name, tensor in out.items()}
