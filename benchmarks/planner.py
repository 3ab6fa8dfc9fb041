"""Planner speed on the CPU: 64 sequences x 4k tokens and 512 sequences x 1k tokens.

    python benchmarks/planner.py [--out FILE]

Each shape is planned in three structures: GRPO groups of 8 (a shared prompt of half the
length), a step-wise chain (each sample a prefix of the next) and unrelated sequences.
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
    write_report(report, args.out)


if __name__ == "__main__":
    main()
