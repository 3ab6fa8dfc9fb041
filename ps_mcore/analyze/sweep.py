"""Every threshold from one trie pass.

``plan_prefix_tree`` builds the compacted prefix trie of a micro-batch, then dissolves shared
nodes whose run (tokens since the nearest kept ancestor) is shorter than ``min_prefix_len`` or
whose sequence count is below ``min_group_size``. The packed length T and the attention pairs
depend only on, per trie node: its end depth, how many sequences pass through it and how many
end on it. So the tries of all micro-batches are built once per mode (:meth:`ModeTries.build`)
and each (``min_prefix_len``, ``min_group_size``) is evaluated from those arrays, vectorised
over every node of every micro-batch, one numpy pass per tree level
(:meth:`ModeTries.evaluate`). ``tests/test_cli_analyze.py`` checks it equals planning with each
threshold.

The rules, as in ``planner._apply_thresholds`` (v a trie node, a its nearest kept ancestor,
run = depth[v] - depth[a], count[v] sequences through v, ends[v] ending on v):

* kept iff count[v] == 1 or (run >= min_prefix_len and count[v] >= min_group_size): one node
  of run tokens, context depth[v];
* else dissolved: each of the ends[v] sequences ending on v gets its own copy of the run;
  children attach to a (their run grows by v's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps_mcore.analyze.progress import QUIET, Progress
from ps_mcore.analyze.read import Rollouts

# The planner's own trie construction (private: the analysis must build exactly its trie).
from ps_mcore.planner import _build_trie, _sorted_order_and_lcp, causal_pairs


@dataclass
class Sharing:
    """Per micro-batch results at one threshold setting (arrays ``[K]``, K micro-batches);
    the ``*_window`` pairs are those of a layer with the sliding window (None without one)."""

    N: np.ndarray  # original tokens
    T: np.ndarray  # packed tokens
    pairs_unshared: np.ndarray  # attention (query, key) pairs of the unshared batch
    pairs_tree: np.ndarray  # ... of the tree
    pairs_unshared_window: np.ndarray | None = None
    pairs_tree_window: np.ndarray | None = None

    @property
    def dedup(self) -> float:
        """N / T over all micro-batches."""
        return float(self.N.sum() / self.T.sum())

    @property
    def attn_ratio(self) -> float:
        return float(self.pairs_unshared.sum() / self.pairs_tree.sum())

    @property
    def attn_ratio_window(self) -> float | None:
        if self.pairs_tree_window is None:
            return None
        return float(self.pairs_unshared_window.sum() / self.pairs_tree_window.sum())

    @property
    def dedups(self) -> np.ndarray:
        return self.N / self.T


@dataclass
class ModeTries:
    """The unthresholded tries of all micro-batches of one mode, concatenated.

    Node arrays ``[M]`` (every micro-batch's virtual root included, depth 0): ``batch``,
    ``parent`` (global index, -1 for roots), ``depth`` (end depth = context length),
    ``count`` (sequences through), ``ends`` (sequences ending on it); ``levels`` lists the
    node indices per tree level (roots first); ``N`` / ``pairs_unshared`` are ``[K]``;
    ``window``: a sliding window whose pairs are counted too (``pairs_unshared_window``).
    """

    batch: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    count: np.ndarray
    ends: np.ndarray
    levels: list[np.ndarray]
    N: np.ndarray
    pairs_unshared: np.ndarray
    window: int | None = None
    pairs_unshared_window: np.ndarray | None = None

    @classmethod
    def build(cls, batches: list[tuple[Rollouts, list[int]]], mode: str,
              progress: Progress = QUIET, window: int | None = None) -> "ModeTries | None":
        """None when ``mode`` is ``prompt_only`` and a file has no prompt/response split."""
        if mode == "prompt_only" and any(r.prompt_lens is None for r, _ in batches):
            return None
        # Plain lists per node, one numpy conversion at the end: a micro-batch has few nodes.
        parents: list[int] = []
        depths: list[int] = []
        end_nodes: list[int] = []
        sizes, n, pairs, pairs_w = [], [], [], []
        offset = 0
        with progress.step(f"building tries ({mode})", len(batches), "micro-batches") as step:
            for r, idx in batches:
                # Rows were validated when read (non-empty, non-negative ints, prompt lengths
                # within the rows), so the planner's per-call validation is skipped.
                arrays = [r.sequences[i] for i in idx]
                lens = [a.size for a in arrays]
                prompts = groups = None
                if mode == "prompt_only":
                    prompts = r.prompt_lens[idx]
                    if r.groups is not None:  # dense ranks, as the planner makes them
                        rank: dict = {}
                        groups = np.array([rank.setdefault(r.groups[i], len(rank)) for i in idx])
                order, lcp = _sorted_order_and_lcp(arrays, mode, prompts, groups)
                parent, depth, _, end_node = _build_trie(order, lcp, lens)
                parents += [p + offset if p >= 0 else -1 for p in parent]
                depths += depth
                end_nodes += [v + offset for v in end_node]
                sizes.append(len(parent))
                offset += len(parent)
                n.append(sum(lens))
                pairs.append(sum(x * (x + 1) // 2 for x in lens))
                if window is not None:
                    pairs_w.append(float(np.sum(causal_pairs(lens, lens, window))))
                step.advance()
        parent = np.asarray(parents, dtype=np.int64)
        ends_a = np.bincount(np.asarray(end_nodes, dtype=np.int64), minlength=len(parent))
        level = np.zeros(len(parent), dtype=np.int64)
        cur = parent.copy()
        while (live := cur >= 0).any():  # one step per tree level
            level[live] += 1
            cur[live] = parent[cur[live]]
        levels = [np.flatnonzero(level == k) for k in range(int(level.max()) + 1)]
        count = ends_a.copy()
        for idx in reversed(levels[1:]):  # children before parents
            np.add.at(count, parent[idx], count[idx])
        return cls(
            batch=np.repeat(np.arange(len(sizes)), sizes),
            parent=parent,
            depth=np.asarray(depths, dtype=np.int64),
            count=count,
            ends=ends_a,
            levels=levels,
            N=np.asarray(n, dtype=np.int64),
            pairs_unshared=np.asarray(pairs, dtype=np.float64),
            window=window,
            pairs_unshared_window=np.asarray(pairs_w, dtype=np.float64) if window is not None else None,
        )

    def evaluate(self, min_prefix_len: int, min_group_size: int) -> Sharing:
        """T and attention pairs of every micro-batch as ``plan_prefix_tree`` would pack it
        with these thresholds."""
        m = len(self.parent)
        anchor = np.arange(m)  # nearest kept ancestor-or-self; roots are kept
        run = np.zeros(m, dtype=np.int64)
        copies = np.zeros(m, dtype=np.int64)  # packed copies of the node's run
        for idx in self.levels[1:]:  # parents before children
            a = anchor[self.parent[idx]]
            r = self.depth[idx] - self.depth[a]
            c = self.count[idx]
            kept = (c == 1) | ((r >= min_prefix_len) & (c >= min_group_size))
            anchor[idx] = np.where(kept, idx, a)
            run[idx] = r
            copies[idx] = np.where(kept, 1, self.ends[idx])
        k = len(self.N)
        tokens = np.bincount(self.batch, weights=copies * run, minlength=k)
        # a node of q rows with context d (ancestors + own): q * d - q (q - 1) / 2 pairs
        q, d = run.astype(np.float64), self.depth.astype(np.float64)
        pairs = np.bincount(self.batch, weights=copies * (q * d - q * (q - 1) / 2), minlength=k)
        pairs_w = None
        if self.window is not None:
            pairs_w = np.bincount(self.batch, weights=copies * causal_pairs(d, q, self.window), minlength=k)
        return Sharing(self.N, np.rint(tokens).astype(np.int64), self.pairs_unshared, pairs,
                       self.pairs_unshared_window, pairs_w)
