"""Megatron-Bridge's own attention classes on trees: one table.

Bridge's subclasses of megatron's ``SelfAttention`` that have a tree form are in
:data:`BRIDGE_SELF_ATTENTIONS` (``to_tree_spec`` looks them up by qualified name; a spec naming
one was built by Bridge, so Bridge is loaded and never imported here);
:func:`bridge_core_attention_refusal` names Bridge's own core attentions, which tree attention
does not reproduce; :func:`provider_attention_refusal` checks a provider's attention options
layer by layer. Kept apart from :mod:`~ps_mcore.layer_specs.conversion.bridge` (the provider
spec callables), which builds on the layer conversion that reads this table.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from typing import Any, Callable

from ps_mcore.layer_specs.modules.core_attention import megatron_attention_refusal
from ps_mcore.layer_specs.modules.self_attention import TreeSelfAttention


@functools.cache
def _tree_subclass(cls: type) -> type:
    """``cls`` (a reviewed subclass of megatron's ``SelfAttention`` whose forward only picks its
    arguments and calls the parent's) on top of :class:`TreeSelfAttention`: its forward runs
    first, then tree RoPE on the table it picked. Same parameters and keys as ``cls``."""
    tree_cls = type(f"Tree{cls.__name__}", (cls, TreeSelfAttention), {
        "__module__": __name__,
        "__doc__": f"{cls.__module__}.{cls.__qualname__} with tree RoPE (ps_mcore.to_tree_spec).",
    })
    setattr(sys.modules[__name__], tree_cls.__name__, tree_cls)  # found by name: specs pickle
    return tree_cls


def _gemma3_layer_config(is_local_layer: Callable, config, layer_number: int):
    """The config Megatron-Bridge's ``Gemma3TEDotProductAttention`` runs layer ``layer_number``
    with: local layers (``interleaved_attn_pattern``, 5 local : 1 global) the sliding window
    ``(window_size - 1, 0)``, global layers none."""
    if getattr(config, "is_vision_language", False):
        raise NotImplementedError(
            "Megatron-Bridge's Gemma 3 vision-language model on a tree: its layers take their "
            "windows and image visibility from attention biases, which a tree batch does not carry; "
            "the text-only Gemma 3 runs on trees"
        )
    config = copy.copy(config)  # the stock module deep-copies; only window_size differs
    local = is_local_layer(layer_number, config.interleaved_attn_pattern)
    config.window_size = (config.window_size - 1, 0) if local else None
    return config


def _gemma3_layer_config_of(module_name: str) -> Callable:
    return functools.partial(_gemma3_layer_config, sys.modules[module_name]._is_local_attn_layer)


@dataclasses.dataclass(frozen=True)
class BridgeSelfAttention:
    """A Megatron-Bridge subclass of megatron's ``SelfAttention`` with a tree form: the class
    (qualified name), the provider class whose default spec builds it, and the per-layer config
    rewrite of its core attention (``layer_config_of(module name) -> layer_config``)."""

    attention: str
    provider: str
    layer_config_of: Callable[[str], Callable]


# Gemma3SelfAttention.forward picks the local (rotary_pos_emb[0]) or global ([1]) RoPE table of
# its layer from the stacked [2, S, 1, 1, d] table of Gemma3RotaryEmbedding (two bases) and calls
# SelfAttention.forward: TreeSelfAttention then indexes the picked table by the tree positions.
# Its core attention (Gemma3TEDotProductAttention) sets the layer's window: layer_config.
BRIDGE_SELF_ATTENTIONS = (
    BridgeSelfAttention("megatron.bridge.models.gemma.gemma3_provider.Gemma3SelfAttention",
                        "megatron.bridge.models.gemma.gemma3_provider.Gemma3ModelProvider", _gemma3_layer_config_of),
)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def bridge_self_attention(cls: type) -> tuple[type, Callable] | None:
    """The tree form of Megatron-Bridge's self-attention subclass ``cls`` (see
    :data:`BRIDGE_SELF_ATTENTIONS`): the tree class and its core attention's ``layer_config``;
    None for any other class."""
    for entry in BRIDGE_SELF_ATTENTIONS:
        if entry.attention == _qualified(cls):
            return _tree_subclass(cls), entry.layer_config_of(cls.__module__)
    return None


def bridge_core_attention_refusal(cls: Any) -> str | None:
    """Why core attention class ``cls`` cannot be replaced by tree attention: Megatron-Bridge's
    own core attentions (Gemma 2's softcapping, Ministral 3's position-dependent query scaling,
    Gemma 4, ...) compute something the tree kernels do not; None for any other class. Those a
    :data:`BRIDGE_SELF_ATTENTIONS` entry reproduces are converted with their self attention."""
    module = getattr(cls, "__module__", None) or ""
    if module.split(".")[:2] != ["megatron", "bridge"]:
        return None
    return (
        f"core attention {_qualified(cls)}: Megatron-Bridge's own core attention, whose behaviour "
        "tree attention does not reproduce (to_tree_spec converts megatron-core's DotProductAttention "
        "and TEDotProductAttention, and Bridge's Gemma 3 layers)"
    )


def provider_attention_refusal(config) -> str | None:
    """:func:`~ps_mcore.layer_specs.modules.core_attention.megatron_attention_refusal` of the
    configs ``config``'s attention layers run with: a Bridge provider whose own layers rewrite
    it per layer (Gemma 3: :data:`BRIDGE_SELF_ATTENTIONS`) layer by layer, any other config as
    it is."""
    for cls in type(config).__mro__:
        entry = next((e for e in BRIDGE_SELF_ATTENTIONS if e.provider == _qualified(cls)), None)
        if entry is not None:
            layer_config = entry.layer_config_of(cls.__module__)
            for layer_number in range(1, config.num_layers + 1):
                try:
                    refusal = megatron_attention_refusal(layer_config(config, layer_number))
                except NotImplementedError as error:
                    return str(error)
                if refusal is not None:
                    return refusal
            return None
    return megatron_attention_refusal(config)
