"""``tree_attention(q, k, v, plan, backend)``: causal attention over a packed prefix forest.

Backends:
    reference  dense tree mask, float32 math, any device (the oracle; O(T^2) memory).
    chunked    gather-KV per node with a pure-torch kernel, any device (exact fp32 math).
    varlen     gather-KV + varlen FlashAttention (torch's flash kernel or flash-attn), CUDA.
    flex       FlexAttention with a BlockMask from subtree ends (compiled on CUDA).
    npu        gather-KV + torch_npu.npu_fusion_attention (TND, bottom-right causal), Ascend.
    auto       npu on an NPU device, varlen on CUDA for fp16/bf16, else flex on CUDA, else chunked.
"""

from __future__ import annotations

import torch

from ps_mcore.attention.gather_kv import (
    MATH_KERNEL,
    default_scale,
    flash_kernel_for,
    gather_kv_attention,
)
from ps_mcore.planner import TreePlan

BACKENDS = ("auto", "reference", "chunked", "varlen", "flex", "npu")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreePlan) -> None:
    if not isinstance(plan, TreePlan):
        raise TypeError(f"plan must be a TreePlan, got {type(plan).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "tree_attention expects q [T, Hq, D] and k/v [T, Hkv, D]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v rows/heads differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.size(0) != plan.num_tokens or k.size(0) != plan.num_tokens:
        raise ValueError(
            f"q/k/v have {q.size(0)}/{k.size(0)} rows but the plan packs T={plan.num_tokens} tokens"
        )
    if q.size(2) != k.size(2):
        raise ValueError(f"head dims differ: q {q.size(2)}, k/v {k.size(2)}")
    if q.size(1) % k.size(1) != 0:
        raise ValueError(f"GQA needs Hq % Hkv == 0; got Hq={q.size(1)}, Hkv={k.size(1)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q/k/v need one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q/k/v are on different devices: {q.device}, {k.device}, {v.device}")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend ``backend`` means for ``q``; raises if it cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        if q.device.type == "npu":
            return "npu"
        if q.is_cuda and q.dtype in _FLASH_DTYPES and flash_kernel_for(q.device) is not None:
            return "varlen"
        return "flex" if q.is_cuda else "chunked"
    if backend == "varlen":
        if flash_kernel_for(q.device) is None:
            raise ValueError(
                f"backend 'varlen' needs a CUDA device with a varlen flash kernel (torch's flash "
                f"attention or flash-attn); q is on {q.device}. Use 'chunked' or 'reference'."
            )
        if q.dtype not in _FLASH_DTYPES:
            raise ValueError(f"backend 'varlen' needs fp16 or bf16 inputs, got {q.dtype}")
    if backend == "npu":
        from ps_mcore.attention.npu import require_torch_npu

        require_torch_npu()
    if backend == "flex" and not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "backend 'flex' runs forward only off CUDA (FlexAttention has no CPU backward); "
            "use 'chunked' for training on CPU"
        )
    return backend


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreePlan,
    backend: str = "auto",
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence in ``plan``, computed once per shared token.

    Args:
        q: ``[T, Hq, D]`` packed queries (rows in plan order).
        k, v: ``[T, Hkv, D]`` (v may have its own head dim ``Dv``, e.g. MLA: the output is then
            ``[T, Hq, Dv]``); ``Hq % Hkv == 0`` (query head i reads kv head ``i // (Hq//Hkv)``).
        plan: the micro-batch's :class:`TreePlan` (moved to q's device, cached).
        backend: one of :data:`BACKENDS`.
        softmax_scale: defaults to ``1/sqrt(D)``.

    Returns:
        ``[T, Hq, D]`` in q's dtype. For every sequence s with rows ``r = unpack rows of s``,
        ``out[r]`` equals causal attention over ``q[r], k[r], v[r]``.
    """
    _check_inputs(q, k, v, plan)
    scale = default_scale(q.size(-1)) if softmax_scale is None else float(softmax_scale)
    if v.size(-1) != q.size(-1):
        return _with_one_head_dim(q, k, v, plan, backend, scale)
    plan = plan.to(q.device)
    name = resolve_backend(backend, q)
    if name == "reference":
        from ps_mcore.attention.reference import reference_attention

        return reference_attention(q, k, v, plan, scale)
    if name == "chunked":
        return gather_kv_attention(q, k, v, plan, scale, MATH_KERNEL)
    if name == "varlen":
        return gather_kv_attention(q, k, v, plan, scale, flash_kernel_for(q.device))
    if name == "npu":
        from ps_mcore.attention.npu import NPU_KERNEL

        return gather_kv_attention(q, k, v, plan, scale, NPU_KERNEL)
    from ps_mcore.attention.flex import flex_tree_attention

    return flex_tree_attention(q, k, v, plan, scale)


def _with_one_head_dim(q, k, v, plan, backend, scale) -> torch.Tensor:
    """Attention with v's head dim ``Dv`` != q/k's ``D`` (MLA) through kernels that take one
    head dim: zero-pad the narrower side to ``max(D, Dv)`` and cut the output to ``Dv``. Exact:
    zero q/k columns add nothing to q.k, zero v columns only produce output columns that are
    cut (their gradients are dropped by the cut)."""
    d, dv = q.size(-1), v.size(-1)
    if dv < d:
        v = torch.nn.functional.pad(v, (0, d - dv))
    else:
        q = torch.nn.functional.pad(q, (0, dv - d))
        k = torch.nn.functional.pad(k, (0, dv - d))
    return tree_attention(q, k, v, plan, backend, scale)[..., :dv]


__all__ = ["BACKENDS", "tree_attention", "resolve_backend"]
