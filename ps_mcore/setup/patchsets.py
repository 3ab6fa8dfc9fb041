"""Patchset ``verl080_mcore0161_ms0160``: verl 0.8.0's Megatron engine on megatron-core
0.16.x (MindSpeed 0.16.0 on Ascend, when installed). See :mod:`ps_mcore.verl.megatron`."""

from __future__ import annotations

from ps_mcore.setup.registry import Patchset, distribution_version, module_importable, register
from ps_mcore.setup.verl080_common import VERL080_COMMON, verl_reason

NAME = "verl080_mcore0161_ms0160"


def detect() -> str | None:
    reason = verl_reason()
    if reason is not None:
        return reason
    mcore = distribution_version("megatron-core", "megatron_core")
    if mcore is None and not module_importable("megatron.core"):
        return "megatron-core is not installed"
    if mcore is not None and not mcore.startswith("0.16."):
        return f"megatron-core {mcore} is installed, this patchset is for 0.16.x"
    mindspeed = distribution_version("mindspeed")
    if mindspeed is not None and not mindspeed.startswith("0.16"):
        return f"MindSpeed {mindspeed} is installed, this patchset pairs with MindSpeed 0.16.0"
    return None


def _install(patcher) -> None:
    from ps_mcore.mindspeed.patch import engine_available, install_patches
    from ps_mcore.verl.megatron import install_megatron_patches

    install_megatron_patches(patcher)
    # verl's MindSpeed engine module imports without MindSpeed, so CPU tests cover the patch;
    # the patched class only ever runs on NPU.
    if engine_available():
        install_patches(patcher)


PATCHSET = register(
    Patchset(
        name=NAME,
        description="verl 0.8.0 Megatron engine, megatron-core 0.16.x, MindSpeed 0.16.0 (optional)",
        detect=detect,
        install=_install,
        components=(VERL080_COMMON,),
    )
)
