"""Megatron-Bridge: spec callables that convert a provider's spec.

Bridge exposes ``GPTModelProvider.transformer_layer_spec`` (a ModuleSpec, a block spec or a
callable ``spec(provider)`` / ``spec(provider, vp_stage=...)``) and
``HybridModelProvider.hybrid_stack_spec`` (None for Bridge's default, a ModuleSpec or a
callable ``spec()`` / ``spec(provider)``). :func:`tree_layer_spec`, :func:`tree_layer_spec_from`
and :func:`tree_hybrid_stack_spec_from` are such callables; :func:`provider_spec_field` names
the field a provider builds its model from. Bridge itself is imported only when a provider's
default spec is needed (it imports transformer_engine at import).

Bridge's own attention classes that have a tree form, and the per-layer check of a provider's
attention options, are in :mod:`~ps_mcore.layer_specs.conversion.bridge_attention`.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ps_mcore.layer_specs.conversion.gpt import to_tree_spec


def _call_spec(fn: Callable, provider, vp_stage):
    # Bridge's own rule: pass vp_stage only to spec callables that take it.
    if "vp_stage" in inspect.signature(fn).parameters:
        return fn(provider, vp_stage=vp_stage)
    return fn(provider)


def _provider_base_spec(provider) -> Callable | Any:
    """The spec the provider's class would build: its ``transformer_layer_spec`` default,
    else Bridge's ``default_layer_spec`` (imported lazily: Bridge imports transformer_engine)."""
    fields = getattr(type(provider), "__dataclass_fields__", {})
    field = fields.get("transformer_layer_spec")
    base = None
    if field is not None:
        if field.default is not dataclasses.MISSING:
            base = field.default
        elif field.default_factory is not dataclasses.MISSING:
            base = field.default_factory()
    if base is None or _is_tree_spec_callable(base):
        from megatron.bridge.models.gpt_provider import default_layer_spec

        base = default_layer_spec
    return base


# Megatron-Bridge picks a parameter's tensor-parallel layout (column / row / replicated) from
# its module's class name; tree modules that own parameters take their stock class's layout.
_BRIDGE_LAYOUTS = {
    "TreeTopKRouter": "replicated",  # TopKRouter's
    # (TE)DotProductAttention's: the learnable sink logits (softmax_offset) split over TP by head
    "TreeCoreAttention": "column",
    "TreeCoreAttentionTEState": "column",
}


def _register_with_bridge() -> None:
    """Tell Bridge's weight mappings the tree modules' layouts, when Bridge is loaded (it made
    the provider that calls our spec); never imports Bridge."""
    param_mapping = sys.modules.get("megatron.bridge.models.conversion.param_mapping")
    if param_mapping is not None:
        for name, layout in _BRIDGE_LAYOUTS.items():
            param_mapping.AutoMapping.register_module_type(name, layout)


def _refuse_local_attention(provider) -> None:
    backend = getattr(provider, "attention_backend", None)
    if getattr(backend, "name", backend) == "local":
        raise ValueError(
            "Megatron-Bridge with attention_backend='local' replaces core attention by "
            "DotProductAttention after building the spec; use attention_backend='auto' (or "
            "'flash') with tree specs"
        )


def _tree_spec_of(provider, base, vp_stage):
    _refuse_local_attention(provider)
    _register_with_bridge()
    if base is None:
        base = getattr(provider, "transformer_layer_spec", None)
        if base is None or _is_tree_spec_callable(base):  # already ours: the class's default
            base = _provider_base_spec(provider)
    spec = base if isinstance(base, (ModuleSpec, TransformerBlockSubmodules)) else _call_spec(base, provider, vp_stage)
    return to_tree_spec(spec, getattr(provider, "tree_attention_backend", None))


def _is_tree_spec_callable(spec) -> bool:
    return spec is tree_layer_spec or getattr(spec, "_ps_mcore_tree_spec", False)


def tree_layer_spec(provider, vp_stage: int | None = None):
    """Megatron-Bridge spec callable: the provider's own spec with tree attention.

    Called directly (``tree_layer_spec(provider)``) it converts the spec set on the provider
    instance (``provider.transformer_layer_spec``: a ModuleSpec, block spec or Bridge spec
    callable). Installed as ``provider.transformer_layer_spec = tree_layer_spec`` it can no
    longer see what was there and converts the provider class's default; to keep an instance
    spec, install ``tree_layer_spec_from(provider.transformer_layer_spec)``. Set
    ``provider.tree_attention_backend`` to pick the backend.
    """
    return _tree_spec_of(provider, None, vp_stage)


def tree_layer_spec_from(base) -> Callable:
    """A ``transformer_layer_spec`` callable converting ``base`` (a ModuleSpec, a block spec
    or a Bridge spec callable) to tree attention."""

    if _is_tree_spec_callable(base):
        return base  # already converting: idempotent

    def spec(provider, vp_stage: int | None = None):
        return _tree_spec_of(provider, base, vp_stage)

    spec._ps_mcore_tree_spec = True
    return spec


def tree_hybrid_stack_spec_from(base) -> Callable:
    """A ``HybridModelProvider.hybrid_stack_spec`` callable converting ``base`` (None: Bridge's
    default for the provider, a stack ModuleSpec, or a callable taking the provider or nothing)
    to tree layers (attention, Mamba, GDN, MoE; see :func:`~ps_mcore.layer_specs.to_tree_spec`)."""

    if _is_tree_spec_callable(base):
        return base

    def spec(provider):
        _refuse_local_attention(provider)
        _register_with_bridge()
        resolved = base
        if resolved is None:
            from megatron.bridge.models.hybrid.hybrid_provider import get_default_hybrid_stack_spec

            resolved = get_default_hybrid_stack_spec(provider)
        elif not isinstance(resolved, ModuleSpec):
            resolved = resolved(provider) if inspect.signature(resolved).parameters else resolved()
        return to_tree_spec(resolved, getattr(provider, "tree_attention_backend", None))

    spec._ps_mcore_tree_spec = True
    return spec


def provider_spec_field(provider) -> str:
    """The provider field its model's layers are built from: ``hybrid_stack_spec`` for Bridge's
    hybrid providers, ``transformer_layer_spec`` for GPT providers."""
    fields = getattr(type(provider), "__dataclass_fields__", {})
    return "hybrid_stack_spec" if "hybrid_stack_spec" in fields else "transformer_layer_spec"


def tree_provider_spec(provider) -> Callable:
    """The tree version of what ``provider`` builds its layers from (for
    :func:`provider_spec_field`): ``setattr(provider, provider_spec_field(provider),
    tree_provider_spec(provider))`` before ``provide`` gives the provider's model tree layers,
    its own spec (instance or class default) converted."""
    field = provider_spec_field(provider)
    stock = getattr(provider, field)
    return tree_hybrid_stack_spec_from(stock) if field == "hybrid_stack_spec" else tree_layer_spec_from(stock)
