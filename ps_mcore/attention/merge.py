"""Log-sum-exp merge of two partial attention results, in one pass (Triton on CUDA).

``merge(oa, la, ob, lb, rows_b, out_dtype) -> (out, lse)``: oa/ob ``[T, H, D]``, la/lb ``[H, T]``
float32, or float64 from the math kernel on float64 inputs (natural-log logsumexp of each part); rows_b ``[T]`` bool marks the rows for which part
b had any key (elsewhere its lse is ignored, whatever the kernel wrote). Part a must have a key
on every row. ``out = (exp(la - lse) * oa + exp(lb - lse) * ob)`` in lse's dtype, cast to
``out_dtype``; ``lse = logaddexp(la, lb)``.

The torch fallback (CPU, or Triton missing) makes ~6 passes over ``[T, H, D]``; the kernel
reads each part once and writes the result once.
"""

from __future__ import annotations

import functools

import torch


def _merge_torch(oa, la, ob, lb, rows_b, out_dtype):
    if rows_b is not None:
        lb = lb.masked_fill(~rows_b, float("-inf"))
    lse = torch.logaddexp(la, lb)
    wa = torch.exp(la - lse).t().contiguous().unsqueeze(-1)  # [T, H, 1]
    wb = torch.exp(lb - lse).t().contiguous().unsqueeze(-1)
    out = oa * wa
    out.addcmul_(torch.where(wb > 0, ob, 0), wb)
    return out.to(out_dtype), lse


@functools.lru_cache(maxsize=None)
def _triton_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(oa, la, ob, lb, rows_b, out, lse_out, T, H: tl.constexpr, D: tl.constexpr,
               BH: tl.constexpr, BD: tl.constexpr, HAS_ROWS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        hm = h < H
        a = tl.load(la + h * T + t, mask=hm, other=0.0)
        b = tl.load(lb + h * T + t, mask=hm, other=float("-inf"))
        if HAS_ROWS:
            has = tl.load(rows_b + t)
            b = tl.where(has != 0, b, float("-inf"))
        m = tl.maximum(a, b)
        wa = tl.exp(a - m)
        wb = tl.exp(b - m)
        s = wa + wb
        tl.store(lse_out + h * T + t, m + tl.log(s), mask=hm)
        wa = wa / s
        wb = wb / s
        offs = t * (H * D) + h[:, None] * D + d[None, :]
        msk = hm[:, None] & (d[None, :] < D)
        xa = tl.load(oa + offs, mask=msk, other=0.0).to(tl.float32)
        xb = tl.load(ob + offs, mask=msk, other=0.0).to(tl.float32)
        y = xa * wa[:, None] + tl.where(wb[:, None] > 0, xb * wb[:, None], 0.0)
        tl.store(out + offs, y.to(out.dtype.element_ty), mask=msk)

    return kernel, triton.next_power_of_2


def merge(oa, la, ob, lb, rows_b, out_dtype):
    """See the module docstring."""
    # The kernel computes in fp32: float64 parts (the math kernel's on fp64 inputs) merge in torch.
    found = _triton_kernel() if oa.is_cuda and la.dtype != torch.float64 else None
    if found is None:
        return _merge_torch(oa, la, ob, lb, rows_b, out_dtype)
    kernel, pow2 = found
    t, h, d = oa.shape
    oa, ob, la, lb = oa.contiguous(), ob.contiguous(), la.contiguous(), lb.contiguous()
    out = torch.empty(oa.shape, dtype=out_dtype, device=oa.device)
    lse = torch.empty_like(la)
    rows = rows_b.view(torch.uint8) if rows_b is not None else la
    kernel[(t,)](oa, la, ob, lb, rows, out, lse, t, h, d, pow2(h), pow2(d), rows_b is not None, num_warps=4)
    return out, lse
