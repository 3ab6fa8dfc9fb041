"""``benchmarks/hf.py --tiny``: the CPU smoke run of the Hugging Face benchmark, plain and under
autocast, finishes and reports a tree that matches its baseline (the GPU tables in
docs/benchmarks.md come from the same code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _rows(out: str) -> list[list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


@pytest.mark.parametrize("mode", [[], ["--autocast"]], ids=["bf16", "autocast"])
def test_tiny_run_matches_its_baseline(mode):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "benchmarks/hf.py", "--tiny", "--model", "qwen2", "--workloads", "agent-tree",
           "no-sharing", "--warmup", "0", "--iters", "1", *mode]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _rows(done.stdout.replace("|dlogp|", "dlogp"))
    assert [r[0] for r in rows] == ["agent-tree", "no-sharing"]
    # the last column: max |dlogp| of the tree vs the baseline (fp32 on the CPU; bf16 under autocast)
    assert all(float(r[-1]) < (5e-2 if mode else 1e-4) for r in rows), rows
