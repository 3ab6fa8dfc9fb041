"""Gather-KV tree attention: each node's queries attend to its ancestor chain + itself.

Queries are already contiguous per node (DFS pre-order), so only K/V are gathered into each
node's context and any variable-length causal kernel with bottom-right alignment
(``seqlen_k >= seqlen_q``) does the rest, with no wasted FLOP. The gathered K/V are not kept
for backward: backward gathers again, runs the kernel's backward and scatter-adds dK/dV into
the shared rows, so activation memory stays proportional to T, not to the sum of contexts.

A kernel is a pair ``forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True) -> (out, aux)``
and ``backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True) -> (dq, dk, dv)``,
q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (GQA grouped: query head i reads kv head
``i // (Hq // Hkv)``); ``aux`` is whatever the kernel needs back, its logsumexp first (``[Hq, Tq]``
float32 (the math kernel: float64 for float64 inputs), natural log, softmax scale included), then e.g. rng state. ``causal=False`` (full
attention) is what the cascade layout's level calls use; the math, torch-flash and flash-attn
kernels support it. A query row whose segment has no key gets out 0 and the kernel's logsumexp
for "no key" (flash: +inf, math: -inf); callers mask those rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ps_mcore.planner import TreePlan


@dataclass(frozen=True)
class VarlenKernel:
    name: str
    forward: Callable
    backward: Callable


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


def _bottom_right_causal(len_q: int, len_k: int, device) -> torch.Tensor:
    """``[len_q, len_k]`` True where masked: query i sees keys ``j <= len_k - len_q + i``."""
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    return j > (len_k - len_q) + i


def _math_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True):
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
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            s.masked_fill_(_bottom_right_causal(q1 - q0, k1 - k0, q.device), float("-inf"))
        seg_lse = torch.logsumexp(s, dim=-1)  # [H, l]
        out[q0:q1] = torch.matmul(torch.exp(s - seg_lse[..., None]), vs).transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = seg_lse
    return out, (lse,)


def _math_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True):
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
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            s.masked_fill_(_bottom_right_causal(q1 - q0, k1 - k0, q.device), float("-inf"))
        p = torch.exp(s - lse[:, q0:q1][..., None])  # [H, l, c]
        dp = torch.matmul(do, vs.transpose(1, 2))
        ds = p * (dp - (do * o).sum(-1, keepdim=True)) * scale
        dq[q0:q1] = torch.matmul(ds, ks).transpose(0, 1).to(q.dtype)
        # Sum each kv head's gradient over the query heads of its group.
        dks = torch.matmul(ds.transpose(1, 2), qs).view(hkv, group, -1, d).sum(1)
        dvs = torch.matmul(p.transpose(1, 2), do).view(hkv, group, -1, d).sum(1)
        dk[k0:k1] = dks.transpose(0, 1).to(k.dtype)
        dv[k0:k1] = dvs.transpose(0, 1).to(v.dtype)
    return dq, dk, dv


MATH_KERNEL = VarlenKernel("math", _math_forward, _math_backward)


# ----------------------------------------------------------------------------- flash kernels


def _torch_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True):
    # is_causal with seqlen_k > seqlen_q is bottom-right aligned in FlashAttention-2.
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, (lse, seed, offset)


def _torch_flash_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True):
    lse, seed, offset = aux
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


TORCH_FLASH_KERNEL = VarlenKernel("torch_flash", _torch_flash_forward, _torch_flash_backward)


def _flash_attn_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True):
    # flash-attn >= 2.6 private API (the public function keeps K/V alive for backward).
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    out, lse, _, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal
    )
    return out, (lse, rng_state)


def _flash_attn_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    lse, rng_state = aux
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
        window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        rng_state=rng_state,
    )
    return dq, dk, dv


FLASH_ATTN_KERNEL = VarlenKernel("flash_attn", _flash_attn_forward, _flash_attn_backward)


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


# ----------------------------------------------------------------------------- autograd


class _GatherKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kv_index, cu_q, cu_k, max_q, max_k, scale, kernel, csr):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kg = k if kv_index is None else k.index_select(0, kv_index)
        vg = v if kv_index is None else v.index_select(0, kv_index)
        out, aux = kernel.forward(q, kg, vg, cu_q, cu_k, max_q, max_k, scale)
        ctx.save_for_backward(q, k, v, out, kv_index, cu_q, cu_k, *aux)
        ctx.meta = (max_q, max_k, scale, kernel, csr)
        return out

    @staticmethod
    def backward(ctx, dout):
        from ps_mcore.attention.scatter import scatter_sum_kv

        q, k, v, out, kv_index, cu_q, cu_k, *aux = ctx.saved_tensors
        max_q, max_k, scale, kernel, csr = ctx.meta
        kg = k if kv_index is None else k.index_select(0, kv_index)
        vg = v if kv_index is None else v.index_select(0, kv_index)
        dq, dkg, dvg = kernel.backward(
            dout.contiguous(), q, kg, vg, out, tuple(aux), cu_q, cu_k, max_q, max_k, scale
        )
        if kv_index is None:
            return dq, dkg, dvg, None, None, None, None, None, None, None, None
        # Shared rows receive the sum over every context that read them (fp32 accumulation).
        dk, dv = scatter_sum_kv(dkg, dvg, kv_index, csr, k.shape, k.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def gather_kv_attention(q, k, v, plan, softmax_scale: float, kernel: VarlenKernel) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` through ``kernel``."""
    # Without sharing every node's context is itself: skip the gather (no-sharing fast path).
    kv_index = None if plan.is_trivial else plan.kv_index
    csr = None
    # The fused scatter-add's row -> copies index is cached on TreePlans (the context-parallel
    # layout passes its own plan-like object, whose K/V rows are the all-gathered ones).
    if kv_index is not None and q.is_cuda and isinstance(plan, TreePlan):
        from ps_mcore.attention.scatter import copies_csr

        csr = copies_csr(plan, q.device)
    return _GatherKVAttention.apply(
        q, k, v, kv_index, plan.cu_seqlens_q, plan.cu_seqlens_kv,
        plan.max_seqlen_q, plan.max_seqlen_kv, softmax_scale, kernel, csr,
    )


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
