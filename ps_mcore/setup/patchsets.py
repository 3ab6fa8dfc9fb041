"""The built-in patchsets: pure wiring. Each entry says which stack it needs (``detect``) and
which integration glue it installs; the glue itself lives in ``ps_mcore.integrations``.

Supporting a new verl release: add ``ps_mcore/integrations/verl0XY/`` (a sibling of
``verl080``; what both releases share lives in ``verl_common``) and one :class:`Patchset`
entry here. Detecting a stack reads package metadata and installing imports no verl /
megatron-core: every patch waits for its module to be imported.
"""

from __future__ import annotations

from typing import Callable

from ps_mcore.integrations.env import distribution_version, module_importable
from ps_mcore.integrations.verl080 import install as verl080_install
from ps_mcore.integrations.verl091 import install as verl091_install
from ps_mcore.setup.registry import Component, Patchset, register


def release_refusal(label: str, distributions: tuple[str, ...], prefix: str, wanted: str) -> str | None:
    """None when the first installed of ``distributions`` has a version starting with
    ``prefix``; else why not (``label`` names it, ``wanted`` is what the patchset is for)."""
    version = distribution_version(*distributions)
    if version is None:
        return f"{label} is not installed"
    if not version.startswith(prefix):
        return f"{label} {version} is installed, this patchset is for {wanted}"
    return None


def verl080_refusal() -> str | None:
    """None when verl 0.8.0 is installed, else why not."""
    return release_refusal("verl", ("verl",), "0.8.0", "verl 0.8.0")


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


VERL080_COMMON = Component(name="verl080_common", install=verl080_install.install_common)

VERL080_MCORE = register(
    Patchset(
        name="verl080_mcore0161_ms0160",
        description="verl 0.8.0 Megatron engine, megatron-core 0.16.x, MindSpeed 0.16.0 (optional)",
        detect=first_refusal(verl080_refusal, mcore016_refusal, mindspeed016_refusal),
        install=verl080_install.install_megatron_engines,
        components=(VERL080_COMMON,),
    )
)

VERL080_FSDP = register(
    Patchset(
        name="verl080_fsdp",
        description="verl 0.8.0 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=first_refusal(verl080_refusal, transformers_refusal),
        install=verl080_install.install_fsdp_engines,
        components=(VERL080_COMMON,),
    )
)


# ----------------------------------------------------------------------------- verl 0.9.1


def verl091_refusal() -> str | None:
    """None when verl 0.9.1 is installed, else why not."""
    return release_refusal("verl", ("verl",), "0.9.1", "verl 0.9.1")


def mcore019_refusal() -> str | None:
    """None when megatron-core 0.19.x is installed, else why not."""
    return release_refusal("megatron-core", ("megatron-core", "megatron_core"), "0.19.", "0.19.x")


def megatron_builder_refusal() -> str | None:
    """None when a model builder verl 0.9.1's Megatron engine uses is installed: Megatron-Bridge
    (its default, ``vanilla_mbridge: false``) or mbridge (``vanilla_mbridge: true``)."""
    if distribution_version("megatron-bridge", "mbridge") is not None:
        return None
    return "neither Megatron-Bridge nor mbridge is installed (verl 0.9.1's Megatron engine builds models through one)"


VERL091_COMMON = Component(name="verl091_common", install=verl091_install.install_common)

VERL091_MCORE = register(
    Patchset(
        name="verl091_mcore019",
        description="verl 0.9.1 Megatron engine (Megatron-Bridge or mbridge builder), megatron-core 0.19.x",
        detect=first_refusal(verl091_refusal, mcore019_refusal, megatron_builder_refusal),
        install=verl091_install.install_megatron_engines,
        components=(VERL091_COMMON,),
    )
)

VERL091_FSDP = register(
    Patchset(
        name="verl091_fsdp",
        description="verl 0.9.1 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=first_refusal(verl091_refusal, transformers_refusal),
        install=verl091_install.install_fsdp_engines,
        components=(VERL091_COMMON,),
    )
)
