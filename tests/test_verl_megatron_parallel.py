"""verl 0.8.0's real Megatron engine at model-parallel scale, patched vs stock (torchrun worlds).

One subprocess per layout runs ``tests/verl_parallel_worker.py``: verl's real
``forward_backward_batch`` / ``forward_step`` / THD preprocessing and megatron's real
``get_forward_backward_func`` schedules (no-pipelining; interleaved 1F1B for PP=2 x VPP=2) on
tiny tree-spec GPTModels, gloo on CPU (NCCL variants below, skipped without enough GPUs).
Per rank: log-probs, entropy, values, ``sum_pi_squared`` and the top-k distillation outputs,
the PPO / value / distillation losses and every gradient (summed over CP and, for SP norms, TP,
as megatron's DDP does) equal verl's stock path on the unshared batch;
``ENABLE_PREFIX_SHARING=0`` equals stock bit for bit; the plan check raises when one rank's
micro-batch differs. Under TP=2 + SP, MTP training (2 layers) too: the PPO loss, the logged MTP
losses and every gradient equal verl's stock MTP. ``use_fused_kernels`` (verl's fused GPTModel
forward, a CPU stand-in for its Triton kernel, vocab-parallel under TP, in both runs): on the
tree under TP + SP and PP (the kernel sees fewer rows than the tokens), verl's stock fused
forward under CP. Under CP the stock path runs the tree-spec model on verl's per-sequence
CP chunks (``TreeCoreAttention`` serves ordinary THD under CP), so it is an independent layout.

With verl 0.9.1 and Megatron-Bridge (Python 3.12 stage) the TP=2 + SP, CP=2 and PP=2 x VPP=2
worlds also run with the models built by the engine through Megatron-Bridge
(``test_verl_engine_bridge_builder_layout_matches_stock``, marked slow).

Wall times on a shared 2-core CPU: CP=2 23 s, TP=2 + SP 22 s, PP=2 x VPP=2 20 s, CP=4 43 s,
CP=2 x TP=2 + SP 40-43 s; the two 4-process worlds are marked ``slow`` (CI's default run
includes them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

from megatron_shims import run_torchrun  # noqa: E402
from verl_batches import RTOL  # noqa: E402
from verl_parallel_worker import LAYOUTS, world_size  # noqa: E402

WORKER = Path(__file__).with_name("verl_parallel_worker.py")
# fp32 noise measured: outputs <= 4e-6 absolute (log-probs ~ -5), gradients <= 3e-6 of each
# tensor's largest entry (shared rows sum in another order; CP / TP sums in another order)
OUT_ATOL, GRAD_RTOL = 1e-5, 1e-5


def _run(layout: str, tmp_path: Path, device: str, *builder: str) -> list[dict]:
    out = tmp_path / f"{layout}.json"
    run_torchrun(WORKER, world_size(layout), layout, out, device, *builder, timeout=900)
    reports = json.loads(out.read_text())
    assert len(reports) == world_size(layout)
    return reports


def _check(layout: str, reports: list[dict], direct_builder: bool = True) -> None:
    lay = LAYOUTS[layout]
    lasts = [r for r in reports if r["actor"]["last_stage"]]
    assert len(lasts) == world_size(layout) // lay["pp"]  # every rank of the last stage reports
    for rep in reports:
        actor, critic = rep["actor"], rep["critic"]
        assert actor["num_grads"] > 0 and actor["grad_missing"] == 0, rep
        assert actor["grad_rel"] <= GRAD_RTOL, (layout, rep)
        assert actor["off_grads_equal"], rep  # ENABLE_PREFIX_SHARING=0: bit-identical gradients
        assert critic["num_grads"] > 0 and critic["grad_missing"] == 0, rep
        assert critic["grad_rel"] <= GRAD_RTOL, (layout, rep)
        if actor["last_stage"]:
            assert actor["offsets_equal"] and critic["offsets_equal"], rep
            assert actor["log_probs"] < OUT_ATOL and actor["entropy"] < OUT_ATOL, rep
            assert critic["values"] < OUT_ATOL, rep
            np.testing.assert_allclose(actor["loss"][1], actor["loss"][0], rtol=RTOL)
            np.testing.assert_allclose(critic["loss"][1], critic["loss"][0], rtol=RTOL)
            assert actor["off_outputs_equal"] and actor["off_loss_equal"] and actor["off_no_metrics"], rep
            n, t = actor["tokens"]
            assert n == actor["num_input_tokens"] and t < n, rep  # every micro-batch shared
            assert actor["micro_batches"] >= 2, rep
            if lay["vpp"]:
                assert actor["micro_batches"] % lay["pp"] == 0, rep
    for rep in reports:  # sum_pi_squared and top-k distillation
        stats = rep["statistics"]
        assert stats["num_grads"] > 0 and stats["grad_missing"] == 0 and stats["grad_rel"] <= GRAD_RTOL, (layout, rep)
        if stats["last_stage"]:
            assert max(stats["outputs"].values()) < OUT_ATOL, (layout, stats)
            np.testing.assert_allclose(stats["loss"][1], stats["loss"][0], rtol=RTOL)
            assert stats["tokens"][1] < stats["tokens"][0], stats
    for rep in reports:  # use_fused_kernels (the direct builder's worlds)
        fused = rep.get("fused")
        assert (fused is not None) == direct_builder, rep.keys()
        if fused is None:
            continue
        assert fused["num_grads"] > 0 and fused["grad_missing"] == 0 and fused["grad_rel"] <= GRAD_RTOL, (layout, fused)
        if fused["last_stage"]:
            assert fused["log_probs"] < OUT_ATOL and fused["entropy"] < OUT_ATOL, (layout, fused)
            np.testing.assert_allclose(fused["loss"][1], fused["loss"][0], rtol=RTOL)
            stock_rows, tree_rows = fused["kernel_rows"]
            if lay["cp"] > 1:  # verl's stock fused forward on every micro-batch (split prefix-aware)
                assert tree_rows == stock_rows, (layout, fused)
            else:  # the tree: the kernel on its labelled rows
                assert stock_rows >= fused["num_input_tokens"] > tree_rows, (layout, fused)
    # rank 0 planned another micro-batch: it and every rank sharing a TP x PP or CP group with
    # it raise (all groups' all-reduces run first, so none is left waiting)
    raised = {r["rank"] for r in reports if "ranks of the group hold different plans" in r["plan_mismatch"]}
    peers = {0} | {r for r in range(world_size(layout)) if _shares_a_group(layout, 0, r)}
    assert raised == peers, (layout, raised, [r["plan_mismatch"][:60] for r in reports])
    mtp_under_tp = direct_builder and lay["tp"] > 1 and lay["cp"] == 1 and lay["pp"] == 1
    assert all(("mtp" in rep) == mtp_under_tp for rep in reports)
    if mtp_under_tp:  # MTP training under TP (no CP / PP)
        for mtp in (rep["mtp"] for rep in reports):
            assert mtp["num_grads"] > 0 and mtp["grad_missing"] == 0 and mtp["grad_rel"] <= GRAD_RTOL, (layout, mtp)
            np.testing.assert_allclose(mtp["loss"][1], mtp["loss"][0], rtol=RTOL)
            assert mtp["mtp_keys"][0] == mtp["mtp_keys"][1], mtp
            np.testing.assert_allclose(mtp["mtp_losses"][1], mtp["mtp_losses"][0], rtol=RTOL)
            assert mtp["tokens"][1] < mtp["tokens"][0] and mtp["mtp_grads"], mtp  # shared; MTP layers trained
        # verl logs the MTP losses on the model-parallel source rank
        assert len(reports[0]["mtp"]["mtp_keys"][0]) == 2, reports[0]["mtp"]
    # every CP / TP rank of the last stage returns the same full outputs
    assert len({json.dumps(r["actor"]["loss"]) for r in lasts}) == 1


def _shares_a_group(layout: str, a: int, b: int) -> bool:
    """Megatron's default rank order (tp-cp-ep-dp-pp, dp = 1 here): do ranks a and b share the
    TP x PP group (same cp coordinate) or the CP group (same tp and pp coordinates)?"""
    lay = LAYOUTS[layout]
    tp, cp = lay["tp"], lay["cp"]

    def coords(r):
        return r % tp, (r // tp) % cp, r // (tp * cp)  # (tp, cp, pp) with dp = 1

    (ta, ca, pa), (tb, cb, pb) = coords(a), coords(b)
    return ca == cb or (ta == tb and pa == pb)


@pytest.mark.parametrize("layout", ["cp2", "tp2sp", "pp2vpp2"])
def test_verl_engine_layout_matches_stock(layout, tmp_path):
    _check(layout, _run(layout, tmp_path, "cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp4", "cp2tp2sp"])
def test_verl_engine_4_process_layout_matches_stock(layout, tmp_path):
    """4 processes on CI's 2 cores: marked slow, run by CI's full suite anyway (see README)."""
    _check(layout, _run(layout, tmp_path, "cpu"))


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.gpu(world_size(layout))) for layout in LAYOUTS])
def test_verl_engine_layout_matches_stock_nccl(layout, tmp_path):
    """The same worlds on GPUs (NCCL, fp32, chunked kernel), one GPU per rank."""
    _check(layout, _run(layout, tmp_path, "cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2sp", "cp2", "pp2vpp2"])
def test_verl_engine_bridge_builder_layout_matches_stock(layout, tmp_path):
    """verl 0.9.1: the models come from the engine's own Megatron-Bridge build (HF checkpoints
    written here, the provider's TE spec converted by the patchset, TE shimmed for the CPU)."""
    import importlib.util

    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge is not installed")
    from bridge_helpers import write_hf_checkpoint

    layers = 4 if LAYOUTS[layout]["pp"] > 1 else 2  # one layer per virtual stage
    paths = []
    for kind, seed in (("qwen2", 11), ("qwen3", 3)):
        path = tmp_path / kind
        path.mkdir()
        write_hf_checkpoint(kind, path, seed=seed, layers=layers)
        paths.append(path)
    _check(layout, _run(layout, tmp_path, "cpu", "bridge", *paths), direct_builder=False)
