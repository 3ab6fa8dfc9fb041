"""The environment: switches read when they are needed (never cached), and probes of the
installed stack. A leaf: imports nothing of ps_mcore, so the integrations can use it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
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


def distribution_version(*names: str) -> str | None:
    """Installed version of the first distribution found among ``names`` (None if none)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def module_importable(name: str) -> bool:
    """Whether ``name`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
