"""Patchset ``verl080_fsdp``: verl 0.8.0's FSDP engines with Hugging Face models.

The engine glue lives in ``ps_mcore.verl.fsdp`` (``install_verl_fsdp_patches(patcher)``,
written with the FSDP bridge); the patchset reports itself unavailable while that hook is
missing. It reuses the shared config keys, micro-batching (``ps_mcore.verl.engine``) and DP
balancing of the verl 0.8.0 patchsets.
"""

from __future__ import annotations

import importlib

from ps_mcore.setup.registry import Patchset, distribution_version, register
from ps_mcore.setup.verl080_common import VERL080_COMMON, verl_reason

NAME = "verl080_fsdp"
GLUE_MODULE = "ps_mcore.verl.fsdp"
GLUE_HOOK = "install_verl_fsdp_patches"


def _glue():
    try:
        module = importlib.import_module(GLUE_MODULE)
    except ImportError:
        return None
    return getattr(module, GLUE_HOOK, None)


def detect() -> str | None:
    reason = verl_reason()
    if reason is not None:
        return reason
    if distribution_version("transformers") is None:
        return "transformers is not installed"
    if _glue() is None:
        return f"the verl FSDP engine glue ({GLUE_MODULE}.{GLUE_HOOK}) is not available yet"
    return None


def _install(patcher) -> None:
    hook = _glue()
    if hook is None:
        raise NotImplementedError(
            f"patchset {NAME}: the verl FSDP engine glue ({GLUE_MODULE}.{GLUE_HOOK}) is not available yet"
        )
    hook(patcher)


PATCHSET = register(
    Patchset(
        name=NAME,
        description="verl 0.8.0 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=detect,
        install=_install,
        components=(VERL080_COMMON,),
    )
)
