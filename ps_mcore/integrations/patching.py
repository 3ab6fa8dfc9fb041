"""Reversible attribute patches and one-time warnings.

A :class:`Patcher` records what it replaced (or that there was nothing) so ``restore()``
puts every namespace back exactly: the original objects, not copies, and attributes that did
not exist are deleted again. Patches target the namespace a name is looked up in at call
time (a module that did ``from x import f`` or a class ``__dict__``).
"""

from __future__ import annotations

import functools
import logging
import warnings
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


class Patcher:
    """Applies attribute patches and undoes them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

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

    def restore(self) -> None:
        """Undo every patch, newest first."""
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
