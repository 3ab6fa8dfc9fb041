"""Running a :class:`~ps_mcore.minibatch.MiniBatchPlan`: every row computed once, loss and every
gradient equal to the unshared run's.

A training loop drives one :class:`ScheduleRunner` per mini-batch::

    runner = ScheduleRunner(mb_plan, run_call)          # run_call: ContextPlan -> {name: [n]}
    for j in range(mb_plan.num_steps):
        out = runner.forward(j)                         # e.g. out["log_probs"]: [N_j]
        loss_j(out, mb_plan.steps[j].samples).backward()
        runner.release(j)                               # or: the next forward(j+1) does it
    runner.finish()                                     # before the optimizer / grad sync

``run_call(plan)`` runs the model on one call (own rows ``plan.input_ids``, positions
``plan.position_ids``; its attention layers call
:func:`ps_mcore.attention.context.context_attention`, which reads ``plan.runtime``) and
returns per-token outputs for the call's tokens (``plan.unpack_index`` order), e.g. log-probs
from :func:`ps_mcore.logprobs.token_logprobs`, which takes the ContextPlan as its rows. A forest
that fits the budget is one call whose plan is the :class:`~ps_mcore.planner.TreePlan` itself
(today's path: the model runs it as any tree micro-batch).

What happens to gradients. A *kept* call records its K/V per layer and its per-token
outputs; later calls read them through :func:`~ps_mcore.attention.context.read_kept`, whose
backward adds into the kept call's fp32 accumulators. At its release (after the backward of
the last step that reads it) the kept call's backward runs once: from its outputs with their
accumulated gradients as the roots, while its attention adds the accumulated dK/dV to its own
(:func:`~ps_mcore.attention.context.add_kept_grad`). A graph-kept call backpropagates the
graph of its first forward; a K/V-kept call runs its forward again first (same inputs, same
kept context: the K/V its readers used). Releases run descendants first, so a release's
gradients reach its ancestors' accumulators before their own release. Activation checkpointing
inside the model (e.g. Megatron's full or selective recompute) composes: K/V are recorded once
and the accumulated gradient is added whenever the attention's backward runs.

Recurrent layers (Gated DeltaNet, Mamba) keep, per layer key, the state and conv window at
each of a kept call's *exit* rows (the rows later calls continue: ``ContextPlan.exit_rows``);
a call reads its context calls' exits as the *entries* its segments start from
(:meth:`CallRuntime.context_recurrent`). The gradients its readers send back accumulate like
dK/dV, and the kept call's backward hands them to its exit states and windows when it
reaches the layer's output (:meth:`CallRuntime.own_recurrent`).

Forward only (``training=False``, e.g. log-prob passes): kept calls keep K/V and outputs,
nothing needs gradients, releases just free the state.
"""

from __future__ import annotations

from typing import Callable

import torch

from ps_mcore.attention.context import add_kept_grad, add_side_grads, read_kept
from ps_mcore.logprobs import token_logprobs
from ps_mcore.minibatch import ContextPlan, MiniBatchPlan
from ps_mcore.planner import TreePlan

RunCall = Callable[[ContextPlan], dict[str, torch.Tensor]]


def call_outputs(
    rows: torch.Tensor,
    plan: ContextPlan | TreePlan,
    value_head: bool = False,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
) -> dict[str, torch.Tensor]:
    """What ``run_call`` returns, from one call's packed head output.

    Args:
        rows: ``[R, V]`` the call's LM-head logits (a vocab shard under TP), or ``[R, 1]`` a
            value head's output (``value_head``); rows past R (padding) are ignored.
        plan: the call's plan (a ContextPlan, or the TreePlan of a forest that fits).
        temperature, compute_entropy, tp_group: as :func:`~ps_mcore.logprobs.token_logprobs`.

    Returns:
        ``{"values": [n]}``, or ``{"log_probs": [n]}`` plus ``"entropy"`` when asked, in the
        call's token order.
    """
    if value_head:
        return {"values": rows[: plan.num_tokens, 0].index_select(0, plan.unpack_index.to(rows.device))}
    logprobs, entropy = token_logprobs(
        rows, plan, temperature=temperature, compute_entropy=compute_entropy, tp_group=tp_group
    )
    return {"log_probs": logprobs} if entropy is None else {"log_probs": logprobs, "entropy": entropy}


def _accumulate(store: dict, key, grad: torch.Tensor) -> None:
    if key in store:
        store[key].add_(grad)
    else:  # fp32 sums of bf16 / fp32 gradients (fp64 kept: exactness checks)
        store[key] = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)


class KeptState:
    """What a kept call leaves for the calls that continue it.

    Attributes:
        k, v: layer key -> ``[R, Hkv, D]`` K/V of its rows as its attention saw them.
        dk, dv: layer key -> fp32 sums of the gradients its readers produced (lazily made).
        states, windows: layer key -> ``[X, ...]`` recurrent state and ``[X, w, D]`` conv
            window at each exit row (recurrent layers).
        dstates, dwindows: layer key -> their fp32 gradient sums.
        outputs: name -> ``[n]`` its per-token outputs (detached).
        doutputs: name -> fp32 sums of the outputs' gradients.
        graph: its outputs with their autograd graph (graph-kept calls), else None.
    """

    def __init__(self):
        self.k: dict = {}
        self.v: dict = {}
        self.dk: dict = {}
        self.dv: dict = {}
        self.states: dict = {}
        self.windows: dict = {}
        self.dstates: dict = {}
        self.dwindows: dict = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.doutputs: dict[str, torch.Tensor] = {}
        self.graph: dict[str, torch.Tensor] | None = None

    def nbytes(self) -> int:
        """Bytes held: K/V, recurrent states and windows, their accumulators and the outputs
        (graphs not counted)."""
        held = (self.k, self.v, self.dk, self.dv, self.states, self.windows, self.dstates, self.dwindows,
                self.outputs, self.doutputs)
        tensors = [t for store in held for t in store.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class CallRuntime:
    """The kept state one running call sees (attached to its ContextPlan as ``runtime``).

    Args:
        runner: the schedule runner.
        context: kept states of the call's context calls, in the plan's context order.
        own: the call's own kept state when it is kept, else None.
        record: store the call's K/V in ``own`` (False when a release runs it again).
    """

    def __init__(self, runner: "ScheduleRunner", context: list[KeptState], own: KeptState | None, record: bool):
        self.runner = runner
        self.context = context
        self.own = own
        self.record = record
        self._anchor: torch.Tensor | None = None

    def _grads(self) -> bool:
        return self.runner.training and torch.is_grad_enabled()

    def anchor(self) -> torch.Tensor:
        if self._anchor is None:
            self._anchor = torch.zeros((), requires_grad=True)
        return self._anchor

    def read(self, state: KeptState, value: torch.Tensor, store: dict, key) -> torch.Tensor:
        """``value`` from a kept state; its gradient adds into ``store[key]``."""
        if not self._grads():
            return value
        return read_kept(self.anchor(), value, lambda g: _accumulate(store, key, g))

    def context_kv(self, key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``([C, Hkv, D], [C, Hkv, Dv])`` K/V of the context rows for layer ``key``, or None."""
        if not self.context:
            return None
        ks = [self.read(s, s.k[key], s.dk, key) for s in self.context]
        vs = [self.read(s, s.v[key], s.dv, key) for s in self.context]
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, 0), torch.cat(vs, 0)

    def context_recurrent(self, key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``([E, ...] states, [E, w, D] windows)`` at the exits of the context calls (in
        context order: the entries ``ContextPlan.segment_entry`` indexes) for recurrent layer
        ``key``, or None when no context call kept any."""
        kept = [s for s in self.context if key in s.states and s.states[key].size(0)]
        if not kept:
            return None
        states = [self.read(s, s.states[key], s.dstates, key) for s in kept]
        windows = [self.read(s, s.windows[key], s.dwindows, key) for s in kept]
        if len(kept) == 1:
            return states[0], windows[0]
        return torch.cat(states, 0), torch.cat(windows, 0)

    def own_recurrent(self, key, out: torch.Tensor, states: torch.Tensor | None,
                      windows: torch.Tensor | None) -> torch.Tensor:
        """Record a kept call's exit states ``[X, ...]`` and windows ``[X, w, D]`` for layer
        ``key`` (once) and return ``out`` (the layer's rows), through whose backward the
        gradients its readers accumulated reach those states and windows."""
        own = self.own
        if own is None or states is None:
            return out
        if self.record and key not in own.states:
            own.states[key], own.windows[key] = states.detach(), windows.detach()
        if self._grads() and (states.requires_grad or windows.requires_grad):
            out = add_side_grads(out, (states, windows), lambda: (own.dstates.get(key), own.dwindows.get(key)))
        return out

    def own_kv(self, key, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record a kept call's K/V (once) and route its readers' gradients into its backward."""
        own = self.own
        if own is None:
            return k, v
        if self.record and key not in own.k:
            own.k[key], own.v[key] = k.detach(), v.detach()
        if self._grads() and k.requires_grad:
            k = add_kept_grad(k, lambda: own.dk.get(key))
            v = add_kept_grad(v, lambda: own.dv.get(key))
        return k, v


class ScheduleRunner:
    """Runs the steps of a :class:`MiniBatchPlan` (see the module docstring).

    Args:
        plan: the mini-batch plan.
        run_call: runs the model on one call's :class:`ContextPlan` (with ``runtime`` set) and
            returns per-token outputs ``{name: [n]}``; every call must return the same names.
        training: gradients are needed (graph-kept calls keep their graph, releases run
            backwards). Planned K/V-only calls run without a graph either way.
    """

    def __init__(self, plan: MiniBatchPlan, run_call: RunCall, training: bool = True):
        self.plan = plan
        self.run_call = run_call
        self.training = training
        self.kept: dict[int, KeptState] = {}
        self._next = 0
        self._released = -1

    # ------------------------------------------------------------------ steps

    def forward(self, step: int) -> dict[str, torch.Tensor]:
        """Run step ``step``'s calls (after the releases of the steps before it) and return its
        samples' per-token outputs ``{name: [N_step]}`` in sample order."""
        if step != self._next:
            raise ValueError(f"steps run in order: expected step {self._next}, got {step}")
        self._next += 1
        self.release_through(step - 1)
        produced: dict[int, dict[str, torch.Tensor]] = {}
        for index in self.plan.steps[step].calls:
            call = self.plan.calls[index]
            if call.kept:
                self._run_kept(index)
            else:
                produced[index] = self._run(index, own=None, record=False)
        return self._gather(step, produced)

    def release(self, step: int) -> None:
        """Run the releases of ``step`` (after its backward)."""
        self.release_through(step)

    def release_through(self, step: int) -> None:
        """Run every release of the steps up to ``step`` not run yet."""
        while self._released < step:
            self._released += 1
            for index in self.plan.steps[self._released].releases:
                self._release(index)

    def finish(self) -> None:
        """Run every release left (after the last step's backward)."""
        if self._next != self.plan.num_steps:
            raise RuntimeError(f"finish() after {self._next} of {self.plan.num_steps} steps")
        self.release_through(self.plan.num_steps - 1)

    @property
    def done(self) -> bool:
        return self._next == self.plan.num_steps and self._released == self.plan.num_steps - 1

    def kept_bytes(self) -> int:
        """Bytes of kept K/V, accumulators and outputs now held."""
        return sum(state.nbytes() for state in self.kept.values())

    # ------------------------------------------------------------------ calls

    def _run(self, index: int, own: KeptState | None, record: bool) -> dict[str, torch.Tensor]:
        call = self.plan.calls[index]
        plan = self.plan.call_plan(index)
        if isinstance(plan, ContextPlan):  # else the whole forest in one call: a TreePlan
            plan = plan.with_runtime(CallRuntime(self, [self.kept[c] for c in call.context], own, record))
        return self.run_call(plan)

    def _run_kept(self, index: int) -> None:
        state = KeptState()
        self.kept[index] = state
        graph = self.training and torch.is_grad_enabled() and not self.plan.calls[index].recompute
        with torch.set_grad_enabled(graph):
            out = self._run(index, own=state, record=True)
        state.outputs = {name: t.detach() for name, t in out.items()}
        state.graph = out if graph else None

    def _release(self, index: int) -> None:
        state = self.kept[index]
        try:
            if self.training:
                self._backward_kept(index, state)
        finally:
            del self.kept[index]

    def _backward_kept(self, index: int, state: KeptState) -> None:
        out = state.graph
        if out is None:
            if not self.plan.calls[index].recompute:
                return  # planned for training but run without gradients (e.g. under no_grad)
            with torch.enable_grad():
                out = self._run(index, own=state, record=False)
        roots, grads = [], []
        for name, tensor in out.items():
            if tensor.requires_grad:
                grad = state.doutputs.get(name)
                roots.append(tensor)
                grads.append(torch.zeros_like(tensor) if grad is None else grad.to(tensor.dtype))
        if roots:
            torch.autograd.backward(roots, grads)
        state.graph = None

    def _gather(self, step: int, produced: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        sources, gather = self.plan.step_sources(step)
        parts: dict[str, list[torch.Tensor]] = {}
        for index in sources:
            if index in produced:
                outputs = produced[index]
            else:
                state = self.kept[index]
                runtime = CallRuntime(self, [], None, False)
                outputs = {n: runtime.read(state, t, state.doutputs, n) for n, t in state.outputs.items()}
            for name, tensor in outputs.items():
                parts.setdefault(name, []).append(tensor)
        result = {}
        for name, tensors in parts.items():
            if len(tensors) != len(sources):
                raise ValueError(f"every call must return the same outputs; {name!r} is missing from some")
            flat = tensors[0] if len(tensors) == 1 else torch.cat(tensors, 0)
            result[name] = flat.index_select(0, gather.to(flat.device))
        return result
