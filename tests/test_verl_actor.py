"""``benchmarks/verl_actor.py --tiny``: verl 0.8.0's real ActorRolloutRefWorker (FSDP2 and
Megatron engines: real __init__, model build through HF / mbridge, optimizer, the trainer's
``left_right_2_no_padding`` batches) on a CPU gloo world of one, fp32, stock vs ps-mcore (and
verl's PrefixGrouper on FSDP): old / ref log-probs, entropy, the update's loss, grad norm and
every gradient must equal stock's, with the sharing path shown to have run (fewer tokens
computed); the same for the Qwen3-MoE-like model on the Megatron engine (Megatron's seeded
init, MoE layers) and for the training-curve mode (``--curves``, ``--plot``). Runs in a
subprocess: the CPU shims it installs (tests/verl_cpu_worker_shims.py) patch torch and
megatron process-wide."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("prefix_grouper")

ROOT = Path(__file__).resolve().parents[1]
FP32_TOL = 1e-5  # fp32 on a CPU: shared rows only reorder sums (the benchmark's TINY_ATOL / TINY_RTOL)


def run_script(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """``benchmarks/verl_actor.py *args`` in a process of its own (no torchrun variables)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "verl_actor.py"), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def run_tiny(*args: str, stderr: bool = False):
    """``verl_actor.py --tiny *args``'s stdout (``(stdout, stderr)`` with ``stderr``); exit 0 asserted."""
    proc = run_script("--tiny", *args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


def refused(*args: str) -> str:
    """``verl_actor.py *args``'s stderr; exit 2 (argparse's refusal) asserted."""
    proc = run_script(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr


def table_rows(table: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (engine rows only)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and ("fsdp" in line or "megatron" in line)]


def check_cells(out: str, count: int) -> list[list[str]]:
    table = out[out.index("tiny exactness check"):]
    rows = table_rows(table)
    # every model/engine/configuration/batch cell was compared and passed
    assert len(rows) == count and all(row[-1] == "ok" for row in rows), table
    assert table.rstrip().endswith("OK")
    return rows


def recomputed_layers(stderr: str) -> dict[str, int]:
    """Layers each engine reran inside a backward pass (the CPU shims' count)."""
    line = [x for x in stderr.splitlines() if x.startswith("CPU layer forwards recomputed in backward:")][-1]
    counts = line.split(":", 1)[1].split(",")
    return {engine: int(n) for n, engine in (c.split() for c in counts)}


@pytest.mark.slow  # ~80 s of CPU (10 worker builds over 2 engines; 3 min wall on a busy 2-core box)
def test_tiny_actor_worker_matches_stock():
    out, err = run_tiny(stderr=True)
    rows = check_cells(out, 9)
    assert {row[0] for row in rows} == {"tiny"}
    assert recomputed_layers(err) == {"megatron": 0, "fsdp": 0}


@pytest.mark.slow  # ~25 s of CPU (8 worker builds over 2 engines)
def test_tiny_recompute_matches_stock():
    """``--recompute``: Megatron's full recompute of every layer and FSDP2's gradient
    checkpointing in both configurations; layers were rerun in backward on both engines, and
    every output, loss and gradient still equals stock's."""
    out, err = run_tiny("--recompute", "--configs", "stock", "ps", stderr=True)
    rows = check_cells(out, 6)
    assert {(row[1], row[2]) for row in rows} == {("fsdp", "ps"), ("megatron", "ps")}, rows
    counts = recomputed_layers(err)
    assert counts["megatron"] > 0 and counts["fsdp"] > 0, err[-2000:]


@pytest.mark.slow  # ~15 s of CPU (4 Megatron worker builds)
def test_tiny_moe_megatron_matches_stock():
    """The Qwen3-30B-A3B-like MoE (the GPU run's config builder at tiny sizes: 4 experts,
    top-2, every layer MoE) on the Megatron engine from Megatron's seeded init."""
    rows = check_cells(run_tiny("--engines", "megatron", "--models", "tiny-moe"), 3)
    for model, engine, config, batch, n, t, *_ in rows:
        assert (model, engine, config) == ("tiny-moe", "megatron", "ps") and int(t) < int(n), rows


@pytest.mark.slow  # ~10 s of CPU (4 Megatron worker builds)
def test_tiny_fused_kernels_megatron_match_stock():
    """``--fused-kernels``: verl's fused LM head (``use_fused_kernels``) in both
    configurations on the Megatron engine, its kernel verl's torch one on the CPU; the kernel
    ran, and every output, loss and gradient still equals stock's. With the FSDP2 engine
    ``--tiny`` refuses the option by name."""
    out, err = run_tiny("--fused-kernels", "--engines", "megatron", stderr=True)
    rows = check_cells(out, 3)
    assert {(row[1], row[2]) for row in rows} == {("megatron", "ps")}, rows
    calls = [line for line in err.splitlines() if line.startswith("CPU fused LM-head kernel:")]
    assert calls and all(int(line.split()[4]) > 0 for line in calls), err[-2000:]
    assert "--fused-kernels runs the megatron engine only" in refused("--tiny", "--fused-kernels")


@pytest.mark.slow  # ~50 s of CPU (6 worker builds over 2 engines, 2 steps each)
def test_tiny_training_curves_match_stock(tmp_path):
    """``--curves 2 --plot``: per step, ps-mcore's loss and grad norm (relative) and entropy
    and held-out log-prob (absolute) within fp32 tolerance of stock's, ps-mcore's updates
    computing fewer tokens, the PNG written."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    out = run_tiny("--curves", "2", "--plot", str(png))
    table = out[out.index("training curves"):]
    rows = table_rows(table)
    assert [(r[0], r[1]) for r in rows] == [(e, m) for e in ("fsdp", "megatron")
                                             for m in ("loss", "grad_norm", "entropy", "held_out_logp")], table
    for engine, metric, kind, ps_dev, _, _, _, _, tokens, verdict in rows:
        assert kind == ("rel" if metric in ("loss", "grad_norm") else "abs"), table
        assert float(ps_dev) <= FP32_TOL and verdict == "ok", table
        t, n = map(int, tokens.split("/"))
        assert t < n, table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.rstrip().splitlines()[-1].startswith("OK")


@pytest.mark.parametrize("option", ["--profile", "--profile-idle"])
def test_profile_is_a_gpu_benchmark_option(option):
    """``--profile`` and ``--profile-idle`` profile the timed phases on the GPU: refused by name
    with ``--tiny`` (and ``--curves``), and their tables follow the engines' tables in the
    report."""
    for extra in (["--tiny"], ["--curves", "2"]):
        stderr = refused(*extra, option, "update")
        assert f"{option} times" in stderr, stderr[-2000:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    text = verl_actor.write_report(["header"], {"fsdp": [], "megatron": []}, None, ["profile: update (ms per step)"])
    assert text.splitlines()[0] == "header" and text.rstrip().endswith("profile: update (ms per step)")


def test_floor_counted_ideal_column():
    """The ``floor`` batch's stock time is the part of each phase that does not shrink with the
    tokens: the table's floor-counted ideal keeps it and divides the rest by the FLOP ideal."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    assert verl_actor.floor_counted_ideal(3.0, 0.0, 3.0) == pytest.approx(3.0)
    assert verl_actor.floor_counted_ideal(3.0, 3.0, 3.0) == pytest.approx(1.0)
    assert verl_actor.floor_counted_ideal(2.2, 0.1, 3.0) == pytest.approx(2.2 / (0.1 + 2.1 / 3.0))
    floor = verl_actor.make_batch("floor", 1000, 1, 0)
    assert len(floor.samples) == 1 and floor.num_tokens <= 96
    cells = [verl_actor.Cell("m", b, cfg, "update", 10, 5, s, 1.0, 2.0)
             for b, cfg, s in (("floor", "stock", 0.2), ("x", "stock", 2.2), ("x", "ps", 1.2))]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in verl_actor.table(cells).splitlines()]
    row = next(r for r in rows if r[1:3] == ["x", "ps"])
    counted = (2.2 / 1.2) / (2.2 / (0.2 + 2.0 / 2.0))
    assert float(row[verl_actor.HEADERS.index("meas/ideal, floor counted")]) == pytest.approx(counted, rel=1e-2)


def test_allocator_retries_are_named_under_the_table():
    """A cell whose timed calls made the CUDA allocator release its cache and retry is named
    under its engine's table with the retries of all its runs; a report without any has no note."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    def cell(config, retries):
        return verl_actor.Cell("m", "agent", config, "update", 10, 5, 1.0, 1.0, 2.0, alloc_retries=retries)

    cells = verl_actor.mean_of_runs([cell("stock", 30), cell("ps", 0), cell("ps", 0), cell("stock", 6)])
    assert [c.alloc_retries for c in cells] == [36, 0]
    text = verl_actor.write_report(["header"], {"megatron": cells}, None)
    note = text.splitlines()[-1]
    assert note.startswith("Allocator retries in the timed calls") and note.endswith("m agent stock update_actor (36)")
    assert "ps update_actor" not in note
    clean = verl_actor.write_report(["header"], {"megatron": [cell("stock", 0), cell("ps", 0)]}, None)
    assert "Allocator retries" not in clean
    timing = verl_actor.timed(lambda: 7, warmup=1, iters=3, device="cpu")
    assert (timing.retries, timing.result) == (0, 7) and timing.seconds >= 0


def fake_model_benchmark(args) -> None:
    """A stand-in for one model's GPU benchmark: its report, or a failure without one."""
    if args.models == ["broken"]:
        sys.exit(3)
    with open(args.out, "w") as f:
        f.write(f"report of {args.models[0]}, pid {os.getpid()}")


def test_several_models_run_one_process_each(tmp_path):
    """Each model runs in a process of its own; the reports come back in order, a failing
    model is named and makes the run fail, the others still report."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    args = verl_actor.parse_args(["--tiny", "--out", str(tmp_path / "all.md")])
    args.models = ["a", "broken", "b"]
    assert verl_actor.benchmark_per_model(args, run=fake_model_benchmark) == 1
    text = (tmp_path / "all.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("report of a, pid ") and "broken: no report (its process exited with code 3)" in text
    assert lines[-1].startswith("report of b, pid ")
    pids = {line.rsplit(" ", 1)[1] for line in lines if line.startswith("report of")}
    assert len(pids) == 2 and str(os.getpid()) not in pids


FREE_CHECK = """
import gc, sys, weakref
import verl_actor as va
va.start(True)
settings = va.run_settings(va.parse_args(["--tiny"]))
model_dir = va.write_model_dir("tiny-moe", "cpu", weights=False)
with va.megatron_seeded_init(True), va.patchsets("stock"):
    workers = va.Workers("megatron", model_dir, "stock", settings, ref=True)
    batch = va.tiny_batches(va.MODELS["tiny-moe"]["vocab_size"])[0]
    workers.update(batch, workers.old_log_prob(batch)[0])
    params = [weakref.ref(p) for m in workers.actor.actor.engine.module for p in m.parameters()]
    workers.close()
gc.collect()
print("alive", sum(r() is not None for r in params), "of", len(params))
"""


@pytest.mark.slow  # ~10 s of CPU (2 Megatron worker builds)
def test_closed_megatron_workers_are_freed():
    """The benchmark builds one engine per configuration in a process: a closed one must free
    its model, or the next configuration's GPU holds both. megatron-core's DDP hooks and an
    MoE dispatcher's kept routing graph form a cycle Python cannot collect alone."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", FREE_CHECK], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("alive ")][-1]
    alive, total = int(line.split()[1]), int(line.split()[3])
    assert total > 0 and alive == 0, line


def test_scale_multiplies_batch_sizes():
    """``--scale``: every batch several times larger (a mini-batch past one call's fixed
    costs), the floor batch still one sample; a non-positive scale is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    quick = verl_actor.batch_sizes(verl_actor.parse_args(["--quick"]))
    scaled = verl_actor.batch_sizes(verl_actor.parse_args(["--quick", "--scale", "4"]))
    assert quick == verl_actor.QUICK["sizes"]
    assert scaled == {name: 1 if name == "floor" else 4 * n for name, n in quick.items()}
    with pytest.raises(SystemExit):
        verl_actor.parse_args(["--scale", "0"])


def test_quick_keeps_explicit_repeats():
    """``--quick`` sets the warm-up and timed mini-batches only where they are not given."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    quick = verl_actor.parse_args(["--quick"])
    assert (quick.warmup, quick.iters) == (verl_actor.QUICK["warmup"], verl_actor.QUICK["iters"])
    given = verl_actor.parse_args(["--quick", "--warmup", "2", "--iters", "5"])
    assert (given.warmup, given.iters) == (2, 5)
    plain = verl_actor.parse_args([])
    assert (plain.warmup, plain.iters) == (1, 3)


class FakeWorkers:
    """Workers whose update runs out of memory on the batch named ``big`` and fails outright
    on ``broken``; records which configurations were closed."""

    closed: list[str] = []

    def __init__(self, engine, model_dir, config, settings, ref):
        self.config = config
        self.engine = types.SimpleNamespace(forward_step=lambda: None)

    def engine_for(self, phase):
        return self.engine

    def update(self, batch, lp):
        if batch.name == "big":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.35 GiB. GPU 0 has ...")
        if batch.name == "broken":
            raise RuntimeError("engine broke")
        for _ in range(2 if self.config == "ps" else 5):  # its micro-batches
            self.engine.forward_step()
        return {}

    def old_log_prob(self, batch):
        """``[1, 2]`` log-probs that differ by configuration: ps's are 0.25 above stock's."""
        logp = torch.tensor([[-1.0, -2.0]]) + (0.25 if self.config == "ps" else 0.0)
        return logp, torch.zeros_like(logp)

    def close(self):
        FakeWorkers.closed.append(self.config)


def test_counted_calls_counts_and_restores():
    """The micro-batches column counts an engine's ``forward_step`` calls through an instance
    attribute that goes away afterwards (a method of the class) or gives the attribute back."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    class Engine:
        def forward_step(self, x):
            return 2 * x

    engine = Engine()
    with verl_actor.counted_calls(engine, "forward_step") as calls:
        assert [engine.forward_step(i) for i in range(3)] == [0, 2, 4]
    assert len(calls) == 3 and "forward_step" not in vars(engine) and engine.forward_step(5) == 10
    original = lambda: "own"  # noqa: E731
    own = types.SimpleNamespace(forward_step=original)
    with verl_actor.counted_calls(own, "forward_step") as calls:
        assert own.forward_step() == "own" and own.forward_step is not original
    assert len(calls) == 1 and own.forward_step is original
    with pytest.raises(ValueError), verl_actor.counted_calls(engine, "forward_step"):
        raise ValueError
    assert "forward_step" not in vars(engine)


def test_out_of_memory_cell_and_failed_configuration(monkeypatch):
    """A batch too large for the card is kept as an out-of-memory cell and the next batch still
    runs; a configuration that fails still closes its workers (or its model stays on the GPU
    under the next configuration's)."""
    import contextlib
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    monkeypatch.setattr(verl_actor, "Workers", FakeWorkers)
    monkeypatch.setattr(verl_actor, "patchsets", lambda config: contextlib.nullcontext())
    monkeypatch.setattr(verl_actor, "prefix_grouper_driving", lambda config: contextlib.nullcontext())
    args = types.SimpleNamespace(phases=["update"], warmup=0, iters=1, profile=[], profile_idle=[])
    settings = types.SimpleNamespace(device="cpu")
    batches = [types.SimpleNamespace(name=n) for n in ("big", "small")]
    plans = {"big": (100, 50, 2.0), "small": (10, 5, 2.0)}
    FakeWorkers.closed.clear()
    every = []
    for config in ("stock", "ps"):
        cells = []
        verl_actor.run_config("fsdp", "m", "dir", config, batches, plans, args, settings, {}, {}, cells, [])
        assert [(c.batch, math.isnan(c.seconds)) for c in cells] == [("big", True), ("small", False)]
        every += cells
    assert FakeWorkers.closed == ["stock", "ps"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in verl_actor.table(every).splitlines()]
    big_ps = next(r for r in rows if r[1:3] == ["big", "ps"])
    assert big_ps[verl_actor.HEADERS.index("s")] == "out of memory"
    assert big_ps[verl_actor.HEADERS.index("speedup")] == "-"
    small_ps = next(r for r in rows if r[1:3] == ["small", "ps"])
    assert small_ps[verl_actor.HEADERS.index("speedup")] != "-"
    small_stock = next(r for r in rows if r[1:3] == ["small", "stock"])
    column = verl_actor.HEADERS.index("micro-batches")
    assert (small_ps[column], small_stock[column], big_ps[column]) == ("2", "5", "-")

    with pytest.raises(RuntimeError, match="engine broke"):
        verl_actor.run_config("fsdp", "m", "dir", "ps", [types.SimpleNamespace(name="broken")],
                              {"broken": (1, 1, 1.0)}, args, settings, {}, {}, [], [])
    assert FakeWorkers.closed[-1] == "ps" and len(FakeWorkers.closed) == 3


def test_configurations_run_in_the_order_given(monkeypatch):
    """``--configs ps stock`` runs ps first (an order effect in one process shows up by running
    both orders), and ps's log-probs are still compared with stock's once stock has run;
    ``--both-orders`` runs them there and back and averages each cell."""
    import contextlib
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor

    monkeypatch.setattr(verl_actor, "Workers", FakeWorkers)
    monkeypatch.setattr(verl_actor, "patchsets", lambda config: contextlib.nullcontext())
    monkeypatch.setattr(verl_actor, "prefix_grouper_driving", lambda config: contextlib.nullcontext())
    monkeypatch.setattr(verl_actor, "ideal_speedup", lambda batch, shape: (2, 2, 1.0))
    monkeypatch.setattr(verl_actor, "response_mask", lambda batch: torch.tensor([[0, 1]]))
    args = types.SimpleNamespace(phases=["old"], warmup=0, iters=1, profile=[], profile_idle=[], configs=["ps", "stock"],
                                 both_orders=False)
    settings = types.SimpleNamespace(device="cpu")
    FakeWorkers.closed.clear()
    batches = [types.SimpleNamespace(name="b")]
    cells = verl_actor.run_engine_model("fsdp", "qwen2.5-0.5b", "dir", batches, args, settings, {}, [])
    assert FakeWorkers.closed == ["ps", "stock"]
    assert [c.config for c in cells] == ["ps", "stock"]
    assert cells[0].vs_stock == pytest.approx(0.25) and math.isnan(cells[1].vs_stock)

    # --both-orders: ps, stock, stock, ps; each cell the mean of its two runs
    seconds = iter([1.0, 2.0, 4.0, 3.0])
    monkeypatch.setattr(verl_actor, "timed",
                        lambda fn, warmup, iters, device: verl_actor.Timing(next(seconds), 0.5, 0, fn()))
    args.both_orders = True
    FakeWorkers.closed.clear()
    cells = verl_actor.run_engine_model("fsdp", "qwen2.5-0.5b", "dir", batches, args, settings, {}, [])
    assert FakeWorkers.closed == ["ps", "stock", "stock", "ps"]
    assert [(c.config, c.seconds) for c in cells] == [("ps", 2.0), ("stock", 3.0)]
    assert cells[0].vs_stock == pytest.approx(0.25)


def test_ps_pieces_configuration_turns_schedules_off():
    """``ps-pieces`` is ``ps`` with cross-micro-batch schedules off, in the config verl's
    workers receive (so the two can be timed side by side); ``ps`` keeps the default."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import verl_actor
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig

    settings = verl_actor.RunSettings(device="cpu", max_token_len=4096, tiny=True)
    model_dir = verl_actor.write_model_dir("tiny", "cpu", weights=False)
    seen = {}
    for config in ("ps", "ps-pieces"):
        arr = verl_actor.compose_config("megatron", model_dir, config, settings)
        assert arr.actor.use_prefix_grouper
        seen[config] = PrefixGrouperConfig.from_any(arr.actor.prefix_grouper).cross_microbatch
    assert seen == {"ps": True, "ps-pieces": False}
