"""The one place that maps Megatron's recurrent mixers to their tree versions.

``to_tree_spec`` asks :func:`tree_recurrent_spec` about every mixer spec it meets (the
``self_attention`` slot of a GPT layer, where megatron-core 0.16's hybrid GPT block puts Gated
DeltaNet; the ``mixer`` of a Mamba layer). Mixer classes are recognised without importing their
modules (megatron-core 0.16's Mamba mixer module imports triton), so specs without them cost
nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from ps_mcore.layer_specs.conversion.spec_class import is_subclass, spec_class

# stock class (module, name) -> tree class (module, name). Add a recurrent layer type here.
TREE_MIXERS: dict[tuple[str, str], tuple[str, str]] = {
    ("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"): ("ps_mcore.layer_specs.modules.gdn", "TreeGatedDeltaNet"),
    ("megatron.core.ssm.mamba_mixer", "MambaMixer"): ("ps_mcore.layer_specs.modules.mamba", "TreeMambaMixer"),
}


def _stock_class(cls: type) -> tuple[str, str] | None:
    """The registry key ``cls`` is (or derives from), else None."""
    for module_name, class_name in TREE_MIXERS:
        module = sys.modules.get(module_name)  # a spec holding the class imported its module
        stock = getattr(module, class_name, None) if module is not None else None
        if stock is not None and is_subclass(cls, stock):
            return module_name, class_name
    return None


def is_recurrent_mixer(spec: Any) -> bool:
    """True when ``spec`` (a ModuleSpec or class) builds one of the registered recurrent mixers."""
    return _stock_class(spec_class(spec)) is not None


def tree_recurrent_spec(spec: Any) -> Any | None:
    """The tree version of a recurrent mixer spec, or None when ``spec`` is not one.

    Raises NotImplementedError for a custom subclass of a stock mixer (its own behaviour would
    be lost by the swap)."""
    cls = spec_class(spec)
    key = _stock_class(cls)
    if key is None:
        return None
    if isinstance(spec, functools.partial) or (
            isinstance(spec, ModuleSpec) and isinstance(spec.module, functools.partial)):
        raise NotImplementedError(f"cannot convert a functools.partial {key[1]} spec to a tree mixer: {spec!r}")
    tree_module, tree_name = TREE_MIXERS[key]
    tree_cls = getattr(importlib.import_module(tree_module), tree_name)
    if cls is tree_cls or issubclass(cls, tree_cls):
        return spec
    if cls is not getattr(sys.modules[key[0]], key[1]):  # 0.19 defines GatedDeltaNet in a submodule
        raise NotImplementedError(
            f"cannot convert {cls.__module__}.{cls.__name__} (a subclass of {key[1]}) to a tree "
            f"mixer: to_tree_spec swaps megatron's {key[1]} only"
        )
    if not isinstance(spec, ModuleSpec):
        return tree_cls
    return dataclasses.replace(spec, module=tree_cls, params=dict(spec.params))

