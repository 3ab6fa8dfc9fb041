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


def _masked_lse(lse: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``[H, T]`` logsumexp with rows that had no key set to -inf (flash writes +inf there)."""
    if rows is None:
        return lse
    return lse.masked_fill(~rows, float("-inf"))


def _check_lse(lse: torch.Tensor, q: torch.Tensor, kernel: VarlenKernel) -> None:
    if lse.shape != (q.size(1), q.size(0)):
        raise RuntimeError(
            f"kernel {kernel.name!r} returned a logsumexp of shape {tuple(lse.shape)}; the cascade "
            f"layout needs [Hq, T] = {(q.size(1), q.size(0))}"
        )


class _CascadeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: CascadeLayout, scale, kernel: VarlenKernel):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        outs, lses, rests = [], [], []
        for call in layout.calls:
            o, aux = kernel.forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, scale, causal=call.causal)
            _check_lse(aux[0], q, kernel)
            outs.append(o)
            lses.append(_masked_lse(aux[0], call.rows))
            rests.append(tuple(aux[1:]))
        if len(outs) == 1:
            out, lse = outs[0], lses[0]
        else:
            lse = torch.logsumexp(torch.stack(lses), 0)  # [H, T]; the self call covers every row
            acc = None
            for o, part in zip(outs, lses):
                w = torch.exp(part - lse).t().unsqueeze(-1)  # [T, H, 1]
                acc = o * w if acc is None else acc.addcmul_(o, w)
            out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (layout, scale, kernel, rests)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, kernel, rests = ctx.meta
        dout = dout.contiguous()
        grads = None
        for i, (call, rest) in enumerate(zip(layout.calls, rests)):
            g = kernel.backward(
                dout, q, k, v, out, (lse,) + rest, call.cu_q, call.cu_k, call.max_q, call.max_k,
                scale, causal=call.causal,
            )
            if grads is None:
                # fp32 accumulation when more than two parts; two parts add once (an fp16/bf16
                # add computes in fp32 and rounds once, the same result).
                grads = [x.float() for x in g] if len(layout.calls) > 2 else list(g)
            elif len(layout.calls) > 2:
                for acc, x in zip(grads, g):
                    acc.add_(x)
            else:
                grads = [a + b for a, b in zip(grads, g)]
        dq, dk, dv = (x.to(y.dtype) for x, y in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None


def cascade_attention(q, k, v, layout: CascadeLayout, softmax_scale: float, kernel: VarlenKernel) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` over ``layout`` (same device)."""
    return _CascadeAttention.apply(q, k, v, layout, softmax_scale, kernel)


def tree_varlen_attention(q, k, v, plan, softmax_scale: float, kernel: VarlenKernel, layout: str = "auto") -> torch.Tensor:
    """Tree attention through a varlen ``kernel``: the cascade layout (no copy), or gather-KV
    for very deep chain forests (``layout="auto"``), or the one named (``"cascade"``/``"gather"``)."""
    from ps_mcore.attention.gather_kv import gather_kv_attention
    from ps_mcore.attention.layout import MAX_CASCADE_LEVELS, cascade_layout

    if layout not in ("auto", "cascade", "gather"):
        raise ValueError(f"unknown tree attention layout {layout!r}; expected auto, cascade or gather")
    if layout == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel)
    cascade = cascade_layout(plan, q.device)
    if layout == "auto" and cascade.num_levels > MAX_CASCADE_LEVELS:
        return gather_kv_attention(q, k, v, plan, softmax_scale, kernel)
    return cascade_attention(q, k, v, cascade, softmax_scale, kernel)
