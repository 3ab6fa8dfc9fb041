"""The node tree of a :class:`TreePlan`, laid out for recurrent layers.

A recurrent layer (gated delta rule, Mamba's SSM, their short causal convolution) carries state
along each root-to-leaf path. On a prefix forest each node starts from its parent's final
state. A node with exactly one child needs no state hand-over at all: in DFS pre-order that
child's rows follow the parent's directly, so the recurrence just runs on. :class:`RecurrentTree`
therefore scans *chains* (maximal runs of nodes each with exactly one child, as one varlen
sequence) and groups chains by chain depth into levels, one varlen kernel call each: a
step-wise batch (every sample a prefix of the next) is one chain, one call. The short causal convolution needs no
levels: each node reads the last ``kernel_size - 1`` rows of its ancestor chain (which may span
several ancestors when nodes are short), gathered once (:meth:`RecurrentTree.conv_layout`).

Pure torch/numpy (no Megatron import). Rows past the plan's ``T`` (padding to a TP / SP
multiple) form one extra root node: they start from zero state and never reach a real row.

One call of a cross-micro-batch schedule (a :class:`~ps_mcore.minibatch.ContextPlan`:
:class:`CallRecurrentTree`) computes part of a forest: some of its nodes continue rows of
earlier calls (*entries*: they start from a kept state and conv window) and some of its rows
are continued by later calls (*exits*: their state and window are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps_mcore.planner import TreePlan, ragged_arange, unary_chains


@dataclass(frozen=True)
class Level:
    """All chains of one chain depth, as one varlen batch.

    Attributes:
        nodes: ``[n]`` node id of each chain's head (pre-order; host, for inspection).
        rows: ``[R]`` packed rows of these chains, chain after chain (a chain's rows are
            contiguous).
        cu_seqlens: ``[n+1]`` int64 chain boundaries within ``rows`` (device).
        cu_seqlens_host: the same on the host. Both live as long as the plan: fla memoises its
            chunk indices by tensor identity (the last 4 per helper), so up to four levels cost
            one host-to-device copy (a device sync) each per micro-batch, not one per call.
        parent_slot: ``[n]`` position, within the level above, of the chain that ends in each
            head's parent (None at depth 0, where every chain starts at a root).
        has_children: ``[n]`` bool; only these chains' final states are read (a chain that
            ends in an exit counts).
        entry_slot, entry_index: chains at this level that start from an entry state (their
            positions in the level, ``[e]`` device) and which entry (``[e]``); None if none.
    """

    nodes: np.ndarray
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    parent_slot: torch.Tensor | None
    has_children: np.ndarray
    entry_slot: torch.Tensor | None = None
    entry_index: torch.Tensor | None = None


class RecurrentTree:
    """Nodes of a plan (plus one padding root), their unary chains, levels and conv tails.

    Args:
        plan: the micro-batch's plan.
        rows: rows the layer sees (``T_pad >= T``); rows ``T..rows`` are a padding root.
    """

    def __init__(self, plan: TreePlan, rows: int):
        t = plan.num_tokens
        if rows < t:
            raise ValueError(f"recurrent layers need all T={t} packed rows, got {rows}")
        host = plan.host  # no device-to-host sync for a GPU plan
        cu = host.cu_seqlens_q.cpu().numpy().astype(np.int64)
        parent = host.node_parent.cpu().numpy().astype(np.int64)
        self.num_rows = rows
        self.plan_nodes = len(parent)
        if rows > t:  # padding rows: one more root after every real node (pre-order kept)
            cu = np.append(cu, rows)
            parent = np.append(parent, -1)
        self.start = cu[:-1]
        self.length = np.diff(cu)
        self.parent = parent
        self.chains = unary_chains(parent, self.start, rows)
        self.device = plan.device
        self._plan = plan
        self.entry = np.full(len(parent), -1, dtype=np.int64)  # entry index per node (roots only)
        self.exit_nodes = np.zeros(0, dtype=np.int64)  # nodes whose final state later calls read
        self._levels: list[Level] | None = None
        self._conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_entries(self) -> int:
        return int((self.entry >= 0).sum())

    @property
    def num_exits(self) -> int:
        return int(self.exit_nodes.size)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def is_flat(self) -> bool:
        """True when every chain starts at a root: one varlen call over the rows as they are."""
        return bool((self.chains.depth == 0).all()) and not self.num_entries and not self.num_exits

    def levels(self) -> list[Level]:
        """Chains grouped by chain depth (roots' chains first); cached."""
        if self._levels is None:
            c = self.chains
            forks = np.zeros(c.heads.size, dtype=bool)
            forks[c.parent[c.parent >= 0]] = True  # only these chains' final states are read
            exit_chains = c.chain_of[self.exit_nodes]  # an exit ends its chain (CallRecurrentTree)
            forks[exit_chains] = True
            chain_entry = self.entry[c.heads]
            slot = np.zeros(c.heads.size, dtype=np.int64)
            by_depth = [np.flatnonzero(c.depth == d) for d in range(int(c.depth.max()) + 1 if c.heads.size else 0)]
            lens = [c.end[chains] - c.start[chains] for chains in by_depth]
            # Every level's rows, level after level (chains by depth, stable: each level's chains
            # in the order of by_depth): one host-to-device copy, one view per level.
            level_chains = np.argsort(c.depth, kind="stable")
            order = ragged_arange(c.start[level_chains], c.end[level_chains] - c.start[level_chains])
            sizes = [int(n.sum()) for n in lens]
            order_dev = torch.from_numpy(order).to(self.device)
            rows = order_dev.split(sizes)
            levels = []
            for d, (chains, n) in enumerate(zip(by_depth, lens)):
                slot[chains] = np.arange(len(chains))
                cu = torch.from_numpy(np.concatenate([[0], np.cumsum(n)]).astype(np.int64))
                entering = np.flatnonzero(chain_entry[chains] >= 0)
                levels.append(
                    Level(
                        nodes=c.heads[chains],
                        rows=rows[d],
                        cu_seqlens=cu.to(self.device),
                        cu_seqlens_host=cu,
                        parent_slot=None if d == 0 else torch.from_numpy(slot[c.parent[chains]]).to(self.device),
                        has_children=forks[chains],
                        entry_slot=torch.from_numpy(entering).to(self.device) if entering.size else None,
                        entry_index=(torch.from_numpy(chain_entry[chains][entering]).to(self.device)
                                     if entering.size else None),
                    )
                )
            self._levels = levels
            self._exit_where = [(int(c.depth[e]), int(slot[e])) for e in exit_chains]
            inverse = np.empty(order.size, dtype=np.int64)
            inverse[order] = np.arange(order.size)
            self._level_order = order_dev, sizes
            self._level_inverse = torch.from_numpy(inverse).to(self.device)
        return self._levels

    def level_order(self) -> tuple[torch.Tensor, list[int]]:
        """``([rows] packed rows level after level, [rows per level])``: one gather puts every
        level's rows next to each other (``tree_scan`` splits it, one view per level)."""
        self.levels()
        return self._level_order

    def exit_where(self) -> list[tuple[int, int]]:
        """``(level, position in the level)`` of the chain ending in each exit node."""
        self.levels()
        return self._exit_where

    def level_inverse(self) -> torch.Tensor:
        """``[rows]``: position of each packed row in the level-by-level concatenation."""
        self.levels()
        return self._level_inverse

    def conv_layout(self, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index tensors for a causal convolution of width ``kernel_size`` over the tree.

        Returns:
            ext_index: ``[E]`` with ``E = rows + num_nodes * (kernel_size - 1)``: for each node,
                the packed rows of the last ``kernel_size - 1`` tokens of its ancestor chain
                (the value ``rows`` = a zero row where the chain is shorter), then its own
                rows. A plain causal convolution over these ``E`` rows gives every own row
                exactly its root path's window.
            out_index: ``[rows]`` position, in the valid (unpadded) convolution output over
                the ``E`` rows, of each packed row's result.
        """
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if kernel_size not in self._conv:
            w = kernel_size - 1
            m = self.num_nodes
            tails = self._tails(w)
            ext_len = self.length + w
            ext_off = np.concatenate([[0], np.cumsum(ext_len)[:-1]])
            ext = np.empty(int(ext_len.sum()), dtype=np.int64)
            if w:
                ext[ragged_arange(ext_off, np.full(m, w))] = tails.reshape(-1)
            ext[ragged_arange(ext_off + w, self.length)] = ragged_arange(self.start, self.length)
            out = np.empty(self.num_rows, dtype=np.int64)
            out[ragged_arange(self.start, self.length)] = ragged_arange(ext_off, self.length)
            self._conv[kernel_size] = (
                torch.from_numpy(ext).to(self.device),
                torch.from_numpy(out).to(self.device),
            )
        return self._conv[kernel_size]

    def _tails(self, w: int) -> np.ndarray:
        """``[nodes, w]`` rows of the last ``w`` tokens before each node on its root path
        (``rows``: a zero row)."""
        plan = self._plan.host
        real = self.plan_nodes
        tails = np.full((self.num_nodes, w), self.num_rows, dtype=np.int64)
        if w and real:
            cu_kv = plan.cu_seqlens_kv.cpu().numpy().astype(np.int64)
            kv_index = plan.kv_index.cpu().numpy()
            own_start = cu_kv[1:] - self.length[:real]  # context position of own row 0
            pos = own_start[:, None] - w + np.arange(w)[None, :]
            valid = pos >= cu_kv[:-1, None]
            tails[:real][valid] = kv_index[pos[valid]]
        return tails


class CallRecurrentTree(RecurrentTree):
    """The nodes of one call of a cross-micro-batch schedule (a
    :class:`~ps_mcore.minibatch.ContextPlan`): its query segments (a node's rows in the call),
    each continuing an own segment, an *entry* (a row an earlier call computed and kept: the
    segment starts from that row's kept state, its conv reads that row's kept window) or a
    root; plus one padding root. *Exits*: the segments whose last row later calls continue.

    The conv source of a call is ``[x (rows); a zero row; entry windows (entries * w)]``:
    :meth:`conv_layout` and :meth:`exit_window_index` index it.

    Args:
        plan: the call's ContextPlan (``segment_parent``, ``segment_entry``, ``exit_rows``).
        rows: rows the layer sees (``>= R``); rows ``R..rows`` are a padding root.
    """

    def __init__(self, plan, rows: int):
        r = plan.num_tokens
        if rows < r:
            raise ValueError(f"recurrent layers need all R={r} rows of the call, got {rows}")
        host = plan.host
        cu = host.cu_seqlens_q.cpu().numpy().astype(np.int64)
        parent = host.segment_parent.cpu().numpy().astype(np.int64)
        entry = host.segment_entry.cpu().numpy().astype(np.int64)
        depth = host.position_ids.cpu().numpy().astype(np.int64)[cu[:-1]]
        exit_rows = host.exit_rows.cpu().numpy().astype(np.int64)
        self.num_rows = rows
        self.plan_nodes = len(parent)
        if rows > r:
            cu, parent = np.append(cu, rows), np.append(parent, -1)
            entry, depth = np.append(entry, -1), np.append(depth, 0)
        self.start = cu[:-1]
        self.length = np.diff(cu)
        self.parent = parent
        self.exit_nodes = np.searchsorted(cu, exit_rows, side="right") - 1
        if (cu[self.exit_nodes + 1] - 1 != exit_rows).any():  # a planner invariant
            raise AssertionError("a kept state must be at the last row of a segment")
        # An exit may have one own child (its other children run in later calls): its chain
        # ends there, so its final state comes out of the scan.
        self.chains = unary_chains(parent, self.start, rows, ends=self.exit_nodes)
        self.device = plan.device
        self._plan = plan
        self.entry = entry
        self.depth = depth  # root-path depth of each node's first row
        self._levels = None
        self._conv = {}

    def _path_index(self, nodes: np.ndarray, depths: np.ndarray, w: int) -> np.ndarray:
        """Conv source index of the row at depth ``depths`` on the root path of ``nodes``
        (elementwise, ``depths >= depth of the node's first row - w``)."""
        node = nodes.copy()
        for _ in range(w):  # every node holds >= 1 row: w steps up reach any depth >= d0 - w
            up = (depths < self.depth[node]) & (self.parent[node] >= 0)
            if not up.any():
                break
            node[up] = self.parent[node[up]]
        offset = depths - self.depth[node]
        index = np.where(offset >= 0, self.start[node] + offset, self.num_rows)
        entry = self.entry[node]
        kept = (offset < 0) & (entry >= 0)
        index[kept] = self.num_rows + 1 + entry[kept] * w + offset[kept] + w
        return index

    def _tails(self, w: int) -> np.ndarray:
        nodes = np.repeat(np.arange(self.num_nodes), w).reshape(-1, w)
        return self._path_index(nodes, self.depth[:, None] - w + np.arange(w)[None, :], w)

    def exit_window_index(self, w: int) -> torch.Tensor:
        """``[exits * w]`` conv source rows of the last ``w`` conv inputs of each exit's path
        (its window: what a continuation's convolution reads before its own rows)."""
        last = self.depth[self.exit_nodes] + self.length[self.exit_nodes] - 1
        nodes = np.repeat(self.exit_nodes, w).reshape(-1, w)
        index = self._path_index(nodes, last[:, None] - w + 1 + np.arange(w)[None, :], w)
        return torch.from_numpy(index.reshape(-1)).to(self.device)


def recurrent_tree(plan, rows: int) -> RecurrentTree:
    """The plan's :class:`RecurrentTree` for ``rows`` rows (a :class:`CallRecurrentTree` for a
    schedule call's ContextPlan), cached on the plan (every recurrent layer of a micro-batch
    shares one)."""
    trees = plan.memo.recurrent_trees
    if rows not in trees:
        call = getattr(plan, "segment_entry", None) is not None
        trees[rows] = (CallRecurrentTree if call else RecurrentTree)(plan, rows)
    return trees[rows]
