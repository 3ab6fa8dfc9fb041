"""examples/: the run scripts' configs (Megatron and FSDP) compose and instantiate in verl
0.8.0 (driver ``validate_config`` and the worker-side actor config) with the GSM8K demo's
setting (``arbitrary_prefix``), and the GSM8K converter writes verl's RL format."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")

from verl_helpers import compose, installed_patchsets  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    "megatron": os.path.join(ROOT, "examples", "run_prefix_sharing.sh"),
    "fsdp": os.path.join(ROOT, "examples", "run_prefix_sharing_fsdp.sh"),
}


def _script_overrides(engine="megatron", **env):
    full = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            "PRINT_OVERRIDES": "1", **env}
    out = subprocess.run(["bash", SCRIPTS[engine]], capture_output=True, text=True, env=full, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    config_dir = lines[0].split("=", 1)[1]
    name = lines[1].split("=", 1)[1]
    return config_dir, name, lines[2:]


def _instantiate(config_dir, name, overrides):
    """Driver-side validation, then the worker-side actor config and its engine setting."""
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from ps_mcore.integrations.verl_common.config import ENGINE_ATTR

    cfg = compose(config_dir, name, overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    return cfg, getattr(actor.engine, ENGINE_ATTR)


def test_megatron_script_config_composes_and_instantiates(installed_patchsets):
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig

    config_dir, name, overrides = _script_overrides("megatron", NGPUS="8", TP="2")
    assert name == "prefix_sharing_megatron"
    cfg, setting = _instantiate(config_dir, name, overrides)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert setting.enabled and setting.config == PrefixGrouperConfig(mode="arbitrary_prefix")


def test_fsdp_script_config_composes_and_instantiates(installed_patchsets):
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig

    config_dir, name, overrides = _script_overrides("fsdp", NGPUS="4")
    assert name == "prefix_sharing_fsdp"
    cfg, setting = _instantiate(config_dir, name, overrides)
    actor = cfg.actor_rollout_ref.actor
    assert cfg.algorithm.adv_estimator == "grpo" and actor.strategy == "fsdp2"
    assert cfg.trainer.n_gpus_per_node == 4
    # what would send every micro-batch to verl's stock forward is off
    assert cfg.actor_rollout_ref.model.use_fused_kernels is False and actor.ulysses_sequence_parallel_size == 1
    assert setting.enabled and setting.config == PrefixGrouperConfig(mode="arbitrary_prefix")


def test_scripts_share_everything_but_the_engine():
    """Both scripts run the same GRPO job: their overrides differ only in engine keys."""
    _, _, megatron = _script_overrides("megatron")
    _, _, fsdp = _script_overrides("fsdp")
    only = set(megatron) ^ set(fsdp)
    assert only and all(".megatron." in o or ".strategy=" in o or "experiment_name" in o or
                        o.startswith(("actor_rollout_ref.model.", "actor_rollout_ref.actor.ulysses",
                                      "actor_rollout_ref.actor.fsdp_config.")) for o in only), only
    assert "actor_rollout_ref.actor.prefix_grouper.mode=arbitrary_prefix" in megatron


def test_prompt_only_mode_from_the_environment(installed_patchsets):
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig

    config_dir, name, overrides = _script_overrides("fsdp", PREFIX_GROUPER_MODE="prompt_only")
    _, setting = _instantiate(config_dir, name, overrides)
    assert setting.config == PrefixGrouperConfig(mode="prompt_only")


@pytest.mark.parametrize("engine", list(SCRIPTS))
def test_run_script_honours_enable_prefix_sharing(engine):
    _, _, overrides = _script_overrides(engine, ENABLE_PREFIX_SHARING="0")
    assert f"trainer.experiment_name=qwen2.5-0.5b-grpo-{engine}-ps0" in overrides


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
