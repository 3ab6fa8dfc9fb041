"""Test helpers for the verl glue: the patchsets of the installed verl release, composing
verl's hydra configs and installing the patchsets for one test module.

The verl glue tests run unchanged on verl 0.8.0 (megatron-core 0.16) and verl 0.9.1
(megatron-core 0.19, Python 3.12): what differs is named here."""

from __future__ import annotations

import os

import pytest

def verl_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("verl")


def _patchset(kind: str) -> str:
    names = {"0.8.0": {"megatron": "verl080_mcore0161_ms0160", "fsdp": "verl080_fsdp"},
             "0.9.1": {"megatron": "verl091_mcore019", "fsdp": "verl091_fsdp"}}
    version = verl_version()
    if version not in names:
        import pytest

        pytest.skip(f"verl {version}: no ps-mcore patchset")
    return names[version][kind]


def megatron_patchset() -> str:
    """The Megatron-engine patchset of the installed verl."""
    return _patchset("megatron")


def fsdp_patchset() -> str:
    """The FSDP-engine patchset of the installed verl."""
    return _patchset("fsdp")


def kv_trainer():
    """(module, the method that sets its workers up) of verl's ``KVBatchMeta`` trainer:
    0.8.0's ``main_ppo_sync``, 0.9.1's ``verl.trainer.ppo.v1.trainer_base`` (``main_ppo``)."""
    if verl_version() == "0.8.0":
        from verl.trainer import main_ppo_sync

        return main_ppo_sync, "init_workers"
    from verl.trainer.ppo.v1 import trainer_base

    return trainer_base, "init"


def integration_config_dir() -> str:
    """The installed verl release's shipped hydra configs."""
    return __import__(f"ps_mcore.integrations.verl{verl_version().replace('.', '')}", fromlist=["CONFIG_DIR"]).CONFIG_DIR


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
