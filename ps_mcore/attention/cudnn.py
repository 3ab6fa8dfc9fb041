"""cuDNN fused attention (through Transformer Engine) as a tree-attention kernel.

TE's functional API (``transformer_engine.pytorch.cpp_extensions.fused_attn``: ``fused_attn_fwd``
/ ``fused_attn_bwd``, TE >= 2.16, checked against 2.20) runs cuDNN's F16 "arbitrary seqlen"
fused attention on packed THD tensors with per-segment ``cu_seqlens``. Wrapped as a
:class:`~ps_mcore.attention.gather_kv.VarlenKernel`, it runs inside our own autograd functions,
so the gathered K/V's gradient goes through the same fused scatter-add as the flash path.

Layouts (backend ``"cudnn"``, :func:`cudnn_tree_attention`):

* gather-KV (``gather_kv.py``) on every plan with a branch: each node's rows attend to its
  gathered ancestor context + itself, ``padding_causal_bottom_right``;
* on a chain forest (the cascade layout has no level call: no sharing, step-wise batches) the
  cascade's single causal self call over the chains, in place (nothing gathered).

cuDNN is *not* used for the cascade's level calls: those need the kernel's log-sum-exp in the
``[Hq, T]`` form for the merge and segments with no key (filler rows), neither of which this
wrapper promises. The kernel handles GQA natively (query head i reads kv head
``i // (Hq // Hkv)``), fp16/bf16, any softmax scale; head dims as cuDNN supports them
(:func:`cudnn_refusal` probes the exact ``(dtype, Hq, D)`` once per device).

Variants: a sliding window is TE's ``window_size=(W - 1, 0)`` with the bottom-right causal
mask (the same band as flash); attention sinks are TE's ``softmax_type="learnable"`` with the
sink logits as ``softmax_offset`` ``[1, Hq, 1, 1]`` (the gradient comes back from the
backward), since cuDNN's softmax statistics are not promised in a layout the sink could be
applied from. Both are probed once per shape like the rest (TE documents the learnable
softmax for THD from cuDNN 9.18); cuDNN takes no logit softcap.

TE is imported lazily, only on CUDA; without it the backend's check says so.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ps_mcore.attention.gather_kv import (
    GatherContext,
    VarlenKernel,
    gather_kv_attention,
    unavailable_error,
    varlen_attention,
)
from ps_mcore.attention.layout import auto_layout, cascade_layout

CUDNN_DTYPES = (torch.float16, torch.bfloat16)
# cuDNN's F16 fused attention (sm80/sm90) takes head dims that are multiples of 8 up to 256, but
# on the H200 (TE 2.20.2, 2026-12-03) the tree-shape test failed for D = 192 and 256 (the run
# kept no detail) while D <= 128 passed (40, 64, 72, 96, 128): larger head dims are refused.
CUDNN_MAX_HEAD_DIM = 128
CUDNN_HEAD_DIM_MULTIPLE = 8


@functools.lru_cache(maxsize=None)
def _te_fused_attn():
    """``(fused_attn_fwd, fused_attn_bwd, backend, fwd_params, bwd_params)`` or an error string."""
    try:
        from transformer_engine.pytorch.cpp_extensions.fused_attn import (
            FusedAttnBackend,
            fused_attn_bwd,
            fused_attn_fwd,
        )
    except Exception as e:  # noqa: BLE001  (ImportError, or TE's own import-time checks)
        return f"transformer_engine's fused attention is not importable ({type(e).__name__}: {e})"
    try:
        backend = FusedAttnBackend["F16_arbitrary_seqlen"]
    except Exception as e:  # noqa: BLE001
        return f"transformer_engine has no F16_arbitrary_seqlen fused attention backend ({e!r})"
    fwd_params = frozenset(inspect.signature(fused_attn_fwd).parameters)
    bwd_params = frozenset(inspect.signature(fused_attn_bwd).parameters)
    return fused_attn_fwd, fused_attn_bwd, backend, fwd_params, bwd_params


def _te():
    found = _te_fused_attn()
    if isinstance(found, str):
        raise RuntimeError(f"cuDNN tree attention: {found}")
    return found


def _mask(causal: bool) -> str:
    # Bottom-right causal: in a segment with seqlen_k >= seqlen_q, query i sees keys
    # j <= seqlen_k - seqlen_q + i (its context, then itself causally).
    return "padding_causal_bottom_right" if causal else "padding"


def _layout_kwargs(params, causal: bool, scale: float, window: int | None = None, sinks: bool = False,
                   **extra) -> dict:
    kw = dict(
        attn_scale=scale, dropout=0.0, fast_zero_fill=True, qkv_layout="thd_thd_thd", o_format="thd",
        do_format="thd", dqkv_layout="thd_thd_thd", attn_bias_type="no_bias", attn_mask_type=_mask(causal),
        window_size=(window - 1, 0) if window is not None else (-1, 0) if causal else (-1, -1), **extra,
    )
    if sinks:
        kw["softmax_type"] = "learnable"
    # The TE versions this targets (2.16-2.20) take all of these; drop any an install lacks
    # rather than failing on a keyword it never needed (e.g. o_format before it existed) -
    # but never one a variant needs: dropping it would compute plain attention.
    needed = {"softmax_type"} & kw.keys()
    if needed - params:
        raise RuntimeError(f"this transformer_engine's fused attention takes no {sorted(needed - params)}")
    return {k: v for k, v in kw.items() if k in params}


def _cudnn_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, sinks=None):
    fwd, _, backend, fwd_params, _ = _te()
    extra = dict(cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k)
    if sinks is not None:
        extra["softmax_offset"] = sinks.detach().float().reshape(1, -1, 1, 1).contiguous()
    out, aux = fwd(
        True, int(max_q), int(max_k), cu_q, cu_k, q, k, v, q.dtype, backend,
        **_layout_kwargs(fwd_params, causal, scale, window, sinks is not None, **extra),
    )
    # aux: cuDNN's softmax statistics and rng state (and the softmax offset), handed back to
    # the backward as they are (their layout differs across cuDNN versions; no caller here
    # reads them).
    return out, tuple(aux)


def _cudnn_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale, causal=True, window=None, sinks=None):
    _, bwd, backend, _, bwd_params = _te()
    grads = bwd(
        int(max_q), int(max_k), cu_q, cu_k, q, k, v, out, dout, q.dtype, list(aux), backend,
        **_layout_kwargs(bwd_params, causal, scale, window, sinks is not None,
                         cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k),
    )
    if sinks is None:
        return grads[0], grads[1], grads[2]
    # [dq, dk, dv, d_bias, d_softmax_offset [1, Hq, 1, 1] fp32]
    return grads[0], grads[1], grads[2], grads[4].reshape(-1).to(sinks.dtype)


CUDNN_KERNEL = VarlenKernel(
    "cudnn", _cudnn_forward, _cudnn_backward, frozenset({"window", "sinks"}), native_sinks=True,
    missing=(("softcap", "cuDNN's fused attention (through Transformer Engine) takes no logit softcap"),),
)


# ----------------------------------------------------------------------------- availability


def cudnn_static_refusal(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """The checks that need no GPU: device, dtype, head dim, TE importable (None: all pass)."""
    if device_type != "cuda":
        return f"it needs a CUDA device (q is on {device_type})"
    if dtype not in CUDNN_DTYPES:
        return f"it needs fp16 or bf16 inputs (got {dtype})"
    if head_dim % CUDNN_HEAD_DIM_MULTIPLE or head_dim > CUDNN_MAX_HEAD_DIM:
        return (
            f"cuDNN fused attention needs a head dim that is a multiple of {CUDNN_HEAD_DIM_MULTIPLE} "
            f"and at most {CUDNN_MAX_HEAD_DIM} (got {head_dim})"
        )
    found = _te_fused_attn()
    return found if isinstance(found, str) else None


def cudnn_refusal(q: torch.Tensor, window: bool = False, sinks: bool = False) -> str | None:
    """Why cuDNN tree attention cannot run for ``q`` ``[T, Hq, D]`` (None: it can), with a
    sliding window and/or learnable sinks where asked.

    :func:`cudnn_static_refusal` first; then, once per ``(device, dtype, Hq, D, window,
    sinks)``, a tiny forward + backward through TE, so a cuDNN build that refuses the shape is
    found here and not in the middle of a training step."""
    reason = cudnn_static_refusal(q.device.type, q.dtype, q.size(-1))
    if reason is not None:
        return reason
    if torch.cuda.is_current_stream_capturing():
        return "the probe cannot run during CUDA graph capture"  # not cached: ask again later
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _probe(index, q.dtype, q.size(1), q.size(-1), window, sinks)


@functools.lru_cache(maxsize=None)
def _probe(device_index: int, dtype: torch.dtype, hq: int, d: int, window: bool = False,
           sinks: bool = False) -> str | None:
    device = torch.device("cuda", device_index)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(24, hq, d, device=device, dtype=dtype, generator=g)
    kv = torch.randn(2, 40, 1, d, device=device, dtype=dtype, generator=g)  # MQA: the hardest GQA case
    k, v = kv[0].contiguous(), kv[1].contiguous()
    cu_q = torch.tensor([0, 8, 24], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 16, 40], dtype=torch.int32, device=device)
    kw = dict(window=5 if window else None, sinks=torch.zeros(hq, device=device) if sinks else None)
    what = f"dtype {dtype}, Hq={hq}, D={d}" + (", sliding window" if window else "") + (", learnable sinks" if sinks else "")
    try:
        out, aux = _cudnn_forward(q, k, v, cu_q, cu_k, 16, 24, d**-0.5, **kw)
        grads = _cudnn_backward(torch.ones_like(out), q, k, v, out, aux, cu_q, cu_k, 16, 24, d**-0.5, **kw)
        dk = grads[1]
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001  (cuDNN / TE say why in their message)
        return f"TE's cuDNN fused attention refused ({what}): {type(e).__name__}: {e}"
    if out.shape != q.shape or dk.shape != k.shape or not torch.isfinite(out).all():
        return f"TE's cuDNN fused attention returned unexpected results (out {tuple(out.shape)}, dk {tuple(dk.shape)})"
    return None


def require_cudnn(q: torch.Tensor, window: bool = False, sinks: bool = False) -> None:
    """Raise ``ValueError`` saying why backend ``"cudnn"`` cannot run for ``q`` (with a
    window / sinks where asked)."""
    reason = cudnn_refusal(q, window, sinks)
    if reason is not None:
        raise unavailable_error("cudnn", "Transformer Engine's cuDNN fused attention", reason)


# ----------------------------------------------------------------------------- tree attention


def cudnn_tree_attention(q, k, v, plan, softmax_scale: float, layout: str = "auto", variant=None) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` through cuDNN.

    ``layout``: ``"auto"`` = the chain self call where the plan is a chain forest (no cascade
    level call), else gather-KV; ``"gather"`` forces gather-KV; ``"cascade"`` is accepted only
    for a chain forest (cuDNN does not run the cascade's level calls, see the module
    docstring). ``variant``: window and sinks (:mod:`ps_mcore.attention.variants`); the
    chain self call takes the window as it is (a chain's rows are consecutive positions)."""
    if layout not in ("auto", "cascade", "gather"):
        raise ValueError(f"unknown tree attention layout {layout!r}; expected auto, cascade or gather")
    if layout == "gather":
        return gather_kv_attention(q, k, v, plan, softmax_scale, CUDNN_KERNEL, variant)
    cascade = cascade_layout(plan, q.device)
    if auto_layout(plan, cascade, level_calls=False) == "gather":
        if layout == "cascade":
            raise ValueError(
                f"the cuDNN kernel runs the cascade layout only on chain forests; this plan has "
                f"{cascade.num_levels} chain level(s): use layout 'gather' or the 'varlen' backend"
            )
        return gather_kv_attention(q, k, v, plan, softmax_scale, CUDNN_KERNEL, variant)
    self_call = cascade.calls[0]  # one causal segment per chain, q = k = the chain's rows
    in_place = GatherContext(None, self_call.cu_k, self_call.max_k)
    return varlen_attention(q, k, v, self_call.cu_q, self_call.max_q, in_place, softmax_scale, CUDNN_KERNEL, variant)
