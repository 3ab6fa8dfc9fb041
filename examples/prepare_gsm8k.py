"""GSM8K -> verl's RL parquet format (what verl's own gsm8k preprocessing writes).

Input: a folder with GSM8K's ``train*.parquet`` and ``test*.parquet`` (columns ``question``
and ``answer``; the ``main`` config of the ``openai/gsm8k`` dataset). Output:
``<out>/train.parquet`` and ``<out>/test.parquet`` with ``data_source``, ``prompt`` (chat
messages), ``ability``, ``reward_model`` (rule, ground truth after ``####``), ``extra_info``.

    python examples/prepare_gsm8k.py --input_dir ~/gsm8k_raw --output_dir ~/data/gsm8k
"""

from __future__ import annotations

import argparse
import glob
import os

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def ground_truth(answer: str) -> str:
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[:80]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def convert(frame, split: str):
    import pandas as pd

    rows = []
    for i, (question, answer) in enumerate(zip(frame["question"], frame["answer"])):
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth(answer)},
                "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
            }
        )
    return pd.DataFrame(rows)


def main() -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    os.makedirs(os.path.expanduser(args.output_dir), exist_ok=True)
    for split in ("train", "test"):
        files = sorted(glob.glob(os.path.join(os.path.expanduser(args.input_dir), f"{split}*.parquet")))
        if not files:
            raise FileNotFoundError(f"no {split}*.parquet in {args.input_dir}")
        frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        out = os.path.join(os.path.expanduser(args.output_dir), f"{split}.parquet")
        convert(frame, split).to_parquet(out)
        print(f"{split}: {len(frame)} rows -> {out}")


if __name__ == "__main__":
    main()
