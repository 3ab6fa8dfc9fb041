"""Which verl 0.8.0 attributes each patchset wraps (the patchsets in
:mod:`ps_mcore.setup.patchsets` call these through their :class:`~ps_mcore.integrations.patching.Patcher`).

Every patch waits for its verl module (:meth:`Patcher.when_imported`): installing imports no
verl code, and each module is patched right after verl's own import of it.

* :func:`install_common` (installed once, shared): the ``prefix_grouper`` config keys, ref
  policy and critic following the actor's setting, DP balancing that keeps groups on one rank
  (``main_ppo`` and ``main_ppo_sync``), and the ``prefix_sharing/*`` step metrics.
* :func:`install_megatron_engines`: the Megatron engine, and verl's ``mindspeed_megatron``
  engine when its module is imported.
* :func:`install_fsdp_engines`: the FSDP / FSDP2 engines.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

from ps_mcore.integrations.patching import Patcher
from ps_mcore.integrations.verl080.config import install_config_patches
from ps_mcore.integrations.verl080.fsdp import install_verl_fsdp_patches
from ps_mcore.integrations.verl080.megatron import install_forward_fn_patch, install_megatron_patches
from ps_mcore.integrations.verl080.mindspeed import ENGINE_MODULE, install_mindspeed_build_patch
from ps_mcore.integrations.verl080.trainer import (
    init_workers_following_actor,
    ray_trainer_balance_batch,
    reduce_metrics_with_prefix_sharing,
    sync_trainer_balance_batch,
)

CONFIG_MODULE = "verl.workers.config"  # imports the actor and critic config modules
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def _wrap_trainer(patcher: Patcher, module: ModuleType, trainer: type, balance: Callable) -> None:
    patcher.wrap(trainer, "_balance_batch", balance)
    patcher.wrap(trainer, "init_workers", init_workers_following_actor)
    patcher.wrap(module, "reduce_metrics", reduce_metrics_with_prefix_sharing)


def _patch_configs(patcher: Patcher, _module: ModuleType) -> None:
    install_config_patches(patcher)


def _patch_ray_trainer(patcher: Patcher, module: ModuleType) -> None:
    _wrap_trainer(patcher, module, module.RayPPOTrainer, ray_trainer_balance_batch)


def _patch_sync_trainer(patcher: Patcher, module: ModuleType) -> None:
    _wrap_trainer(patcher, module, module.PPOTrainer, sync_trainer_balance_batch)


def _patch_forward_fn(patcher: Patcher, _module: ModuleType) -> None:
    install_forward_fn_patch(patcher)


def _patch_megatron_engine(patcher: Patcher, _module: ModuleType) -> None:
    install_megatron_patches(patcher)


def _patch_mindspeed_engine(patcher: Patcher, _module: ModuleType) -> None:
    # verl's MindSpeed engine module imports without MindSpeed, so CPU tests cover the patch;
    # the patched class only ever runs on NPU.
    install_mindspeed_build_patch(patcher)


def _patch_fsdp_engine(patcher: Patcher, _module: ModuleType) -> None:
    install_verl_fsdp_patches(patcher)


def _defer(patcher: Patcher, module: str, patch: Callable[[Patcher, ModuleType], None]) -> None:
    patcher.when_imported(module, lambda mod: patch(patcher, mod))


def install_common(patcher: Patcher) -> None:
    _defer(patcher, CONFIG_MODULE, _patch_configs)
    _defer(patcher, "verl.trainer.ppo.ray_trainer", _patch_ray_trainer)
    _defer(patcher, "verl.trainer.main_ppo_sync", _patch_sync_trainer)


def install_megatron_engines(patcher: Patcher) -> None:
    _defer(patcher, "verl.models.mcore", _patch_forward_fn)
    _defer(patcher, MEGATRON_ENGINE_MODULE, _patch_megatron_engine)
    _defer(patcher, ENGINE_MODULE, _patch_mindspeed_engine)


def install_fsdp_engines(patcher: Patcher) -> None:
    _defer(patcher, FSDP_ENGINE_MODULE, _patch_fsdp_engine)
