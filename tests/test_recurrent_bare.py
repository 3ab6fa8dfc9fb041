"""The tree recurrent mixers on a plain CPU install: built and run without flash-linear-attention
or mamba-ssm, with none of the test shims (a fresh interpreter: other tests in this process may
have applied gdn_shims / mamba_shims, which change megatron's modules for good), against each
sequence computed alone from the layer's equations (tests/recurrent_bare_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("kind", ["gdn", "mamba"])
def test_tree_mixer_without_cuda_packages_matches_each_sequence_alone(kind):
    # torch.compile of megatron's fused helpers takes ~40 s per process on CPU: run them eagerly
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(TESTS / "recurrent_bare_worker.py"), kind],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = proc.stdout.strip().splitlines()[-1]
    if result.startswith("skip:"):
        pytest.skip(result[len("skip:"):].strip())
    assert result == "ok", result
