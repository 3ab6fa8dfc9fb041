"""Cascade tree attention: a causal self call over chains plus one full-attention call per
chain level (``layout.py``), merged by log-sum-exp. Nothing is gathered or copied.

Forward: ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i lse_i`` (fp32).
Backward: every call's kernel backward runs with the *merged* output and logsumexp and the
plain dout. A kernel's backward computes ``p = exp(s - lse)`` and ``D = rowsum(dout * out)``
from what it is given, so with the merged pair it yields exactly its keys' share of the
gradient of the whole attention (the ring-attention identity); dQ sums over calls, dK/dV too
(each call writes 0 on rows it does not read).
"""

from __future__ import annotations

import torch

from ps_mcore.attention.gather_kv import VarlenKernel
from ps_mcore.attention.layout import CascadeLayout
from ps_mcore.attention.merge import merge


def _check_lse(lse: torch.Tensor, q: torch.Tensor, kernel: VarlenKernel) -> None:
    if lse.shape != (q.size(1), q.size(0)):
        raise RuntimeError(
            f"kernel {kernel.name!r} returned a logsumexp of shape {tuple(lse.shape)}; the cascade "
            f"layout needs [Hq, T] = {(q.size(1), q.size(0))}"
        )


def _kv(call, k, v):
    if call.kv_index is None:
        return k, v
    return k.index_select(0, call.kv_index), v.index_select(0, call.kv_index)


class _CascadeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: CascadeLayout, scale, kernel: VarlenKernel):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        calls = layout.calls
        out = lse = None
        rests = []
        for i, call in enumerate(calls):
            kc, vc = _kv(call, k, v)
            o, aux = kernel.forward(q, kc, vc, call.cu_q, call.cu_k, call.max_q, call.max_k, scale, causal=call.causal)
            _check_lse(aux[0], q, kernel)
            rests.append(tuple(aux[1:]))
            if out is None:  # the self call: every row has a key
                out, lse = o, aux[0]
            else:  # intermediate merges stay fp32 (fp64 kept), the last casts to q's dtype
                dtype = q.dtype if i == len(calls) - 1 else torch.promote_types(q.dtype, torch.float32)
                out, lse = merge(out, lse, o, aux[0], call.rows, dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (layout, scale, kernel, rests)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, kernel, rests = ctx.meta
        dout = dout.contiguous()
        parts = len(layout.calls)
        # Two parts add once in q's dtype (an fp16/bf16 add computes in fp32 and rounds once:
        # the same result as fp32 accumulation); more parts accumulate in fp32, and so do dK/dV
        # when a level call gathered keys (copies of a row sum back through index_add_).
        fp32_q = parts > 2
        fp32_kv = fp32_q or any(c.kv_index is not None for c in layout.calls)
        acc = torch.promote_types(q.dtype, torch.float32)  # "fp32" sums; fp64 kept
        dq = dk = dv = None
        for call, rest in zip(layout.calls, rests):
            kc, vc = _kv(call, k, v)
            dqi, dki, dvi = kernel.backward(
                dout, q, kc, vc, out, (lse,) + rest, call.cu_q, call.cu_k, call.max_q, call.max_k,
                scale, causal=call.causal,
            )
            if dq is None:  # the self call: in place, every row
                dq = dqi.to(acc) if fp32_q else dqi
                dk, dv = (dki.to(acc), dvi.to(acc)) if fp32_kv else (dki, dvi)
                continue
            dq = dq.add_(dqi) if fp32_q else dq + dqi
            if call.kv_index is not None:
                dk.index_add_(0, call.kv_index, dki.to(acc)), dv.index_add_(0, call.kv_index, dvi.to(acc))
            elif fp32_kv:
                dk.add_(dki), dv.add_(dvi)
            else:
                dk, dv = dk + dki, dv + dvi
        grads = (dq, dk, dv)
        dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None


def cascade_attention(q, k, v, layout: CascadeLayout, softmax_scale: float, kernel: VarlenKernel) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` over ``layout`` (same device)."""
    return _CascadeAttention.apply(q, k, v, layout, softmax_scale, kernel)


def tree_varlen_attention(q, k, v, plan, softmax_scale: float, kernel: VarlenKernel, layout: str = "auto") -> torch.Tensor:
    """Tree attention through a varlen ``kernel``: with ``layout="auto"`` the cascade layout
    (no copy) where it pays, else gather-KV (``layout.cascade_pays``); or the one named
    (``"cascade"``/``"gather"``)."""
    from ps_mcore.attention.gather_kv import gather_kv_attention
    from ps_mcore.attention.layout import auto_layout, cascade_layout

    if layout not in ("auto", "cascade", "gather"):
        raise ValueError(f"unknown tree attention layout {layout!r}; expected auto, cascade or gather")
    if layout == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel)
    cascade = cascade_layout(plan, q.device)
    if layout == "auto" and auto_layout(plan, cascade) == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel)
    return cascade_attention(q, k, v, cascade, softmax_scale, kernel)
