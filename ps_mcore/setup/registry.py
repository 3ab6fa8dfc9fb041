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
        detect: returns None when the stack is present, else the reason it is not (cheap:
            package metadata, no imports of the stack).
        components: shared components, installed in order before ``install``.
        install: applies this patchset's own patches through the given :class:`Patcher`,
            each deferred until its module is imported (:meth:`Patcher.when_imported`).
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


@dataclass(frozen=True)
class StackStatus:
    """Whether a patchset's stack is installed: ``available``, else ``refusal`` says why not.
    True in a boolean context when available; prints as ``available`` or
    ``not available (<refusal>)``."""

    refusal: str | None = None

    @property
    def available(self) -> bool:
        return self.refusal is None

    def __bool__(self) -> bool:
        return self.available

    def __str__(self) -> str:
        return "available" if self.available else f"not available ({self.refusal})"

    __repr__ = __str__


def detect() -> dict[str, StackStatus]:
    """Every known patchset -> whether its stack is installed (imports none of it)."""
    return {name: StackStatus(ps.detect()) for name, ps in PATCHSETS.items()}


def _describe(status: dict[str, StackStatus]) -> str:
    return "\n".join(f"  {name}: {state}" for name, state in status.items())


def _select(patchsets: list[str] | None) -> list[str]:
    status = detect()
    if patchsets is None:
        return [name for name, state in status.items() if state.available]
    unknown = [n for n in patchsets if n not in PATCHSETS]
    if unknown:
        raise ValueError(
            f"unknown prefix-sharing patchset(s) {unknown}; known patchsets on this machine:\n"
            + _describe(status)
        )
    missing = [n for n in patchsets if not status[n].available]
    if missing:
        raise RuntimeError(
            f"prefix-sharing patchset(s) {missing} requested but their stack is not installed; "
            "detected:\n" + _describe(status)
        )
    return list(dict.fromkeys(patchsets))


def _on_deferred_error(users: Callable[[], list[str]], explicit: bool) -> Callable[[str, Exception], None]:
    """What happens when a deferred patch fails while the program imports its module: the
    patchsets involved are removed (verl runs its own code); an explicitly requested one
    raises from that import, an automatically selected one warns once."""

    def handle(module: str, err: Exception) -> None:
        names = users()
        uninstall(names)
        message = (f"patchset(s) {names} could not patch {module} ({type(err).__name__}: {err}); "
                   "removed: verl runs its own code")
        if explicit:
            raise RuntimeError(f"[prefix_sharing] {message}") from err
        warn_once(f"deferred:{names}:{module}", message)

    return handle


def _install_component(comp: Component, user: str, explicit: bool) -> None:
    if comp.name in _COMPONENTS:
        _COMPONENTS[comp.name][1].add(user)
        return
    patcher = Patcher(_on_deferred_error(lambda: sorted(_COMPONENTS.get(comp.name, (None, {user}))[1]), explicit))
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

    Each patch is applied when the program imports its verl module (at once for modules
    already imported), so installing imports no verl engine code.

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
            _install_one(PATCHSETS[name], explicit=patchsets is not None)
        except Exception as err:
            if patchsets is not None:
                raise
            # auto-selection: a stack that looked compatible but fails to patch is skipped
            warn_once(f"install:{name}", f"patchset {name} skipped: {type(err).__name__}: {err}")
    return list(_INSTALLED)


def _install_one(ps: Patchset, explicit: bool) -> None:
    patcher = Patcher(_on_deferred_error(lambda: [ps.name], explicit))
    try:
        for comp in ps.components:
            _install_component(comp, ps.name, explicit)
        ps.install(patcher)
    except BaseException:
        patcher.restore()
        _release_components(ps.name)
        raise
    _INSTALLED[ps.name] = patcher
    logger.info("[prefix_sharing] installed patchset %s (%s)", ps.name, ps.description)


@_locked
def uninstall(patchsets: list[str] | None = None) -> None:
    """Remove installed patchsets (all by default), restoring every patched attribute and
    cancelling the patches still waiting for their module."""
    names = list(_INSTALLED) if patchsets is None else [n for n in patchsets if n in _INSTALLED]
    for name in reversed(names):
        _INSTALLED.pop(name).restore()
        _release_components(name)


@_locked
def installed() -> list[str]:
    """Names of the installed patchsets."""
    return list(_INSTALLED)
