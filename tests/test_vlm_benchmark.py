"""``benchmarks/vlm.py``: its stock baseline is the model's own per-sample computation, and its
``--tiny`` CPU run reports a tree equal to that baseline with fewer images encoded.

The baseline runs the text decoder on verl's packed row (``varlen_fa2``: one causal segment
per sample) and the vision tower through ``varlen_fa2``'s cu_seqlens path (one bidirectional
segment per image or window); checked against each sample run alone with transformers' eager
attention (its vision tower loops over the images and windows one attention call each).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vlm  # noqa: E402


def _eager(model) -> None:
    for config in (model.config, model.config.text_config, model.config.vision_config):
        config._attn_implementation_internal = "eager"


def test_stock_baseline_equals_each_sample_alone():
    model, ids = vlm.build_model(True, 2, 2, "cpu", torch.float32)
    assert model.model.visual.config._attn_implementation == vlm.verl_flash_fallback.VISION_ATTN_NAME
    # two prompts whose 112x112 images span 2 x 2 windows of the tiny tower (full attention in block 1)
    batch = vlm.make_batch(model, ids, vlm.VLMWorkload(2, 8, (112, 112), 3, 6), seed=3, dtype=torch.float32)
    steps = vlm.Steps(model, batch, ids["IMAGE"], "cpu")
    assert steps.images[0] == [(1, 8, 8)] * 6 and len(steps.images[1]) == 2
    with torch.no_grad():
        stock = steps.base_logprobs()
        _eager(model)
        offset = 0
        for seq, (pixels, grid), pos in zip(batch.sequences, batch.images, batch.positions):
            logits = model(input_ids=torch.from_numpy(seq)[None], position_ids=pos[:, None], pixel_values=pixels,
                           image_grid_thw=torch.tensor([grid]), use_cache=False).logits[0]
            want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.from_numpy(seq[1:])[:, None])[:, 0]
            torch.testing.assert_close(stock[offset: offset + len(seq) - 1], want, rtol=1e-5, atol=1e-5)
            offset += len(seq)
    assert offset == stock.numel()


def test_tiny_run_matches_stock_with_fewer_images():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vlm.py"), "--tiny"], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    header, *rows = [line for line in proc.stdout.splitlines() if line.startswith("|") and "---" not in line]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(rows) == len(vlm.TINY_WORKLOADS)
    for line in rows:
        row = dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
        assert int(row["T"]) < int(row["N"]) and int(row["images tree"]) < int(row["images stock"])
        assert float(row["ideal"]) > 1
        assert float(row["logp max diff"]) < 1e-4 and float(row["grad max rel diff"]) < 1e-4, line
