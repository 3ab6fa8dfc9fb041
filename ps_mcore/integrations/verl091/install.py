"""Which verl 0.9.1 attributes each patchset wraps (the patchsets in
:mod:`ps_mcore.setup.patchsets` call these through their :class:`~ps_mcore.integrations.patching.Patcher`).

What changed from verl 0.8.0 (:mod:`ps_mcore.integrations.verl080.install`): ``main_ppo`` runs
the ``KVBatchMeta`` trainer of ``verl.trainer.ppo.v1`` (0.8.0's ``main_ppo_sync``; set up by
``init`` instead of ``init_workers``), ``main_ppo_v0`` the ``RayPPOTrainer``; the MindSpeed
engines inherit the Megatron engine's model build and forward, so the Megatron patches cover
them. The engine seams themselves are 0.8.0's (:mod:`ps_mcore.integrations.verl_common`), in
the same modules (:mod:`ps_mcore.integrations.verl_common.install`).

Every patch waits for its verl module (:meth:`Patcher.when_imported`): installing imports no
verl code, and each module is patched right after verl's own import of it. ``main_ppo``'s
trainer module imports TransferQueue (verl's verl-core extra): without it that trainer cannot
run, and its patch never applies.

* :func:`install_common` (installed once, shared): the ``prefix_grouper`` config keys, ref
  policy and critic following the actor's setting, DP balancing that keeps groups on one rank
  (both trainers), and the ``prefix_sharing/*`` step metrics.
* :func:`install_megatron_engines`: the Megatron engine (Megatron-Bridge and mbridge builds).
* :func:`install_fsdp_engines`: the FSDP / FSDP2 engines.
"""

from __future__ import annotations

from ps_mcore.integrations.patching import Patcher
from ps_mcore.integrations.verl_common.install import (
    defer_common,
    defer_fsdp_engine,
    defer_megatron_engine,
)


def install_common(patcher: Patcher) -> None:
    defer_common(patcher, "verl.trainer.ppo.v1.trainer_base", "init")


def install_megatron_engines(patcher: Patcher) -> None:
    defer_megatron_engine(patcher)


def install_fsdp_engines(patcher: Patcher) -> None:
    defer_fsdp_engine(patcher)
