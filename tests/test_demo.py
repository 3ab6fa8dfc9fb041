"""The demo (the README's main job) on its smallest setting, and its parity check failing
when fed a deliberately broken plan."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("megatron.core")

from ps_mcore import demo  # noqa: E402
from ps_mcore.planner import plan_prefix_tree  # noqa: E402


def _args(**kw):
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    return parser.parse_args(
        ["--workloads", "grpo-wide", "step-wise", "--scale", "0.03", "--iters", "1", "--device", "cpu"]
    )


def test_demo_passes_parity_and_prints_table(capsys, monkeypatch):
    monkeypatch.setattr(demo, "NOISE_SPREAD", -1.0)  # every row counts as noisy: the caveat shows
    assert demo.run_demo(_args()) == 0
    out = capsys.readouterr().out
    assert "grpo-wide" in out and "step-wise" in out and "FAIL" not in out
    assert "shared == unshared" in out
    lines = out.splitlines()
    speedup_col = lines[1].split("|").index(" speedup ")
    row = next(line for line in lines if line.startswith("| grpo-wide"))
    assert row.split("|")[speedup_col].strip().endswith("*")
    assert "ideal: model-FLOP ratio" in out and "speedup = unshared/shared ms" in out  # legend
    assert "* noisy timing" in out


def test_demo_fails_on_a_broken_plan(capsys, monkeypatch):
    def broken(w):
        plan = plan_prefix_tree(w.sequences)
        # Wrong RoPE positions for every packed token: log-probs must change.
        return dataclasses.replace(plan, position_ids=plan.position_ids.flip(0))

    monkeypatch.setattr(demo, "plan_fn", broken)
    assert demo.run_demo(_args()) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out


def test_demo_with_a_token_budget_runs_the_schedule(capsys):
    """agent-long several budgets large: the schedule computes T once where splitting
    recomputes the history per piece; a workload that fits is one step (today's path)."""
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    args = parser.parse_args(["--workloads", "agent-long", "grpo-wide", "--scale", "0.015",
                              "--iters", "1", "--device", "cpu", "--max-tokens", "500"])
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = [c.strip() for c in lines[1].split("|")]
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")] for r in lines if r.startswith("| ")}
    long, wide = rows["agent-long"], rows["grpo-wide"]
    col = header.index
    assert int(long[col("steps")]) > 1 and int(wide[col("steps")]) == 1
    assert int(long[col("T split")]) > int(long[col("T")])  # splitting recomputes the history
    assert int(wide[col("T split")]) == int(wide[col("T")])
    assert "FAIL" not in out and "micro-batch budget 500 tokens" in out and "T split =" in out


def test_demo_budget_too_small_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    args = parser.parse_args(["--workloads", "step-wise", "--scale", "0.03", "--iters", "1",
                              "--device", "cpu", "--max-tokens", "2"])
    assert demo.run_demo(args) == 2
    assert "cannot hold the context" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI edges


def _cli(argv, capsys):
    from ps_mcore import cli

    try:
        rc = cli.main(argv)
    except SystemExit as exit_:  # argparse usage errors
        rc = exit_.code
    return rc, capsys.readouterr().err


def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)
    rc, err = _cli(["demo", "--device", "cuda"], capsys)
    assert rc == 2
    assert err.strip().splitlines() == [err.strip()]  # one line, no traceback
    assert err.startswith("ps-mcore demo: error: --device cuda: no CUDA device is available")


@pytest.mark.parametrize("argv,message", [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--scale", "-1"], "argument --scale: must be positive, got -1"),
    (["--scale", "nan"], "argument --scale: must be positive, got nan"),
    (["--iters", "0"], "argument --iters: must be positive, got 0"),
    (["--iters", "2.5"], "argument --iters: expected a int, got '2.5'"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
])
def test_bad_demo_arguments_are_usage_errors(argv, message, capsys):
    rc, err = _cli(["demo", *argv], capsys)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"ps-mcore demo: error: {message}")  # usage, then one line


def test_third_party_warnings_hidden_unless_verbose():
    import warnings

    def emit():
        warnings.warn_explicit("Apex is not installed", UserWarning, "backends.py", 21,
                               module="megatron.core.models.backends")
        warnings.warn_explicit("[prefix_sharing] fell back to stock", UserWarning, "x.py", 1,
                               module="ps_mcore.integrations.verl_common.batch")

    for verbose, expected in ((False, ["[prefix_sharing] fell back to stock"]),
                              (True, ["Apex is not installed", "[prefix_sharing] fell back to stock"])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with demo._third_party_warnings(verbose):
                emit()
        assert [str(w.message) for w in seen] == expected


def test_noisy_timing_flags_spread_and_speedup_beyond_ideal():
    steady = [[10.0, 10.5, 10.2], [5.0, 5.1, 5.2]]
    assert not demo.noisy_timing(steady, speedup=2.0, ideal=2.5)
    assert demo.noisy_timing(steady, speedup=2.0 * 1.0, ideal=1.2)  # 2.0 > 1.2 x 1.5
    # one disturbed run (another process took the CPU) does not spoil a row: the fastest counts
    assert not demo.noisy_timing([[10.0, 30.0, 11.0], [5.0, 5.1, 9.0]], speedup=2.0, ideal=2.5)
    # not even two runs agree: flagged
    assert demo.noisy_timing([[10.0, 30.0, 25.0], [5.0, 5.1, 5.2]], speedup=2.0, ideal=2.5)


def test_cpu_timing_runs_short_steps_until_its_time_budget(monkeypatch):
    calls = {"a": 0, "b": 0}

    def step(name):
        def run():
            calls[name] += 1
        return run

    monkeypatch.setattr(demo, "TIMED_SECONDS", 0.0)
    times = demo.time_alternating([step("a"), step("b")], 3)
    assert [len(t) for t in times] == [3, 3] and calls == {"a": 4, "b": 4}  # + one warm-up each
    monkeypatch.setattr(demo, "TIMED_SECONDS", 10.0)  # never reached by empty steps: capped
    times = demo.time_alternating([step("a"), step("b")], 3)
    assert [len(t) for t in times] == [demo.MAX_ITERS] * 2


def test_gpu_speed_row_reports_the_kernel_auto_picks_and_bf16_drift(monkeypatch):
    """The GPU table's row, assembled on the CPU (bf16 model, chunked kernel; the CUDA-event
    timer replaced by fixed times): what each column holds."""
    from ps_mcore.workloads import make_workload

    monkeypatch.setattr(demo, "time_queued", lambda steps, iters: [[8.0] * iters, [2.0] * iters])
    device = demo.torch.device("cpu")
    with demo._megatron_rope_on(device):
        model = demo.build_model(demo.TINY, device, dtype=demo.torch.bfloat16)
        w = make_workload("grpo-wide", seed=0, scale=0.03, vocab=demo.TINY.vocab)
        row = demo.speed_row(model, w, device, 0, 3, demo.TINY)
    plan = plan_prefix_tree(w.sequences)
    assert (row["N"], row["T"]) == (plan.num_input_tokens, plan.num_tokens)
    assert row["kernel"] in ("chunked/cascade", "chunked/gather")
    assert row["speedup"] == 4.0 and abs(row["meas/ideal"] - 4.0 / row["ideal"]) < 1e-12
    assert row["act MiB shared"] < row["act MiB unshared"]
    assert 0 < row["max |d logp|"] < 0.1  # bf16 rounding, not exact (the fp32 table checks that)
