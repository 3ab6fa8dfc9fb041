"""Write a synthetic GRPO rollout file for timing ``ps-mcore analyze`` (CPU only).

    python benchmarks/analyze_input.py --rows 100000 --out /tmp/rollouts.jsonl
    /usr/bin/time -v ps-mcore analyze /tmp/rollouts.jsonl --quiet

Groups of ``--group`` responses to one prompt (``uid``), prompt and response lengths uniform in
the given ranges, token ids below 152k (a Qwen-sized vocabulary); half the groups' responses
open with a shared 16-token chunk so ``arbitrary_prefix`` differs from ``prompt_only``.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--response-len", type=int, nargs=2, default=[16, 208])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    with open(args.out, "w") as f:
        for g in range(0, args.rows, args.group):
            prompt = rng.integers(0, 152_000, int(rng.integers(*args.prompt_len))).tolist()
            head = rng.integers(0, 152_000, 16).tolist() if (g // args.group) % 2 else []
            for _ in range(min(args.group, args.rows - g)):
                resp = head + rng.integers(0, 152_000, int(rng.integers(*args.response_len))).tolist()
                f.write(json.dumps({"prompt_ids": prompt, "response_ids": resp, "uid": f"u{g}",
                                    "score": float(rng.random())}) + "\n")


if __name__ == "__main__":
    main()
