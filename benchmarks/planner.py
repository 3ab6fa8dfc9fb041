"""Planner speed on the CPU: 64 sequences x 4k tokens and 512 sequences x 1k tokens.

    python benchmarks/planner.py [--out FILE]

Each shape is planned in three structures: GRPO groups of 8 (a shared prompt of half the
length), a step-wise chain (each sample a prefix of the next) and unrelated sequences.

With verl installed, a second table times the verl glue's prefix-aware micro-batching of
whole mini-batches under a 16k token budget (``prepare_micro_batches``' host work per engine
step, the cross-micro-batch scheduler's choice included): GSM8K-shaped GRPO batches, whose
chat header binds every group into one unit, and agent batches (``benchmarks/verl_actor.py``'s
batch shapes).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, time_ms, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402


def batch(structure: str, num: int, length: int, rng) -> list[np.ndarray]:
    tok = lambda n: rng.integers(0, 150000, n)  # noqa: E731
    if structure == "grpo":
        seqs = []
        for _ in range(num // 8):
            prompt = tok(length // 2)
            seqs += [np.concatenate([prompt, tok(length - length // 2)]) for _ in range(8)]
        return seqs
    if structure == "step-wise":
        full = tok(length * 2)
        return [full[: max(1, (i + 1) * 2 * length // num)] for i in range(num)]
    return [tok(length) for _ in range(num)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for num, length in ((64, 4096), (512, 1024)):
        for structure in ("grpo", "step-wise", "unrelated"):
            seqs = batch(structure, num, length, rng)
            plan = plan_prefix_tree(seqs)
            ms = time_ms(lambda: plan_prefix_tree(seqs), warmup=2, iters=10)
            rows.append([f"{num} x {length}", structure, plan.num_input_tokens, plan.num_tokens, ms])
    table = markdown_table(["batch", "structure", "N", "T", "plan ms (median)"], rows)
    report = f"Planner, CPU\n\n{environment()}\n\n{table}\n"
    try:
        import verl  # noqa: F401
    except ImportError:
        report += "\n(verl is not installed: no micro-batching table)\n"
    else:
        report += "\nMicro-batching under a 16k token budget (verl glue, training)\n\n" + micro_batching_table() + "\n"
    write_report(report, args.out)


def micro_batching_table(budget: int = 16384) -> str:
    """Host time of the prefix-aware micro-batcher on whole mini-batches, and what it chose."""
    import verl_actor
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
    from ps_mcore.integrations.verl_common.microbatch import _Units, budget_partitions
    from ps_mcore.integrations.verl_common.schedule import MiniBatchScheduler

    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=8)
    rows = []
    for name, size in (("gsm8k", 16), ("gsm8k", 64), ("agent", 16)):
        batch = verl_actor.make_batch(name, 151936, size, seed=0)
        seqs = batch.sequences
        prompts = np.array([len(p) for p, _, _ in batch.samples])
        uids = [u for _, _, u in batch.samples]

        def prepare():
            units = _Units(seqs, config, prompts, uids)
            fits = max(units.tokens) <= budget
            parts, scheduler = budget_partitions(units, budget, MiniBatchScheduler(config, True, kv_row_cost=0.03))
            return parts, None if scheduler is None else scheduler.schedule, fits

        parts, schedule, fits = prepare()
        t = plan_prefix_tree(seqs, min_prefix_len=8).num_tokens
        if fits:
            how, computed = "units fit", t
        elif schedule is not None:
            how, computed = f"schedule ({len(schedule.plan.calls)} calls)", schedule.plan.computed_tokens
            computed += sum(plan_prefix_tree([seqs[i] for i in p], min_prefix_len=8).num_tokens
                            for p in parts[schedule.plan.num_steps:])
        else:
            how = "pieces"
            computed = sum(plan_prefix_tree([seqs[i] for i in p], min_prefix_len=8).num_tokens for p in parts)
        ms = time_ms(prepare, warmup=1, iters=5)
        rows.append([f"{name} x {size}", len(seqs), sum(map(len, seqs)), t, how, len(parts), computed - t, ms])
    return markdown_table(["mini-batch", "samples", "N", "T", "runs as", "micro-batches", "rows repeated",
                           "ms (median)"], rows)


if __name__ == "__main__":
    main()
