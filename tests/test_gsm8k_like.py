"""benchmarks/gsm8k_like.py: the batch has the documented shape (docs/verl.md's
arbitrary_prefix vs prompt_only table is computed on it), and ``analyze`` on it finds what
the generator put there: prompt_only saves exactly the repeated prompts, arbitrary_prefix
saves more (the response openings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ps_mcore import plan_prefix_tree

from benchmarks import gsm8k_like

ROOT = Path(__file__).resolve().parents[1]


def test_shape_as_documented():
    rows = gsm8k_like.gsm8k_like_rows(groups=32, seed=3)
    assert len(rows) == 32 * 8 and len({r["uid"] for r in rows}) == 32
    prompts = [len(r["prompt_ids"]) for r in rows]
    responses = [len(r["response_ids"]) for r in rows]
    assert 105 <= np.mean(prompts) <= 135 and 0.75 * 120 - 1 <= min(prompts) and max(prompts) <= 1.25 * 120 + 1
    assert 230 <= np.mean(responses) <= 270
    header = rows[0]["prompt_ids"][: gsm8k_like.HEADER]
    assert all(r["prompt_ids"][: gsm8k_like.HEADER] == header for r in rows)  # the chat header
    # responses of a group often start alike: the longest common opening with another
    # response of the group, over responses that have one
    shared = []
    for g in range(32):
        group = [r["response_ids"] for r in rows[g * 8 : (g + 1) * 8]]
        for i, a in enumerate(group):
            best = max(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                       for j, b in enumerate(group) if j != i)
            shared.append(best)
    shared = np.array(shared)
    assert 0.4 <= np.mean(shared >= 10) <= 0.8  # p_opening 0.6, and two must pick the same one
    assert shared.max() <= gsm8k_like.OPENING_LEN[1]
    assert gsm8k_like.gsm8k_like_rows(groups=2, seed=5) == gsm8k_like.gsm8k_like_rows(groups=2, seed=5)


def test_analyze_prompt_only_vs_arbitrary_prefix(tmp_path):
    out = tmp_path / "b.jsonl"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gsm8k_like.py"), "--out", str(out), "--groups", "4"],
                   check=True, capture_output=True, timeout=120)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    n = t_prompt = t_any = 0
    for g in range(4):  # micro-batch = one group of 8 (analyze's default micro-batch size)
        group = rows[g * 8 : (g + 1) * 8]
        seqs = [r["prompt_ids"] + r["response_ids"] for r in group]
        n += sum(len(s) for s in seqs)
        t_prompt += plan_prefix_tree(seqs, mode="prompt_only", min_prefix_len=8,
                                     prompt_lens=[len(r["prompt_ids"]) for r in group],
                                     group_ids=[r["uid"] for r in group]).num_tokens
        t_any += plan_prefix_tree(seqs, mode="arbitrary_prefix", min_prefix_len=8).num_tokens
        # prompt_only: every prompt once; the responses as they are
        assert t_prompt == sum(len(rows[k * 8]["prompt_ids"]) for k in range(g + 1)) + sum(
            len(r["response_ids"]) for r in rows[: (g + 1) * 8])
    assert t_any < t_prompt < n
    report = subprocess.run([sys.executable, "-m", "ps_mcore", "analyze", str(out)], check=True,
                            capture_output=True, text=True, timeout=120).stdout
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
             for line in report.splitlines() if line.startswith("|") and line.count("|") == 9}
    assert cells["prompt_only"] == [str(n), str(t_prompt)]
    assert cells["arbitrary_prefix"] == [str(n), str(t_any)]
