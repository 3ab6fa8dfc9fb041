"""Megatron-Bridge: ``transformer_layer_spec`` callables that convert a provider's spec.

Bridge exposes ``GPTModelProvider.transformer_layer_spec`` (a ModuleSpec, a block spec or a
callable ``spec(provider)`` / ``spec(provider, vp_stage=...)``). :func:`tree_layer_spec` and
:func:`tree_layer_spec_from` are such callables; Bridge itself is imported only when a
provider's class default is needed (it imports transformer_engine at import).
"""

from __future__ import annotations

import dataclasses
import inspect
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


def _tree_spec_of(provider, base, vp_stage):
    backend = getattr(provider, "attention_backend", None)
    if getattr(backend, "name", backend) == "local":
        raise ValueError(
            "Megatron-Bridge with attention_backend='local' replaces core attention by "
            "DotProductAttention after building the spec; use attention_backend='auto' (or "
            "'flash') with tree_layer_spec"
        )
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
