"""Test helpers for the verl 0.8.0 glue: composing verl's hydra configs and installing the
patchsets for one test module."""

from __future__ import annotations

import os

import pytest

# Overrides every composed config needs to instantiate on a CPU box (no model download).
BASE_OVERRIDES = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.n_gpus_per_node=1",
]


def verl_config_dir() -> str:
    import verl.trainer.config

    return os.path.dirname(verl.trainer.config.__file__)


def compose(config_dir: str, name: str, overrides: list[str]):
    """``hydra.compose`` of ``name`` in ``config_dir`` (a fresh global hydra each call)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = hydra_compose(name, overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def installed_patchsets():
    """Install every compatible patchset for the module, restore verl afterwards."""
    from ps_mcore import setup
    from ps_mcore.integrations.verl_common.config import reset_actor_setting

    names = setup.install()
    yield names
    setup.uninstall()
    reset_actor_setting()
