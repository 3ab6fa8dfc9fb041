"""The ``"prefix_tree"`` attention implementation for Hugging Face transformers.

A model whose config says ``_attn_implementation == "prefix_tree"`` routes every attention
call here. With a plan (model kwarg ``tree_call=TreeCall(plan)``) the call runs
:func:`tree_attention` on the packed forest; without one it runs the implementation the model
had before (flash_attention_2 / sdpa / eager) with exactly the mask that implementation would
have built, so unshared batches behave as stock.

Masks: the mask hook registered for ``"prefix_tree"`` returns a :class:`DeferredMask` that
only holds the mask arguments. A tree call ignores it (no dense ``[T, T]`` mask is ever
built); an unshared call materialises it once per forward with the base implementation's
own mask function.

transformers is imported lazily: importing this module registers nothing.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator

import torch

from ps_mcore.attention import tree_attention
from ps_mcore.attention.context import context_attention
from ps_mcore.fsdp_bridge.sequence_parallel import SequenceParallelPlan
from ps_mcore.fsdp_bridge.unwrap import unwrap_model
from ps_mcore.minibatch import ContextPlan
from ps_mcore.planner import TreePlan

ATTN_NAME = "prefix_tree"
# Keyword arguments of features the tree kernels do not implement; a plan with any of
# them set is refused rather than silently ignored. (Per-head sinks arrive as ``s_aux``, the
# sliding window as ``sliding_window``, softcapping as ``softcap``: those run on the tree.)
_UNSUPPORTED_KWARGS = {
    "sinks": "per-token attention sinks (sinks=, a logit per head and token; per-head sinks "
             "come as s_aux= and are supported)",
    "position_bias": "an additive position bias (a dense [H, T, T] term has no tree form "
                     "the kernels take)",
}
# Packing metadata of HF's own varlen path; it contradicts a tree layout.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")
# The model kwargs that carried a bare plan before TreeCall: refused, never run as stock.
_BARE_PLAN_KWARGS = ("tree_plan", "tree_backend")

# id(config) -> the implementation the config had before "prefix_tree" (configs are not
# hashable; a finalizer drops the entry with the config). Kept off the config object so
# that saving the model does not serialise it.
_BASE_IMPL: dict[int, str] = {}


def _remember_base(config: Any, base: str) -> None:
    key = id(config)
    if key not in _BASE_IMPL:
        weakref.finalize(config, _BASE_IMPL.pop, key, None)
    _BASE_IMPL[key] = base


def base_implementation(config: Any) -> str:
    """The stock implementation unshared calls of ``config``'s modules use.

    Models switched by :func:`enable_tree_attention` keep their previous one; a config set
    to ``"prefix_tree"`` some other way (e.g. ``from_pretrained(attn_implementation=...)``)
    falls back to ``"sdpa"``.
    """
    return _BASE_IMPL.get(id(config), "sdpa")


# ----------------------------------------------------------------------------- the call


class TreeCall:
    """One tree forward's call data, handed to the model as the kwarg ``tree_call=`` and read
    by :func:`prefix_tree_attention` in every layer: ``plan`` (a :class:`TreePlan` on the
    model's device, one call of a cross-micro-batch schedule, a
    :class:`~ps_mcore.minibatch.ContextPlan` with its runtime, or a Ulysses rank's share of a
    plan, a :class:`~ps_mcore.fsdp_bridge.sequence_parallel.SequenceParallelPlan`) and
    ``backend`` (a :func:`tree_attention` backend).

    Deliberately neither a dataclass nor a tensor or container: wrappers that walk a forward's
    kwargs pass it through as it is, the same object to every layer. FSDP2 with
    ``MixedPrecisionPolicy(cast_forward_inputs=True)`` (verl's fsdp2 engine) and FSDP1's
    mixed precision cast the kwargs of every wrapped module with ``_apply_to_tensors``, which
    rebuilds dataclasses field by field, and FSDP2 collects the tensors needing gradients
    through dataclasses too; ``torch.utils._pytree`` treats it as a leaf. A bare plan there
    was walked into (a plan moved to the GPU links its host copy and back) and rebuilt per
    layer."""

    __slots__ = ("plan", "backend")

    def __init__(self, plan: TreePlan | ContextPlan | SequenceParallelPlan, backend: str = "auto"):
        if not isinstance(plan, (TreePlan, ContextPlan, SequenceParallelPlan)):
            raise TypeError(
                f"TreeCall needs a TreePlan, a ContextPlan or a SequenceParallelPlan, got {type(plan).__name__}"
            )
        if not isinstance(backend, str):
            raise TypeError(f"TreeCall backend must be a backend name, got {type(backend).__name__}")
        self.plan = plan
        self.backend = backend

    def __repr__(self) -> str:
        plan = self.plan.plan if isinstance(self.plan, SequenceParallelPlan) else self.plan
        return f"TreeCall(T={plan.num_tokens}, N={plan.num_input_tokens}, backend={self.backend!r})"


def _bare_plan_refusal(kwargs: dict) -> str | None:
    """Why a call passing a plan the old way (``tree_plan=`` / ``tree_backend=``) cannot run:
    it would otherwise reach the stock attention, which ignores it."""
    bare = [name for name in _BARE_PLAN_KWARGS if name in kwargs]
    if not bare:
        return None
    return (
        f"{', '.join(f'{n}=' for n in bare)} is not a prefix_tree attention argument: pass "
        "tree_call=TreeCall(plan, backend) (ps_mcore.fsdp_bridge.TreeCall), which FSDP's input "
        "casting passes through unchanged, or use forward_tree"
    )


# ----------------------------------------------------------------------------- masks


class DeferredMask:
    """Stands in for the mask of one forward until an unshared attention call needs it.

    Holds the keyword arguments transformers' ``create_*_mask`` passed to the mask interface;
    :meth:`materialize` calls the base implementation's mask function with them (once).
    """

    def __init__(self, mask_kwargs: dict[str, Any]):
        self.mask_kwargs = mask_kwargs
        self._masks: dict[str, Any] = {}
        self.tree_checked = False  # one-time per-forward checks of a tree call

    @property
    def padding_mask(self) -> torch.Tensor | None:
        """The 2-D ``[B, S]`` padding mask the model was called with (None if none)."""
        return self.mask_kwargs.get("attention_mask")

    def materialize(self, base: str) -> Any:
        """The mask ``base``'s own mask function builds from the same arguments."""
        if base not in self._masks:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

            self._masks[base] = ALL_MASK_ATTENTION_FUNCTIONS[base](**self.mask_kwargs)
        return self._masks[base]


def _deferred_mask(**mask_kwargs: Any) -> DeferredMask:
    return DeferredMask(mask_kwargs)


# ----------------------------------------------------------------------------- attention


@contextlib.contextmanager
def _reporting(config: Any, implementation: str) -> Iterator[None]:
    """Let ``config`` report ``implementation`` for one call: flash attention reads the
    implementation name from the module's config to pick its kernel."""
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = implementation
    try:
        yield
    finally:
        config._attn_implementation_internal = saved


def _stock_function(module: torch.nn.Module, base: str):
    if base == "eager":
        # Eager is not in the interface; every modeling file defines its own.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(
                f"{type(module).__name__}'s module defines no eager_attention_forward; load the "
                "model with attn_implementation='sdpa' before enabling prefix_tree attention"
            )
        return fn
    from transformers import AttentionInterface

    return AttentionInterface()[base]


def _stock_attention(module, query, key, value, attention_mask, **kwargs):
    """An unshared call: the base implementation, with the mask it would have built."""
    base = base_implementation(module.config)
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.materialize(base)
    fn = _stock_function(module, base)
    with _reporting(module.config, base):
        return fn(module, query, key, value, attention_mask, **kwargs)


def _check_tree_call(module, query, key, attention_mask, dropout, plan, kwargs) -> None:
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        raise NotImplementedError(
            f"{type(module).__name__} is not causal; prefix-tree attention is for causal decoders"
        )
    if query.dim() != 4 or query.size(0) != 1 or query.size(2) != plan.num_tokens:
        raise ValueError(
            f"a tree call needs the packed forest as one row [1, H, T={plan.num_tokens}, D]; "
            f"got query {tuple(query.shape)}. Call the model with input_ids=plan.input_ids[None] "
            "and position_ids=plan.position_ids[None] (or use forward_tree)"
        )
    if key.size(2) != plan.num_tokens:
        raise ValueError(
            f"key has {key.size(2)} rows for a plan of T={plan.num_tokens} tokens; a KV cache "
            "cannot be combined with a tree call (pass use_cache=False)"
        )
    if dropout:
        raise NotImplementedError(
            f"attention dropout p={dropout} is not supported by prefix-tree attention; set "
            "config.attention_dropout=0 (or call model.eval())"
        )
    for name, feature in _UNSUPPORTED_KWARGS.items():
        value = kwargs.get(name)
        if value is not None and not (isinstance(value, (int, float)) and value == 0):  # 0: off
            raise NotImplementedError(f"prefix-tree attention does not implement {feature} ({name}=)")
    if any(kwargs.get(name) is not None for name in _PACKING_KWARGS):
        raise ValueError("a tree call cannot be combined with cu_seq_lens packing kwargs")
    if isinstance(attention_mask, DeferredMask):
        _check_once_per_forward(attention_mask, plan, kwargs.get("position_ids"))
    elif attention_mask is not None:
        raise ValueError(
            "the tree plan describes the whole mask; got a prepared attention mask of shape "
            f"{tuple(attention_mask.shape)}. Pass attention_mask=None"
        )


def _check_once_per_forward(mask: DeferredMask, plan: TreePlan, position_ids) -> None:
    """Value checks that need a device sync: done on the first layer of each forward only."""
    if mask.tree_checked:
        return
    padding = mask.padding_mask
    if padding is not None and not bool(padding.all()):
        raise ValueError("a tree call cannot be combined with padding (attention_mask has zeros)")
    if position_ids is not None:
        expected = plan.to(position_ids.device).position_ids
        if position_ids.numel() != expected.numel() or not torch.equal(
            position_ids.reshape(-1), expected
        ):
            raise ValueError(
                "position_ids must be plan.position_ids (tree depths) so RoPE sees each "
                "token's original position"
            )
    mask.tree_checked = True


def prefix_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_call: TreeCall | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature).

    Args:
        query: ``[1, Hq, T, D]``; key/value ``[1, Hkv, T, D]`` (HF layout, the forest as one row).
        tree_call: the micro-batch's :class:`TreeCall` (plan and backend; the plan may be one
            call of a cross-micro-batch schedule, a :class:`~ps_mcore.minibatch.ContextPlan`:
            its rows against the kept context K/V, kept per ``module.layer_idx``; or a
            :class:`SequenceParallelPlan`: this Ulysses rank's rows, query ``[1, Hq, c, D]``);
            None runs the model's stock implementation.
        kwargs: what the layer passes; read on a tree call: ``sliding_window`` (the layer's
            window, None on full layers), ``s_aux`` (GPT-OSS's per-head sink logits),
            ``softcap`` (Gemma 2's logit softcapping).

    Returns:
        ``([1, T, Hq, D], None)`` as every HF attention function (no attention weights).
    """
    refusal = _bare_plan_refusal(kwargs)
    if refusal is not None:
        raise TypeError(refusal)
    if tree_call is None:
        return _stock_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    return _tree_call(module, query, key, value, attention_mask, scaling, dropout, tree_call, kwargs)


# Under torch.compile the tree call runs eagerly between compiled graphs: its plan checks and
# host-side layouts (numpy) are no graph material, and the graphs stay free of plan constants.
@torch.compiler.disable
def _tree_call(module, query, key, value, attention_mask, scaling, dropout, tree_call, kwargs):
    if not isinstance(tree_call, TreeCall):
        raise TypeError(f"tree_call must be a TreeCall(plan, backend), got {type(tree_call).__name__}")
    plan = tree_call.plan
    if isinstance(plan, SequenceParallelPlan):  # this rank's rows: all-to-all around the call
        return plan.attend(
            prefix_tree_attention, module, query, key, value, attention_mask,
            scaling=scaling, dropout=dropout, tree_call=TreeCall(plan.plan, tree_call.backend), **kwargs,
        )
    _check_tree_call(module, query, key, attention_mask, dropout, plan, kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    variant = dict(window=kwargs.get("sliding_window"), sinks=kwargs.get("s_aux"), softcap=kwargs.get("softcap"))
    if isinstance(plan, ContextPlan):  # one call of a cross-micro-batch schedule
        out = context_attention(q, k, v, plan, _layer_key(module), tree_call.backend, scaling, **variant)
    else:
        out = tree_attention(q, k, v, plan, backend=tree_call.backend, softmax_scale=scaling, **variant)
    return out.unsqueeze(0), None


def _layer_key(module: torch.nn.Module) -> int:
    """The attention module's layer index: a schedule keeps K/V per layer."""
    index = getattr(module, "layer_idx", None)
    if index is None:
        raise ValueError(
            f"{type(module).__name__} has no layer_idx: a cross-micro-batch schedule keeps K/V per "
            "layer and needs it"
        )
    return int(index)


# ----------------------------------------------------------------------------- switching


def register_attention() -> None:
    """Register ``"prefix_tree"`` with transformers' attention and mask interfaces.

    Idempotent. Registration alone changes no model: a model uses it once its config says
    ``"prefix_tree"`` (see :func:`enable_tree_attention`, :func:`forward_tree`).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, prefix_tree_attention)
    AttentionMaskInterface.register(ATTN_NAME, _deferred_mask)


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The config(s) the causal text decoder of ``model`` reads its attention implementation
    from. Vision towers and other encoders keep theirs: tree attention is for the decoder."""
    config = unwrap_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def enable_tree_attention(model: torch.nn.Module) -> list[Any]:
    """Switch ``model`` (an HF model or any wrapper holding one) to ``"prefix_tree"``.

    Calls with ``tree_call=`` then run tree attention; calls without keep the previous
    implementation, mask included, so the switch can stay on for the whole run. It must stay
    on until the backward of every tree forward has run: activation checkpointing recomputes
    layers during backward and reads the implementation again. Idempotent; returns the
    configs this call switched.
    """
    register_attention()
    switched = []
    for config in attention_configs(model):
        current = config._attn_implementation_internal
        if current == ATTN_NAME:
            continue
        # HF itself treats an unset implementation as eager.
        _remember_base(config, current or "eager")
        config._attn_implementation_internal = ATTN_NAME
        switched.append(config)
    return switched


def disable_tree_attention(model: torch.nn.Module) -> None:
    """Give ``model``'s decoder back the implementation it had before :func:`enable_tree_attention`."""
    for config in attention_configs(model):
        if config._attn_implementation_internal == ATTN_NAME:
            config._attn_implementation_internal = base_implementation(config)
