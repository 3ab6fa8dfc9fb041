"""``tree_attention_scope``: a model's decoder on ``"prefix_tree"`` for one tree forward, and
back on the user's implementation afterwards, activation-checkpoint recomputation included.

Code outside the forward (verl, TRL, PEFT, ``save_pretrained``) reads
``config._attn_implementation``: it must read what the user set. A checkpointed layer,
though, is recomputed during backward, after the forward returned, and its attention looks
the implementation up again. So for the scope's forward every activation-checkpoint function
of the model (Hugging Face's ``_gradient_checkpointing_func`` and torch's
``CheckpointWrapper.checkpoint_fn``) checkpoints the layer under ``"prefix_tree"``: the
recompute switches the decoder's configs for exactly the layer's replay.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from ps_mcore.fsdp_bridge.hf_attention import ATTN_NAME, attention_configs, enable_tree_attention

# Attributes holding a checkpoint function called as ``fn(run, *args, **kwargs)``: Hugging
# Face layers (``GradientCheckpointingLayer``, older decoder loops) and torch's
# ``CheckpointWrapper`` (FSDP's ``apply_activation_checkpointing``).
_CHECKPOINT_ATTRS = ("_gradient_checkpointing_func", "checkpoint_fn")

# module -> {attribute: (original checkpoint function, configs, its tree-routing wrapper)}:
# the same wrapper object every forward, so a compiled model's guards on the attribute hold.
_ROUTED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _switched(configs: list) -> Iterator[None]:
    """``configs`` report ``"prefix_tree"`` inside (already switched ones are left alone)."""
    saved = [(c, c._attn_implementation_internal) for c in configs if c._attn_implementation_internal != ATTN_NAME]
    for config, _ in saved:
        config._attn_implementation_internal = ATTN_NAME
    try:
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


def _under_tree(run: Callable, configs: list) -> Callable:
    def replay(*args, **kwargs):
        with _switched(configs):
            return run(*args, **kwargs)

    return replay


def _routed(checkpoint: Callable, configs: list) -> Callable:
    def routed(run, *args, **kwargs):
        return checkpoint(_under_tree(run, configs), *args, **kwargs)

    routed.ps_mcore_routes = checkpoint
    return routed


def _route_recompute(model: torch.nn.Module, configs: list) -> list[tuple[Any, str, Any]]:
    """Route every checkpoint function of ``model`` through ``"prefix_tree"``; returns what to
    put back ``(module, attribute, original)``."""
    restore = []
    for module in model.modules():
        for attr in _CHECKPOINT_ATTRS:
            checkpoint = vars(module).get(attr)
            if not callable(checkpoint) or hasattr(checkpoint, "ps_mcore_routes"):
                continue
            cache = _ROUTED.setdefault(module, {})
            cached = cache.get(attr)
            same = cached is not None and cached[0] is checkpoint and len(cached[1]) == len(configs)
            if not (same and all(a is b for a, b in zip(cached[1], configs))):
                cached = cache[attr] = (checkpoint, tuple(configs), _routed(checkpoint, configs))
            setattr(module, attr, cached[2])
            restore.append((module, attr, checkpoint))
    return restore


@contextlib.contextmanager
def tree_attention_scope(model: torch.nn.Module) -> Iterator[None]:
    """Inside: ``model``'s decoder runs ``"prefix_tree"`` (calls with ``tree_call=`` take the
    tree kernels). On exit, exceptions included, its configs read what they read before and
    its checkpoint functions are its own again; recomputation of this scope's checkpointed
    layers still runs tree attention. A model already switched by
    :func:`~ps_mcore.fsdp_bridge.enable_tree_attention` stays switched."""
    saved = [(c, c._attn_implementation_internal) for c in attention_configs(model)]
    switched = enable_tree_attention(model)
    restore = _route_recompute(model, switched) if switched else []
    try:
        yield
    finally:
        for module, attr, original in restore:
            setattr(module, attr, original)
        for config, implementation in saved:
            if any(config is c for c in switched):
                config._attn_implementation_internal = implementation  # exactly, None included
