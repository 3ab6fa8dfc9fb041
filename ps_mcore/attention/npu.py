"""Ascend NPU varlen kernel: ``torch_npu.npu_fusion_attention`` in TND layout.

The gather-KV layout (see :mod:`ps_mcore.attention.gather_kv`) needs a varlen kernel with
separate query/key lengths per segment and bottom-right causal alignment. On Ascend that is
``npu_fusion_attention(..., input_layout="TND", sparse_mode=3)`` (3 = rightDownCausal), the
same call MindSpeed core_r0.16.0 makes in its KV-all-gather context parallelism
(``mindspeed/te/pytorch/attention/dot_product_attention/kvallgather_context_parallel.py``:
queries a suffix of their keys, TND, ``sparse_mode=3``, forward stats handed to
``npu_fusion_attention_grad``).

Cumulative lengths. torch_npu documents ``actual_seq_qlen`` / ``actual_seq_kvlen`` as host-side
``List[int]`` of the *cumulative* per-batch lengths **without a leading 0**: lengths
``2 2 2 2 2`` are passed as ``2 4 6 8 10`` (Ascend/op-plugin, branch 26.0.0 = torch_npu
26.0.0, ``docs/en/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md``).
Our plans store Megatron/FlashAttention ``cu_seqlens`` ``[0, e1, ..., eM]``, so we pass
``cu_seqlens[1:]``. A leading 0 would be read as an extra zero-length batch: the doc tolerates
zero-length batches only without ``pse`` and counts them against the batch limit, and zeros
have a second documented meaning (trailing zeros = batches skipped), so we never send one.
MindSpeed's own builders use the same convention (``get_cu_seqlens_qkv_before_attn`` appends
only segment ends; its EOD path sets ``actual_seq_len = eod_index + 1``).

Other documented facts used here: ``head_num`` is the number of *query* heads (N means Nq;
Nq/Nkv must be an integer: GQA; the doc does not spell out the head grouping, we assume
Megatron's ``i // (Nq//Nkv)`` as MindSpeed and Huawei's msprobe golden do); modes 2/3/4
take the compressed mask ``triu(ones(2048, 2048, bool), 1)`` (True = masked) whatever the
sequence lengths; ``pre_tockens``/``next_tockens`` are ignored in mode 3; varlen rows must not
be fully masked (holds: every context ends with its own queries, so ``len_kv >= len_q``);
limits: D <= 768, Nq <= 256, at most 1K segments and 1M tokens per call (larger plans are
split into several calls). ``softmax_max``/``softmax_sum`` are kept opaque (their layout
changed across torch_npu versions) and handed back unchanged to the grad call together with
``attention_in`` (the forward output). No dropout (``keep_prob=1``), so the forward's
seed/offset/numels are not needed by backward (MindSpeed's KV-all-gather backward omits them).

This module imports torch_npu lazily and never at import time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ps_mcore.attention.gather_kv import VarlenKernel

INPUT_LAYOUT = "TND"
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
COMPRESSED_MASK_SIZE = 2048
# Documented limits of the varlen (TND) path, per call.
NPU_MAX_SEGMENTS = 1024
NPU_MAX_TOKENS = 1 << 20
NPU_MAX_HEAD_DIM = 768
NPU_MAX_QUERY_HEADS = 256
# Ignored in sparse mode 3; set to the unbounded causal band anyway (all past keys, no future
# key) so the arguments stay truthful should a version honour them.
_PRE_TOCKENS = 2147483647
_NEXT_TOCKENS = 0


@dataclass(frozen=True)
class NpuFusionCall:
    """One ``npu_fusion_attention`` call over consecutive segments.

    ``q_rows``/``kv_rows`` select the call's rows of the packed q ``[Tq, Hq, D]`` and gathered
    k/v ``[Tk, Hkv, D]``; ``kwargs`` are the forward's keyword arguments (local cumulative
    lengths, no leading 0)."""

    q_rows: slice
    kv_rows: slice
    head_num: int
    input_layout: str
    kwargs: dict[str, Any]

    def grad_kwargs(
        self, softmax_max: torch.Tensor, softmax_sum: torch.Tensor, attention_in: torch.Tensor
    ) -> dict[str, Any]:
        """Keyword arguments of the matching ``npu_fusion_attention_grad`` call."""
        kw = dict(self.kwargs)
        kw["scale_value"] = kw.pop("scale")  # the grad op names its scale scale_value
        kw.update(softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=None,
                  attention_in=attention_in)
        return kw


def compressed_causal_mask(device: torch.device | str) -> torch.Tensor:
    """``[2048, 2048]`` bool, True above the diagonal: the mask sparse modes 2/3/4 expect."""
    device = torch.device(device)
    key = str(device)
    if key not in _MASKS:
        n = COMPRESSED_MASK_SIZE
        _MASKS[key] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)
    return _MASKS[key]


_MASKS: dict[str, torch.Tensor] = {}


def _as_bounds(cu: torch.Tensor | Sequence[int], name: str) -> list[int]:
    bounds = cu.tolist() if isinstance(cu, torch.Tensor) else [int(x) for x in cu]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"{name} must be cumulative boundaries [0, e1, ..., eM], got {bounds[:8]}")
    if any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"{name} must be non-decreasing, got {bounds[:8]}...")
    return bounds


def _segment_groups(
    bq: list[int], bk: list[int], max_segments: int, max_tokens: int
) -> list[tuple[int, int]]:
    """Greedy ``[lo, hi)`` segment ranges within the per-call segment and token limits."""
    groups, lo = [], 0
    for i in range(len(bq) - 1):
        if bq[i + 1] - bq[i] > max_tokens or bk[i + 1] - bk[i] > max_tokens:
            raise NotImplementedError(
                f"segment {i} has {bq[i + 1] - bq[i]} queries / {bk[i + 1] - bk[i]} keys; "
                f"npu_fusion_attention takes at most {max_tokens} tokens per call"
            )
        full = (
            i - lo >= max_segments
            or bq[i + 1] - bq[lo] > max_tokens
            or bk[i + 1] - bk[lo] > max_tokens
        )
        if full:
            groups.append((lo, i))
            lo = i
    groups.append((lo, len(bq) - 1))
    return groups


def npu_fusion_args(
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_kv: torch.Tensor | Sequence[int],
    num_heads: int,
    scale: float,
    atten_mask: torch.Tensor | None,
    max_segments: int = NPU_MAX_SEGMENTS,
    max_tokens: int = NPU_MAX_TOKENS,
) -> list[NpuFusionCall]:
    """The ``npu_fusion_attention`` calls computing bottom-right causal varlen attention.

    Pure (no torch_npu needed), so it is checked on CPU.

    Args:
        cu_seqlens_q, cu_seqlens_kv: ``[M+1]`` boundaries with a leading 0 (the plan's
            ``cu_seqlens_q`` / ``cu_seqlens_kv``); segment i has queries ``q[bq[i]:bq[i+1]]``
            attending bottom-right causally to ``k[bk[i]:bk[i+1]]``.
        num_heads: query heads ``Hq`` (torch_npu's ``head_num``).
        scale: softmax scale.
        atten_mask: the compressed causal mask (:func:`compressed_causal_mask` on q's device).

    Returns:
        Calls covering all segments in order; their ``actual_seq_qlen``/``actual_seq_kvlen``
        are cumulative within the call, without a leading 0.
    """
    bq = _as_bounds(cu_seqlens_q, "cu_seqlens_q")
    bk = _as_bounds(cu_seqlens_kv, "cu_seqlens_kv")
    if len(bq) != len(bk):
        raise ValueError(f"cu_seqlens_q has {len(bq) - 1} segments, cu_seqlens_kv {len(bk) - 1}")
    for i in range(len(bq) - 1):
        if bk[i + 1] - bk[i] < bq[i + 1] - bq[i]:
            # Bottom-right causal would mask whole query rows, which varlen mode forbids.
            raise ValueError(
                f"segment {i} has {bq[i + 1] - bq[i]} queries but only {bk[i + 1] - bk[i]} keys; "
                "gather-KV contexts always end with their own queries"
            )
    calls = []
    for lo, hi in _segment_groups(bq, bk, max_segments, max_tokens):
        q0, k0 = bq[lo], bk[lo]
        kwargs = dict(
            pse=None,
            padding_mask=None,
            atten_mask=atten_mask,
            scale=float(scale),
            keep_prob=1.0,
            pre_tockens=_PRE_TOCKENS,
            next_tockens=_NEXT_TOCKENS,
            inner_precise=0,
            actual_seq_qlen=[b - q0 for b in bq[lo + 1 : hi + 1]],
            actual_seq_kvlen=[b - k0 for b in bk[lo + 1 : hi + 1]],
            sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        )
        rows = slice(q0, bq[hi]), slice(k0, bk[hi])
        calls.append(NpuFusionCall(*rows, int(num_heads), INPUT_LAYOUT, kwargs))
    return calls


# ----------------------------------------------------------------------------- kernel


def require_torch_npu() -> Any:
    """``import torch_npu`` or a ValueError saying what backend 'npu' needs."""
    try:
        import torch_npu
    except ImportError as err:
        raise ValueError(
            "tree attention backend 'npu' needs torch_npu (Ascend Extension for PyTorch) with "
            f"npu_fusion_attention; importing it failed: {err}. Use 'chunked' or 'reference'."
        ) from err
    return torch_npu


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.size(-1) > NPU_MAX_HEAD_DIM:
        raise NotImplementedError(
            f"npu_fusion_attention supports head dim <= {NPU_MAX_HEAD_DIM}, got {q.size(-1)}"
        )
    if q.size(1) > NPU_MAX_QUERY_HEADS:
        raise NotImplementedError(
            f"npu_fusion_attention supports <= {NPU_MAX_QUERY_HEADS} query heads per rank, "
            f"got {q.size(1)}; use more tensor parallelism"
        )


# Plans are cached per device, so the same cu_seqlens tensors come back every layer: build the
# host-side lists once per tensor pair instead of syncing the device on every call.
_CALLS: dict[tuple, tuple[Any, Any, int, int, list[NpuFusionCall]]] = {}


def _calls_for(cu_q: torch.Tensor, cu_k: torch.Tensor, num_heads: int, scale: float,
               device: torch.device) -> list[NpuFusionCall]:
    key = (id(cu_q), id(cu_k), num_heads, scale, str(device), NPU_MAX_SEGMENTS, NPU_MAX_TOKENS)
    hit = _CALLS.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k \
            and hit[2] == cu_q._version and hit[3] == cu_k._version:
        return hit[4]
    calls = npu_fusion_args(cu_q, cu_k, num_heads, scale, compressed_causal_mask(device),
                            NPU_MAX_SEGMENTS, NPU_MAX_TOKENS)
    if len(_CALLS) >= 64:
        _CALLS.clear()
    _CALLS[key] = (weakref.ref(cu_q), weakref.ref(cu_k), cu_q._version, cu_k._version, calls)
    return calls


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _npu_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    torch_npu = require_torch_npu()
    _check_heads(q, k)
    outs, aux = [], []
    for c in _calls_for(cu_q, cu_k, q.size(1), scale, q.device):
        res = torch_npu.npu_fusion_attention(
            q[c.q_rows], k[c.kv_rows], v[c.kv_rows], c.head_num, c.input_layout, **c.kwargs
        )
        outs.append(res[0])
        aux += [res[1], res[2]]  # softmax_max, softmax_sum (opaque)
    return _cat(outs), tuple(aux)


def _npu_backward(dout, q, k, v, out, aux, cu_q, cu_k, max_q, max_k, scale):
    torch_npu = require_torch_npu()
    dq, dk, dv = [], [], []
    for i, c in enumerate(_calls_for(cu_q, cu_k, q.size(1), scale, q.device)):
        res = torch_npu.npu_fusion_attention_grad(
            q[c.q_rows], k[c.kv_rows], v[c.kv_rows], dout[c.q_rows], c.head_num, c.input_layout,
            **c.grad_kwargs(aux[2 * i], aux[2 * i + 1], out[c.q_rows]),
        )
        dq.append(res[0])
        dk.append(res[1])
        dv.append(res[2])
    return _cat(dq), _cat(dk), _cat(dv)


NPU_KERNEL = VarlenKernel(
    "npu_fusion_attention", _npu_forward, _npu_backward,
    missing=(
        ("window", "npu_fusion_attention's band mode (sparse_mode 4) is not documented for varlen TND "
                   "segments with more keys than queries, and is unverified on Ascend hardware here"),
        ("sinks", "npu_fusion_attention takes no sink logits and its softmax statistics are opaque"),
        ("softcap", "npu_fusion_attention takes no logit softcap"),
    ),
)

__all__ = [
    "NPU_KERNEL",
    "NpuFusionCall",
    "compressed_causal_mask",
    "npu_fusion_args",
    "require_torch_npu",
]
