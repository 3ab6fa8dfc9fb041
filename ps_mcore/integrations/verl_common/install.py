"""The deferred installs both verl releases share: the modules holding the seams are the same
in 0.8.0 and 0.9.1, so each release's ``install.py`` composes these with its own trainers
(and 0.8.0's MindSpeed engine).

Every patch waits for its verl module (:meth:`Patcher.when_imported`): installing imports no
verl code, and each module is patched right after verl's own import of it.
"""

from __future__ import annotations

from typing import Callable

from ps_mcore.integrations.patching import Patcher
from ps_mcore.integrations.verl_common.config import install_config_patches
from ps_mcore.integrations.verl_common.fsdp import install_verl_fsdp_patches
from ps_mcore.integrations.verl_common.megatron import install_forward_fn_patch, install_megatron_patches
from ps_mcore.integrations.verl_common.trainer import (
    install_trainer_patches,
    ray_trainer_balance_batch,
    sync_trainer_balance_batch,
)

CONFIG_MODULE = "verl.workers.config"  # imports the actor and critic config modules
RAY_TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"  # the DataProto trainer (RayPPOTrainer)
FORWARD_FN_MODULE = "verl.models.mcore"
MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"


def defer(patcher: Patcher, module: str, install: Callable[[Patcher], None]) -> None:
    """``install(patcher)`` once ``module`` is imported (at once if it is)."""
    patcher.when_imported(module, lambda _module: install(patcher))


def defer_trainer(patcher: Patcher, module: str, trainer: str, balance: Callable, setup_method: str) -> None:
    """:func:`~ps_mcore.integrations.verl_common.trainer.install_trainer_patches` on class
    ``trainer`` of ``module`` once that module is imported."""
    patcher.when_imported(
        module, lambda mod: install_trainer_patches(patcher, mod, getattr(mod, trainer), balance, setup_method)
    )


def defer_common(patcher: Patcher, kv_trainer_module: str, kv_trainer_setup: str) -> None:
    """What every patchset of a release shares: the ``prefix_grouper`` keys on the actor and
    critic config dataclasses, and both trainers (``RayPPOTrainer``, and the ``KVBatchMeta``
    trainer ``PPOTrainer`` of ``kv_trainer_module``, whose workers ``kv_trainer_setup`` makes)."""
    defer(patcher, CONFIG_MODULE, install_config_patches)
    defer_trainer(patcher, RAY_TRAINER_MODULE, "RayPPOTrainer", ray_trainer_balance_batch, "init_workers")
    defer_trainer(patcher, kv_trainer_module, "PPOTrainer", sync_trainer_balance_batch, kv_trainer_setup)


def defer_megatron_engine(patcher: Patcher) -> None:
    """The Megatron engine: the forward function it looks up per step, and its class patches."""
    defer(patcher, FORWARD_FN_MODULE, install_forward_fn_patch)
    defer(patcher, MEGATRON_ENGINE_MODULE, install_megatron_patches)


def defer_fsdp_engine(patcher: Patcher) -> None:
    """The FSDP / FSDP2 engines."""
    defer(patcher, FSDP_ENGINE_MODULE, install_verl_fsdp_patches)
