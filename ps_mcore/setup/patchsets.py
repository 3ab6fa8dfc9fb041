"""The built-in patchsets: pure wiring. Each entry says which stack it needs (``detect``) and
which integration glue it installs; the glue itself lives in ``ps_mcore.integrations``.

Supporting a new verl release: add ``ps_mcore/integrations/verl0XY/`` (a sibling of
``verl080``) and one :class:`Patchset` entry here. Integrations are imported only inside
``install``, so detecting a stack imports no verl / megatron-core.
"""

from __future__ import annotations

from typing import Callable

from ps_mcore.integrations.env import distribution_version, module_importable
from ps_mcore.integrations.patching import Patcher
from ps_mcore.setup.registry import Component, Patchset, register


def verl080_reason() -> str | None:
    """None when verl 0.8.0 is installed, else why not."""
    version = distribution_version("verl")
    if version is None:
        return "verl is not installed"
    if not version.startswith("0.8.0"):
        return f"verl {version} is installed, this patchset is for verl 0.8.0"
    return None


def mcore016_reason() -> str | None:
    """None when megatron-core 0.16.x is installed, else why not."""
    mcore = distribution_version("megatron-core", "megatron_core")
    if mcore is None and not module_importable("megatron.core"):
        return "megatron-core is not installed"
    if mcore is not None and not mcore.startswith("0.16."):
        return f"megatron-core {mcore} is installed, this patchset is for 0.16.x"
    return None


def mindspeed016_reason() -> str | None:
    """None when MindSpeed is absent (GPU) or 0.16 (Ascend), else why not."""
    mindspeed = distribution_version("mindspeed")
    if mindspeed is not None and not mindspeed.startswith("0.16"):
        return f"MindSpeed {mindspeed} is installed, this patchset pairs with MindSpeed 0.16.0"
    return None


def transformers_reason() -> str | None:
    return "transformers is not installed" if distribution_version("transformers") is None else None


def first_reason(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    """A ``detect`` function: the first check's reason, None when every check passes."""

    def detect() -> str | None:
        for check in checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    return detect


def _install_verl080_common(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl080.install import install_common

    install_common(patcher)


def _install_verl080_megatron(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl080.install import install_megatron_engines

    install_megatron_engines(patcher)


def _install_verl080_fsdp(patcher: Patcher) -> None:
    from ps_mcore.integrations.verl080.install import install_fsdp_engines

    install_fsdp_engines(patcher)


VERL080_COMMON = Component(name="verl080_common", install=_install_verl080_common)

VERL080_MCORE = register(
    Patchset(
        name="verl080_mcore0161_ms0160",
        description="verl 0.8.0 Megatron engine, megatron-core 0.16.x, MindSpeed 0.16.0 (optional)",
        detect=first_reason(verl080_reason, mcore016_reason, mindspeed016_reason),
        install=_install_verl080_megatron,
        components=(VERL080_COMMON,),
    )
)

VERL080_FSDP = register(
    Patchset(
        name="verl080_fsdp",
        description="verl 0.8.0 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=first_reason(verl080_reason, transformers_reason),
        install=_install_verl080_fsdp,
        components=(VERL080_COMMON,),
    )
)


# ----------------------------------------------------------------------------- verl 0.9.1


def release_refusal(label: str, distributions: tuple[str, ...], prefix: str, wanted: str) -> str | None:
    """None when the first installed of ``distributions`` has a version starting with
    ``prefix``; else why not (``label`` names it, ``wanted`` is what the patchset is for)."""
    version = distribution_version(*distributions)
    if version is None:
        return f"{label} is not installed"
    if not version.startswith(prefix):
        return f"{label} {version} is installed, this patchset is for {wanted}"
    return None


def verl091_refusal() -> str | None:
    """None when verl 0.9.1 is installed, else why not."""
    return release_refusal("verl", ("verl",), "0.9.1", "verl 0.9.1")


def mcore019_refusal() -> str | None:
    """None when megatron-core 0.19.x is installed, else why not."""
    return release_refusal("megatron-core", ("megatron-core", "megatron_core"), "0.19.", "0.19.x")


def megatron_builder_refusal() -> str | None:
    """None when a model builder verl 0.9.1's Megatron engine uses is installed: Megatron-Bridge
    (its default, ``vanilla_mbridge: false``) or mbridge (``vanilla_mbridge: true``)."""
    if module_importable("megatron.bridge") or module_importable("mbridge"):
        return None
    return "neither Megatron-Bridge nor mbridge is installed (verl 0.9.1's Megatron engine builds models through one)"


def _verl091_glue(function: str) -> Callable[[Patcher], None]:
    """``ps_mcore.integrations.verl091.install.<function>``, imported when the patchset installs."""

    def install(patcher: Patcher) -> None:
        from ps_mcore.integrations.verl091 import install as glue

        getattr(glue, function)(patcher)

    return install


VERL091_COMMON = Component(name="verl091_common", install=_verl091_glue("install_common"))

VERL091_MCORE = register(
    Patchset(
        name="verl091_mcore019",
        description="verl 0.9.1 Megatron engine (Megatron-Bridge or mbridge builder), megatron-core 0.19.x",
        detect=first_reason(verl091_refusal, mcore019_refusal, megatron_builder_refusal),
        install=_verl091_glue("install_megatron_engines"),
        components=(VERL091_COMMON,),
    )
)

VERL091_FSDP = register(
    Patchset(
        name="verl091_fsdp",
        description="verl 0.9.1 FSDP / FSDP2 engines with Hugging Face transformers",
        detect=first_reason(verl091_refusal, transformers_reason),
        install=_verl091_glue("install_fsdp_engines"),
        components=(VERL091_COMMON,),
    )
)
