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


def test_demo_passes_parity_and_prints_table(capsys):
    assert demo.run_demo(_args()) == 0
    out = capsys.readouterr().out
    assert "grpo-wide" in out and "step-wise" in out and "FAIL" not in out
    assert "shared == unshared" in out


def test_demo_fails_on_a_broken_plan(capsys, monkeypatch):
    def broken(w):
        plan = plan_prefix_tree(w.sequences)
        # Wrong RoPE positions for every packed token: log-probs must change.
        return dataclasses.replace(plan, position_ids=plan.position_ids.flip(0), _cache={})

    monkeypatch.setattr(demo, "plan_fn", broken)
    assert demo.run_demo(_args()) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out
