"""Attention of one call of a mini-batch plan: its queries against kept context K/V plus its
own K/V (:class:`~ps_mcore.minibatch.ContextPlan`).

The call's K/V buffer is ``[context rows; own rows]``: the context rows' K/V come from the
kept state of earlier calls (the schedule runner's :class:`~ps_mcore.schedule.CallRuntime`,
attached to the plan), then this call's own K/V. Every query segment gathers its context from
that buffer (``kv_index``) and runs the gather-KV kernel of the backend, so backward
scatter-adds dK/dV into the buffer: the context part flows into the kept state's gradient
accumulators, the own part into this call's graph.

A kept call also records its own K/V here (per layer key, after RoPE: what its readers
attend to) and, in backward, adds the dK/dV its readers accumulated to its own
(:func:`add_kept_grad`), so its single backward carries every reader's gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ps_mcore.attention import _autocast_inputs, _no_autocast
from ps_mcore.attention.backends import cp_kernel
from ps_mcore.attention.gather_kv import GatherContext, varlen_attention
from ps_mcore.attention.kernel_choice import context_plan_shape
from ps_mcore.attention.variants import attention_variant


class _ReadKept(torch.autograd.Function):
    """``value`` (kept, detached) as a tensor whose gradient goes to ``sink(grad)``."""

    @staticmethod
    def forward(ctx, anchor, holder):
        ctx.sink = holder.sink
        return holder.value.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None


class _Holder:
    __slots__ = ("value", "sink")

    def __init__(self, value, sink):
        self.value, self.sink = value, sink


def read_kept(anchor: torch.Tensor, value: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """``value`` for a graph: its gradient is handed to ``sink`` (an accumulator) instead of
    flowing anywhere. ``anchor`` is any tensor that requires grad (it gets none)."""
    return _ReadKept.apply(anchor, _Holder(value, sink))


class _AddKeptGrad(torch.autograd.Function):
    """Identity whose backward adds ``extra()`` (read at backward time) to the gradient."""

    @staticmethod
    def forward(ctx, x, extra):
        ctx.extra = extra
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        extra = ctx.extra()
        if extra is None:
            return grad, None
        return (grad.to(torch.promote_types(grad.dtype, extra.dtype)) + extra).to(grad.dtype), None


def add_kept_grad(x: torch.Tensor, extra: Callable[[], torch.Tensor | None]) -> torch.Tensor:
    """``x``, plus ``extra()`` (fp32, ``x``'s shape, or None) added to its gradient."""
    return _AddKeptGrad.apply(x, extra)


class _AddSideGrads(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives each side tensor its ``extras()`` gradient."""

    @staticmethod
    def forward(ctx, x, extras, *sides):
        ctx.extras = extras
        ctx.sides = [(s.dtype, s.requires_grad) for s in sides]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        extras = ctx.extras()
        side_grads = [
            None if e is None or not needs else e.to(dtype)
            for e, (dtype, needs) in zip(extras, ctx.sides, strict=True)
        ]
        return (grad, None, *side_grads)


def add_side_grads(x: torch.Tensor, sides: tuple[torch.Tensor, ...],
                   extras: Callable[[], tuple[torch.Tensor | None, ...]]) -> torch.Tensor:
    """``x``; when its gradient is computed, each of ``sides`` (tensors computed before ``x``
    that nothing downstream reads, e.g. a kept call's exit states) receives ``extras()`` (read
    at backward time, one per side, fp32 or None) as its gradient: their backward runs inside
    the backward that reaches ``x``, also under activation recompute."""
    return _AddSideGrads.apply(x, extras, *sides)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    layer_key,
    backend: str = "auto",
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a :class:`~ps_mcore.minibatch.ContextPlan` call.

    Args:
        q: ``[R, Hq, D]`` the call's queries; k/v: ``[R, Hkv, D]`` (v may have its own head
            dim, e.g. MLA) its own keys/values, after RoPE.
        plan: the call's ContextPlan with its schedule runtime attached.
        layer_key: identifies the layer (kept K/V are stored and read per key).
        backend: a gather-KV tree attention backend (``auto``: on CUDA cuDNN where the call's
            work pays for its host cost, else flash (:mod:`~ps_mcore.attention.kernel_choice`);
            exact math on CPU).
        window, sinks, softcap: the variants of :func:`~ps_mcore.attention.tree_attention`.
            Every query segment's context is its whole root path up to its last row, so the
            kernel's bottom-right window is the window along the sample's path.

    Inside ``torch.autocast`` q/k/v are cast to the autocast dtype, as ``tree_attention``
    casts them.

    Returns:
        ``[R, Hq, Dv]``: each own row's attention over its ancestors (kept or own) and itself.
    """
    runtime = getattr(plan, "runtime", None)
    if runtime is None:
        raise ValueError(
            "a ContextPlan call runs inside a mini-batch schedule (ps_mcore.schedule."
            "ScheduleRunner), which attaches the kept context; this plan has none"
        )
    rows = plan.num_tokens
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.size(0) != rows or k.size(0) != rows:
        raise ValueError(
            f"context attention expects q [R={rows}, Hq, D] and k/v [R, Hkv, D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.size(1) % k.size(1):
        raise ValueError(f"GQA needs Hq % Hkv == 0; got Hq={q.size(1)}, Hkv={k.size(1)}")
    q, k, v = _autocast_inputs(q, k, v)
    variant = attention_variant(q, window, sinks, softcap)
    scale = q.size(-1) ** -0.5 if softmax_scale is None else float(softmax_scale)
    k, v = runtime.own_kv(layer_key, k, v)
    context = runtime.context_kv(layer_key)
    if context is not None:
        k = torch.cat([context[0].to(k.dtype), k], 0)
        v = torch.cat([context[1].to(v.dtype), v], 0)
    dv = v.size(-1)
    if dv != q.size(-1):  # one head dim for the kernels: zero columns change nothing (MLA)
        width = max(dv, q.size(-1))
        q, k, v = (F.pad(x, (0, width - x.size(-1))) for x in (q, k, v))
    plan = plan.to(q.device)
    shape = context_plan_shape(plan, q.size(1), q.size(2))
    kernel = cp_kernel(backend, q, purpose="against kept context K/V", variant=variant, shape=shape)
    keys = GatherContext(plan.kv_index, plan.cu_seqlens_kv, plan.max_seqlen_kv)
    with _no_autocast(q.device.type):
        out = varlen_attention(q, k, v, plan.cu_seqlens_q, plan.max_seqlen_q, keys, scale, kernel, variant)
    return out[..., :dv]
