"""Patches every verl 0.8.0 patchset shares (installed once): the ``prefix_grouper``
config keys, ref policy and critic following the actor's setting, DP balancing that keeps groups on one rank (``main_ppo`` and
``main_ppo_sync``), and the ``prefix_sharing/*`` step metrics."""

from __future__ import annotations

from ps_mcore.setup.registry import Component, distribution_version


def verl_reason() -> str | None:
    """None when verl 0.8.0 is installed, else why not."""
    version = distribution_version("verl")
    if version is None:
        return "verl is not installed"
    if not version.startswith("0.8.0"):
        return f"verl {version} is installed, this patchset is for verl 0.8.0"
    return None


def _install(patcher) -> None:
    from verl.trainer import main_ppo_sync
    from verl.trainer.ppo import ray_trainer

    from ps_mcore.verl.config import install_config_patches
    from ps_mcore.verl.trainer import (
        init_workers_following_actor,
        ray_trainer_balance_batch,
        reduce_metrics_with_prefix_sharing,
        sync_trainer_balance_batch,
    )

    install_config_patches(patcher)
    patcher.wrap(ray_trainer.RayPPOTrainer, "_balance_batch", ray_trainer_balance_batch)
    patcher.wrap(main_ppo_sync.PPOTrainer, "_balance_batch", sync_trainer_balance_batch)
    patcher.wrap(ray_trainer.RayPPOTrainer, "init_workers", init_workers_following_actor)
    patcher.wrap(main_ppo_sync.PPOTrainer, "init_workers", init_workers_following_actor)
    patcher.wrap(ray_trainer, "reduce_metrics", reduce_metrics_with_prefix_sharing)
    patcher.wrap(main_ppo_sync, "reduce_metrics", reduce_metrics_with_prefix_sharing)


VERL080_COMMON = Component(name="verl080_common", install=_install)
