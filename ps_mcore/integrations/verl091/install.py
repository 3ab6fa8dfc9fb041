"""Which verl 0.9.1 attributes each patchset wraps (the patchsets in
:mod:`ps_mcore.setup.patchsets` call these through their :class:`~ps_mcore.integrations.patching.Patcher`).

What changed from verl 0.8.0 (:mod:`ps_mcore.integrations.verl080.install`): ``main_ppo`` runs
the ``KVBatchMeta`` trainer of ``verl.trainer.ppo.v1`` (0.8.0's ``main_ppo_sync``; set up by
``init`` instead of ``init_workers``), ``main_ppo_v0`` the ``RayPPOTrainer``; the MindSpeed
engines inherit the Megatron engine's model build and forward, so the Megatron patches cover
them. The engine seams themselves are 0.8.0's (:mod:`ps_mcore.integrations.verl_common`).

* :func:`install_common` (installed once, shared): the ``prefix_grouper`` config keys, ref
  policy and critic following the actor's setting, DP balancing that keeps groups on one rank
  (both trainers), and the ``prefix_sharing/*`` step metrics.
* :func:`install_megatron_engines`: the Megatron engine (Megatron-Bridge and mbridge builds).
* :func:`install_fsdp_engines`: the FSDP / FSDP2 engines.
"""

from __future__ import annotations

from ps_mcore.integrations.env import module_importable
from ps_mcore.integrations.patching import Patcher

def install_common(patcher: Patcher) -> None:
    from verl.trainer.ppo import ray_trainer

    from ps_mcore.integrations.verl_common.config import install_config_patches
    from ps_mcore.integrations.verl_common.trainer import (
        install_trainer_patches,
        ray_trainer_balance_batch,
        sync_trainer_balance_batch,
    )

    install_config_patches(patcher)
    install_trainer_patches(patcher, ray_trainer, ray_trainer.RayPPOTrainer, ray_trainer_balance_batch, "init_workers")
    # main_ppo's trainer module imports TransferQueue (verl's verl-core extra): without it that
    # trainer cannot run either
    if module_importable("transfer_queue"):
        from verl.trainer.ppo.v1 import trainer_base

        install_trainer_patches(patcher, trainer_base, trainer_base.PPOTrainer, sync_trainer_balance_batch, "init")


def install_megatron_engines(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl_common.megatron import install_megatron_patches

    install_megatron_patches(patcher)


def install_fsdp_engines(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl_common.fsdp import install_verl_fsdp_patches

    install_verl_fsdp_patches(patcher)
