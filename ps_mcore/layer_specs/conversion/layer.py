"""One transformer layer spec -> its tree version.

The self-attention slot gets :class:`TreeSelfAttention` (MLA: :class:`TreeMLASelfAttention`)
with :class:`TreeCoreAttention` as its core attention, or the tree version of a recurrent
mixer placed there (Gated DeltaNet: :mod:`~ps_mcore.layer_specs.conversion.recurrent`); an MoE
MLP gets :class:`TreeTopKRouter`. Linear layers, norms, experts and parameter names stay as the
stock spec built them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, get_module

from ps_mcore.layer_specs.conversion.bridge_attention import bridge_core_attention_refusal, bridge_self_attention
from ps_mcore.layer_specs.conversion.recurrent import tree_recurrent_spec
from ps_mcore.layer_specs.conversion.spec_class import is_subclass, spec_class
from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention, TreeCoreAttentionTEState
from ps_mcore.layer_specs.modules.mla import TreeMLASelfAttention
from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter
from ps_mcore.layer_specs.modules.self_attention import TreeSelfAttention


def is_identity(spec: Any) -> bool:
    """Whether ``spec`` builds an ``IdentityOp`` (a layer slot left empty)."""
    return is_subclass(spec_class(spec), IdentityOp)


def _carries_extra_state(cls: Any) -> bool:
    """Whether the stock core attention class has a ``_extra_state`` checkpoint key (TE's
    DotProductAttention does; Megatron's local one does not)."""
    return is_subclass(cls, torch.nn.Module) and cls.get_extra_state is not torch.nn.Module.get_extra_state


def _tree_core_spec(stock_core: Any, backend: str | None, layer_config=None) -> ModuleSpec:
    """Our core attention, with TE's checkpoint keys where it replaces one that has them, and
    the replaced one kept for the batches that are not trees (``stock_core_attention``), except
    megatron's local ``DotProductAttention``: it takes no THD batch, and on sbhd it reads neither
    verl's ``[b, s]`` key-padding masks nor a missing mask off the GPU, so our kernels keep
    serving those batches on the local spec. ``layer_config``: the per-layer config rewrite of
    a known self-attention subclass. A tree core attention spec comes back as it is (with
    ``backend`` where given)."""
    stock_cls = spec_class(stock_core)
    if is_subclass(stock_cls, TreeCoreAttention):
        params = dict(getattr(stock_core, "params", None) or {})
        if backend is not None:
            params["backend"] = backend
        return ModuleSpec(module=stock_cls, params=params)
    if layer_config is None:  # a known self-attention subclass vouches for its core attention
        refusal = bridge_core_attention_refusal(stock_cls)
        if refusal is not None:
            raise NotImplementedError(f"cannot convert {refusal}")
    cls = TreeCoreAttentionTEState if _carries_extra_state(stock_cls) else TreeCoreAttention
    params = {} if backend is None else {"backend": backend}
    if not is_subclass(stock_cls, DotProductAttention):
        params["stock_core_attention"] = stock_core
    if layer_config is not None:
        params["layer_config"] = layer_config
    return ModuleSpec(module=cls, params=params)


def _tree_self_attention(cls: Any, where: str) -> tuple[type, Any]:
    """The tree class for self-attention class ``cls`` and the ``layer_config`` its core
    attention needs (None: the layer's config as it is). Known subclasses of megatron's
    ``SelfAttention`` (Megatron-Bridge's, ``conversion.bridge_attention.bridge_self_attention``) get their
    tree version; any other subclass is refused."""
    if is_subclass(cls, SelfAttention) and cls is not SelfAttention and not (
            issubclass(cls, (TreeSelfAttention, MLASelfAttention))):
        known = bridge_self_attention(cls)
        if known is not None:
            return known
    return _tree_self_attention_class(cls, where), None


def _tree_self_attention_class(cls: Any, where: str) -> type:
    if is_subclass(cls, MLASelfAttention):
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
    if is_subclass(cls, TreeSelfAttention):
        return cls
    raise NotImplementedError(
        f"cannot convert self attention {getattr(cls, '__name__', cls)!r} ({where}): to_tree_spec "
        "swaps megatron's SelfAttention only (a custom subclass would lose its behaviour)"
    )


def _tree_attention_spec(attn: Any, backend: str | None) -> Any:
    """The self-attention spec with tree classes; ``attn`` itself for a layer without
    attention (IdentityOp). Anything else it cannot convert raises: a stock self attention
    left in a tree model would silently ignore the tree mask."""
    if is_identity(attn):
        return attn  # a layer without attention (hybrid / MLP-only layers)
    recurrent = tree_recurrent_spec(attn)  # Gated DeltaNet in megatron 0.16's hybrid GPT block
    if recurrent is not None:
        return recurrent
    if isinstance(attn, ModuleSpec):
        module = attn.module
        if isinstance(module, functools.partial):  # ModuleSpec(module=partial(SelfAttention, ...))
            cls, layer_config = _tree_self_attention(spec_class(module), "a partial module")
            module = functools.partial(cls, *module.args, **module.keywords)
        else:
            module, layer_config = _tree_self_attention(get_module(attn), "ModuleSpec")
        submodules = attn.submodules
        if submodules is None or not hasattr(submodules, "core_attention"):
            raise NotImplementedError(
                f"cannot convert self attention spec without core_attention submodules: {attn!r}"
            )
        submodules = dataclasses.replace(
            submodules, core_attention=_tree_core_spec(submodules.core_attention, backend, layer_config))
        return dataclasses.replace(attn, module=module, params=dict(attn.params), submodules=submodules)
    if isinstance(attn, functools.partial):  # partial(SelfAttention, submodules=..., ...)
        cls, layer_config = _tree_self_attention(spec_class(attn), "functools.partial")
        submodules = attn.keywords.get("submodules")
        if submodules is None or not hasattr(submodules, "core_attention"):
            raise NotImplementedError(
                "cannot convert a functools.partial self attention without a submodules= "
                f"keyword holding core_attention: {attn!r}"
            )
        keywords = dict(attn.keywords, submodules=dataclasses.replace(
            submodules, core_attention=_tree_core_spec(submodules.core_attention, backend, layer_config)))
        return functools.partial(cls, *attn.args, **keywords)
    raise NotImplementedError(
        f"cannot convert self attention spec {attn!r} (a {type(attn).__name__}): to_tree_spec "
        "understands ModuleSpec, functools.partial and IdentityOp"
    )


def to_tree_layer_spec(spec: Any, backend: str | None) -> ModuleSpec:
    """One transformer layer spec with its token mixer (self attention, MLA or a recurrent
    mixer) and MoE router swapped for their tree versions."""
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


def to_tree_moe_spec(mlp_spec):
    """The MLP spec of one layer with :class:`TreeTopKRouter` in an MoE layer; any other MLP
    spec unchanged. A router class other than megatron's ``TopKRouter`` is refused (its
    statistics would stay unweighted)."""
    if isinstance(mlp_spec, functools.partial):  # megatron 0.17+ builds some MLP specs as partials
        inner = mlp_spec.keywords.get("submodules")
        if not isinstance(inner, MoESubmodules):
            return mlp_spec
        return functools.partial(mlp_spec.func, *mlp_spec.args,
                                 **dict(mlp_spec.keywords, submodules=_tree_moe_submodules(inner)))
    if not isinstance(mlp_spec, ModuleSpec) or not isinstance(mlp_spec.submodules, MoESubmodules):
        return mlp_spec
    return dataclasses.replace(mlp_spec, submodules=_tree_moe_submodules(mlp_spec.submodules))


def _tree_moe_submodules(submodules):
    router = submodules.router
    if router is TopKRouter:
        router = TreeTopKRouter
    elif not is_subclass(router, TreeTopKRouter):
        raise NotImplementedError(
            f"cannot make MoE router {getattr(router, '__name__', router)!r} tree-aware: "
            "to_tree_spec swaps megatron's TopKRouter only"
        )
    return dataclasses.replace(submodules, router=router)
