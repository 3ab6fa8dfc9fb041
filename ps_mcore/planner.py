"""Prefix-tree planner: token sequences of one micro-batch -> :class:`TreePlan`.

The plan is a compacted trie over whole sequences laid out in DFS pre-order. A node is a
maximal run of tokens shared by the same set of sequences; every packed row keeps its
original position (its depth in the tree), so RoPE sees what it saw in the unshared sample.

Pure numpy/torch: no Megatron, verl or Hugging Face import, so every integration (and the
tests) share one planner. Per-token work is vectorised; Python loops run over sequences and
nodes only (a few thousand at most per micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

MODES = ("arbitrary_prefix", "prompt_only")


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every (s, l): the workhorse of the layout."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_begin = np.cumsum(lengths) - lengths
    return np.repeat(starts - seg_begin, lengths) + np.arange(total, dtype=np.int64)


class PlanMemo:
    """What is derived from one :class:`TreePlan` and kept with it (never part of its value).
    One call's :class:`~ps_mcore.minibatch.ContextPlan` keeps its host copy, moved copies and
    ``max_token_id`` in one the same way (:func:`plan_on`, :func:`claim_memo`).

    Every layer of a micro-batch runs on the same plan, so what a kernel derives from it is
    built once and kept here, one named field per thing. Layouts are built on the host copy
    (``plan.host.memo``): a plan moved to the GPU by :meth:`TreePlan.to` keeps its CPU copy, so
    building them costs no device-to-host sync; per-device copies sit on the moved plan's memo,
    keyed by device. Owners (who reads and writes each field) are named with it.

    A memo belongs to the plan values it was derived from (``source``): ``dataclasses.replace``
    hands it on when they are the same objects and a plan with other values starts a fresh one.

    Not a dataclass, nor a container, on purpose: a moved plan and its host copy link each
    other through their memos (``host``, ``moved``), and generic walkers of a forward's inputs
    descend into dataclasses field by field (FSDP's input cast ``_apply_to_tensors``, which
    rebuilds them with ``dataclasses.replace``; FSDP2's post-backward hook registration). They
    stop here: they never follow the links (a walk of a linked plan recursed without end) and
    a plan they rebuild keeps this memo, the same object. Model kwargs carry a plan in
    ``fsdp_bridge``'s opaque ``TreeCall``, so such walkers do not even rebuild it.

    Attributes:
        source: the plan's field values the memo was derived from (tensors held and compared
            by identity, the rest by equality); None until a plan takes the memo.
        host: the CPU copy a plan moved by :meth:`TreePlan.to` keeps (None: the plan is its
            own host copy, or it was built on a device).
        moved: ``TreePlan.to`` (:func:`plan_on`): the plan on each other device, so per-layer
            calls copy once.
        max_token_id: ``TreePlan.max_token_id`` (host memo): the vocabulary bound log-prob
            kernels check, read without a device sync.
        fingerprint: ``layer_specs.parallel.pipeline.plan_fingerprint`` (host memo): the hash
            every model-parallel rank compares before a step.
        cascade_layouts: ``attention.layout.cascade_layout`` per device (the CPU entry on the
            host memo is the one build): the varlen calls of the cascade.
        kv_copies_csr: ``attention.scatter.copies_csr`` per device: ``(row_ptr [T+1],
            copies [C])``, the row -> context copies index of the fused dK/dV scatter-add.
        windowed_contexts: ``attention.gather_kv.gather_context`` per ``(window, device)``:
            each node's gather-KV context cut to a sliding window (with its CSR).
        kernel_choice_shape: ``attention.kernel_choice.plan_shape`` (host memo): the plan's
            shape numbers ``(pairs, rows, contexts, segments, levels, cascade)``.
        flex_block_masks: ``attention.flex.block_mask`` per ``(device, window)``:
            FlexAttention's ``BlockMask`` of the plan.
        recurrent_trees: ``recurrent.tree.recurrent_tree`` per row count (``T_pad``): the
            chains and levels every recurrent layer of the micro-batch scans.
        backend_choices: ``attention.tree_attention``: the backend a name resolved to per
            ``(name, device, dtype, Hq, D, variant features, grad)``, so the layers after the
            first skip the availability checks and the kernel-choice rule.
    """

    __slots__ = (
        "host", "moved", "max_token_id", "fingerprint", "cascade_layouts", "kv_copies_csr",
        "windowed_contexts", "kernel_choice_shape", "flex_block_masks", "recurrent_trees", "backend_choices",
        "source",
    )

    def __init__(self) -> None:
        self.host: TreePlan | None = None
        self.moved: dict[torch.device, TreePlan] = {}
        self.max_token_id: int | None = None
        self.fingerprint: int | None = None
        self.cascade_layouts: dict[torch.device, Any] = {}
        self.kv_copies_csr: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.windowed_contexts: dict[tuple[int, torch.device], Any] = {}
        self.kernel_choice_shape: tuple | None = None
        self.flex_block_masks: dict[tuple[torch.device, int | None], Any] = {}
        self.recurrent_trees: dict[int, Any] = {}
        self.backend_choices: dict[tuple, str] = {}
        self.source: tuple | None = None

    def belongs_to(self, values: tuple) -> bool:
        """Whether ``values`` (a plan's field values) are those this memo was derived from."""
        if self.source is None:
            return True
        return len(values) == len(self.source) and all(
            a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
            for a, b in zip(values, self.source)
        )


_CPU = torch.device("cpu")


def host_built(
    plan: "TreePlan",
    entries: Callable[[PlanMemo], dict],
    device: torch.device | str,
    build: Callable[["TreePlan"], Any],
    move: Callable[[Any, torch.device], Any],
) -> Any:
    """``entries(plan.memo)[device]``, one per-device field of the memo: built once by
    ``build(plan.host)`` (kept as the host memo's CPU entry), then copied to ``device`` by
    ``move``; so every device's copy comes from one host build, without a device sync."""
    device = torch.device(device)
    mine = entries(plan.memo)
    if device not in mine:
        on_host = entries(plan.host.memo)
        if _CPU not in on_host:
            on_host[_CPU] = build(plan.host)
        mine[device] = on_host[_CPU] if device.type == "cpu" else move(on_host[_CPU], device)
    return mine[device]


@dataclass(frozen=True, eq=False)
class TreePlan:
    """A micro-batch packed as a prefix forest (all tensors on one device).

    Shapes: ``T`` packed tokens, ``N`` original tokens (sequences concatenated in batch
    order), ``M`` tree nodes, ``C`` = sum over nodes of their context length (ancestors + own).

    Attributes:
        input_ids: ``[T]`` packed tokens in DFS pre-order.
        position_ids: ``[T]`` original position (tree depth) of every packed token.
        unpack_index: ``[N]`` packed row of every original token.
        seq_lens: original sequence lengths, batch order (``N = sum``).
        cu_seqlens_q: ``[M+1]`` int32 node boundaries in the packed rows (queries need no gather).
        cu_seqlens_kv: ``[M+1]`` int32 boundaries of each node's context in ``kv_index``.
        kv_index: ``[C]`` packed rows of each node's ancestor chain followed by its own rows.
        max_seqlen_q: longest node.
        max_seqlen_kv: longest context (= deepest node end).
        subtree_end: ``[T]`` end of the packed range of each token's node subtree; token q may
            attend to token k iff ``k <= q < subtree_end[k]``.
        next_token_ids: ``[N]`` token following each original token (0 after a sequence's last).
        next_token_mask: ``[N]`` bool, False at each sequence's last token.
        node_parent: ``[M]`` parent node (-1 for roots), for statistics and plotting.
        multiplicity: ``[T]`` int64, how many original tokens each packed row stands for (the
            number of samples sharing it; ``sum = N``). The weight that turns a statistic over
            the T packed rows (MoE router losses, expert token counts) into the statistic over
            the N tokens of the unshared batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    unpack_index: torch.Tensor
    seq_lens: tuple[int, ...]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    kv_index: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    subtree_end: torch.Tensor
    next_token_ids: torch.Tensor
    next_token_mask: torch.Tensor
    node_parent: torch.Tensor
    multiplicity: torch.Tensor
    # What kernels derive from the plan, kept with it (PlanMemo says when a copy shares it).
    memo: PlanMemo = field(default_factory=PlanMemo, repr=False, compare=False)

    def __post_init__(self) -> None:
        claim_memo(self)

    # Keeps the plan opaque to torch.compile: Dynamo (torch 2.11) builds every field of a frozen
    # dataclass it meets (e.g. a plan handed to the compiler-disabled tree_attention, at the
    # graph break) and guards on them (len(seq_lens), tensor ranks, 0/1 sizes), so every new
    # sequence count compiled a new graph. With a class-level __getattribute__ Dynamo treats the
    # plan as a plain object guarded on its type and traces only the reads compiled code makes
    # (through super(), which it can trace; ``object.__getattribute__(self, name)`` it cannot).
    def __getattribute__(self, name: str) -> Any:
        return super().__getattribute__(name)

    @property
    def num_tokens(self) -> int:
        """T, the packed length."""
        return int(self.input_ids.numel())

    @property
    def num_input_tokens(self) -> int:
        """N, the total length of the original sequences."""
        return int(self.unpack_index.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def num_nodes(self) -> int:
        return int(self.node_parent.numel())

    @property
    def max_token_id(self) -> int:
        """Largest id in ``input_ids``, computed once per plan on its host copy where it has
        one (a plan moved by :meth:`to` keeps it), so a GPU plan costs no device sync."""
        memo = self.host.memo
        if memo.max_token_id is None:
            memo.max_token_id = int(self.host.input_ids.max()) if self.num_tokens else -1
        return memo.max_token_id

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def host(self) -> "TreePlan":
        """The plan's CPU copy (a plan moved by :meth:`to` keeps it), else the plan itself:
        host-side layouts read it, so a GPU plan costs them no device-to-host sync."""
        return self.memo.host or self

    @property
    def is_trivial(self) -> bool:
        """True when nothing is shared: packed rows are the batch concatenated in order."""
        return self.num_tokens == self.num_input_tokens

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[B+1]`` int32 boundaries of the original sequences in the unpacked layout."""
        lens = torch.tensor((0,) + self.seq_lens, dtype=torch.int32)
        return torch.cumsum(lens, 0, dtype=torch.int32).to(self.device)

    def to(self, device: torch.device | str) -> "TreePlan":
        """The plan on ``device`` (cached, so per-layer calls cost nothing after the first)."""
        return plan_on(self, device)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...] -> [N, ...]``; differentiable (backward is a scatter-add over shared rows)."""
        if x.dim() == 0 or x.size(0) < self.num_tokens:
            raise ValueError(
                f"unpack expects at least T={self.num_tokens} rows, got shape {tuple(x.shape)}"
            )
        return x.index_select(0, self.unpack_index.to(x.device))

    def stats(self, window: int | None = None) -> dict[str, Any]:
        """N, T, token dedup N/T, attention-FLOP ratio (unshared / tree), nodes, depth.

        With ``window`` (a sliding window of W positions, see :func:`causal_pairs`) the
        pairs of a windowed layer are added as ``attn_pairs_unshared_window``,
        ``attn_pairs_tree_window`` and ``attn_flop_ratio_window``."""
        n, t = self.num_input_tokens, self.num_tokens
        cu_q, cu_k = self.cu_seqlens_q.cpu().numpy(), self.cu_seqlens_kv.cpu().numpy()
        pairs = tree_pairs(cu_q, cu_k)
        lens = np.asarray(self.seq_lens, dtype=np.float64)
        unshared_pairs = float(np.sum(causal_pairs(lens, lens)))
        parent = self.node_parent.cpu().numpy()
        depth = np.ones(len(parent), dtype=np.int64)
        for v in range(len(parent)):  # parents precede children in pre-order
            if parent[v] >= 0:
                depth[v] = depth[parent[v]] + 1
        out = {
            "sequences": self.num_sequences,
            "N": n,
            "T": t,
            "dedup": n / t,
            "attn_pairs_unshared": unshared_pairs,
            "attn_pairs_tree": pairs,
            "attn_flop_ratio": unshared_pairs / pairs,
            "nodes": self.num_nodes,
            "depth": int(depth.max()) if len(depth) else 0,
        }
        if window is not None:
            unshared_w = float(np.sum(causal_pairs(lens, lens, window)))
            tree_w = tree_pairs(cu_q, cu_k, window)
            out.update(window=int(window), attn_pairs_unshared_window=unshared_w,
                       attn_pairs_tree_window=tree_w, attn_flop_ratio_window=unshared_w / tree_w)
        return out


def claim_memo(plan, ignore: tuple[str, ...] = ()) -> None:
    """Give ``plan`` (a frozen dataclass with a ``memo: PlanMemo`` field) the memo it was
    built with if that memo belongs to its values, else a fresh one (:class:`PlanMemo`);
    fields named in ``ignore`` are not part of the values (run-time state). Call from
    ``__post_init__``."""
    values = tuple(getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name not in ("memo", *ignore))
    if not plan.memo.belongs_to(values):
        object.__setattr__(plan, "memo", PlanMemo())
    plan.memo.source = values


def plan_on(plan, device: torch.device | str):
    """``plan`` (a frozen dataclass with a ``memo: PlanMemo``) with every tensor field on
    ``device``: copied once per device (kept in ``plan.memo.moved``) and keeping the host copy,
    where layouts derived from the plan are built (no device-to-host sync)."""
    device = torch.device(device)
    if device == plan.device:
        return plan
    if device not in plan.memo.moved:
        tensors = {
            f.name: getattr(plan, f.name).to(device, non_blocking=True)
            for f in dataclasses.fields(plan)
            if isinstance(getattr(plan, f.name), torch.Tensor)
        }
        moved = dataclasses.replace(plan, memo=PlanMemo(), **tensors)
        moved.memo.host = plan.memo.host or (plan if plan.device.type == "cpu" else None)
        plan.memo.moved[device] = moved
    return plan.memo.moved[device]


def causal_pairs(context_end, rows, window: int | None = None) -> np.ndarray:
    """Query-key pairs (per head) of ``rows`` query rows at positions
    ``[context_end - rows, context_end)`` of one sample, each attending causally to the
    positions before it and itself; with a sliding ``window`` W, only to the last W of them
    (keys at position > p - W: the Hugging Face / FlashAttention convention). Elementwise
    over numpy arrays; float64."""
    end = np.asarray(context_end, dtype=np.float64)
    start = end - np.asarray(rows, dtype=np.float64)
    return _pairs_before(end, window) - _pairs_before(start, window)


def _pairs_before(m: np.ndarray, window: int | None) -> np.ndarray:
    """Pairs of the first ``m`` positions of a sample: sum over p < m of min(p + 1, W)."""
    if window is None:
        return m * (m + 1) / 2
    w = float(window)
    return np.where(m <= w, m * (m + 1) / 2, w * (w + 1) / 2 + (m - w) * w)


def tree_pairs(cu_q: np.ndarray, cu_k: np.ndarray, window: int | None = None) -> float:
    """Query-key pairs a tree attends (per head): per node with ``q`` own rows after a context
    of ``k`` rows (itself included), ``q * k - q * (q - 1) / 2`` (causal pairs counted once);
    with a sliding ``window``, the pairs inside it (:func:`causal_pairs`)."""
    q = np.diff(np.asarray(cu_q, dtype=np.float64))
    k = np.diff(np.asarray(cu_k, dtype=np.float64))
    return float(np.sum(causal_pairs(k, q, window)))


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class UnaryChains:
    """Maximal unary chains of a pre-order forest: a node whose parent has exactly one child
    continues its parent's chain (it is the very next node in pre-order, so a chain's rows are
    contiguous). Attention's cascade layout and the recurrent layers both work on chains.

    Attributes:
        chain_of: ``[m]`` chain index of each node (chains numbered in row order).
        heads: ``[c]`` first node of each chain.
        start, end: ``[c]`` the chain's rows ``[start, end)``.
        parent: ``[c]`` chain index of the chain ending in the head's parent (-1 at roots).
        depth: ``[c]`` chains above it (roots 0).
    """

    chain_of: np.ndarray
    heads: np.ndarray
    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray
    depth: np.ndarray


def unary_chains(node_parent: np.ndarray, node_start: np.ndarray, num_rows: int,
                 ends: np.ndarray | None = None) -> UnaryChains:
    """:class:`UnaryChains` of nodes in pre-order with parents ``node_parent`` (-1 at roots)
    and first rows ``node_start``, over ``num_rows`` rows; ``ends``: nodes that end their
    chain even with one child (whose final state is read elsewhere)."""
    parent = np.asarray(node_parent, dtype=np.int64)
    m = parent.size
    has_parent = parent >= 0
    n_children = np.bincount(parent[has_parent], minlength=m)
    if ends is not None:
        n_children[ends] += 1  # counted as a fork
    continues = has_parent & (n_children[np.maximum(parent, 0)] == 1)
    chain_of = np.cumsum(~continues) - 1
    heads = np.flatnonzero(~continues)
    start = np.asarray(node_start, dtype=np.int64)[heads]
    end = np.append(start[1:], num_rows)
    c_parent = np.where(has_parent[heads], chain_of[np.maximum(parent[heads], 0)], -1)
    depth = np.zeros(heads.size, dtype=np.int64)
    cur = c_parent
    while (cur >= 0).any():  # one step per level of the chain forest
        depth += cur >= 0
        cur = np.where(cur >= 0, c_parent[np.maximum(cur, 0)], -1)
    return UnaryChains(chain_of, heads, start, end, c_parent, depth)


def _as_int_array(seq: Any, i: int) -> np.ndarray:
    if isinstance(seq, torch.Tensor):
        if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise ValueError(f"sequence {i}: token ids must be integers, got {seq.dtype}")
        arr = seq.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(seq)
        except ValueError as err:  # ragged nesting: numpy's "inhomogeneous shape"
            raise ValueError(
                f"sequence {i}: could not read it as a 1-D array of token ids ({err})"
            ) from None
        if arr.size and arr.dtype.kind in "fO" and _all_python_ints(seq):
            # numpy holds ints past int64 as float64 or object: say that, not "float64"
            raise ValueError(
                f"sequence {i}: token ids must be < 2**63 (int64), found {max(seq)}"
            )
        if arr.dtype == object:
            raise ValueError(f"sequence {i}: could not read it as a 1-D array of token ids")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"sequence {i}: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(
            f"sequence {i}: expected a 1-D token sequence, got shape {tuple(arr.shape)} "
            "(pass a list of unpadded sequences, not a padded 2-D batch)"
        )
    if arr.size == 0:
        raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
    if arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"sequence {i}: token ids must be < 2**63 (int64), found {int(arr.max())}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise ValueError(f"sequence {i}: token ids must be non-negative, found {int(arr.min())}")
    return arr


def _all_python_ints(seq: Any) -> bool:
    return isinstance(seq, (list, tuple)) and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in seq
    )


def _validate(
    sequences, mode, min_prefix_len, min_group_size, prompt_lens, group_ids
) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray | None]:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    for name, value in (("min_prefix_len", min_prefix_len), ("min_group_size", min_group_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(sequences, torch.Tensor) and sequences.dim() != 1 and not sequences.is_nested:
        raise ValueError(
            f"expected a list of 1-D token sequences, got a tensor of shape {tuple(sequences.shape)}"
        )
    if isinstance(sequences, torch.Tensor) and sequences.is_nested:
        sequences = sequences.unbind()
    if isinstance(sequences, np.ndarray) and sequences.dtype != object:
        raise ValueError(
            f"expected a list of 1-D token sequences, got an array of shape {sequences.shape}"
        )
    seqs = list(sequences)
    if not seqs:
        raise ValueError("empty batch: plan_prefix_tree needs at least one sequence")
    arrays = [_as_int_array(s, i) for i, s in enumerate(seqs)]
    lens = np.array([a.size for a in arrays], dtype=np.int64)

    prompts = None
    if mode == "prompt_only":
        if prompt_lens is None:
            raise ValueError("mode='prompt_only' needs prompt_lens (one prompt length per sequence)")
    if prompt_lens is not None:
        raw = np.asarray(list(prompt_lens))
        if raw.size and raw.dtype.kind not in "iu":  # floats only when whole (never truncated)
            whole = (
                np.isfinite(raw) & (raw == np.round(raw)) if raw.dtype.kind == "f"
                else np.zeros(raw.shape, bool)
            )
            bad = np.flatnonzero(~whole)
            if bad.size:
                i = int(bad[0])
                value = raw.flat[i].item() if hasattr(raw.flat[i], "item") else raw.flat[i]
                raise ValueError(f"prompt_lens must be integers; prompt_lens[{i}]={value!r}")
        prompts = raw.astype(np.int64)
        if prompts.shape != (len(arrays),):
            raise ValueError(
                f"prompt_lens has {prompts.size} entries for {len(arrays)} sequences"
            )
        bad = np.flatnonzero((prompts < 1) | (prompts > lens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"prompt_lens[{i}]={int(prompts[i])} is outside [1, len(sequence {i})={int(lens[i])}]"
            )
    groups = None
    if group_ids is not None:
        labels = list(group_ids)
        if len(labels) != len(arrays):
            raise ValueError(f"group_ids has {len(labels)} entries for {len(arrays)} sequences")
        # Dense ranks keep arbitrary hashable labels (verl uids are strings) sortable.
        rank: dict = {}
        for i, g in enumerate(labels):
            try:
                rank.setdefault(g, len(rank))
            except TypeError:
                raise TypeError(
                    f"group_ids[{i}] = {g!r} is not hashable; group_ids need hashable labels "
                    "(ints or strings, e.g. verl's uid)"
                ) from None
        groups = np.array([rank[g] for g in labels], dtype=np.int64)
    return arrays, prompts, groups


# ----------------------------------------------------------------------------- trie


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _sorted_order_and_lcp(
    arrays: list[np.ndarray], mode: str, prompts: np.ndarray | None, groups: np.ndarray | None
) -> tuple[list[int], list[int]]:
    """Sequences in an order where every shareable set is contiguous, and the shareable
    length between neighbours. Any two sequences then share min(lcp between them)."""
    b = len(arrays)
    group = groups if groups is not None else np.zeros(b, dtype=np.int64)
    if mode == "arbitrary_prefix":
        # Big-endian bytes of non-negative int64 compare like the token lists (memcmp).
        keys = [a.astype(">i8").tobytes() for a in arrays]
        order = sorted(range(b), key=lambda i: (group[i], keys[i]))
        lcp = [0] + [
            common_prefix_len(arrays[i], arrays[j]) if group[i] == group[j] else 0
            for i, j in zip(order, order[1:])
        ]
    else:  # prompt_only: only whole, identical prompts are shared (PrefixGrouper)
        keys = [arrays[i][: prompts[i]].astype(">i8").tobytes() for i in range(b)]
        order = sorted(range(b), key=lambda i: (group[i], keys[i], i))
        lcp = [0] + [
            int(prompts[j]) if (group[i] == group[j] and keys[i] == keys[j]) else 0
            for i, j in zip(order, order[1:])
        ]
    return order, lcp


def _build_trie(order, lcp, lens):
    """Compacted trie from sorted sequences and neighbour LCPs (stack construction).

    Returns per node lists ``parent, depth_end, rep`` (node 0 is the virtual root, depth 0)
    and ``end_node`` per sequence. ``rep`` is a sequence passing through the node, whose
    tokens spell it.
    """
    parent, depth, rep = [-1], [0], [-1]
    end_node = [0] * len(order)
    stack = [0]
    for s, h in zip(order, lcp):
        last = -1
        while depth[stack[-1]] > h:
            last = stack.pop()
        if depth[stack[-1]] < h:  # branch inside the edge to `last`: split it
            parent.append(stack[-1]), depth.append(h), rep.append(s)
            parent[last] = len(parent) - 1
            stack.append(len(parent) - 1)
        if lens[s] > h:
            parent.append(stack[-1]), depth.append(int(lens[s])), rep.append(s)
            stack.append(len(parent) - 1)
        end_node[s] = stack[-1]  # a duplicate or a prefix of its neighbour ends on a node
    return parent, depth, rep, end_node


def _apply_thresholds(parent, depth, rep, end_node, min_prefix_len, min_group_size):
    """Dissolve shared nodes whose run is too short or shared by too few sequences: their
    tokens are duplicated into each continuation instead. Returns the final forest as
    ``(parent, start, end, rep, first_seq)`` lists plus each sequence's end node."""
    m = len(parent)
    count = [0] * m
    ends: list[list[int]] = [[] for _ in range(m)]
    for s, v in enumerate(end_node):
        ends[v].append(s)
        count[v] += 1
    by_depth = sorted(range(1, m), key=lambda v: depth[v])
    for v in reversed(by_depth):
        count[parent[v]] += count[v]

    new_id = {0: -1}  # original node -> final node (the root maps to "no parent")
    keep_anchor = {0: 0}  # original node -> nearest kept ancestor-or-self (original id)
    f_parent, f_start, f_end, f_rep = [], [], [], []
    f_end_node = [0] * len(end_node)

    def add(par_orig, end, r):
        f_parent.append(new_id[par_orig])
        f_start.append(depth[par_orig])
        f_end.append(end)
        f_rep.append(r)
        return len(f_parent) - 1

    for v in by_depth:  # parents before children
        anchor = keep_anchor[parent[v]]
        run = depth[v] - depth[anchor]
        shared = count[v] > 1
        if shared and (run < min_prefix_len or count[v] < min_group_size):
            keep_anchor[v] = anchor  # dissolved: children attach above, absorbing its tokens
            for s in ends[v]:
                f_end_node[s] = add(anchor, depth[v], s)
            continue
        keep_anchor[v] = v
        new_id[v] = add(anchor, depth[v], rep[v])
        for s in ends[v]:
            f_end_node[s] = new_id[v]
    return f_parent, f_start, f_end, f_rep, f_end_node


def _preorder(f_parent, f_end_node, num_nodes):
    """DFS pre-order; siblings (and roots) ordered by the first batch index below them, so a
    forest without sharing lays out exactly as the batch concatenated in order."""
    first = [len(f_end_node)] * num_nodes
    for s, v in enumerate(f_end_node):
        first[v] = min(first[v], s)
    # Children have larger ids than parents (created top-down), so one reverse pass suffices.
    for v in range(num_nodes - 1, -1, -1):
        p = f_parent[v]
        if p >= 0:
            first[p] = min(first[p], first[v])
    children: list[list[int]] = [[] for _ in range(num_nodes)]
    roots = []
    for v in range(num_nodes):
        (children[f_parent[v]] if f_parent[v] >= 0 else roots).append(v)
    order = []
    stack = sorted(roots, key=first.__getitem__, reverse=True)
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(sorted(children[v], key=first.__getitem__, reverse=True))
    return order


# ----------------------------------------------------------------------------- public


def plan_prefix_tree(
    sequences: Sequence[Any],
    mode: str = "arbitrary_prefix",
    min_prefix_len: int = 8,
    min_group_size: int = 2,
    prompt_lens: Sequence[int] | None = None,
    group_ids: Sequence[Any] | None = None,
) -> TreePlan:
    """Pack one micro-batch as a deduplicated prefix forest.

    Args:
        sequences: 1-D integer token sequences (lists, numpy arrays, LongTensors or a jagged
            nested tensor) in batch order, without padding.
        mode: ``"arbitrary_prefix"`` shares any common prefix (step-wise samples, identical
            duplicates, trees); ``"prompt_only"`` shares only whole identical prompts, each
            response a separate leaf (PrefixGrouper's behaviour).
        min_prefix_len: shared runs shorter than this are duplicated instead of shared.
        min_group_size: a run is shared only if at least this many sequences pass through it.
        prompt_lens: prompt length per sequence; required for ``prompt_only``.
        group_ids: optional per-sequence labels (e.g. verl ``uid``); sharing stays within a label.

    Returns:
        A :class:`TreePlan` on the CPU (use ``plan.to(device)``).
    """
    arrays, prompts, groups = _validate(
        sequences, mode, min_prefix_len, min_group_size, prompt_lens, group_ids
    )
    lens = np.array([a.size for a in arrays], dtype=np.int64)
    order, lcp = _sorted_order_and_lcp(arrays, mode, prompts, groups)
    trie = _build_trie(order, lcp, lens)
    f_parent, f_start, f_end, f_rep, f_end_node = _apply_thresholds(
        *trie, min_prefix_len, min_group_size
    )
    pre = _preorder(f_parent, f_end_node, len(f_parent))

    # Renumber nodes in pre-order; everything below is vectorised over tokens.
    rank = np.empty(len(pre), dtype=np.int64)
    rank[pre] = np.arange(len(pre))
    pre = np.asarray(pre, dtype=np.int64)
    parent = np.asarray(f_parent, dtype=np.int64)[pre]
    parent = np.where(parent >= 0, rank[np.maximum(parent, 0)], -1)
    start = np.asarray(f_start, dtype=np.int64)[pre]
    end = np.asarray(f_end, dtype=np.int64)[pre]
    rep = np.asarray(f_rep, dtype=np.int64)[pre]
    seq_end_node = rank[np.asarray(f_end_node, dtype=np.int64)]

    node_len = end - start
    packed_start = np.cumsum(node_len) - node_len
    flat = np.concatenate(arrays)
    seq_off = np.cumsum(lens) - lens
    input_ids = flat[ragged_arange(seq_off[rep] + start, node_len)]
    position_ids = ragged_arange(start, node_len)

    # Subtree ranges: in pre-order each subtree is contiguous, children follow parents.
    subtree_tokens = node_len.copy()
    for v in range(len(pre) - 1, 0, -1):
        if parent[v] >= 0:
            subtree_tokens[parent[v]] += subtree_tokens[v]
    subtree_end = np.repeat(packed_start + subtree_tokens, node_len)

    # Each node's context = rows of every ancestor-or-self, in depth order. Walk all nodes up
    # one level per step (steps = tree height in nodes).
    kv_off = np.cumsum(end) - end
    desc, anc = [], []
    cur = np.arange(len(pre), dtype=np.int64)
    alive = np.ones(len(pre), dtype=bool)
    while alive.any():
        idx = np.flatnonzero(alive)
        desc.append(idx)
        anc.append(cur[idx])
        cur = np.where(alive, parent[cur], -1)
        alive = cur >= 0
    desc_a, anc_a = np.concatenate(desc), np.concatenate(anc)
    kv_index = np.empty(int(end.sum()), dtype=np.int64)
    kv_index[ragged_arange(kv_off[desc_a] + start[anc_a], node_len[anc_a])] = ragged_arange(
        packed_start[anc_a], node_len[anc_a]
    )
    # A sequence's rows are exactly the context of the node it ends on.
    unpack_index = kv_index[ragged_arange(kv_off[seq_end_node], lens)]

    next_ids = np.zeros_like(flat)
    next_ids[:-1] = flat[1:]
    next_mask = np.ones(flat.size, dtype=bool)
    next_mask[np.cumsum(lens) - 1] = False
    next_ids[~next_mask] = 0

    def i64(x):
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))

    def cu32(x):
        return torch.from_numpy(np.concatenate([[0], np.cumsum(x)]).astype(np.int32))

    return TreePlan(
        input_ids=i64(input_ids),
        position_ids=i64(position_ids),
        unpack_index=i64(unpack_index),
        seq_lens=tuple(int(x) for x in lens),
        cu_seqlens_q=cu32(node_len),
        cu_seqlens_kv=cu32(end),
        kv_index=i64(kv_index),
        max_seqlen_q=int(node_len.max()),
        max_seqlen_kv=int(end.max()),
        subtree_end=i64(subtree_end),
        next_token_ids=i64(next_ids),
        next_token_mask=torch.from_numpy(next_mask),
        node_parent=i64(parent),
        multiplicity=i64(np.bincount(unpack_index, minlength=input_ids.size)),
    )


def plan_unshared(sequences: Sequence[Any]) -> TreePlan:
    """The plan of the batch as it is: one node per sequence, nothing shared, batch order.

    The unshared baseline every comparison uses (and the layout of ordinary packed batches):
    the same kernels run it with no gather."""
    seqs = list(sequences.unbind() if isinstance(sequences, torch.Tensor) and sequences.is_nested else sequences)
    return plan_prefix_tree(seqs, min_prefix_len=1, group_ids=range(len(seqs)))
