"""Which verl 0.8.0 attributes each patchset wraps (the patchsets in
:mod:`ps_mcore.setup.patchsets` call these through their :class:`~ps_mcore.integrations.patching.Patcher`).

* :func:`install_common` (installed once, shared): the ``prefix_grouper`` config keys, ref
  policy and critic following the actor's setting, DP balancing that keeps groups on one rank
  (``main_ppo`` and ``main_ppo_sync``), and the ``prefix_sharing/*`` step metrics.
* :func:`install_megatron_engines`: the Megatron engine, and verl's ``mindspeed_megatron``
  engine when its module imports.
* :func:`install_fsdp_engines`: the FSDP / FSDP2 engines.
"""

from __future__ import annotations

from ps_mcore.integrations.patching import Patcher


def install_common(patcher: Patcher) -> None:
    from verl.trainer import main_ppo_sync
    from verl.trainer.ppo import ray_trainer

    from ps_mcore.integrations.verl_common.config import install_config_patches
    from ps_mcore.integrations.verl_common.trainer import (
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


def install_megatron_engines(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl_common.megatron import install_megatron_patches
    from ps_mcore.integrations.verl080.mindspeed import engine_available, install_mindspeed_build_patch

    install_megatron_patches(patcher)
    # verl's MindSpeed engine module imports without MindSpeed, so CPU tests cover the patch;
    # the patched class only ever runs on NPU.
    if engine_available():
        install_mindspeed_build_patch(patcher)


def install_fsdp_engines(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl_common.fsdp import install_verl_fsdp_patches

    install_verl_fsdp_patches(patcher)
