"""Reversible attribute patches, patches deferred until a module is imported, and one-time
warnings.

A :class:`Patcher` records what it replaced (or that there was nothing) so ``restore()``
puts every namespace back exactly: the original objects, not copies, and attributes that did
not exist are deleted again. Patches target the namespace a name is looked up in at call
time (a module that did ``from x import f`` or a class ``__dict__``).

:meth:`Patcher.when_imported` applies a patch as soon as its target module exists: at once
when it is imported already, else right after the module's code has run (a post-import hook
on ``sys.meta_path``), before any importer sees the module. Installing patches therefore
imports nothing of the patched library (verl's engine modules take seconds and print notes at
import); each part is patched when the program imports it.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable

logger = logging.getLogger("ps_mcore")

_MISSING = object()
_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a ``UserWarning`` (and a log line) once per process per ``key``."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.warning("[prefix_sharing] %s", message)
    warnings.warn(f"[prefix_sharing] {message}", UserWarning, stacklevel=3)


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO level once per process per ``key`` (no warning)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    logger.info("[prefix_sharing] %s", message)


# ----------------------------------------------------------------------------- post-import hooks

# module name -> callbacks waiting for that module's code to have run
_HOOKS: dict[str, list[Callable[[ModuleType], None]]] = {}
_HOOKS_LOCK = threading.Lock()
_FINDING = threading.local()  # names this thread is looking up through the other finders


def _initialized(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> Callable[[], None]:
    """Call ``callback(module)`` once module ``name`` is imported: now when it already is,
    else right after its code has run (before its importer sees it). Returns a function that
    cancels the callback if it has not run yet.

    A module whose import is under way in another thread when this is called is not seen;
    patch sets are installed before the program imports what they patch, or after."""
    module = sys.modules.get(name)
    if module is not None and _initialized(module):
        callback(module)
        return lambda: None
    with _HOOKS_LOCK:
        _HOOKS.setdefault(name, []).append(callback)
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())

    def cancel() -> None:
        with _HOOKS_LOCK:
            waiting = _HOOKS.get(name, [])
            if callback in waiting:
                waiting.remove(callback)
            if not waiting:
                _HOOKS.pop(name, None)

    return cancel


def _run_hooks(module: ModuleType) -> None:
    with _HOOKS_LOCK:
        callbacks = _HOOKS.pop(module.__name__, [])
    for callback in callbacks:
        callback(module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with waiting callbacks it asks the other finders for
    the spec and wraps the loader so that the callbacks run after the module's code."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        finding = getattr(_FINDING, "names", None)
        if finding is None:
            finding = _FINDING.names = set()
        if fullname in finding:
            return None
        finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            finding.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderThenHooks(spec.loader)
        return spec


class _LoaderThenHooks:
    """The module's own loader (every attribute delegated), then its post-import callbacks."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module keeps its real loader (introspection, reloads, resources)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_hooks(module)


# ----------------------------------------------------------------------------- patcher


class Patcher:
    """Applies attribute patches and undoes them in reverse order.

    ``on_deferred_error(module_name, error)``, when given, handles an exception raised by a
    :meth:`when_imported` patch that ran during a later import (else it propagates to that
    import)."""

    def __init__(self, on_deferred_error: Callable[[str, Exception], None] | None = None) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self._pending: list[Callable[[], None]] = []  # cancels of patches still waiting
        self.on_deferred_error = on_deferred_error

    def __len__(self) -> int:
        return len(self._undo)

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """``setattr(owner, name, value)``; returns the previous value (the class's own entry
        for classes, so inherited methods are wrapped without touching the base class)."""
        previous = _own_attribute(owner, name)
        self._undo.append((owner, name, previous))
        setattr(owner, name, value)
        return getattr(owner, name) if previous is _MISSING else previous

    def wrap(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> Callable:
        """Replace ``owner.name`` by ``make(original)``; ``original`` is what attribute lookup
        returned before (the inherited one if ``owner`` had no own entry)."""
        original = getattr(owner, name)
        raw = owner.__dict__.get(name, original) if isinstance(owner, type) else original
        if isinstance(raw, (staticmethod, classmethod)):
            raise TypeError(f"cannot wrap {owner!r}.{name}: static/class methods are not supported")
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        wrapper.__ps_mcore_original__ = original
        self.set(owner, name, wrapper)
        return wrapper

    def when_imported(self, module: str, patch: Callable[[ModuleType], None]) -> None:
        """Run ``patch(module)`` (which patches through this patcher) when ``module`` is
        imported: now if it is, else right after its code runs. :meth:`restore` also cancels
        it while it waits."""
        deferred = False

        def run(mod: ModuleType) -> None:
            try:
                patch(mod)
            except Exception as err:
                if not deferred or self.on_deferred_error is None:
                    raise
                self.on_deferred_error(mod.__name__, err)
            else:
                if deferred:
                    logger.info("[prefix_sharing] patched %s", mod.__name__)

        self._pending.append(when_imported(module, run))
        deferred = True

    def restore(self) -> None:
        """Cancel the patches still waiting for their module; undo every patch, newest first."""
        while self._pending:
            self._pending.pop()()
        while self._undo:
            owner, name, previous = self._undo.pop()
            if previous is _MISSING:
                if name in _namespace(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, previous)


def _namespace(owner: Any) -> dict:
    return owner.__dict__ if hasattr(owner, "__dict__") else {}


def _own_attribute(owner: Any, name: str) -> Any:
    ns = _namespace(owner)
    return ns[name] if name in ns else _MISSING
