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
        has_children: ``[n]`` bool; only these chains' final states are read.
    """

    nodes: np.ndarray
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    parent_slot: torch.Tensor | None
    has_children: np.ndarray


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
        self._levels: list[Level] | None = None
        self._conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def is_flat(self) -> bool:
        """True when every chain starts at a root: one varlen call over the rows as they are."""
        return bool((self.chains.depth == 0).all())

    def levels(self) -> list[Level]:
        """Chains grouped by chain depth (roots' chains first); cached."""
        if self._levels is None:
            c = self.chains
            forks = np.zeros(c.heads.size, dtype=bool)
            forks[c.parent[c.parent >= 0]] = True  # only these chains' final states are read
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
                levels.append(
                    Level(
                        nodes=c.heads[chains],
                        rows=rows[d],
                        cu_seqlens=cu.to(self.device),
                        cu_seqlens_host=cu,
                        parent_slot=None if d == 0 else torch.from_numpy(slot[c.parent[chains]]).to(self.device),
                        has_children=forks[chains],
                    )
                )
            self._levels = levels
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
            plan = self._plan.host
            m, real = self.num_nodes, self.plan_nodes
            tails = np.full((m, w), self.num_rows, dtype=np.int64)
            if w and real:
                cu_kv = plan.cu_seqlens_kv.cpu().numpy().astype(np.int64)
                kv_index = plan.kv_index.cpu().numpy()
                own_start = cu_kv[1:] - self.length[:real]  # context position of own row 0
                pos = own_start[:, None] - w + np.arange(w)[None, :]
                valid = pos >= cu_kv[:-1, None]
                tails[:real][valid] = kv_index[pos[valid]]
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


def recurrent_tree(plan: TreePlan, rows: int) -> RecurrentTree:
    """The plan's :class:`RecurrentTree` for ``rows`` rows, cached on the plan (every
    recurrent layer of a micro-batch shares one)."""
    trees = plan.memo.recurrent_trees
    if rows not in trees:
        trees[rows] = RecurrentTree(plan, rows)
    return trees[rows]
