"""Which verl 0.8.0 attributes each patchset wraps (the patchsets in
:mod:`ps_mcore.setup.patchsets` call these through their :class:`~ps_mcore.integrations.patching.Patcher`).

Every patch waits for its verl module (:meth:`Patcher.when_imported`): installing imports no
verl code, and each module is patched right after verl's own import of it. The config,
engine and forward-function modules are the ones 0.9.1 has
(:mod:`ps_mcore.integrations.verl_common.install`).

* :func:`install_common` (installed once, shared): the ``prefix_grouper`` config keys, ref
  policy and critic following the actor's setting, DP balancing that keeps groups on one rank
  (``main_ppo`` and ``main_ppo_sync``), and the ``prefix_sharing/*`` step metrics.
* :func:`install_megatron_engines`: the Megatron engine, and verl's ``mindspeed_megatron``
  engine when its module is imported.
* :func:`install_fsdp_engines`: the FSDP / FSDP2 engines.
"""

from __future__ import annotations

from ps_mcore.integrations.patching import Patcher
from ps_mcore.integrations.verl080.mindspeed import ENGINE_MODULE, install_mindspeed_build_patch
from ps_mcore.integrations.verl_common.install import (
    defer,
    defer_common,
    defer_fsdp_engine,
    defer_megatron_engine,
)


def install_common(patcher: Patcher) -> None:
    defer_common(patcher, "verl.trainer.main_ppo_sync", "init_workers")


def install_megatron_engines(patcher: Patcher) -> None:
    defer_megatron_engine(patcher)
    # verl's MindSpeed engine module imports without MindSpeed, so CPU tests cover the patch;
    # the patched class only ever runs on NPU.
    defer(patcher, ENGINE_MODULE, install_mindspeed_build_patch)


def install_fsdp_engines(patcher: Patcher) -> None:
    defer_fsdp_engine(patcher)
