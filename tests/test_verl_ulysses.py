"""verl's FSDP engine (0.8.0 and 0.9.1) under DeepSpeed-Ulysses sequence parallelism: the tree path (packed
tree rows split over the SP ranks, all-to-all around tree attention) against verl's own
Ulysses path on the unshared batch (verl's fused kernels included), on a 2-process world (``tests/verl_ulysses_worker.py``).

Vision-language (section ``vlm`` of the worker): a tiny Qwen2.5-VL under Ulysses, the tree
against verl's Ulysses VLM path (every rank embeds all rows and images, slices after the
embedding) on batches with images, without images and with different images under one prompt.

CPU (gloo): gloo has no all_to_all; a test-only shim emulates it with all_gather
(``tests/ulysses_shims.py``), for verl's stock all-to-all and ours alike. NCCL: the same world
on two GPUs with the real collective (skipped without them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("transformers")

from megatron_shims import run_torchrun  # noqa: E402

WORKER = Path(__file__).with_name("verl_ulysses_worker.py")
SP = 2
RTOL, ATOL = 1e-5, 1e-5


def _check(reports: list[dict]) -> None:
    assert len(reports) == SP
    for rep in reports:
        for key in ("actor", "actor_per_sample_temperature", "actor_fused"):
            actor = rep[key]
            assert actor["offsets_equal"], rep
            assert actor["log_probs"] < ATOL and actor["entropy"] < ATOL, (key, rep)
            np.testing.assert_allclose(actor["loss"][1], actor["loss"][0], rtol=RTOL)
            assert actor["grad_rel"] <= RTOL and actor["grad_norm"] > 0, (key, rep)
            n, t = actor["tokens"]
            assert 0 < t < n and actor["micro_batches"] >= 2, (key, rep)  # every micro-batch shared
        critic = rep["critic"]
        assert critic["values"] < ATOL, rep
        np.testing.assert_allclose(critic["loss"][1], critic["loss"][0], rtol=RTOL)
        assert critic["grad_rel"] <= RTOL, rep
        stats = rep["statistics"]  # sum_pi_squared and top-k distillation
        assert max(stats["outputs"].values()) < ATOL and stats["grad_rel"] <= RTOL, rep
        np.testing.assert_allclose(stats["loss"][1], stats["loss"][0], rtol=RTOL)
        assert 0 < stats["tokens"][1] < stats["tokens"][0], rep
    # every SP rank returns the same gathered outputs
    assert len({json.dumps(r["actor"]["loss"]) for r in reports}) == 1


def _check_vlm(reports: list[dict]) -> None:
    assert len(reports) == SP
    for rep in reports:
        vlm = rep["vlm"]
        for layout, images in (("images", (6, 2)), ("text-only", (0, 0)), ("different-images", (4, 2))):
            r = vlm[layout]
            assert r["offsets_equal"] and r["same_grads_present"], (layout, r)
            assert r["log_probs"] < ATOL and r["entropy"] < ATOL, (layout, r)
            np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=RTOL)
            assert r["grad_rel"] <= RTOL, (layout, r)
            n, t = r["tokens"]
            assert 0 < t < n, (layout, r)  # the tree ran, the shared prompt once
            # per rank: every image of the micro-batch (stock), each distinct image once (tree)
            assert tuple(r["images_encoded"]) == images, (layout, r)
            assert (r["visual_grads"] > 0) == (layout != "text-only"), (layout, r)
        alone = vlm["images_without_verl_slicing"]
        np.testing.assert_allclose(alone["loss"][1], alone["loss"][0], rtol=RTOL)
        assert alone["grad_rel"] <= RTOL, alone
    assert len({json.dumps(r["vlm"]["images"]["loss"]) for r in reports}) == 1


def _run(tmp_path: Path, device: str, section: str = "text") -> list[dict]:
    out = tmp_path / "ulysses.json"
    run_torchrun(WORKER, SP, out, device, section, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ulysses_sp2_matches_stock_ulysses(tmp_path):
    _check(_run(tmp_path, "cpu"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < SP, reason=f"needs {SP} GPUs")
def test_ulysses_sp2_matches_stock_ulysses_nccl(tmp_path):
    _check(_run(tmp_path, "cuda"))


@pytest.mark.slow
def test_ulysses_sp2_vision_language_matches_stock_ulysses(tmp_path):
    _check_vlm(_run(tmp_path, "cpu", "vlm"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < SP, reason=f"needs {SP} GPUs")
def test_ulysses_sp2_vision_language_matches_stock_ulysses_nccl(tmp_path):
    _check_vlm(_run(tmp_path, "cuda", "vlm"))
