"""examples/: the run script's config composes and instantiates in verl 0.8.0 (driver
``validate_config`` and the worker-side actor config), and the GSM8K converter writes
verl's RL format."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from verl_helpers import compose, installed_patchsets  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "run_prefix_sharing.sh")


def _script_overrides(**env):
    full = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            "PRINT_OVERRIDES": "1", **env}
    out = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=full, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    config_dir = lines[0].split("=", 1)[1]
    name = lines[1].split("=", 1)[1]
    return config_dir, name, lines[2:]


def test_run_script_config_composes_and_instantiates(installed_patchsets):
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from ps_mcore.integrations.verl080.config import ENGINE_ATTR, PrefixGrouperConfig

    config_dir, name, overrides = _script_overrides(NGPUS="8", TP="2")
    cfg = compose(config_dir, name, overrides)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    setting = getattr(actor.engine, ENGINE_ATTR)
    assert setting.enabled and setting.config == PrefixGrouperConfig(mode="prompt_only")


def test_run_script_honours_enable_prefix_sharing():
    _, _, overrides = _script_overrides(ENABLE_PREFIX_SHARING="0")
    assert "trainer.experiment_name=qwen2.5-0.5b-grpo-megatron-ps0" in overrides


def test_prepare_gsm8k_writes_verl_format(tmp_path):
    import pandas as pd

    raw = tmp_path / "raw"
    raw.mkdir()
    frame = pd.DataFrame({"question": ["1+1?", "2*3?"], "answer": ["1+1=2\n#### 2", "six\n#### 1,006"]})
    frame.to_parquet(raw / "train-00000.parquet")
    frame.iloc[:1].to_parquet(raw / "test-00000.parquet")
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "prepare_gsm8k.py"), "--input_dir", str(raw), "--output_dir", str(out)],
        check=True, capture_output=True, timeout=120,
    )
    train = pd.read_parquet(out / "train.parquet")
    assert list(train["data_source"]) == ["openai/gsm8k"] * 2
    assert [r["ground_truth"] for r in train["reward_model"]] == ["2", "1006"]
    assert train["prompt"][0][0]["role"] == "user" and "####" in train["prompt"][0][0]["content"]
    assert len(pd.read_parquet(out / "test.parquet")) == 1
