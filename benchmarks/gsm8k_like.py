"""A seeded GSM8K-shaped GRPO batch as JSONL, for ``python -m ps_mcore analyze``.

    python benchmarks/gsm8k_like.py --out /tmp/gsm8k_like.jsonl [--groups 64] [--seed 0]
    python -m ps_mcore analyze /tmp/gsm8k_like.jsonl --micro-batch-size 8

It measures what ``arbitrary_prefix`` adds over ``prompt_only`` on GRPO batches whose
responses share openings (the tokens are random ids; only the sharing structure is modelled):

* ``groups`` prompts of ~120 tokens (+-25%), each: a chat header every prompt starts with
  (``HEADER`` tokens: system message and user turn start, as a chat template writes them),
  the question, and a fixed instruction tail (``TAIL`` tokens: "Let's think step by step
  ..." and the assistant turn start).
* ``group_size`` responses of ~250 tokens (+-25%) per prompt (GRPO, one ``uid`` per
  prompt). A group has ``OPENINGS`` candidate first sentences of 10-40 tokens; with
  probability ``--p-opening`` a response starts with one of them (the first is the most
  likely), otherwise with its own tokens. Openings of one group often begin with the same
  few words (``--p-nested``): "To find the total ..." / "To find how many ...".

One JSON object per line: ``uid``, ``prompt_ids``, ``response_ids`` (the columns ``analyze``
reads). Needs numpy only.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

VOCAB = 151_000  # Qwen2.5's vocabulary size (order of magnitude; ids are random)
HEADER = 30  # "<|im_start|>system\nYou are Qwen, ...<|im_end|>\n<|im_start|>user\n"
TAIL = 22  # the instruction and "<|im_end|>\n<|im_start|>assistant\n"
OPENINGS = 3
OPENING_WEIGHTS = (0.5, 0.3, 0.2)
OPENING_LEN = (10, 40)  # inclusive
NESTED_LEN = (4, 8)  # shared first words of two openings of a group


def _jittered(rng: np.random.Generator, mean: float) -> int:
    return max(1, int(round(rng.uniform(0.75 * mean, 1.25 * mean))))


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def group_openings(rng: np.random.Generator, p_nested: float) -> list[list[int]]:
    """``OPENINGS`` first sentences; each after the first begins with a few of the first's
    tokens with probability ``p_nested``."""
    openings = [_ids(rng, int(rng.integers(OPENING_LEN[0], OPENING_LEN[1] + 1)))]
    for _ in range(OPENINGS - 1):
        length = int(rng.integers(OPENING_LEN[0], OPENING_LEN[1] + 1))
        head = int(rng.integers(NESTED_LEN[0], NESTED_LEN[1] + 1)) if rng.random() < p_nested else 0
        openings.append(openings[0][:head] + _ids(rng, length - head))
    return openings


def gsm8k_like_rows(
    groups: int = 64,
    group_size: int = 8,
    prompt_len: int = 120,
    response_len: int = 250,
    p_opening: float = 0.6,
    p_nested: float = 0.5,
    seed: int = 0,
) -> list[dict]:
    """The batch, groups contiguous in file order (verl's rollout order)."""
    rng = np.random.default_rng(seed)
    header, tail = _ids(rng, HEADER), _ids(rng, TAIL)
    rows = []
    for g in range(groups):
        question = _ids(rng, max(1, _jittered(rng, prompt_len) - HEADER - TAIL))
        prompt = header + question + tail
        openings = group_openings(rng, p_nested)
        for _ in range(group_size):
            length = _jittered(rng, response_len)
            head = []
            if rng.random() < p_opening:
                head = openings[int(rng.choice(OPENINGS, p=OPENING_WEIGHTS))][:length]
            response = head + _ids(rng, length - len(head))
            rows.append({"uid": f"q{g}", "prompt_ids": prompt, "response_ids": response})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--groups", type=int, default=64, help="prompts (verl's data.train_batch_size)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (rollout.n)")
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--response-len", type=int, default=250)
    parser.add_argument("--p-opening", type=float, default=0.6, help="chance a response starts with a group opening")
    parser.add_argument("--p-nested", type=float, default=0.5, help="chance two openings share first words")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = gsm8k_like_rows(args.groups, args.group_size, args.prompt_len, args.response_len,
                           args.p_opening, args.p_nested, args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} samples ({args.groups} groups of {args.group_size}) to {args.out}")


if __name__ == "__main__":
    main()
