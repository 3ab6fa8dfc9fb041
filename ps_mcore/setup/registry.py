"""Patchset registry: installing / uninstalling registered patchsets (with shared components
installed once). Pure machinery: the built-in entries are registered by
:mod:`ps_mcore.setup.patchsets` (imported by ``ps_mcore.setup``), which says what each one
needs and which glue it installs."""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ps_mcore.integrations.env import distribution_version, module_importable  # noqa: F401 (re-export)
from ps_mcore.integrations.patching import Patcher, warn_once

logger = logging.getLogger("ps_mcore")


@dataclass
class Component:
    """A set of patches shared by patchsets (installed once, removed with the last user)."""

    name: str
    install: Callable[[Patcher], None]


@dataclass
class Patchset:
    """One tested stack.

    Attributes:
        name: the value users put in ``PREFIX_SHARING_PATCHSET``.
        description: the stack in words.
        detect: returns None when the stack is present, else the reason it is not.
        components: shared components, installed in order before ``install``.
        install: applies this patchset's own patches through the given :class:`Patcher`.
    """

    name: str
    description: str
    detect: Callable[[], str | None]
    install: Callable[[Patcher], None]
    components: tuple[Component, ...] = field(default_factory=tuple)


PATCHSETS: dict[str, Patchset] = {}
_INSTALLED: dict[str, Patcher] = {}
_COMPONENTS: dict[str, tuple[Patcher, set[str]]] = {}
# install/uninstall from several threads (e.g. worker start-up hooks) must patch once.
_LOCK = threading.RLock()


def _locked(fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)

    return guarded


def register(patchset: Patchset) -> Patchset:
    PATCHSETS[patchset.name] = patchset
    return patchset


def detect() -> dict[str, str | None]:
    """Every known patchset -> None if its stack is installed, else why not."""
    return {name: ps.detect() for name, ps in PATCHSETS.items()}


def _describe(status: dict[str, str | None]) -> str:
    lines = []
    for name, reason in status.items():
        lines.append(f"  {name}: " + ("compatible" if reason is None else f"not available ({reason})"))
    return "\n".join(lines)


def _select(patchsets: list[str] | None) -> list[str]:
    status = detect()
    if patchsets is None:
        return [name for name, reason in status.items() if reason is None]
    unknown = [n for n in patchsets if n not in PATCHSETS]
    if unknown:
        raise ValueError(
            f"unknown prefix-sharing patchset(s) {unknown}; known patchsets on this machine:\n"
            + _describe(status)
        )
    missing = [n for n in patchsets if status[n] is not None]
    if missing:
        raise RuntimeError(
            f"prefix-sharing patchset(s) {missing} requested but their stack is not installed; "
            "detected:\n" + _describe(status)
        )
    return list(dict.fromkeys(patchsets))


def _install_component(comp: Component, user: str) -> None:
    if comp.name in _COMPONENTS:
        _COMPONENTS[comp.name][1].add(user)
        return
    patcher = Patcher()
    try:
        comp.install(patcher)
    except BaseException:
        patcher.restore()
        raise
    _COMPONENTS[comp.name] = (patcher, {user})


def _release_components(user: str) -> None:
    for name in reversed(list(_COMPONENTS)):
        patcher, users = _COMPONENTS[name]
        users.discard(user)
        if not users:
            patcher.restore()
            del _COMPONENTS[name]


@_locked
def install(patchsets: list[str] | str | None = None) -> list[str]:
    """Install patchsets (idempotent).

    Args:
        patchsets: names, a comma-separated string, or None: every patchset whose stack is
            installed (``PREFIX_SHARING_PATCHSET`` is not read here; ``import prefix_sharing``
            passes it).

    Returns:
        The names installed now or before, in install order.

    Raises:
        ValueError: an unknown name. RuntimeError: a requested patchset's stack is missing.
        Both messages list what was detected.
    """
    if isinstance(patchsets, str):
        patchsets = [n.strip() for n in patchsets.split(",") if n.strip()]
    for name in _select(patchsets):
        if name in _INSTALLED:
            continue
        try:
            _install_one(PATCHSETS[name])
        except Exception as err:
            if patchsets is not None:
                raise
            # auto-selection: a stack that looked compatible but fails to patch is skipped
            warn_once(f"install:{name}", f"patchset {name} skipped: {type(err).__name__}: {err}")
    return list(_INSTALLED)


def _install_one(ps: Patchset) -> None:
    patcher = Patcher()
    try:
        for comp in ps.components:
            _install_component(comp, ps.name)
        ps.install(patcher)
    except BaseException:
        patcher.restore()
        _release_components(ps.name)
        raise
    _INSTALLED[ps.name] = patcher
    logger.info("[prefix_sharing] installed patchset %s (%s)", ps.name, ps.description)


@_locked
def uninstall(patchsets: list[str] | None = None) -> None:
    """Remove installed patchsets (all by default), restoring every patched attribute."""
    names = list(_INSTALLED) if patchsets is None else [n for n in patchsets if n in _INSTALLED]
    for name in reversed(names):
        _INSTALLED.pop(name).restore()
        _release_components(name)


@_locked
def installed() -> list[str]:
    """Names of the installed patchsets."""
    return list(_INSTALLED)
