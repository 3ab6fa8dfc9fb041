"""Cascade tree attention: a causal self call over chains plus one full-attention call per
chain level (``layout.py``), merged by log-sum-exp. Nothing is gathered or copied.

Forward: ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i lse_i`` (fp32).
Backward: every call's kernel backward runs with the *merged* output and logsumexp and the
plain dout. A kernel's backward computes ``p = exp(s - lse)`` and ``D = rowsum(dout * out)``
from what it is given, so with the merged pair it yields exactly its keys' share of the
gradient of the whole attention (the ring-attention identity); dQ sums over calls, dK/dV too
(each call writes 0 on rows it does not read).

Variants (:mod:`variants`): a softcap goes to every call; attention sinks are added once,
after the last merge (``out * exp(lse - L)``, ``L = logaddexp(lse, sink)``), and every call's
backward gets the sink softmax's ``(out, L)``. A sliding window is exact only in the causal
self call (one chain's rows are consecutive positions of one path), so a windowed plan runs
the cascade only when it has no level call; otherwise gather-KV with contexts cut to the
window (:func:`tree_varlen_attention`). Why not windowed level calls: a level call's query
segment holds all descendants of a chain, on several branches, whose depths are not an affine
function of the row offset, while a kernel's window is a band in row offsets; splitting it per
(ancestor chain, descendant chain) pair repeats the key ranges, i.e. gathers them, which is
gather-KV cut to the window (at most W - 1 copied rows per node).
"""

from __future__ import annotations

import torch

from ps_mcore.attention.gather_kv import VarlenKernel, gather_kv_attention
from ps_mcore.attention.layout import CascadeLayout, auto_layout, cascade_layout
from ps_mcore.attention.merge import merge
from ps_mcore.attention.variants import add_sinks, sink_grad


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
    def forward(ctx, q, k, v, sinks, layout: CascadeLayout, scale, kernel: VarlenKernel, kw: dict):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        calls = layout.calls
        out = lse = None
        rests = []
        for i, call in enumerate(calls):
            kc, vc = _kv(call, k, v)
            o, aux = kernel.forward(q, kc, vc, call.cu_q, call.cu_k, call.max_q, call.max_k, scale, causal=call.causal, **kw)
            _check_lse(aux[0], q, kernel)
            rests.append(tuple(aux[1:]))
            if out is None:  # the self call: every row has a key
                out, lse = o, aux[0]
            else:  # intermediate merges stay fp32 (fp64 kept), the last casts to q's dtype (sinks: after them)
                last = i == len(calls) - 1 and sinks is None
                dtype = q.dtype if last else torch.promote_types(q.dtype, torch.float32)
                out, lse = merge(out, lse, o, aux[0], call.rows, dtype)
        if sinks is not None:  # once per row, on the merged result
            out, lse = add_sinks(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.meta = (layout, scale, kernel, rests, kw)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, scale, kernel, rests, kw = ctx.meta
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
                scale, causal=call.causal, **kw,
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
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None, None, None


def cascade_attention(q, k, v, layout: CascadeLayout, softmax_scale: float, kernel: VarlenKernel,
                      variant=None) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` over ``layout`` (same device),
    applying ``variant`` (a window only on a layout without level calls)."""
    sinks, kw = (None, {}) if variant is None else (variant.sinks, variant.kernel_kwargs())
    if "window" in kw and layout.num_levels:
        raise ValueError("the cascade's level calls take no sliding window; use the gather-KV layout")
    return _CascadeAttention.apply(q, k, v, sinks, layout, softmax_scale, kernel, kw)


def tree_varlen_attention(q, k, v, plan, softmax_scale: float, kernel: VarlenKernel, layout: str = "auto",
                          variant=None) -> torch.Tensor:
    """Tree attention through a varlen ``kernel``: with ``layout="auto"`` the cascade layout
    (no copy) where it pays, else gather-KV (``layout.cascade_pays``); or the one named
    (``"cascade"``/``"gather"``). With a sliding window (``variant``) the cascade runs only on
    chain forests (no level call; module docstring), else gather-KV cut to the window."""
    if layout not in ("auto", "cascade", "gather"):
        raise ValueError(f"unknown tree attention layout {layout!r}; expected auto, cascade or gather")
    if layout == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel, variant)
    cascade = cascade_layout(plan, q.device)
    windowed = variant is not None and variant.window is not None
    if layout == "auto" and auto_layout(plan, cascade, level_calls=not windowed) == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel, variant)
    return cascade_attention(q, k, v, cascade, softmax_scale, kernel, variant)
