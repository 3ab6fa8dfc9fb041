"""Planning rollouts the way the verl glue would, and the report's tables.

Micro-batches are cut as verl's fixed-size micro-batching does (``uid`` groups kept
together). The tables come from one trie pass per mode (:mod:`ps_mcore.analyze.sweep`), equal
to planning each micro-batch with :func:`~ps_mcore.planner.plan_prefix_tree` at every threshold;
only ``--plot`` builds a full plan.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import numpy as np

from ps_mcore.analyze.progress import QUIET, Progress
from ps_mcore.analyze.read import Rollouts
from ps_mcore.analyze.sweep import ModeTries
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.planner import TreePlan, plan_prefix_tree
from ps_mcore.table import format_table

DEFAULTS = PrefixGrouperConfig()  # the verl glue's defaults: what a run would plan with
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


MODES_SHOWN = ("prompt_only", "arbitrary_prefix")


def build_tries(batches, progress: Progress = QUIET, window: int | None = None) -> dict[str, ModeTries | None]:
    """One trie pass per mode over all micro-batches; every table is evaluated from it
    (``window``: the pairs of a sliding-window layer are counted too)."""
    return {mode: ModeTries.build(batches, mode, progress, window) for mode in MODES_SHOWN}


# ----------------------------------------------------------------------------- tables


def mode_table(tries: dict[str, ModeTries | None], min_prefix_len: int, min_group_size: int) -> str:
    """Dedup, tokens saved and attention-FLOP ratio per mode (one row each); with a window,
    the ratio of a sliding-window layer in one more column."""
    window = next((t.window for t in tries.values() if t is not None), None)
    windowed = [] if window is None else ["-"]
    rows = []
    for mode in MODES_SHOWN:
        if tries[mode] is None:
            rows.append([mode] + ["-"] * (6 + len(windowed)) + ["needs prompt/response columns in every file"])
            continue
        s = tries[mode].evaluate(min_prefix_len, min_group_size)
        d = s.dedups
        n, t = int(s.N.sum()), int(s.T.sum())
        sharing = int(np.sum(1 - 1 / d >= FALLBACK_SAVED))
        rows.append([
            mode, n, t, s.dedup, f"{100 * (1 - t / n):.1f}%", s.attn_ratio,
            *([] if window is None else [s.attn_ratio_window]),
            f"{d.min():.2f} / {np.median(d):.2f} / {d.max():.2f}", f"{sharing}/{len(d)}",
        ])
    headers = ["mode", "N", "T", "dedup N/T", "tokens saved", "attn-FLOP ratio",
               *([] if window is None else [f"attn-FLOP ratio (window {window})"]),
               "micro-batch dedup min / median / max",
               f"micro-batches saving >= {FALLBACK_SAVED:.0%}"]
    note = (f"A micro-batch saving less than {FALLBACK_SAVED:.0%} of its tokens runs verl's stock "
            "forward under the ps-mcore glue (prefix_grouper.min_saved_fraction).")
    return format_table(headers, rows) + "\n" + note


def threshold_table(tries: dict[str, ModeTries | None], prefix_lens: list[int],
                    group_sizes: list[int]) -> str:
    """Dedup N/T for every (mode, min_prefix_len) x min_group_size."""
    rows = []
    for mode in MODES_SHOWN:
        if tries[mode] is None:
            rows.append([mode, "-"] + ["-"] * len(group_sizes))
            continue
        for mpl in prefix_lens:
            rows.append([mode, mpl] + [tries[mode].evaluate(mpl, g).dedup for g in group_sizes])
    headers = ["mode", "min_prefix_len"] + [f"min_group_size {g}" for g in group_sizes]
    return format_table(headers, rows)


def batch_table(batches, tries: dict[str, ModeTries | None], min_prefix_len: int,
                min_group_size: int) -> str:
    """One row per micro-batch: sequences, N, and T / dedup per mode."""
    per_mode = {m: t.evaluate(min_prefix_len, min_group_size) if t is not None else None
                for m, t in tries.items()}
    rows = []
    for k, (r, idx) in enumerate(batches):
        n = int(sum(r.sequences[i].size for i in idx))
        row: list[object] = [k, os.path.basename(r.path), len(idx), n]
        for mode in MODES_SHOWN:
            s = per_mode[mode]
            row += ["-", "-"] if s is None else [int(s.T[k]), float(s.dedups[k])]
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
