"""The built-in patchsets: pure wiring. Each entry says which stack it needs (``detect``) and
which integration glue it installs; the glue itself lives in ``ps_mcore.integrations``.

Supporting a new verl release: add ``ps_mcore/integrations/verl0XY/`` (a sibling of
``verl080``) and one :class:`Patchset` entry here. The glue imports verl / megatron-core only
inside ``install``, so detecting a stack imports neither.
"""

from __future__ import annotations

from typing import Callable

from ps_mcore.integrations.env import distribution_version, module_importable
from ps_mcore.integrations.verl080.install import install_common, install_fsdp_engines, install_megatron_engines
from ps_mcore.setup.registry import Component, Patchset, register


def verl080_refusal() -> str | None:
    """None when verl 0.8.0 is installed, else why not."""
    version = distribution_version("verl")
    if version is None:
        return "verl is not installed"
    if not version.startswith("0.8.0"):
        return f"verl {version} is installed, this patchset is for verl 0.8.0"
    return None


def mcore016_refusal() -> str | None:
    """None when megatron-core 0.16.x is installed, else why not."""
    mcore = distribution_version("megatron-core", "megatron_core")
    if mcore is None and not module_importable("megatron.core"):
        return "megatron-core is not installed"
    if mcore is not None and not mcore.startswith("0.16."):
        return f"megatron-core {mcore} is installed, this patchset is for 0.16.x"
    return None


def mindspeed016_refusal() -> str | None:
    """None when MindSpeed is absent (GPU) or 0.16 (Ascend), else why not."""
    mindspeed = distribution_version("mindspeed")
    if mindspeed is not None and not mindspeed.startswith("0.16"):
        return f"MindSpeed {mindspeed} is installed, this patchset pairs with MindSpeed 0.16.0"
    return None


def transformers_refusal() -> str | None:
    return "transformers is not installed" if distribution_version("transformers") is None else None


def first_refusal(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    """A ``detect`` function: the first check's reason, None when every check passes."""

    def detect() -> str | None:
        for check in checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    return detect


VERL080_COMMON = Component(name="verl080_common", install=install_common)

VERL080_MCORE = register(
    Patchset(
        name="verl080_mcore0161_ms0160",
        description="verl 0.8.0 Megatron engine, megatron-core 0.16.x, MindSpeed 0.16.0 (optional)",
        detect=first_refusal(verl080_refusal, mcore016_refusal, mindspeed016_refusal),
        install=install_megatron_engines,
        components=(VERL080_COMMON,),
    )
)

VERL080_FSDP = register(
    Patchset(
        name="verl080_fsdp",
        description="verl 0.8.0 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=first_refusal(verl080_refusal, transformers_refusal),
        install=install_fsdp_engines,
        components=(VERL080_COMMON,),
    )
)
