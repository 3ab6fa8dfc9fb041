"""TP=2 (torchrun, gloo, CPU): Gated DeltaNet and Mamba-2 layers shard their heads, groups and
convolution channels over the tensor-parallel group; on every small nasty forest the tree
model's logits (GDN hybrid GPTModel) or the tree mixer's outputs (Mamba), and every gradient
shard, equal the stock module's on each sequence alone; the GDN hybrid under a
cross-micro-batch schedule equals the whole forest in one call (tests/hybrid_tp_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from forests import small_nasty_forests  # noqa: E402

WORKER = Path(__file__).with_name("hybrid_tp_worker.py")


def test_gdn_and_mamba_tp2_tree_matches_each_sequence():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in (0, 1):
        for name in small_nasty_forests():
            assert f"rank {rank} ok {name} logits" in proc.stdout, (rank, name, proc.stdout[-2000:])
            assert f"rank {rank} ok mamba {name} params 8" in proc.stdout, (rank, name, proc.stdout[-2000:])
        assert f"rank {rank} ok schedule steps" in proc.stdout, (rank, proc.stdout[-2000:])
