"""Fused scatter-add of gathered dK/dV back to the packed rows (Triton, CUDA).

Gather-KV backward gets dK/dV per context row ``[C, Hkv, D]`` and must sum every copy of a
packed row: ``dk[r] = sum over c with kv_index[c] == r of dkg[c]``. The torch path costs eight
kernels (two fp32 zero-fills, two casts, two ``index_add_``, two casts back); this one reads
each context row once, sums in fp32 registers in a fixed order (deterministic) and writes
``dk``/``dv`` in their dtype: one launch. The row -> copies index (CSR) is built once per plan
on the host and cached per device.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from ps_mcore.planner import host_built


def copies_csr(plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_ptr [T+1], copies [C])`` int64: the context positions holding each packed row."""
    return host_built(plan, lambda memo: memo.kv_copies_csr, device,
                      lambda host: build_copies_csr(host.kv_index.cpu().numpy(), host.num_tokens), move_csr)


def move_csr(csr, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A host CSR on ``device`` (asynchronous copies)."""
    return tuple(x.to(device, non_blocking=True) for x in csr)


def build_copies_csr(index: np.ndarray, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_ptr [num_rows+1], copies [C])`` int64 on the CPU for a gather ``index`` ``[C]``."""
    order = np.argsort(index, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(index, minlength=num_rows))])
    return torch.from_numpy(ptr.astype(np.int64)), torch.from_numpy(order.astype(np.int64))


@functools.lru_cache(maxsize=None)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(dkg, dvg, ptr, copies, dk, dv, W: tl.constexpr, BW: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        lo = tl.load(ptr + r)
        hi = tl.load(ptr + r + 1)
        w = tl.arange(0, BW)
        m = w < W
        acc_k = tl.zeros([BW], dtype=tl.float32)
        acc_v = tl.zeros([BW], dtype=tl.float32)
        for j in range(lo, hi):
            c = tl.load(copies + j)
            acc_k += tl.load(dkg + c * W + w, mask=m, other=0.0).to(tl.float32)
            acc_v += tl.load(dvg + c * W + w, mask=m, other=0.0).to(tl.float32)
        tl.store(dk + r * W + w, acc_k.to(dk.dtype.element_ty), mask=m)
        tl.store(dv + r * W + w, acc_v.to(dv.dtype.element_ty), mask=m)

    return kernel, triton.next_power_of_2


_BROKEN: list[str] = []


def scatter_sum_kv(dkg, dvg, kv_index, csr, shape, dtype):
    """``[C, Hkv, D]`` dK/dV of the contexts -> ``[T, Hkv, D]`` sums per packed row."""
    # The fused kernel sums in fp32: float64 gradients take the index_add_ path (fp64 sums).
    fused = dkg.is_cuda and csr is not None and not _BROKEN and dtype != torch.float64
    found = _kernel() if fused else None
    if found is not None:
        kernel, pow2 = found
        ptr, copies = csr
        dk = torch.empty(shape, dtype=dtype, device=dkg.device)
        dv = torch.empty(shape, dtype=dtype, device=dkg.device)
        width = shape[1] * shape[2]
        try:
            kernel[(shape[0],)](dkg.contiguous(), dvg.contiguous(), ptr, copies, dk, dv, width, pow2(width))
            return dk, dv
        except Exception as e:  # noqa: BLE001  (a Triton build problem: say so once, stay exact)
            _BROKEN.append(repr(e))
            warnings.warn(f"fused dK/dV scatter-add unavailable, using index_add_: {e!r}", stacklevel=2)
    acc = torch.promote_types(dtype, torch.float32)  # fp32 sums, fp64 kept
    dk = torch.zeros(shape, dtype=acc, device=dkg.device)
    dv = torch.zeros(shape, dtype=acc, device=dkg.device)
    dk.index_add_(0, kv_index, dkg.to(acc))
    dv.index_add_(0, kv_index, dvg.to(acc))
    return dk.to(dtype), dv.to(dtype)
