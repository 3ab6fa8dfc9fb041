"""Tree layer specs: Megatron's GPT specs with only the attention swapped.

``to_tree_spec`` replaces, in every layer, the self-attention module class by
:class:`TreeSelfAttention` (MLA: :class:`TreeMLASelfAttention`) and its core attention by
:class:`TreeCoreAttention`, a recurrent mixer in the attention slot (Gated DeltaNet) by its
tree version (``recurrent_specs.TREE_MIXERS``; in a hybrid stack also the GDN layers' mixer and
the Mamba layers' ``MambaMixer``), and an MoE layer's ``TopKRouter`` by
:class:`TreeTopKRouter` (router statistics weighted by row multiplicity). Linear layers,
norms, experts and parameter names stay as the stock spec built them, so checkpoints,
HF<->Megatron conversion and layer shims keep working.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, get_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ps_mcore.attention.backends import check_backend_name
from ps_mcore.layer_specs.core_attention import TreeCoreAttention, TreeCoreAttentionTEState
from ps_mcore.layer_specs.recurrent_specs import is_recurrent_mixer, tree_recurrent_spec
from ps_mcore.layer_specs.moe import to_tree_moe_spec
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.self_attention import TreeSelfAttention
from ps_mcore.layer_specs.spec_class import spec_class
from ps_mcore.layer_specs.tree_context import set_current_tree_batch


def _is_identity(spec: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    cls = spec_class(spec)
    return isinstance(cls, type) and issubclass(cls, IdentityOp)


def _carries_extra_state(core_spec: Any) -> bool:
    """Whether the stock core attention has a ``_extra_state`` checkpoint key (TE's
    DotProductAttention does; Megatron's local one does not)."""
    cls = spec_class(core_spec)
    return (
        isinstance(cls, type)
        and issubclass(cls, torch.nn.Module)
        and cls.get_extra_state is not torch.nn.Module.get_extra_state
    )


def _tree_core_spec(stock_core: Any, backend: str | None) -> ModuleSpec:
    """Our core attention, with TE's checkpoint keys where it replaces one that has them."""
    cls = TreeCoreAttentionTEState if _carries_extra_state(stock_core) else TreeCoreAttention
    return ModuleSpec(module=cls, params={} if backend is None else {"backend": backend})


def _tree_self_attention_class(cls: Any, where: str) -> type:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if isinstance(cls, type) and issubclass(cls, MLASelfAttention):
        from ps_mcore.layer_specs.mla import TreeMLASelfAttention

        if cls is MLASelfAttention:
            return TreeMLASelfAttention
        if issubclass(cls, TreeMLASelfAttention):
            return cls
        raise NotImplementedError(
            f"cannot convert multi-latent attention {cls.__name__!r} ({where}): to_tree_spec "
            "swaps megatron's MLASelfAttention only"
        )
    if cls is SelfAttention:
        return TreeSelfAttention
    if isinstance(cls, type) and issubclass(cls, TreeSelfAttention):
        return cls
    raise NotImplementedError(
        f"cannot convert self attention {getattr(cls, '__name__', cls)!r} ({where}): to_tree_spec "
        "swaps megatron's SelfAttention only (a custom subclass would lose its behaviour)"
    )


def _tree_attention_spec(attn: Any, backend: str | None) -> Any:
    """The self-attention spec with tree classes; ``attn`` itself for a layer without
    attention (IdentityOp). Anything else it cannot convert raises: a stock self attention
    left in a tree model would silently ignore the tree mask."""
    if _is_identity(attn):
        return attn  # a layer without attention (hybrid / MLP-only layers)
    recurrent = tree_recurrent_spec(attn)  # Gated DeltaNet in megatron 0.16's hybrid GPT block
    if recurrent is not None:
        return recurrent
    if isinstance(attn, ModuleSpec):
        module = attn.module
        if isinstance(module, functools.partial):  # ModuleSpec(module=partial(SelfAttention, ...))
            cls = _tree_self_attention_class(spec_class(module), "a partial module")
            module = functools.partial(cls, *module.args, **module.keywords)
        else:
            module = _tree_self_attention_class(get_module(attn), "ModuleSpec")
        submodules = attn.submodules
        if submodules is None or not hasattr(submodules, "core_attention"):
            raise NotImplementedError(
                f"cannot convert self attention spec without core_attention submodules: {attn!r}"
            )
        submodules = dataclasses.replace(
            submodules, core_attention=_tree_core_spec(submodules.core_attention, backend))
        return dataclasses.replace(attn, module=module, params=dict(attn.params), submodules=submodules)
    if isinstance(attn, functools.partial):  # partial(SelfAttention, submodules=..., ...)
        cls = _tree_self_attention_class(spec_class(attn), "functools.partial")
        submodules = attn.keywords.get("submodules")
        if submodules is None or not hasattr(submodules, "core_attention"):
            raise NotImplementedError(
                "cannot convert a functools.partial self attention without a submodules= "
                f"keyword holding core_attention: {attn!r}"
            )
        keywords = dict(attn.keywords, submodules=dataclasses.replace(
            submodules, core_attention=_tree_core_spec(submodules.core_attention, backend)))
        return functools.partial(cls, *attn.args, **keywords)
    raise NotImplementedError(
        f"cannot convert self attention spec {attn!r} (a {type(attn).__name__}): to_tree_spec "
        "understands ModuleSpec, functools.partial and IdentityOp"
    )


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


# ------------------------------------------------------------------ hybrid stacks
# HybridStackSubmodules (megatron-core 0.19+) and MambaStackSubmodules (0.16) name one spec per
# layer kind. One builder per kind converts it; a kind without one (DSA, MLA, future kinds)
# keeps its parameters but refuses a tree batch (_refuse_tree_batches). Both stacks hand
# packed_seq_params to every layer (checked in 0.16.1 and 0.19.2), which is how the tree plan
# reaches the mixers; _require_packed_seq_params refuses a stack or layer class whose forward
# cannot take them.
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
    return _tree_layer_spec(layer, backend)


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
    return _tree_layer_spec(layer, backend)


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


def _tree_batch_refusing(cls: type, field: str) -> type:
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
    if layer is None or _is_identity(layer):
        return layer
    if isinstance(layer, ModuleSpec):
        cls = spec_class(layer)
        if isinstance(layer.module, functools.partial) or not isinstance(cls, type):
            raise NotImplementedError(f"cannot wrap the hybrid stack's {field} spec {layer!r}")
        return dataclasses.replace(layer, module=_tree_batch_refusing(cls, field))
    if isinstance(layer, functools.partial) and isinstance(layer.func, type):
        return functools.partial(_tree_batch_refusing(layer.func, field), *layer.args, **layer.keywords)
    if isinstance(layer, type):
        return _tree_batch_refusing(layer, field)
    raise NotImplementedError(f"cannot wrap the hybrid stack's {field} spec {layer!r}")


def _tree_hybrid_submodules(spec: Any, backend: str | None) -> Any:
    changes = {}
    for field in dataclasses.fields(spec):
        layer = getattr(spec, field.name)
        build = _HYBRID_LAYER_BUILDERS.get(field.name)
        if build is None:  # dsa, mla, future kinds
            changes[field.name] = _refuse_tree_batches(layer, field.name)
        elif layer is not None and not _is_identity(layer):
            changes[field.name] = build(layer, field.name, backend)
    return dataclasses.replace(spec, **changes)


def to_tree_spec(spec, tree_attention_backend: str | None = None):
    """Tree version of a GPT layer ``ModuleSpec``, a ``TransformerBlockSubmodules`` or a hybrid
    stack spec (``HybridStackSubmodules`` / a ``ModuleSpec`` of ``HybridStack``).

    Args:
        spec: a stock (or mbridge / Megatron-Bridge built) layer, block or hybrid stack spec;
            it is not modified.
        tree_attention_backend: ``tree_attention`` backend for every layer (None: each
            ``TreeCoreAttention`` reads ``config.tree_attention_backend``, else ``"auto"``).

    Returns:
        A spec of the same type; layers that shared one spec object still share one. In a
        hybrid stack (0.19's ``HybridStack``, 0.16's ``MambaStack``) the attention layers get
        tree attention, GDN and Mamba layers their tree mixer (``recurrent_specs.TREE_MIXERS``),
        MoE layers the tree router, MLP layers stay as they are, and every other layer kind
        (DSA, MLA) keeps its parameters but raises ``NotImplementedError`` naming itself when a
        tree batch reaches it.
    """
    check_backend_name(tree_attention_backend)
    if isinstance(spec, TransformerBlockSubmodules):
        converted: dict[int, ModuleSpec] = {}
        layers = []
        for layer in spec.layer_specs:
            if id(layer) not in converted:
                converted[id(layer)] = _tree_layer_spec(layer, tree_attention_backend)
            layers.append(converted[id(layer)])
        return dataclasses.replace(spec, layer_specs=layers)
    if _is_hybrid_submodules(spec):
        return _tree_hybrid_submodules(spec, tree_attention_backend)
    if isinstance(spec, ModuleSpec) and _is_hybrid_submodules(spec.submodules):
        _require_packed_seq_params(spec_class(spec), "the hybrid stack")
        return dataclasses.replace(
            spec, submodules=_tree_hybrid_submodules(spec.submodules, tree_attention_backend))
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
