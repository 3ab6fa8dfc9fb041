"""FlashAttention-4 (the ``flash-attn-4`` package: CuTe DSL kernels, SM90 and newer) as a
tree-attention kernel.

``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (checked against
4.0.0b40) run varlen attention on packed THD tensors with int32 ``cu_seqlens``, causal masks
aligned bottom-right (a segment with ``seqlen_k >= seqlen_q``: query i sees keys
``j <= seqlen_k - seqlen_q + i``), GQA natively, and return the natural-log logsumexp as
``[Hq, total_q]`` float32: the :class:`~ps_mcore.attention.gather_kv.VarlenKernel` protocol, so
FA4 runs both tree layouts (gather-KV and the cascade, whose level calls merge by that
logsumexp) inside our own autograd functions, like torch's flash kernel.

Backend ``"fa4"``: explicit only, ``auto`` does not pick it. Measured on the H200
(2026-12-03, flash-attn-4 4.0.0b40, docs/benchmarks.md):
its kernels are the fastest there (tree steps 2.58 ms vs torch flash 4.92 and cuDNN 3.53 on
grpo-long-prompt), and the TE-spec model with it was the fastest tree model (queued steps,
0.99-1.02 of the FLOP ideal against stock TE); but each call costs the host ~0.5 ms (its
Python interface), so a small step timed alone is host-bound, and it is a beta package whose
SM90 backward returned wrong gradients for head dims 72, 80 and 112 there (outputs right; 64,
96, 128, 160, 192 and 256 right): only :data:`FA4_HEAD_DIMS` are run, others are refused.
Exact against the float64 unshared computation on those head dims (tests/test_gpu_attention.py).

The package is imported lazily, only on CUDA; :func:`fa4_refusal` says why it
cannot run (not installed, GPU older than SM90, dtype, head dim). The first call of a shape
JIT-compiles FA4's kernels (FA4 caches them).
"""

from __future__ import annotations

import functools

import torch

from ps_mcore.attention.gather_kv import VarlenKernel, unavailable_error

FA4_DTYPES = (torch.float16, torch.bfloat16)
# Head dims whose FA4 gradients matched the float64 reference on the H200 (4.0.0b40 accepts any
# multiple of 8 up to 256, but its SM90 backward was wrong for 72, 80 and 112).
FA4_HEAD_DIMS = (64, 96, 128, 160, 192, 256)
FA4_MIN_CAPABILITY = 9


@functools.lru_cache(maxsize=None)
def _fa4_interface():
    """``(fwd, bwd)`` of ``flash_attn.cute.interface``, or a string saying why not."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except Exception as e:  # noqa: BLE001  (ImportError, or the CuTe DSL's own import checks)
        return f"flash-attn-4 (flash_attn.cute) is not importable ({type(e).__name__}: {e})"
    return _flash_attn_fwd, _flash_attn_bwd


def _interface():
    found = _fa4_interface()
    if isinstance(found, str):
        raise RuntimeError(f"FA4 tree attention: {found}")
    return found


def _fa4_variant(window: int | None, softcap: float | None) -> dict:
    """FA4's sliding window (bottom-right ``(W - 1, 0)``, which with ``causal`` it runs as its
    local mask) and softcap (both in forward and backward since 4.0.0b27)."""
    kw = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
    if softcap is not None:
        kw["softcap"] = softcap
    return kw


def _fa4_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, softcap=None):
    fwd, _ = _interface()
    out, lse, *_ = fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
        softmax_scale=scale, causal=causal, return_lse=True, **_fa4_variant(window, softcap),
    )
    return out, (lse,)


def _fa4_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, softcap=None):
    _, bwd = _interface()
    dq, dk, dv = bwd(
        q, k, v, out, dout, aux[0], scale, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), **_fa4_variant(window, softcap),
    )[:3]
    return dq, dk, dv


# Sinks from the returned logsumexp (FA4's own learnable_sink is not used: one sink path for
# every kernel, and the cascade needs the sink once after its merge).
FA4_KERNEL = VarlenKernel("fa4", _fa4_forward, _fa4_backward, frozenset({"window", "softcap", "sinks"}))


def fa4_refusal(q: torch.Tensor) -> str | None:
    """Why FA4 tree attention cannot run for ``q`` ``[T, Hq, D]`` (None: it can): dtype, head
    dim, device, capability, the package importable. A shape FA4 itself refuses raises
    from its first call with FA4's own message."""
    if q.dtype not in FA4_DTYPES:
        return f"it needs fp16 or bf16 inputs (got {q.dtype})"
    d = q.size(-1)
    if d not in FA4_HEAD_DIMS:
        return (f"it runs head dims {', '.join(map(str, FA4_HEAD_DIMS))} (got {d}: flash-attn-4 4.0.0b40's "
                "SM90 backward returned wrong gradients for head dims 72, 80 and 112)")
    if not q.is_cuda:
        return f"it needs a CUDA device (q is on {q.device.type})"
    if torch.cuda.get_device_capability(q.device)[0] < FA4_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(q.device)
        return f"it needs an SM90 (Hopper) or newer GPU, got {name}"
    found = _fa4_interface()
    return found if isinstance(found, str) else None


def require_fa4(q: torch.Tensor) -> None:
    """Raise ``ValueError`` saying why backend ``"fa4"`` cannot run for ``q``."""
    reason = fa4_refusal(q)
    if reason is not None:
        raise unavailable_error("fa4", "FlashAttention-4, the flash-attn-4 package", reason)
