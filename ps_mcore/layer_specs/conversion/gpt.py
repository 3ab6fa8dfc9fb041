"""``to_tree_spec`` and the GPT spec builders: Megatron's specs with only the token mixers swapped.

``to_tree_spec`` converts a layer spec, a block spec (every layer) or a hybrid stack spec
(:mod:`~ps_mcore.layer_specs.conversion.hybrid`); each layer goes through
:func:`~ps_mcore.layer_specs.conversion.layer.to_tree_layer_spec`: self attention by
:class:`TreeSelfAttention` (MLA: :class:`TreeMLASelfAttention`) with :class:`TreeCoreAttention`,
a recurrent mixer by its tree version (``conversion.recurrent.TREE_MIXERS``), an MoE layer's
``TopKRouter`` by :class:`TreeTopKRouter` (router statistics weighted by row multiplicity).
Linear layers, norms, experts and parameter names stay as the stock spec built them, so
checkpoints, HF<->Megatron conversion and layer shims keep working. The builders below mirror
``megatron.core.models.gpt.gpt_layer_specs`` one for one.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ps_mcore.attention.backends import check_backend_name
from ps_mcore.layer_specs.conversion.hybrid import to_tree_hybrid_spec
from ps_mcore.layer_specs.conversion.layer import to_tree_layer_spec


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
        tree attention, GDN and Mamba layers their tree mixer (``conversion.recurrent.TREE_MIXERS``),
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
                converted[id(layer)] = to_tree_layer_spec(layer, tree_attention_backend)
            layers.append(converted[id(layer)])
        return dataclasses.replace(spec, layer_specs=layers)
    hybrid = to_tree_hybrid_spec(spec, tree_attention_backend)
    if hybrid is not None:
        return hybrid
    return to_tree_layer_spec(spec, tree_attention_backend)


def _require_te(what: str) -> None:
    if not gpt_layer_specs.HAVE_TE:
        raise ImportError(
            f"{what} needs transformer-engine (its linear layers), which is not installed. Use "
            "get_gpt_layer_local_tree_spec / use_transformer_engine=False for Megatron's local "
            "layers (note: their state_dict keys differ from the TE spec's, as in stock Megatron)."
        )


def get_gpt_layer_local_tree_spec(*args, tree_attention_backend: str | None = None, **kwargs) -> ModuleSpec:
    """``get_gpt_layer_local_spec(*args, **kwargs)`` with tree attention (same arguments)."""
    return to_tree_spec(gpt_layer_specs.get_gpt_layer_local_spec(*args, **kwargs), tree_attention_backend)


def get_gpt_layer_with_tree_attention_spec(
    *args, tree_attention_backend: str | None = None, **kwargs
) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)`` with tree attention:
    TE linear layers, our core attention. Raises ImportError without transformer-engine
    (no silent local fallback: its parameter names would differ)."""
    _require_te("get_gpt_layer_with_tree_attention_spec")
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)
    return to_tree_spec(spec, tree_attention_backend)


def get_gpt_decoder_block_tree_spec(
    config, use_transformer_engine: bool, *args, tree_attention_backend: str | None = None, **kwargs
) -> TransformerBlockSubmodules:
    """``get_gpt_decoder_block_spec(config, use_transformer_engine, ...)`` with tree attention
    in every layer (dense and MoE; MLPs untouched)."""
    if use_transformer_engine:
        _require_te("get_gpt_decoder_block_tree_spec(use_transformer_engine=True)")
    spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine, *args, **kwargs)
    return to_tree_spec(spec, tree_attention_backend)
