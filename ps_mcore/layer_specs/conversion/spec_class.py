"""What a Megatron spec builds, whatever form the spec takes."""

from __future__ import annotations

import functools
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec, get_module


def spec_class(spec: Any) -> Any:
    """The class a spec builds: ``ModuleSpec`` -> its module, ``functools.partial`` -> its
    function (megatron 0.17+ builds some specs as partials), else the object itself."""
    if isinstance(spec, ModuleSpec):
        spec = spec.module if isinstance(spec.module, functools.partial) else get_module(spec)
    while isinstance(spec, functools.partial):
        spec = spec.func
    return spec


def is_subclass(cls: Any, base) -> bool:
    """Whether ``cls`` (a spec's module: a class, or a factory function) is a class derived from
    ``base`` (a class or a tuple of them)."""
    return isinstance(cls, type) and issubclass(cls, base)
