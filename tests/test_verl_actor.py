"""``benchmarks/verl_actor.py --tiny``: verl 0.8.0's real ActorRolloutRefWorker (FSDP2 and
Megatron engines: real __init__, model build through HF / mbridge, optimizer, the trainer's
``left_right_2_no_padding`` batches) on a CPU gloo world of one, fp32, stock vs ps-mcore (and
verl's PrefixGrouper on FSDP): old / ref log-probs, entropy, the update's loss, grad norm and
every gradient must equal stock's, with the sharing path shown to have run (fewer tokens
computed). Runs in a subprocess: the CPU shims it installs (tests/verl_cpu_worker_shims.py)
patch torch and megatron process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("prefix_grouper")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~80 s of CPU (10 worker builds over 2 engines; 3 min wall on a busy 2-core box)
def test_tiny_actor_worker_matches_stock():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verl_actor.py"), "--tiny"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    table = out[out.index("tiny exactness check"):]
    rows = [line for line in table.splitlines() if line.startswith("|") and ("fsdp" in line or "megatron" in line)]
    # every engine/configuration/batch cell was compared and passed
    assert len(rows) == 9 and all(line.rstrip().endswith("ok |") for line in rows), table
    assert table.rstrip().endswith("OK")
