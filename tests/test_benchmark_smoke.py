"""The benchmarks' ``--tiny`` CPU runs: each finishes and reports a tree that matches its
baseline (the GPU tables in docs/benchmarks.md come from the same code, so a benchmark broken
by a library change fails here rather than on the GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--workloads", "agent-tree", "no-sharing", "--warmup", "0", "--iters", "1"]


def _run_table(script: str, *args: str) -> list[dict[str, str]]:
    """Run ``benchmarks/<script> --tiny *args``; the rows of the table it prints, by header."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.replace("|dlogp|", "dlogp")  # the column name holds the table's separator
    lines = [line for line in out.splitlines() if line.startswith("|")]
    header, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return [dict(zip(header, r)) for r in rows[1:]]  # rows[0] is the |---| rule


@pytest.mark.parametrize("mode", [[], ["--autocast"]], ids=["bf16", "autocast"])
def test_hf(mode):
    pytest.importorskip("transformers")
    rows = _run_table("hf.py", "--model", "qwen2", *FAST, *mode)
    assert [r["workload"] for r in rows] == ["agent-tree", "no-sharing"]
    # max |dlogp| of the tree vs the baseline: fp32 on the CPU; bf16 under autocast
    column = "amp max dlogp" if mode else "max dlogp"
    assert all(float(r[column]) < (5e-2 if mode else 1e-4) for r in rows), rows


@pytest.mark.parametrize("args", [
    [],
    ["--arch", "gpt-oss-20b", "gemma3-4b", "--minibatch-budget", "32768"],
], ids=["local", "windows-sinks-minibatch"])
def test_model(args):
    rows = _run_table("model.py", *FAST, *args)
    names = [r["workload"] for r in rows]
    assert names[:2] == ["agent-tree", "no-sharing"]
    assert len(rows) == (2 if not args else 6) and all("grpo-minibatch" in n for n in names[2::3])
    assert all(float(r["max dlogp"]) < 1e-4 for r in rows), rows
    assert all(0 < float(r["T"]) <= float(r["N"]) for r in rows), rows


@pytest.mark.parametrize("model", ["moe", "mla"])
def test_moe_mla(model):
    rows = _run_table("moe_mla.py", "--model", model, "--workloads", "agent-tree", "--warmup", "0", "--iters", "1")
    assert [r["workload"] for r in rows] == ["agent-tree"]
    # tiny: both models in fp32, the "bf16 err" columns are each model's distance to the reference
    assert float(rows[0]["bf16 err stock"]) < 1e-4 and float(rows[0]["bf16 err tree"]) < 1e-4, rows


def test_hybrid():
    rows = _run_table("hybrid.py", *FAST)
    assert [r["workload"] for r in rows] == ["agent-tree", "no-sharing"]
    assert all(float(r["max dlogp"]) < 1e-4 for r in rows), rows


def test_memory_runs_start_without_gradients(monkeypatch):
    """Each step frees and reallocates its model's gradients, so a peak measured while an earlier
    step's gradients are allocated would leave them out: ``measure`` frees them before each
    memory run, for every benchmark (no caller has to remember)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    from ps_mcore import plan_prefix_tree
    from ps_mcore.flops import DecoderShape

    model = torch.nn.Linear(4, 4)

    class Steps(common.PairedSteps):
        models = (model,)
        plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]])
        token_weights = torch.ones(3)

        def base_logprobs(self):
            return model(torch.ones(3, 4)).sum(-1)

        tree_logprobs = base_logprobs

    grads_at_peak = []

    def peak_mib(step):
        grads_at_peak.append(model.weight.grad is not None)
        step()
        return 1.0

    monkeypatch.setattr(common, "peak_mib", peak_mib)
    shape = DecoderShape(layers=1, hidden=4, heads=1, kv_heads=1, head_dim=4, ffn=4, vocab=8)
    measured = common.measure(Steps(), shape, warmup=1, iters=1)
    assert grads_at_peak == [False, False] and model.weight.grad is None
    assert measured.base_mib == measured.tree_mib == 1.0


def test_cross_microbatch():
    rows = _run_table("cross_microbatch.py", "--warmup", "0", "--iters", "1")
    schedules = [r for r in rows if r["method"] == "schedule"]
    assert len(schedules) == 4 and all(float(r["max dlogp"]) < 1e-4 for r in schedules), rows
    for r in schedules:  # every row once: never more tokens than the split pieces compute
        split = next(s for s in rows if s["mini-batch"] == r["mini-batch"] and s["method"] == "split")
        if split["tokens"] != "-":
            assert int(r["tokens"].split(" + ")[0]) <= int(split["tokens"]), (r, split)


def test_gpu_idle_split_among_the_host_functions_running():
    """``--profile-idle``'s arithmetic: each function is charged the GPU idle time inside its
    calls (a recursive call once), and the profiler ranges come off the functions afterwards."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    busy = [(0.0, 10.0), (20.0, 30.0), (25.0, 28.0)]  # idle: 10-20 and 30-40
    ranges = [("step", 0.0, 40.0), ("loss", 5.0, 25.0), ("walk", 32.0, 38.0), ("walk", 33.0, 34.0),
              ("loss", 35.0, 36.0)]
    window, idle, by_name = common.idle_by_range(ranges, busy)
    assert (window, idle) == (40.0, 20.0)
    assert by_name == {"step": (20.0, 40.0, 1), "loss": (11.0, 21.0, 2), "walk": (6.0, 6.0, 1)}

    import ps_mcore
    import ps_mcore.attention as attention
    from ps_mcore.attention import backends

    plain, method = attention.tree_attention, backends.AttentionBackend.variant_refusal
    with common.profiler_ranges(("ps_mcore.attention",)):
        assert attention.tree_attention.__wrapped__ is plain and ps_mcore.tree_attention is attention.tree_attention
        assert backends.AttentionBackend.variant_refusal.__wrapped__ is method
    assert attention.tree_attention is plain and ps_mcore.tree_attention is plain
    assert backends.AttentionBackend.variant_refusal is method


def test_a_step_whose_trace_was_lost_is_not_reported_idle(monkeypatch):
    """A profiled step that recorded no kernels (the profiler lost its trace) shows its wall time
    only, with a note, never as a step where the GPU idled throughout; the other steps keep
    their figures."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    recorded = {"ok": ({"matmul": 6.0, "attention": 2.0}, 10.0, 40), "lost": ({}, 30.0, 0)}
    monkeypatch.setattr(common, "step_kernels", lambda step, iters, top: recorded[step()])
    monkeypatch.setattr(common, "host_syncs", lambda step: [])
    text = common.profile_steps({"ok": lambda: "ok", "lost": lambda: "lost"}, "profile: t", iters=1)
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
                                  if line.startswith("|"))}
    assert rows["all kernels"] == ["8", "-"] and rows["uncovered"] == ["2", "-"] and rows["wall"] == ["10", "30"]
    assert rows["matmul"] == ["6", "-"]
    assert "The profiler recorded no kernels for lost: its trace of the step was lost" in text


def test_profile_options_need_the_gpu():
    """``--profile`` (CUDA profiler) is refused by name in the CPU runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/cross_microbatch.py", "--tiny", "--profile"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--profile" in done.stderr, done.stderr[-2000:]


def test_moe_host():
    rows = _run_table("moe_host.py", "--workloads", "agent-tree", "no-sharing")
    assert [(r["workload"], r["plan"]) for r in rows] == [
        ("agent-tree", "unshared"), ("agent-tree", "tree"), ("no-sharing", "unshared"), ("no-sharing", "tree")]
    assert all(int(r["aten ops"]) > 0 and float(r["wall ms"]) > 0 for r in rows), rows
    assert int(rows[1]["rows"]) < int(rows[0]["rows"]), rows  # agent-tree shares its prompt and turns
    # without sharing the tree path is the unshared one: the same ops, from the same sources
    columns = ("aten ops", "ps_mcore", "megatron MoE", "megatron other")
    assert [rows[2][c] for c in columns] == [rows[3][c] for c in columns], rows


def test_planner_micro_batching_table():
    """``benchmarks/planner.py``'s micro-batching table: every mini-batch in micro-batches that
    hold its samples, pieces repeating a few prefix rows only, a schedule none."""
    pytest.importorskip("verl")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner

    lines = [line for line in planner.micro_batching_table().splitlines() if line.startswith("|")]
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    rows = [dict(zip(header, r)) for r in rows]
    assert [r["mini-batch"] for r in rows] == ["gsm8k x 16", "gsm8k x 64", "agent x 16"]
    for r in rows:
        n, t, repeated = int(r["N"]), int(r["T"]), int(r["rows repeated"])
        assert t < n and int(r["micro-batches"]) >= -(-t // 16384)
        if r["runs as"].startswith("schedule") or r["runs as"] == "units fit":
            assert repeated == 0
        else:
            assert r["runs as"] == "pieces" and 0 < repeated < 0.01 * t
