"""Patchsets that plug ps-mcore into verl without editing verl.

    import prefix_sharing                      # installs every compatible patchset
    PREFIX_SHARING_PATCHSET=verl080_mcore0161_ms0160 python ...   # only that one

    from ps_mcore import setup
    setup.install()                            # same, programmatically (idempotent)
    setup.install("verl080_mcore0161_ms0160")
    setup.uninstall()                          # verl exactly as before
    setup.detect()                             # patchset -> available, or not available (why)

Patchsets: ``verl080_mcore0161_ms0160`` (verl 0.8.0 Megatron engine, megatron-core 0.16,
MindSpeed 0.16.0) and ``verl080_fsdp`` (verl 0.8.0 FSDP engines). ``ENABLE_PREFIX_SHARING=0``
makes every patched path call verl's own code unchanged, read at each call. Importing
``ps_mcore`` or this package patches nothing; installing imports no verl code (each verl
module is patched when the program imports it).

Pure wiring on top of ``ps_mcore.integrations``: ``registry`` (install machinery) and
``patchsets`` (detect + which glue to install). The patch utilities the glue uses are a leaf
of the integrations floor (:mod:`ps_mcore.integrations.patching`,
:mod:`ps_mcore.integrations.env`).
"""

from ps_mcore.integrations.env import ENABLE_VAR, PATCHSET_VAR, prefix_sharing_enabled, requested_patchsets
from ps_mcore.setup import patchsets as _builtin_patchsets  # noqa: F401 (registers the built-ins)
from ps_mcore.setup.registry import PATCHSETS, StackStatus, detect, install, installed, uninstall

__all__ = [
    "ENABLE_VAR",
    "PATCHSETS",
    "PATCHSET_VAR",
    "StackStatus",
    "detect",
    "install",
    "installed",
    "prefix_sharing_enabled",
    "requested_patchsets",
    "uninstall",
]
