"""Environment switches, read when they are needed (never cached)."""

from __future__ import annotations

import os

ENABLE_VAR = "ENABLE_PREFIX_SHARING"
PATCHSET_VAR = "PREFIX_SHARING_PATCHSET"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def prefix_sharing_enabled() -> bool:
    """``ENABLE_PREFIX_SHARING`` at this moment: unset or 1 -> True, 0 -> False.

    Every patched path reads it per call, so a run can switch the stock path back on
    without uninstalling anything.
    """
    raw = os.environ.get(ENABLE_VAR, "1").strip().lower()
    if raw in _TRUE or raw == "":
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{ENABLE_VAR}={os.environ[ENABLE_VAR]!r}: expected 0 or 1")


def requested_patchsets() -> list[str] | None:
    """Names in ``PREFIX_SHARING_PATCHSET`` (comma separated), or None when unset/empty."""
    raw = os.environ.get(PATCHSET_VAR, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return names or None
