"""Gather-KV tree attention: each node's queries attend to its ancestor chain + itself.

Queries are already contiguous per node (DFS pre-order), so only K/V are gathered into each
node's context and any variable-length causal kernel with bottom-right alignment
(``seqlen_k >= seqlen_q``) does the rest, with no wasted FLOP. The gathered K/V are not kept
for backward: backward gathers again, runs the kernel's backward and scatter-adds dK/dV into
the shared rows, so activation memory stays proportional to T, not to the sum of contexts.

A kernel is a pair ``forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, **variant) -> (out, aux)``
and ``backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, **variant) -> (dq, dk, dv)``,
q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (GQA grouped: query head i reads kv head
``i // (Hq // Hkv)``); ``aux`` is whatever the kernel needs back, its logsumexp first (``[Hq, Tq]``
float32 (the math kernel: float64 for float64 inputs), natural log, softmax scale included), then e.g. rng state. ``causal=False`` (full
attention) is what the cascade layout's level calls use; the math, torch-flash and flash-attn
kernels support it. A query row whose segment has no key gets out 0 and the kernel's logsumexp
for "no key" (flash: +inf, math: -inf); callers mask those rows.

``**variant`` are the keywords of :meth:`AttentionVariant.kernel_kwargs` the kernel lists in
its ``features``: ``window=W`` (causal calls only: query i of a segment sees keys
``j > len_k - len_q + i - W``, the bottom-right-aligned sliding window) and ``softcap=c``.
Attention sinks are applied around the kernel from its logsumexp (:mod:`variants`), or, for a
kernel with ``native_sinks``, passed as ``sinks=`` to both calls, its backward then returning
``(dq, dk, dv, dsinks)``. With a window, gather-KV contexts are cut to the rows the window can
reach (:func:`gather_context`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ps_mcore.attention.scatter import build_copies_csr, copies_csr, move_csr, scatter_sum_kv
from ps_mcore.attention.variants import PLAIN, add_sinks, sink_grad
from ps_mcore.planner import TreePlan, ragged_arange


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen attention kernel (module docstring).

    features: the variant keywords it takes (``"window"``, ``"softcap"``); ``"sinks"`` when
        it returns its logsumexp as ``[Hq, Tq]`` (sinks are then applied from it) or takes
        them natively (``native_sinks``).
    missing: why a feature it lacks is missing (for the refusal message)."""

    name: str
    forward: Callable
    backward: Callable
    features: frozenset = frozenset()
    native_sinks: bool = False
    missing: tuple[tuple[str, str], ...] = ()


def unavailable_error(backend: str, kernel: str, reason: str) -> ValueError:
    """The error an explicitly chosen backend raises when its kernel cannot run here."""
    return ValueError(
        f"tree attention backend {backend!r} ({kernel}) is unavailable: {reason}. "
        "Use 'varlen' (torch flash) or 'auto'."
    )


# ----------------------------------------------------------------------------- math kernel


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    return zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])


def _bottom_right_causal(len_q: int, len_k: int, device, window: int | None = None) -> torch.Tensor:
    """``[len_q, len_k]`` True where masked: query i sees keys ``j <= len_k - len_q + i``
    and, with a window W, ``j > len_k - len_q + i - W``."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    masked = j > (len_k - len_q) + i
    if window is not None:
        masked |= j <= (len_k - len_q) + i - window
    return masked


def _math_scores(qs, ks, scale, causal, window, softcap):
    """Scaled (softcapped) scores ``[H, l, c]`` with masked entries at -inf, and the softcap's
    derivative ``1 - tanh^2`` (None without a cap)."""
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    dcap = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s, dcap = t * softcap, 1 - t * t
    if causal:
        s.masked_fill_(_bottom_right_causal(qs.size(1), ks.size(1), qs.device, window), float("-inf"))
    return s, dcap


def _math_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, softcap=None):
    group = q.size(1) // k.size(1)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math, fp64 kept
    out = torch.zeros_like(q)  # rows of segments without keys stay 0, like flash
    lse = torch.full((q.size(1), q.size(0)), float("-inf"), dtype=acc, device=q.device)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].to(acc).transpose(0, 1)  # [H, l, D]
        ks = k[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        vs = v[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        s, _ = _math_scores(qs, ks, scale, causal, window, softcap)
        seg_lse = torch.logsumexp(s, dim=-1)  # [H, l]
        out[q0:q1] = torch.matmul(torch.exp(s - seg_lse[..., None]), vs).transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = seg_lse
    return out, (lse,)


def _math_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, softcap=None):
    # ``out`` and ``aux[0]`` may be those of a larger attention this call is one part of (the
    # cascade layout passes the merged output and logsumexp): p and D are then the global ones,
    # so the gradients are this part's share of the global gradient.
    lse = aux[0]
    hq, hkv, d = q.size(1), k.size(1), q.size(2)
    group = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k):
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].to(acc).transpose(0, 1)
        ks = k[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        vs = v[k0:k1].to(acc).repeat_interleave(group, 1).transpose(0, 1)
        do = dout[q0:q1].to(acc).transpose(0, 1)
        o = out[q0:q1].to(acc).transpose(0, 1)
        s, dcap = _math_scores(qs, ks, scale, causal, window, softcap)
        p = torch.exp(s - lse[:, q0:q1][..., None])  # [H, l, c]
        dp = torch.matmul(do, vs.transpose(1, 2))
        ds = p * (dp - (do * o).sum(-1, keepdim=True)) * scale
        if dcap is not None:
            ds = ds * dcap
        dq[q0:q1] = torch.matmul(ds, ks).transpose(0, 1).to(q.dtype)
        # Sum each kv head's gradient over the query heads of its group.
        dks = torch.matmul(ds.transpose(1, 2), qs).view(hkv, group, -1, d).sum(1)
        dvs = torch.matmul(p.transpose(1, 2), do).view(hkv, group, -1, d).sum(1)
        dk[k0:k1] = dks.transpose(0, 1).to(k.dtype)
        dv[k0:k1] = dvs.transpose(0, 1).to(v.dtype)
    return dq, dk, dv


MATH_KERNEL = VarlenKernel("math", _math_forward, _math_backward, frozenset({"window", "softcap", "sinks"}))


# ----------------------------------------------------------------------------- flash kernels


def _torch_flash_window(causal: bool, window: int | None) -> tuple[bool, dict]:
    """``(is_causal, window kwargs)`` of torch's flash ops, as ``torch.nn.attention.varlen``
    passes them: a sliding window is the local band ``(W - 1, 0)`` with ``is_causal`` off."""
    if window is None:
        return causal, {}
    return False, dict(window_size_left=window - 1, window_size_right=0)


def _torch_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None):
    # is_causal with seqlen_k > seqlen_q is bottom-right aligned in FlashAttention-2 (so is its window).
    is_causal, win = _torch_flash_window(causal, window)
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, scale=scale, **win
    )
    return out, (lse, seed, offset)


def _torch_flash_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None):
    lse, seed, offset = aux
    is_causal, win = _torch_flash_window(causal, window)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=scale, **win
    )
    return dq, dk, dv


TORCH_FLASH_KERNEL = VarlenKernel(
    "torch_flash", _torch_flash_forward, _torch_flash_backward, frozenset({"window", "sinks"}),
    missing=(("softcap", "torch's flash kernel has no softcap (flash-attn 2, when installed, has)"),),
)


def _flash_attn_variant(window: int | None, softcap: float | None) -> dict:
    """flash-attn 2's window (bottom-right ``(W - 1, 0)``; -1 = none) and softcap (0 = none)."""
    left, right = (-1, -1) if window is None else (window - 1, 0)
    return dict(window_size_left=left, window_size_right=right, softcap=softcap or 0.0)


def _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, softcap=None):
    # flash-attn >= 2.7 private API (the public function keeps K/V alive for backward).
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    out, lse, _, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        **_flash_attn_variant(window, softcap),
    )
    return out, (lse, rng_state)


def _flash_attn_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None,
                         softcap=None):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    lse, rng_state = aux
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False,
        rng_state=rng_state, **_flash_attn_variant(window, softcap),
    )
    return dq, dk, dv


FLASH_ATTN_KERNEL = VarlenKernel(
    "flash_attn", _flash_attn_forward, _flash_attn_backward, frozenset({"window", "softcap", "sinks"})
)


def flash_head_dim_refusal(head_dim: int) -> str | None:
    """Why the varlen flash kernels (torch's, flash-attn 2) cannot take ``head_dim``, or None:
    they take multiples of 8 up to 256."""
    if head_dim % 8 or head_dim > 256:
        return f"head dim {head_dim}: the varlen flash kernels take multiples of 8 up to 256"
    return None


def flash_kernel_for(device: torch.device) -> VarlenKernel | None:
    """The fastest varlen flash kernel usable on ``device``, or None (cached per device type:
    every layer of every micro-batch asks)."""
    return _flash_kernel_for(device.type)


@functools.lru_cache(maxsize=None)
def _flash_kernel_for(device_type: str) -> VarlenKernel | None:
    if device_type != "cuda":
        return None
    if hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available():
        return TORCH_FLASH_KERNEL
    try:  # flash-attn 2 (FlashAttention-4 installs flash_attn.cute alone: not this kernel)
        import flash_attn.flash_attn_interface  # noqa: F401
    except ImportError:
        return None
    return FLASH_ATTN_KERNEL


# ----------------------------------------------------------------------------- contexts


@dataclass(frozen=True)
class GatherContext:
    """The K/V rows every node's queries read, as one varlen key side.

    kv_index: ``[C]`` packed rows to gather (None: each node's context is itself, no gather).
    cu_k: ``[M+1]`` int32 context boundaries; max_k: the longest context.
    csr: the fused scatter-add's row -> copies index (CUDA TreePlans; None: ``index_add_``)."""

    kv_index: torch.Tensor | None
    cu_k: torch.Tensor
    max_k: int
    csr: tuple | None = None


def gather_context(plan, window: int | None, device: torch.device) -> GatherContext:
    """The plan's gather-KV key side on ``device``; with a sliding ``window`` W each node's
    context is cut to the rows its queries' windows reach: the last W - 1 rows before the
    node on its path, then its own rows (built once per plan, window and device on the plan's
    host copy). Plan-like layouts that are not :class:`TreePlan` (a context-parallel
    :class:`~ps_mcore.layer_specs.parallel.cp_layout.CPLayout`) keep their contexts whole: each
    is its segment's root path up to the segment's last query, in depth order, so the kernel's
    bottom-right window is exact without the cut."""
    if not isinstance(plan, TreePlan):
        kv_index = None if plan.is_trivial else plan.kv_index
        return GatherContext(kv_index, plan.cu_seqlens_kv, plan.max_seqlen_kv)
    if plan.is_trivial:  # without sharing every node's context is itself: skip the gather
        return GatherContext(None, plan.cu_seqlens_kv, plan.max_seqlen_kv)
    if window is None:
        csr = copies_csr(plan, device) if device.type == "cuda" else None
        return GatherContext(plan.kv_index, plan.cu_seqlens_kv, plan.max_seqlen_kv, csr)
    key = (window, torch.device(device))
    contexts = plan.memo.windowed_contexts
    if key not in contexts:
        contexts[key] = _windowed_context(plan.host, window, device)
    return contexts[key]


def _windowed_context(host: TreePlan, window: int, device: torch.device) -> GatherContext:
    cu_q = host.cu_seqlens_q.cpu().numpy().astype(np.int64)
    cu_k = host.cu_seqlens_kv.cpu().numpy().astype(np.int64)
    q_len, k_len = np.diff(cu_q), np.diff(cu_k)
    # A context entry's index is its depth; the node's first row sits at depth k_len - q_len
    # and sees depths > that - W: the entries before are outside every row's window.
    cut = np.maximum(k_len - q_len - (window - 1), 0)
    lens = k_len - cut
    index = host.kv_index.cpu().numpy()[ragged_arange(cu_k[:-1] + cut, lens)]
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    csr = move_csr(build_copies_csr(index, host.num_tokens), device) if device.type == "cuda" else None
    kv_index = torch.from_numpy(index).to(device, non_blocking=True)
    return GatherContext(kv_index, cu.to(device, non_blocking=True), int(lens.max()), csr)


# ----------------------------------------------------------------------------- autograd


class _GatherKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, kv_index, cu_q, cu_k, csr, meta):
        max_q, max_k, scale, kernel, kw = meta
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kg = k if kv_index is None else k.index_select(0, kv_index)
        vg = v if kv_index is None else v.index_select(0, kv_index)
        if sinks is not None and kernel.native_sinks:
            out, aux = kernel.forward(q, kg, vg, cu_q, cu_k, max_q, max_k, scale, sinks=sinks, **kw)
        else:
            out, aux = kernel.forward(q, kg, vg, cu_q, cu_k, max_q, max_k, scale, **kw)
            if sinks is not None:  # the sink softmax's output and logsumexp, from the kernel's
                out, big = add_sinks(out, aux[0], sinks)
                aux = (big, *aux[1:])
        ctx.save_for_backward(q, k, v, out, kv_index, cu_q, cu_k, sinks, *aux)
        ctx.meta, ctx.csr = meta, csr
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, kv_index, cu_q, cu_k, sinks, *aux = ctx.saved_tensors
        max_q, max_k, scale, kernel, kw = ctx.meta
        dout = dout.contiguous()
        kg = k if kv_index is None else k.index_select(0, kv_index)
        vg = v if kv_index is None else v.index_select(0, kv_index)
        native = sinks is not None and kernel.native_sinks
        if native:
            kw = dict(kw, sinks=sinks)
        grads = kernel.backward(dout, q, kg, vg, out, tuple(aux), cu_q, cu_k, max_q, max_k, scale, **kw)
        dq, dkg, dvg = grads[:3]
        dsinks = None
        if sinks is not None:
            dsinks = grads[3] if native else sink_grad(dout, out, aux[0], sinks)
        if kv_index is None:
            return dq, dkg, dvg, dsinks, None, None, None, None, None
        # Shared rows receive the sum over every context that read them (fp32 accumulation).
        dk, dv = scatter_sum_kv(dkg, dvg, kv_index, ctx.csr, k.shape, k.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def varlen_attention(q, k, v, cu_q, max_q: int, context: GatherContext, softmax_scale: float,
                     kernel: VarlenKernel, variant=None) -> torch.Tensor:
    """One ``kernel`` call (forward and backward) with queries ``q`` in segments ``cu_q`` over
    the key side ``context``, applying ``variant`` (:class:`~ps_mcore.attention.variants.
    AttentionVariant`; sinks from the kernel's logsumexp or natively). The gathered K/V are
    not saved: backward gathers again and scatter-adds dK/dV into the shared rows."""
    variant = PLAIN if variant is None else variant
    meta = (max_q, context.max_k, softmax_scale, kernel, variant.kernel_kwargs())
    return _GatherKVAttention.apply(q, k, v, variant.sinks, context.kv_index, cu_q, context.cu_k, context.csr, meta)


def gather_kv_attention(q, k, v, plan, softmax_scale: float, kernel: VarlenKernel, variant=None) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` through ``kernel``: every node's
    rows attend to its (windowed) context."""
    window = None if variant is None else variant.window
    context = gather_context(plan, window, q.device)
    return varlen_attention(q, k, v, plan.cu_seqlens_q, plan.max_seqlen_q, context, softmax_scale, kernel, variant)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
