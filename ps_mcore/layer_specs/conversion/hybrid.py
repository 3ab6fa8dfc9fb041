"""Hybrid stack specs -> their tree versions.

``HybridStackSubmodules`` (megatron-core 0.19+) and ``MambaStackSubmodules`` (0.16) name one
spec per layer kind. One builder per kind converts it; a kind without one (DSA, MLA, future
kinds) keeps its parameters but refuses a tree batch (a runtime subclass of its layer class).
Both stacks hand ``packed_seq_params`` to every layer (checked in 0.16.1 and 0.19.2), which is
how the tree plan reaches the mixers; ``_require_packed_seq_params`` refuses a stack or
layer class whose forward cannot take them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec

from ps_mcore.layer_specs.conversion.layer import is_identity, to_tree_layer_spec, to_tree_moe_spec
from ps_mcore.layer_specs.conversion.recurrent import is_recurrent_mixer, tree_recurrent_spec
from ps_mcore.layer_specs.conversion.spec_class import spec_class
from ps_mcore.layer_specs.modules.tree_context import set_current_tree_batch
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams

_LAYER_SUBCLASSES: dict[tuple[type, str, str], type] = {}


def _is_hybrid_submodules(spec: Any) -> bool:
    return dataclasses.is_dataclass(spec) and not isinstance(spec, type) and hasattr(spec, "attention_layer")


def _require_packed_seq_params(cls: Any, what: str) -> None:
    forward = getattr(cls, "forward", None)
    if not isinstance(cls, type) or forward is None:
        return
    params = inspect.signature(forward).parameters
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "packed_seq_params" not in params and not takes_any_keyword:  # 0.16's TransformerLayer: **kwargs
        raise NotImplementedError(
            f"cannot convert {what}: {cls.__name__}.forward takes no packed_seq_params, so the "
            "prefix-tree plan (TreePackedSeqParams) would never reach its token mixer"
        )


def _tree_attention_layer(layer: Any, field: str, backend: str | None) -> Any:
    """``attention_layer``: a TransformerLayer spec, converted as a GPT layer."""
    _require_packed_seq_params(spec_class(layer), f"the hybrid stack's {field}")
    return to_tree_layer_spec(layer, backend)


def _tree_gdn_layer(layer: Any, field: str, backend: str | None) -> Any:
    """``gdn_layer``: a TransformerLayer spec with ``GatedDeltaNet`` as its self_attention
    (0.19's hybrid stack spec; no MLP) -> the tree mixer in that slot."""
    mixer = getattr(getattr(layer, "submodules", None), "self_attention", None)
    if not isinstance(layer, ModuleSpec) or not is_recurrent_mixer(mixer):
        raise NotImplementedError(
            f"cannot convert the hybrid stack's {field} {layer!r}: to_tree_spec expects a "
            "layer ModuleSpec whose self_attention is megatron's GatedDeltaNet"
        )
    _require_packed_seq_params(spec_class(layer), f"the hybrid stack's {field}")
    return to_tree_layer_spec(layer, backend)


def _tree_mamba_layer(layer: Any, field: str, backend: str | None) -> Any:
    """``mamba_layer``: a MambaLayer spec -> its ``mixer`` (MambaMixer) by the tree mixer."""
    mixer = getattr(getattr(layer, "submodules", None), "mixer", None)
    tree_mixer = tree_recurrent_spec(mixer) if mixer is not None else None
    if not isinstance(layer, ModuleSpec) or tree_mixer is None:
        raise NotImplementedError(
            f"cannot convert the hybrid stack's {field} {layer!r}: to_tree_spec expects a "
            "MambaLayer ModuleSpec whose mixer is megatron's MambaMixer"
        )
    _require_packed_seq_params(spec_class(layer), f"the hybrid stack's {field}")
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, mixer=tree_mixer))


def _tokenwise_layer(layer: Any, field: str, backend: str | None) -> Any:
    """MLP layers and the MTP block: no token mixing, nothing to convert."""
    return layer


def _tree_batch_of(args, kwargs):
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, TreePackedSeqParams)), None)


def _layer_subclass(cls: type, field: str, role: str, doc: str, forward: Callable) -> type:
    """A subclass of layer ``cls`` (same parameters and state_dict keys) with ``forward``; one
    class per (cls, field, role), so specs converted twice build the same class."""
    key = (cls, field, role)
    if key not in _LAYER_SUBCLASSES:
        _LAYER_SUBCLASSES[key] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": cls.__module__, "__doc__": f"{cls.__name__} {doc}"})
    return _LAYER_SUBCLASSES[key]


def _refusing_subclass(cls: type, field: str) -> type:
    """``cls`` raising when a tree batch reaches it, instead of mixing tokens across the packed
    branches."""

    def forward(self, *args, **kwargs):
        if _tree_batch_of(args, kwargs) is not None:
            raise NotImplementedError(
                f"a prefix-tree batch reached {cls.__name__} (the hybrid stack's {field}), "
                "which has no tree support: its token mixing would run across the packed "
                "branches. Run this model with the stock (unshared) batch"
            )
        return cls.forward(self, *args, **kwargs)

    return _layer_subclass(cls, field, "refusing", "refusing prefix-tree batches (ps_mcore.to_tree_spec).", forward)


def _tree_moe_layer(layer: Any, field: str, backend: str | None) -> Any:
    """``moe_layer`` (0.19's MoETransformerLayer; 0.16 MambaStack's MoE layer): the router by
    :class:`TreeTopKRouter` (token statistics counted once per sample holding a row), and the
    layer records its own batch for that router: in a GPT layer the attention does it, a hybrid
    MoE layer has no attention of its own."""
    cls = spec_class(layer)
    if not isinstance(layer, ModuleSpec) or not isinstance(cls, type) or not hasattr(layer.submodules, "mlp"):
        raise NotImplementedError(
            f"cannot convert the hybrid stack's {field} {layer!r}: to_tree_spec expects a layer "
            "ModuleSpec with an MoE mlp submodule"
        )
    _require_packed_seq_params(cls, f"the hybrid stack's {field}")

    def forward(self, *args, **kwargs):
        set_current_tree_batch(_tree_batch_of(args, kwargs))  # None for any other batch
        return cls.forward(self, *args, **kwargs)

    recording = _layer_subclass(cls, field, "moe", "recording its tree batch for the router (ps_mcore.to_tree_spec).", forward)
    return dataclasses.replace(layer, module=recording, submodules=dataclasses.replace(
        layer.submodules, mlp=to_tree_moe_spec(layer.submodules.mlp)))


_HYBRID_LAYER_BUILDERS: dict[str, Callable[[Any, str, str | None], Any]] = {
    "attention_layer": _tree_attention_layer,
    "gdn_layer": _tree_gdn_layer,
    "mamba_layer": _tree_mamba_layer,
    "moe_layer": _tree_moe_layer,
    "mlp_layer": _tokenwise_layer,
    "mtp_block_spec": _tokenwise_layer,
}


def _refuse_tree_batches(layer: Any, field: str) -> Any:
    if layer is None or is_identity(layer):
        return layer
    if isinstance(layer, ModuleSpec):
        cls = spec_class(layer)
        if isinstance(layer.module, functools.partial) or not isinstance(cls, type):
            raise NotImplementedError(f"cannot wrap the hybrid stack's {field} spec {layer!r}")
        return dataclasses.replace(layer, module=_refusing_subclass(cls, field))
    if isinstance(layer, functools.partial) and isinstance(layer.func, type):
        return functools.partial(_refusing_subclass(layer.func, field), *layer.args, **layer.keywords)
    if isinstance(layer, type):
        return _refusing_subclass(layer, field)
    raise NotImplementedError(f"cannot wrap the hybrid stack's {field} spec {layer!r}")


def _tree_hybrid_submodules(spec: Any, backend: str | None) -> Any:
    changes = {}
    for field in dataclasses.fields(spec):
        layer = getattr(spec, field.name)
        build = _HYBRID_LAYER_BUILDERS.get(field.name)
        if build is None:  # dsa, mla, future kinds
            changes[field.name] = _refuse_tree_batches(layer, field.name)
        elif layer is not None and not is_identity(layer):
            changes[field.name] = build(layer, field.name, backend)
    return dataclasses.replace(spec, **changes)


def to_tree_hybrid_spec(spec: Any, backend: str | None) -> Any:
    """A hybrid stack spec (``HybridStackSubmodules`` / ``MambaStackSubmodules`` or a
    ``ModuleSpec`` of the stack holding them) with every layer kind converted or refusing tree
    batches; None when ``spec`` is no hybrid stack spec."""
    if _is_hybrid_submodules(spec):
        return _tree_hybrid_submodules(spec, backend)
    if isinstance(spec, ModuleSpec) and _is_hybrid_submodules(spec.submodules):
        _require_packed_seq_params(spec_class(spec), "the hybrid stack")
        return dataclasses.replace(spec, submodules=_tree_hybrid_submodules(spec.submodules, backend))
    return None
