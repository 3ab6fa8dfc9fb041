"""Mini-batch plans: a prefix forest larger than one micro-batch, computed once across
micro-batches.

A micro-batch token budget (verl's ``ppo_max_token_len_per_gpu``) caps what one forward +
backward may hold. A sharing unit whose deduplicated tokens exceed it used to be split into
pieces that each recompute the shared prefix. Here the packed rows of the whole forest
(:class:`~ps_mcore.planner.TreePlan`, DFS pre-order) are cut into *ranges* of consecutive rows
and every row is computed once:

* A range ``[a, b)`` needs, as context, exactly the rows of the ancestor path of its first row
  (in pre-order every subtree is contiguous, so any ancestor outside the range is an ancestor
  of row ``a``). Those rows were computed by earlier ranges and *kept*: their per-layer K/V
  (and their per-token outputs) stay in memory for the ranges that continue them.
* The rows of a range that later ranges continue (``subtree_end > b``: the ancestor path of row
  ``b``) form the range's *kept calls* (one per release time: the rows of a unary chain share
  it), the others its *closed call*, which reads the kept calls like any other context. The
  kept state alive at any row is then exactly its ancestor path. A closed call's samples end inside the range, so its backward runs
  with the range's loss; a kept call's backward runs once, after the last range that reads it,
  with the K/V and output gradients its readers accumulated (a *release*).
* A kept call keeps its autograd graph (no extra compute; memory: its activations) or only
  its K/V (memory: ``kv_row_cost`` budget tokens per row; compute: its forward runs again
  just before its backward). The planner keeps graphs while they leave room and turns the
  largest into K/V-only when they do not: it walks the forest once per room threshold
  (:data:`MIN_ROOM_FRACTIONS`) and keeps the plan of least :func:`plan_cost` (recomputed rows
  against the fixed cost of more model calls).

Budget accounting, per range: ``rows computed + sum over the kept rows of its ancestor path
(graph: 1 token per row; K/V only: kv_row_cost per row) + state_cost per node a kept call
holds <= max_tokens`` (a kept call is released when the walk leaves its subtree).
``state_cost`` is what hybrid models (Gated DeltaNet, Mamba layers) keep besides K/V: every
recurrent layer's state and conv window where a kept node's rows end (the state its
continuations start from; see :func:`kept_state_cost`); 0 for attention-only models. A release
recomputes its call while only its ancestors' kept state is alive, which the range that
computed it already paid for. A prefix longer than the budget becomes a chain of K/V-kept
calls, each the context of the next (a prefix of a prefix).

Ranges without a sample ending in them (only kept rows, e.g. the first pieces of a long
prompt) run in the same *step* as the next range that has one: a step is what a training
loop sees as one micro-batch (its samples' loss, one backward); the releases of a step run
after its backward.

Pure numpy/torch (core layer): no Megatron, verl or Hugging Face import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ps_mcore.planner import PlanMemo, TreePlan, claim_memo, plan_on, plan_prefix_tree, ragged_arange

# A kept K/V row costs this many budget tokens by default: K and V of every layer (plus
# their fp32 gradient accumulators in training) against one token's activations. A cautious
# default: kept_kv_row_cost estimates 0.03 for a Qwen2.5-7B shape in bf16 training (0.13 under
# full activation recompute); integrations pass the model's own estimate.
DEFAULT_KV_ROW_COST = 0.25
# The planner walks the forest once per policy: when kept graphs leave less than this fraction
# of the budget for new rows, the largest are turned into K/V-only calls (recomputed before
# their backward). It keeps the plan of least cost (:func:`plan_cost`).
MIN_ROOM_FRACTIONS = (0.0, 0.125, 0.25, 0.5)
# A model call's fixed cost (launches, small kernels, host work) as a fraction of the budget's
# rows of forward + backward (512 rows at a 32k budget): what one more call (a step's, or a kept
# call's forward and its release's backward) must save to pay for itself.
CALL_OVERHEAD_FRACTION = 1 / 64


class BudgetTooSmall(ValueError):
    """``max_tokens`` cannot hold the kept context of some row (the message names both knobs)."""


@dataclass(frozen=True)
class Call:
    """One model call of a mini-batch plan: rows computed together.

    Attributes:
        index: position in :attr:`MiniBatchPlan.calls` (the order calls first run).
        step: the step whose forward runs it.
        rows: ``[R]`` global packed rows (ascending) of :attr:`MiniBatchPlan.tree`.
        context: kept calls whose rows this call reads as context, in creation order (their
            rows come first in the call's K/V buffer, then the call's own rows).
        kept: later calls read this call's rows (its K/V and per-token outputs are kept
            until its release).
        recompute: kept as K/V only (training): the call runs without a graph and runs
            again just before its backward. False for a kept call that keeps its graph.
        release: for a kept call, the step after whose backward its backward runs.
        tokens: ``[n]`` original tokens (global index into the concatenated sequences) whose
            packed row is in this call, ascending: the call's per-token outputs.
    """

    index: int
    step: int
    rows: np.ndarray
    context: tuple[int, ...]
    kept: bool
    recompute: bool
    release: int | None
    tokens: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.rows.size)


@dataclass(frozen=True)
class Step:
    """One micro-batch of a training loop: calls run in order, one loss, one backward.

    Attributes:
        calls: calls its forward runs, in order.
        samples: sequences (batch indices, ascending) whose loss this step computes.
        releases: kept calls whose backward runs after this step's backward, descendants
            first (a release adds to its ancestors' accumulated gradients).
        charge: the step's peak budget charge in tokens (rows computed + kept state).
    """

    index: int
    calls: tuple[int, ...]
    samples: tuple[int, ...]
    releases: tuple[int, ...]
    charge: float


@dataclass(eq=False)
class MiniBatchMemo:
    """What is derived from one :class:`MiniBatchPlan` on first use and kept with it.

    Attributes:
        call_plans: :meth:`MiniBatchPlan.call_plan` per call index (every step of every pass
            runs the same calls).
        step_sources: :meth:`MiniBatchPlan.step_sources` per step index.
        exit_rows: :func:`_exit_rows` of the plan (built with the first call plan).
    """

    call_plans: dict[int, "ContextPlan"] = field(default_factory=dict)
    step_sources: dict[int, tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=dict)
    exit_rows: dict[int, np.ndarray] | None = None


@dataclass(frozen=True, eq=False)
class MiniBatchPlan:
    """A prefix forest cut into model calls and steps under a token budget.

    Attributes:
        tree: the whole mini-batch's :class:`TreePlan` (global rows and tokens).
        calls, steps: see :class:`Call` and :class:`Step`.
        max_tokens: the budget (tokens per step, kept state included).
        kv_row_cost: budget tokens charged per kept K/V-only row.
        state_cost: budget tokens charged per node of a kept call (its recurrent layers'
            states and conv windows; 0 without recurrent layers).
        training: planned for forward + backward (False: forward only, nothing recomputed).
        range_ends: where the walk's ranges end (packed rows, ascending): the cuts a re-walk
            keeps when a step must be split (``min_steps``).
        memo: call plans and step sources, built on first use (:class:`MiniBatchMemo`).
    """

    tree: TreePlan
    calls: tuple[Call, ...]
    steps: tuple[Step, ...]
    max_tokens: int
    kv_row_cost: float
    training: bool
    range_ends: tuple[int, ...] = ()
    state_cost: float = 0.0
    memo: MiniBatchMemo = field(default_factory=MiniBatchMemo, repr=False, compare=False)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def computed_tokens(self) -> int:
        """Rows computed forward (T: each once), not counting recomputed forwards."""
        return self.tree.num_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Rows whose forward runs a second time before their backward (K/V-kept calls)."""
        return int(sum(c.num_rows for c in self.calls if c.recompute))

    def call_plan(self, index: int) -> "ContextPlan | TreePlan":
        """The :class:`ContextPlan` of call ``index`` (built once, cached); the tree itself for
        the one call of a forest that fits the budget (today's path, unchanged)."""
        call = self.calls[index]
        if not call.context and not call.kept and call.num_rows == self.tree.num_tokens:
            return self.tree
        plans = self.memo.call_plans
        if index not in plans:
            plans[index] = _context_plan(self, call)
        return plans[index]

    def step_sources(self, index: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """Where the per-token outputs of step ``index``'s samples come from.

        Returns ``(calls, gather)``: the concatenation of those calls' per-token outputs
        (each in its ``tokens`` order), indexed by ``gather`` ``[N_step]``, is the step's
        samples' tokens in sample order (each sample's tokens in sequence order)."""
        sources = self.memo.step_sources
        if index not in sources:
            sources[index] = _step_sources(self, self.steps[index])
        return sources[index]

    def sample_tokens(self, samples: Sequence[int]) -> np.ndarray:
        """Global token indices of ``samples``' tokens, sample after sample."""
        lens = np.asarray(self.tree.seq_lens, dtype=np.int64)
        offsets = np.cumsum(lens) - lens
        s = np.asarray(samples, dtype=np.int64)
        return ragged_arange(offsets[s], lens[s])

    def stats(self) -> dict[str, Any]:
        """Tokens unshared / computed / recomputed, steps, calls and the peak charge."""
        return {
            "N": self.tree.num_input_tokens,
            "T": self.tree.num_tokens,
            "recomputed": self.recomputed_tokens,
            "steps": self.num_steps,
            "calls": len(self.calls),
            "kept_calls": sum(c.kept for c in self.calls),
            "peak_charge": max((s.charge for s in self.steps), default=0.0),
        }


# ----------------------------------------------------------------------------- walk


@dataclass
class _Kept:
    call: int
    rows: np.ndarray
    end: int  # its subtree ends here: released once the walk reaches it
    graph: bool
    nodes: int  # nodes its rows belong to: where recurrent states may be kept

    def charge(self, kv_row_cost: float, state_cost: float) -> float:
        return self.rows.size * (1.0 if self.graph else kv_row_cost) + self.nodes * state_cost


@dataclass
class _Range:
    start: int
    end: int
    calls: list[int]
    charge: float


class _Walk:
    """The greedy pre-order walk behind :func:`schedule_tree` (one instance per plan)."""

    def __init__(self, tree: TreePlan, max_tokens: int, kv_row_cost: float, training: bool,
                 cuts: frozenset[int], min_room: float, state_cost: float = 0.0):
        host = tree.host
        self.tree = tree
        self.t = tree.num_tokens
        self.budget = float(max_tokens)
        self.rho = float(kv_row_cost)
        self.state_cost = float(state_cost)
        self.training = training
        self.min_room = min_room
        self.subtree_end = host.subtree_end.cpu().numpy()
        self.depth = np.append(host.position_ids.cpu().numpy(), 0)  # row T: a root boundary
        starts = host.cu_seqlens_q.cpu().numpy()[:-1].astype(np.int64)
        self.node_starts = starts
        self.boundaries = np.append(starts[starts > 0], self.t)  # where a range may end
        self.cuts = np.array(sorted(cuts), dtype=np.int64)
        self.kept: list[_Kept] = []  # alive, creation order
        self.all_kept: dict[int, _Kept] = {}
        self.calls: list[dict] = []
        self.ranges: list[_Range] = []

    def charge(self) -> float:
        return sum(k.charge(self.rho, self.state_cost) for k in self.kept)

    def release_until(self, a: int) -> None:
        self.kept = [k for k in self.kept if k.end > a]

    def make_room(self, a: int) -> float:
        """Room for new rows at ``a``, turning kept graphs into K/V-only calls (largest first)
        while the room is under ``min_room`` of the budget (or under one row)."""
        room = self.budget - self.charge()
        while room < max(self.min_room * self.budget, 1):
            graphs = [k for k in self.kept if k.graph]
            if not graphs:
                break
            largest = max(graphs, key=lambda k: k.rows.size)
            largest.graph = False
            room = self.budget - self.charge()
        if room < 1:
            path = int(self.depth[a])
            raise BudgetTooSmall(
                f"max_tokens={int(self.budget)} cannot hold the context of packed row {a}: its "
                f"{path} ancestor rows are kept at kv_row_cost={self.rho:g} tokens each "
                f"(and state_cost={self.state_cost:g} per kept node: {self.charge():.0f} tokens); "
                "raise max_tokens (or lower kv_row_cost)"
            )
        return room

    def range_end(self, a: int, room: float) -> int:
        """Where the range starting at ``a`` ends: a forced cut if one is within reach; else
        the node boundary with the shortest context path in the upper half of the room (so
        the next range keeps little), the largest boundary within reach, or inside a node."""
        limit = min(self.t, a + int(room))
        forced = self.cuts[(self.cuts > a) & (self.cuts <= limit)]
        if forced.size:
            return int(forced[0])
        if limit == self.t:
            return self.t
        within = self.boundaries[(self.boundaries > a) & (self.boundaries <= limit)]
        if within.size == 0:
            return limit  # a node longer than the room: cut inside it
        upper = within[within >= a + room / 2]
        if upper.size:
            depth = self.depth[upper]
            best = upper[depth == depth.min()]
            return int(best[-1])
        return int(within[-1])

    def add_call(self, rows: np.ndarray, kept: bool) -> int:
        index = len(self.calls)
        # The kept calls alive at the range start are the ancestors of its first row; a range
        # may run past the end of some of their subtrees. A kept call reads only its own
        # ancestors (it may run again at its release, after those others are gone); the
        # closed call reads them all (its rows may lie in any of their subtrees).
        context = tuple(k.call for k in self.kept if not kept or k.end > rows[0])
        self.calls.append(dict(rows=rows, context=context, kept=kept))
        if kept:
            nodes = np.unique(np.searchsorted(self.node_starts, rows, side="right")).size
            entry = _Kept(index, rows, int(self.subtree_end[rows[0]]), graph=self.training, nodes=nodes)
            self.all_kept[index] = entry
        return index

    def run(self) -> None:
        a = 0
        while a < self.t:
            self.release_until(a)
            room = self.make_room(a)
            b = self.range_end(a, room)
            charge = self.charge() + (b - a)
            rows = np.arange(a, b, dtype=np.int64)
            is_open = self.subtree_end[a:b] > b
            calls = []
            # One kept call per release time (the rows of a unary chain share their subtree
            # end), top first: the kept state alive at any row is then exactly its ancestors.
            open_rows = rows[is_open]
            ends = self.subtree_end[open_rows]
            for group in np.split(open_rows, np.flatnonzero(np.diff(ends)) + 1) if open_rows.size else []:
                kept_call = self.add_call(group, kept=True)
                calls.append(kept_call)
                self.kept.append(self.all_kept[kept_call])
            if (~is_open).any():
                calls.append(self.add_call(rows[~is_open], kept=False))
            self.ranges.append(_Range(a, b, calls, charge))
            a = b


def schedule_tree(
    tree: TreePlan,
    max_tokens: int,
    kv_row_cost: float = DEFAULT_KV_ROW_COST,
    training: bool = True,
    min_steps: int | None = None,
    *,
    state_cost: float = 0.0,
) -> MiniBatchPlan:
    """Cut ``tree`` (a whole mini-batch, or one sharing unit) into calls and steps.

    Args:
        tree: the mini-batch's plan.
        max_tokens: the micro-batch token budget (rows computed + kept state per step).
        kv_row_cost: budget tokens per kept K/V-only row (see :func:`kept_kv_row_cost`).
        training: plan for forward + backward; False plans a forward-only pass (kept state is
            K/V only and nothing is recomputed).
        min_steps: at least this many steps (e.g. the most any data-parallel rank needs):
            steps are split at a sample end until there are. Raises when no step has two
            samples ending at different rows.
        state_cost: budget tokens per node of a kept call, for models with recurrent layers
            (see :func:`kept_state_cost`); 0 for attention-only models.

    Returns:
        A :class:`MiniBatchPlan`. A tree that fits the budget is one step of one call.
    """
    _check_budget(max_tokens, kv_row_cost)
    if not float(state_cost) >= 0:
        raise ValueError(f"state_cost must be >= 0 budget tokens per kept node, got {state_cost!r}")
    cuts: frozenset[int] = frozenset()
    rooms = MIN_ROOM_FRACTIONS if training else MIN_ROOM_FRACTIONS[:1]  # forward only: no graphs
    plans = [_plan_from_walk(tree, max_tokens, kv_row_cost, training, cuts, room, state_cost) for room in rooms]
    best = min(range(len(plans)), key=lambda i: (plan_cost(plans[i]), i))
    plan, room = plans[best], rooms[best]
    while min_steps is not None and plan.num_steps < min_steps:
        cut = _extra_cut(plan)
        if cut is None:
            raise ValueError(
                f"cannot make {min_steps} steps from this mini-batch: it has {plan.num_steps} and "
                "no step holds two samples ending at different rows"
            )
        cuts = frozenset(plan.range_ends) | {cut}
        plan = _plan_from_walk(tree, max_tokens, kv_row_cost, training, cuts, room, state_cost)
    return plan


def plan_cost(plan: MiniBatchPlan) -> float:
    """A plan's cost in forward row passes: 3 per computed row (forward + backward; 1 forward
    only), 1 per recomputed row, and ``CALL_OVERHEAD_FRACTION * max_tokens`` rows per model
    call (kept calls included)."""
    return _row_passes(plan.computed_tokens, len(plan.calls), plan.max_tokens, plan.training) + plan.recomputed_tokens


def split_cost(piece_tokens: Sequence[int], steps: int, max_tokens: int, training: bool = True) -> float:
    """What running a forest as pieces costs, in :func:`plan_cost`'s units: pieces of whole
    samples that each compute the prefix their samples share (``piece_tokens``: their
    deduplicated tokens), packed into ``steps`` micro-batches of one model call each.

    A schedule of the same forest computes every row once but adds a call per kept prefix:
    where the prefixes the pieces repeat are shorter than that call's fixed cost (a chat
    header shared by every group), the pieces are cheaper."""
    return _row_passes(float(sum(piece_tokens)), steps, max_tokens, training)


def _row_passes(rows: float, calls: int, max_tokens: int, training: bool) -> float:
    """Forward row passes of computing ``rows`` in ``calls`` model calls: 3 per row (forward +
    backward; 1 forward only), each call's fixed cost counted as rows."""
    return (3 if training else 1) * (rows + CALL_OVERHEAD_FRACTION * max_tokens * calls)


def plan_minibatch(
    sequences: Sequence[Any],
    max_tokens: int,
    kv_row_cost: float = DEFAULT_KV_ROW_COST,
    training: bool = True,
    mode: str = "arbitrary_prefix",
    min_prefix_len: int = 8,
    min_group_size: int = 2,
    prompt_lens: Sequence[int] | None = None,
    group_ids: Sequence[Any] | None = None,
    min_steps: int | None = None,
    *,
    state_cost: float = 0.0,
) -> MiniBatchPlan:
    """:func:`plan_prefix_tree` of the whole mini-batch, then :func:`schedule_tree`."""
    tree = plan_prefix_tree(sequences, mode, min_prefix_len, min_group_size, prompt_lens, group_ids)
    return schedule_tree(tree, max_tokens, kv_row_cost, training, min_steps, state_cost=state_cost)


def _check_budget(max_tokens, kv_row_cost) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    cost = float(kv_row_cost)
    if not 0 < cost <= 1:
        raise ValueError(f"kv_row_cost must be in (0, 1] budget tokens per kept row, got {kv_row_cost!r}")


def _extra_cut(plan: MiniBatchPlan) -> int | None:
    """A sample end inside the largest step that has two samples ending at different rows."""
    tree = plan.tree.host
    lens = np.asarray(tree.seq_lens, dtype=np.int64)
    last_row = tree.unpack_index.cpu().numpy()[np.cumsum(lens) - 1]
    best = None
    for step in plan.steps:
        ends = np.unique(last_row[list(step.samples)])
        if ends.size < 2:
            continue
        rows = sum(plan.calls[c].num_rows for c in step.calls)
        if best is None or rows > best[0]:
            best = (rows, int(ends[(ends.size - 1) // 2]) + 1)
    return None if best is None else best[1]


def _plan_from_walk(tree, max_tokens, kv_row_cost, training, cuts, min_room, state_cost=0.0) -> MiniBatchPlan:
    walk = _Walk(tree, max_tokens, kv_row_cost, training, cuts, min_room, state_cost)
    walk.run()
    host = tree.host
    lens = np.asarray(host.seq_lens, dtype=np.int64)
    unpack = host.unpack_index.cpu().numpy()
    last_row = unpack[np.cumsum(lens) - 1]

    # Steps: ranges merged forward until one has a sample ending in it.
    range_of_row = np.zeros(walk.t, dtype=np.int64)
    for i, r in enumerate(walk.ranges):
        range_of_row[r.start:r.end] = i
    samples_per_range: list[list[int]] = [[] for _ in walk.ranges]
    for s, row in enumerate(last_row):
        samples_per_range[range_of_row[row]].append(s)
    step_of_range = np.zeros(len(walk.ranges), dtype=np.int64)
    groups: list[list[int]] = [[]]
    for i in range(len(walk.ranges)):
        groups[-1].append(i)
        step_of_range[i] = len(groups) - 1
        if samples_per_range[i] and i < len(walk.ranges) - 1:
            groups.append([])
    # Releases: a kept call is released after the step whose range reaches its subtree end.
    range_ends = np.array([r.end for r in walk.ranges], dtype=np.int64)
    call_step = {}
    for i, r in enumerate(walk.ranges):
        for c in r.calls:
            call_step[c] = int(step_of_range[i])
    release_of: dict[int, int] = {}
    for c, k in walk.all_kept.items():
        release_of[c] = int(step_of_range[np.searchsorted(range_ends, k.end, side="left")])

    call_of_row = np.zeros(walk.t, dtype=np.int64)
    for i, spec in enumerate(walk.calls):
        call_of_row[spec["rows"]] = i
    token_call = call_of_row[unpack]
    order = np.argsort(token_call, kind="stable")
    bounds = np.searchsorted(token_call[order], np.arange(len(walk.calls) + 1))
    calls = []
    for i, spec in enumerate(walk.calls):
        kept = spec["kept"]
        calls.append(Call(
            index=i, step=call_step[i], rows=spec["rows"], context=spec["context"], kept=kept,
            recompute=bool(kept and training and not walk.all_kept[i].graph),
            release=release_of.get(i), tokens=order[bounds[i]:bounds[i + 1]],
        ))
    steps = []
    for j, members in enumerate(groups):
        step_calls = tuple(c for i in members for c in walk.ranges[i].calls)
        releases = tuple(sorted((c for c, s in release_of.items() if s == j), reverse=True))
        steps.append(Step(
            index=j, calls=step_calls,
            samples=tuple(s for i in members for s in sorted(samples_per_range[i])),
            releases=releases, charge=max(walk.ranges[i].charge for i in members),
        ))
    return MiniBatchPlan(tree, tuple(calls), tuple(steps), int(max_tokens), float(kv_row_cost), training,
                         range_ends=tuple(r.end for r in walk.ranges), state_cost=float(state_cost))


# ----------------------------------------------------------------------------- call plans


@dataclass(frozen=True, eq=False)
class ContextPlan:
    """What the model needs to run one call: its own rows plus K/V of kept context rows.

    The call's K/V buffer is ``[context rows; own rows]`` (``C + R`` rows): the kept calls'
    rows in :attr:`context_calls` order, each call's rows in its ``rows`` order, then the rows
    this call computes. Every query segment (a node's rows in this call) attends to its
    ancestor chain and its own node's rows up to itself through ``kv_index`` into that buffer,
    bottom-right causal as in :mod:`ps_mcore.attention.gather_kv`.

    Attributes:
        input_ids, position_ids, multiplicity: ``[R]`` of the own rows (global depths, and the
            number of samples sharing each row in the whole mini-batch: MoE router weights).
        cu_seqlens_q, cu_seqlens_kv: ``[S+1]`` int32 query segments and their contexts.
        kv_index: ``[sum of contexts]`` rows of the ``[C + R]`` buffer.
        max_seqlen_q, max_seqlen_kv: longest segment / context (= deepest row + 1).
        context_calls, context_rows: kept calls read as context and their row counts.
        unpack_index: ``[n]`` own row of each of the call's original tokens (``Call.tokens``).
        next_token_ids, next_token_mask: ``[n]`` each token's label and whether it has one.
        segment_parent: ``[S]`` for recurrent layers: the query segment whose last row is the
            row before this segment's first row on its root path, or -1 when that row is not
            an own row (a root, or a row of a context call).
        segment_entry: ``[S]`` where a segment's path comes from a context call: the index of
            that row's kept recurrent state in the concatenation of the context calls' exit
            states (``exit_rows`` of each, in ``context_calls`` order), else -1.
        exit_rows: ``[X]`` own rows (ascending) whose recurrent state and conv window later
            calls start from (the last row of a segment; empty unless the call is kept).
        call: the call's index in its :class:`MiniBatchPlan`.
        runtime: the schedule's run-time state for this call (set by the schedule runner;
            not part of the plan's value): where the attention reads kept K/V.
        memo: the host copy, moved copies and ``max_token_id`` (:class:`~ps_mcore.planner.
            PlanMemo`; a copy with another runtime shares it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    multiplicity: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    context_calls: tuple[int, ...]
    context_rows: tuple[int, ...]
    unpack_index: torch.Tensor
    next_token_ids: torch.Tensor
    next_token_mask: torch.Tensor
    segment_parent: torch.Tensor
    segment_entry: torch.Tensor
    exit_rows: torch.Tensor
    call: int
    runtime: Any = field(default=None, compare=False)
    memo: PlanMemo = field(default_factory=PlanMemo, repr=False, compare=False)

    def __post_init__(self) -> None:
        claim_memo(self, ignore=("runtime",))

    @property
    def num_tokens(self) -> int:
        """R, the rows this call computes."""
        return int(self.input_ids.numel())

    @property
    def num_input_tokens(self) -> int:
        """n, the call's original tokens (its per-token outputs)."""
        return int(self.unpack_index.numel())

    @property
    def num_context_rows(self) -> int:
        return int(sum(self.context_rows))

    @property
    def is_trivial(self) -> bool:  # contexts are rows of the [C + R] buffer: always gathered
        return False

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def host(self) -> "ContextPlan":
        """The plan's CPU copy (a plan moved by :meth:`to` keeps it), else the plan itself."""
        return self.memo.host or self

    @property
    def max_token_id(self) -> int:
        """Largest label id (on the host copy: no device sync), computed once per plan."""
        memo = self.host.memo
        if memo.max_token_id is None:
            ids = self.host.next_token_ids
            memo.max_token_id = int(ids.max()) if ids.numel() else -1
        return memo.max_token_id

    def to(self, device) -> "ContextPlan":
        """The plan on ``device`` (copied once per device; the runtime travels with it)."""
        moved = plan_on(self, device)
        return moved if moved.runtime is self.runtime else dataclasses.replace(moved, runtime=self.runtime)

    def with_runtime(self, runtime) -> "ContextPlan":
        """This plan carrying ``runtime`` (same tensors, the same memo)."""
        return dataclasses.replace(self, runtime=runtime)


def _context_plan(plan: MiniBatchPlan, call: Call) -> ContextPlan:
    tree = plan.tree.host
    rows = call.rows
    ctx_rows = [plan.calls[c].rows for c in call.context]
    buffer_rows = np.concatenate(ctx_rows + [rows]) if ctx_rows else rows
    position = np.full(tree.num_tokens, -1, dtype=np.int64)
    position[buffer_rows] = np.arange(buffer_rows.size)

    cu_q = tree.cu_seqlens_q.cpu().numpy().astype(np.int64)
    cu_kv = tree.cu_seqlens_kv.cpu().numpy().astype(np.int64)
    kv_index = tree.kv_index.cpu().numpy()
    node_of_row = np.searchsorted(cu_q, rows, side="right") - 1
    # Query segments: maximal runs of consecutive rows of one node.
    new_seg = np.ones(rows.size, dtype=bool)
    new_seg[1:] = (node_of_row[1:] != node_of_row[:-1]) | (rows[1:] != rows[:-1] + 1)
    seg_start = np.flatnonzero(new_seg)
    seg_end = np.append(seg_start[1:], rows.size)
    seg_node = node_of_row[seg_start]
    last_row = rows[seg_end - 1]
    ancestors = np.diff(cu_kv)[seg_node] - np.diff(cu_q)[seg_node]
    ctx_len = ancestors + (last_row + 1 - cu_q[seg_node])
    global_ctx = kv_index[ragged_arange(cu_kv[seg_node], ctx_len)]
    index = position[global_ctx]
    if (index < 0).any():  # a planner invariant: every ancestor is kept or computed here
        raise AssertionError(f"call {call.index} reads rows that are neither kept nor its own")

    unpack = tree.unpack_index.cpu().numpy()
    local = np.full(tree.num_tokens, -1, dtype=np.int64)
    local[rows] = np.arange(rows.size)
    tokens = call.tokens

    def long(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    def cu32(lengths):
        return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    # Recurrent layers: where each segment's state comes from (an own segment, a context
    # call's exit, or a root) and which own rows later calls continue from.
    exits = _exit_rows(plan)
    pred = _path_predecessor(tree, rows[seg_start])
    own_end = np.full(tree.num_tokens, -1, dtype=np.int64)
    own_end[last_row] = np.arange(seg_start.size)
    from_own = pred >= 0
    from_own[from_own] = own_end[pred[from_own]] >= 0
    segment_parent = np.where(from_own, own_end[np.maximum(pred, 0)], -1)
    segment_entry = np.full(seg_start.size, -1, dtype=np.int64)
    offset = 0
    for c, c_rows in zip(call.context, ctx_rows):
        c_exits = exits.get(c, np.zeros(0, dtype=np.int64))
        hit = ~from_own & (pred >= 0) & np.isin(pred, c_rows)
        segment_entry[hit] = offset + np.searchsorted(c_exits, pred[hit])
        offset += c_exits.size
    if ((pred >= 0) & ~from_own & (segment_entry < 0)).any():  # a planner invariant
        raise AssertionError(f"call {call.index} continues rows that are neither kept nor its own")
    exit_rows = local[exits.get(call.index, np.zeros(0, dtype=np.int64))]

    seg_len = seg_end - seg_start
    rows_t = torch.from_numpy(rows)
    return ContextPlan(
        input_ids=tree.input_ids[rows_t].clone(),
        position_ids=tree.position_ids[rows_t].clone(),
        multiplicity=tree.multiplicity[rows_t].clone(),
        cu_seqlens_q=cu32(seg_len),
        cu_seqlens_kv=cu32(ctx_len),
        kv_index=long(index),
        max_seqlen_q=int(seg_len.max(initial=0)),
        max_seqlen_kv=int(ctx_len.max(initial=0)),
        context_calls=tuple(call.context),
        context_rows=tuple(int(r.size) for r in ctx_rows),
        unpack_index=long(local[unpack[tokens]]),
        next_token_ids=tree.next_token_ids[torch.from_numpy(tokens)].clone(),
        next_token_mask=tree.next_token_mask[torch.from_numpy(tokens)].clone(),
        segment_parent=long(segment_parent),
        segment_entry=long(segment_entry),
        exit_rows=long(exit_rows),
        call=call.index,
    )


def _path_predecessor(tree: TreePlan, rows: np.ndarray) -> np.ndarray:
    """``[n]`` the row before each of ``rows`` on its root path (the previous row of its node,
    or its parent node's last row), -1 at a root's first row. ``tree``: a host plan."""
    cu_q = tree.cu_seqlens_q.cpu().numpy().astype(np.int64)
    parent = tree.node_parent.cpu().numpy().astype(np.int64)
    node = np.searchsorted(cu_q, rows, side="right") - 1
    first = rows == cu_q[node]
    up = parent[node]
    return np.where(first, np.where(up >= 0, cu_q[np.maximum(up, 0) + 1] - 1, -1), rows - 1)


def _exit_rows(plan: MiniBatchPlan) -> dict[int, np.ndarray]:
    """Kept call -> ``[X]`` its rows (global, ascending) that rows of other calls continue on
    their root path: where recurrent layers keep their state and conv window. Built once per
    plan (:class:`MiniBatchMemo`)."""
    if plan.memo.exit_rows is None:
        tree = plan.tree.host
        cu_q = tree.cu_seqlens_q.cpu().numpy().astype(np.int64)
        call_of_row = np.zeros(tree.num_tokens, dtype=np.int64)
        for c in plan.calls:
            call_of_row[c.rows] = c.index
        exits: dict[int, set[int]] = {}
        for c in plan.calls:
            rows = c.rows
            node = np.searchsorted(cu_q, rows, side="right") - 1
            starts = rows[np.flatnonzero(np.r_[True, (node[1:] != node[:-1]) | (rows[1:] != rows[:-1] + 1)])]
            pred = _path_predecessor(tree, starts)
            pred = pred[pred >= 0]
            owner = call_of_row[pred]
            for p, o in zip(pred[owner != c.index].tolist(), owner[owner != c.index].tolist()):
                exits.setdefault(o, set()).add(p)
        plan.memo.exit_rows = {c: np.array(sorted(r), dtype=np.int64) for c, r in exits.items()}
    return plan.memo.exit_rows


def _step_sources(plan: MiniBatchPlan, step: Step) -> tuple[tuple[int, ...], torch.Tensor]:
    tokens = plan.sample_tokens(step.samples)
    call_of_token = np.zeros(plan.tree.num_input_tokens, dtype=np.int64)
    offset_in_call = np.zeros(plan.tree.num_input_tokens, dtype=np.int64)
    for c in plan.calls:
        call_of_token[c.tokens] = c.index
        offset_in_call[c.tokens] = np.arange(c.tokens.size)
    sources = tuple(sorted(set(call_of_token[tokens].tolist())))
    base = {}
    total = 0
    for c in sources:
        base[c] = total
        total += plan.calls[c].tokens.size
    gather = np.array([base[c] for c in call_of_token[tokens]], dtype=np.int64) + offset_in_call[tokens]
    return sources, torch.from_numpy(gather)


# ----------------------------------------------------------------------------- costs


def kept_kv_row_cost(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    training: bool = True,
    full_recompute: bool = False,
    dtype_bytes: int = 2,
) -> float:
    """Budget tokens one kept K/V row costs: its bytes against one token's activations.

    Kept: K and V of every layer (``2 * kv_heads * head_dim`` values each, in the activation
    dtype) plus, in training, their fp32 gradient accumulators; one token's activations:
    :func:`token_activation_bytes`. Clamped to (0, 1]."""
    kv = 2 * kv_heads * head_dim
    kept = layers * kv * (dtype_bytes + (4 if training else 0))
    act = token_activation_bytes(layers, hidden, heads, kv_heads, head_dim, ffn, vocab, training,
                                 full_recompute, dtype_bytes)
    return float(min(1.0, max(kept / act, 1e-6)))


def token_activation_bytes(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
                           training: bool = True, full_recompute: bool = False, dtype_bytes: int = 2) -> float:
    """An estimate of what a micro-batch holds per token (the unit of the token budget).

    Training: per layer the inputs of both norms and of the four linear layers, q/k/v and the
    attention output (flash attention: no score matrix) and the SwiGLU MLP's intermediates;
    with full recompute only each layer's input plus one layer's working set; plus the LM
    head's logits (activation dtype) and their fp32 softmax. Forward only: one layer's working
    set and the logits."""
    per_layer = dtype_bytes * (4 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 4 * ffn)
    logits = vocab * (dtype_bytes + 4)
    if not training:
        return float(max(per_layer + logits, 1))
    layers_act = layers * dtype_bytes * hidden + per_layer if full_recompute else layers * per_layer
    return float(max(layers_act + logits, 1))


def kept_state_cost(state_values: int, window_values: int, token_bytes: float, training: bool = True,
                    dtype_bytes: int = 2) -> float:
    """Budget tokens one kept node's recurrent state costs (``state_cost`` of
    :func:`schedule_tree`): where a kept call's node ends, every recurrent layer keeps its
    state (fp32) and its conv window (the last ``kernel - 1`` conv inputs, activation dtype),
    and in training their fp32 gradient accumulators.

    Args:
        state_values: elements of one state summed over the recurrent layers (Gated DeltaNet:
            ``value_heads * key_head_dim * value_head_dim``; Mamba-2: ``heads * head_dim *
            d_state``), per tensor-parallel rank.
        window_values: elements of one conv window summed over those layers (``(kernel - 1)
            * conv channels``).
        token_bytes: one token's activations (:func:`token_activation_bytes`).
    """
    grads = 4 if training else 0
    kept = state_values * (4 + grads) + window_values * (dtype_bytes + grads)
    return float(kept / max(token_bytes, 1))
