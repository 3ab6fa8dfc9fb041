"""Planning rollouts the way the verl glue would, and the report's tables.

Micro-batches are cut as verl's fixed-size micro-batching does (``uid`` groups kept
together); each is planned with :func:`~ps_mcore.planner.plan_prefix_tree` per mode.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from ps_mcore.analyze.read import Rollouts
from ps_mcore.config import PrefixGrouperConfig
from ps_mcore.planner import TreePlan, plan_prefix_tree
from ps_mcore.table import format_table

DEFAULTS = PrefixGrouperConfig()
FALLBACK_SAVED = DEFAULTS.min_saved_fraction


def micro_batches(r: Rollouts, size: int) -> list[list[int]]:
    """Sample indices per micro-batch: file order with ``uid`` groups kept together (groups
    ordered by first appearance, which is verl's own order for its GRPO batches), cut into
    chunks of ``size`` as verl's fixed-size micro-batching does."""
    order = list(range(len(r.sequences)))
    if r.groups is not None:
        first: dict[Any, int] = {}
        for i, g in enumerate(r.groups):
            first.setdefault(g, i)
        order.sort(key=lambda i: first[r.groups[i]])
    return [order[a : a + size] for a in range(0, len(order), size)]


def plan_micro_batch(
    r: Rollouts, idx: list[int], mode: str, min_prefix_len: int, min_group_size: int
) -> TreePlan | None:
    """The plan the ps-mcore verl glue would build (``prompt_only`` shares whole prompts
    within a ``uid`` group, ``arbitrary_prefix`` any common prefix); None when ``mode`` needs
    prompt lengths the file lacks."""
    if mode == "prompt_only" and r.prompt_lens is None:
        return None
    prompt_only = mode == "prompt_only"
    return plan_prefix_tree(
        [r.sequences[i] for i in idx],
        mode=mode,
        min_prefix_len=min_prefix_len,
        min_group_size=min_group_size,
        prompt_lens=r.prompt_lens[idx] if prompt_only else None,
        group_ids=[r.groups[i] for i in idx] if prompt_only and r.groups is not None else None,
    )


@dataclass
class ModeSummary:
    """Sums over micro-batches of one mode and threshold setting."""

    N: int = 0
    T: int = 0
    pairs_unshared: float = 0.0
    pairs_tree: float = 0.0
    dedups: list[float] = field(default_factory=list)

    def add(self, stats: dict) -> None:
        self.N += stats["N"]
        self.T += stats["T"]
        self.pairs_unshared += stats["attn_pairs_unshared"]
        self.pairs_tree += stats["attn_pairs_tree"]
        self.dedups.append(stats["dedup"])

    @property
    def dedup(self) -> float:
        return self.N / self.T if self.T else float("nan")

    @property
    def attn_ratio(self) -> float:
        return self.pairs_unshared / self.pairs_tree if self.pairs_tree else float("nan")


def summarize(
    batches: list[tuple[Rollouts, list[int]]], mode: str, min_prefix_len: int, min_group_size: int
) -> ModeSummary | None:
    """Totals over all micro-batches, or None when ``mode`` is not computable on the data."""
    total = ModeSummary()
    for r, idx in batches:
        plan = plan_micro_batch(r, idx, mode, min_prefix_len, min_group_size)
        if plan is None:
            return None
        total.add(plan.stats())
    return total


# ----------------------------------------------------------------------------- tables


def mode_table(batches, min_prefix_len: int, min_group_size: int) -> str:
    """Dedup, tokens saved and attention-FLOP ratio per mode (one row each)."""
    rows = []
    for mode in ("prompt_only", "arbitrary_prefix"):
        s = summarize(batches, mode, min_prefix_len, min_group_size)
        if s is None:
            rows.append([mode] + ["-"] * 6 + ["needs prompt/response columns in every file"])
            continue
        d = s.dedups
        sharing = sum(1 - 1 / x >= FALLBACK_SAVED for x in d)
        rows.append([
            mode, s.N, s.T, s.dedup, f"{100 * (1 - s.T / s.N):.1f}%", s.attn_ratio,
            f"{min(d):.2f} / {statistics.median(d):.2f} / {max(d):.2f}", f"{sharing}/{len(d)}",
        ])
    headers = ["mode", "N", "T", "dedup N/T", "tokens saved", "attn-FLOP ratio",
               "micro-batch dedup min / median / max",
               f"micro-batches saving >= {FALLBACK_SAVED:.0%}"]
    note = (f"A micro-batch saving less than {FALLBACK_SAVED:.0%} of its tokens runs verl's stock "
            "forward under the ps-mcore glue (prefix_grouper.min_saved_fraction).")
    return format_table(headers, rows) + "\n" + note


def threshold_table(batches, prefix_lens: list[int], group_sizes: list[int]) -> str:
    """Dedup N/T for every (mode, min_prefix_len) x min_group_size."""
    rows = []
    for mode in ("prompt_only", "arbitrary_prefix"):
        for mpl in prefix_lens:
            cells = [summarize(batches, mode, mpl, g) for g in group_sizes]
            if cells[0] is None:
                rows.append([mode, "-"] + ["-"] * len(group_sizes))
                break
            rows.append([mode, mpl] + [c.dedup for c in cells])
    headers = ["mode", "min_prefix_len"] + [f"min_group_size {g}" for g in group_sizes]
    return format_table(headers, rows)


def batch_table(batches, min_prefix_len: int, min_group_size: int) -> str:
    """One row per micro-batch: sequences, N, and T / dedup per mode."""
    rows = []
    for k, (r, idx) in enumerate(batches):
        n = int(sum(r.sequences[i].size for i in idx))
        row: list[object] = [k, os.path.basename(r.path), len(idx), n]
        for mode in ("prompt_only", "arbitrary_prefix"):
            plan = plan_micro_batch(r, idx, mode, min_prefix_len, min_group_size)
            st = plan.stats() if plan is not None else None
            row += ["-", "-"] if st is None else [st["T"], st["dedup"]]
        rows.append(row)
    headers = ["micro-batch", "file", "sequences", "N", "T prompt_only", "dedup prompt_only",
               "T arbitrary_prefix", "dedup arbitrary_prefix"]
    return format_table(headers, rows)


def _header(files: list[Rollouts], batches, mbs: int) -> str:
    seqs = [s.size for r in files for s in r.sequences]
    grouped = " (uid groups kept together)" if any(r.groups for r in files) else ""
    lines = [
        f"ps-mcore analyze: {len(files)} file(s), {len(seqs)} sequences, N = {sum(seqs)} tokens, "
        f"{len(batches)} micro-batches of up to {mbs} sequences{grouped}",
        f"sequence length: mean {statistics.mean(seqs):.0f}, min {min(seqs)}, max {max(seqs)}",
    ]
    for r in files:
        lines.append(f"  {r.path}: {len(r.sequences)} rows from {r.source}")
    return "\n".join(lines)
