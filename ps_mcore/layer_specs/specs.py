"""Tree layer specs: Megatron's GPT specs with only the attention swapped.

``to_tree_spec`` replaces, in every layer, the self-attention module class by
:class:`TreeSelfAttention` and its core attention by :class:`TreeCoreAttention`, and an MoE
layer's ``TopKRouter`` by :class:`TreeTopKRouter` (router statistics weighted by row
multiplicity). Linear layers, norms, experts and parameter names stay as the stock spec built
them, so checkpoints, HF<->Megatron conversion and layer shims keep working.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, get_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ps_mcore.attention import BACKENDS
from ps_mcore.layer_specs.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.moe import to_tree_moe_spec
from ps_mcore.layer_specs.self_attention import TreeSelfAttention


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown tree attention backend {backend!r}; expected one of {BACKENDS}")


def _tree_attention_spec(attn: Any, backend: str | None) -> Any:
    """The self-attention spec with tree classes, or ``attn`` itself for a layer without one."""
    if not isinstance(attn, ModuleSpec):
        return attn  # IdentityOp: a layer without attention (e.g. hybrid models)
    cls = get_module(attn)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if cls is MLASelfAttention:
        from ps_mcore.layer_specs.mla import TreeMLASelfAttention

        cls = TreeMLASelfAttention
    elif isinstance(cls, type) and issubclass(cls, MLASelfAttention):
        from ps_mcore.layer_specs.mla import TreeMLASelfAttention

        if not issubclass(cls, TreeMLASelfAttention):
            raise NotImplementedError(
                f"cannot convert multi-latent attention {cls.__name__!r}: to_tree_spec swaps "
                "megatron's MLASelfAttention only"
            )
    elif cls is SelfAttention:
        cls = TreeSelfAttention
    elif not (isinstance(cls, type) and issubclass(cls, TreeSelfAttention)):
        raise NotImplementedError(
            f"cannot convert self attention {getattr(cls, '__name__', cls)!r}: to_tree_spec swaps "
            "megatron's SelfAttention only (a custom subclass would lose its behaviour)"
        )
    core = ModuleSpec(module=TreeCoreAttention, params={} if backend is None else {"backend": backend})
    submodules = dataclasses.replace(attn.submodules, core_attention=core)
    return dataclasses.replace(attn, module=cls, params=dict(attn.params), submodules=submodules)


def _tree_layer_spec(spec: Any, backend: str | None) -> ModuleSpec:
    if not isinstance(spec, ModuleSpec) or not hasattr(spec.submodules, "self_attention"):
        raise TypeError(
            "to_tree_spec expects a transformer layer ModuleSpec (submodules with self_attention) "
            f"or TransformerBlockSubmodules, got {type(spec).__name__}"
        )
    changes = {"self_attention": _tree_attention_spec(spec.submodules.self_attention, backend)}
    if hasattr(spec.submodules, "mlp"):  # MoE: multiplicity-weighted router statistics
        changes["mlp"] = to_tree_moe_spec(spec.submodules.mlp)
    submodules = dataclasses.replace(spec.submodules, **changes)
    return dataclasses.replace(spec, submodules=submodules)


def to_tree_spec(spec, tree_attention_backend: str | None = None):
    """Tree version of a GPT layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``.

    Args:
        spec: a stock (or mbridge / Megatron-Bridge built) layer spec or block spec; it is not
            modified.
        tree_attention_backend: ``tree_attention`` backend for every layer (None: each
            ``TreeCoreAttention`` reads ``config.tree_attention_backend``, else ``"auto"``).

    Returns:
        A spec of the same type; layers that shared one spec object still share one.
    """
    _check_backend(tree_attention_backend)
    if isinstance(spec, TransformerBlockSubmodules):
        converted: dict[int, ModuleSpec] = {}
        layers = []
        for layer in spec.layer_specs:
            if id(layer) not in converted:
                converted[id(layer)] = _tree_layer_spec(layer, tree_attention_backend)
            layers.append(converted[id(layer)])
        return dataclasses.replace(spec, layer_specs=layers)
    return _tree_layer_spec(spec, tree_attention_backend)


def _require_te(what: str) -> None:
    from megatron.core.models.gpt import gpt_layer_specs

    if not gpt_layer_specs.HAVE_TE:
        raise ImportError(
            f"{what} needs transformer-engine (its linear layers), which is not installed. Use "
            "get_gpt_layer_local_tree_spec / use_transformer_engine=False for Megatron's local "
            "layers (note: their state_dict keys differ from the TE spec's, as in stock Megatron)."
        )


def get_gpt_layer_local_tree_spec(*args, tree_attention_backend: str | None = None, **kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec(*args, **kwargs)`` with tree attention (same arguments)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return to_tree_spec(get_gpt_layer_local_spec(*args, **kwargs), tree_attention_backend)


def get_gpt_layer_with_tree_attention_spec(
    *args, tree_attention_backend: str | None = None, **kwargs
) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)`` with tree attention:
    TE linear layers, our core attention. Raises ImportError without transformer-engine
    (no silent local fallback: its parameter names would differ)."""
    _require_te("get_gpt_layer_with_tree_attention_spec")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)
    return to_tree_spec(spec, tree_attention_backend)


def get_gpt_decoder_block_tree_spec(
    config, use_transformer_engine: bool, *args, tree_attention_backend: str | None = None, **kwargs
) -> TransformerBlockSubmodules:
    """``get_gpt_decoder_block_spec(config, use_transformer_engine, ...)`` with tree attention
    in every layer (dense and MoE; MLPs untouched)."""
    if use_transformer_engine:
        _require_te("get_gpt_decoder_block_tree_spec(use_transformer_engine=True)")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs)
    return to_tree_spec(spec, tree_attention_backend)


# ----------------------------------------------------------------------------- Megatron-Bridge


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
    if base is None or base is tree_layer_spec:
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
    if getattr(provider, "apply_rope_fusion", False):
        raise ValueError(
            "tree_layer_spec needs provider.apply_rope_fusion = False (fused RoPE cannot take "
            "per-token tree positions)"
        )
    if base is None or base is tree_layer_spec:
        base = _provider_base_spec(provider)
    spec = base if isinstance(base, (ModuleSpec, TransformerBlockSubmodules)) else _call_spec(base, provider, vp_stage)
    return to_tree_spec(spec, getattr(provider, "tree_attention_backend", None))


def tree_layer_spec(provider, vp_stage: int | None = None):
    """Megatron-Bridge ``provider.transformer_layer_spec`` callable: the spec the provider's
    class builds by default, with tree attention.

    Usage: ``provider.transformer_layer_spec = tree_layer_spec``. Set
    ``provider.tree_attention_backend`` to pick the backend. To keep a spec set on the
    instance, use ``tree_layer_spec_from(provider.transformer_layer_spec)`` instead.
    """
    return _tree_spec_of(provider, None, vp_stage)


def tree_layer_spec_from(base) -> Callable:
    """A ``transformer_layer_spec`` callable converting ``base`` (a ModuleSpec, a block spec
    or a Bridge spec callable) to tree attention."""

    def spec(provider, vp_stage: int | None = None):
        return _tree_spec_of(provider, base, vp_stage)

    return spec
