"""``tree_attention(q, k, v, plan, backend)``: causal attention over a packed prefix forest.

Backends:
    reference  dense tree mask, any device (the oracle; O(T^2) memory).
    chunked    cascade layout (attention/layout.py) with a pure-torch kernel, any device.
               Both compute fp16/bf16/fp32 inputs in fp32 and fp64 inputs in fp64 (merges and
               dK/dV sums included); the CUDA/NPU kernels take fp16/bf16 and accumulate in fp32.
    varlen     varlen FlashAttention (torch's flash kernel or flash-attn), CUDA, in the cascade
               layout (no K/V copy) or gather-KV, whichever layout.cascade_pays picks.
    flex       FlexAttention with a BlockMask from subtree ends (compiled on CUDA).
    cudnn      cuDNN fused attention through Transformer Engine, CUDA fp16/bf16: gather-KV, or
               on a chain forest the single causal call in place (attention/cudnn.py).
    npu        gather-KV + torch_npu.npu_fusion_attention (TND, bottom-right causal), Ascend.
    fa4        FlashAttention-4 (flash-attn-4, CuTe DSL, SM90+), CUDA fp16/bf16: the cascade or
               gather-KV layout like varlen (attention/fa4.py); explicit only.
    auto       npu on an NPU device; on CUDA for fp16/bf16 varlen, or cudnn where TE is present and
               the plan's shape favours it (attention/kernel_choice.py); else flex on CUDA,
               else chunked.

Variants (attention/variants.py): ``window=`` (sliding window along each sample's path),
``sinks=`` (per-head sink logits), ``softcap=`` (logit softcapping). Which backend computes
which: ``ATTENTION_BACKENDS[name].supported_features(device)``; the others refuse by name.

The names map to code in one table, :mod:`ps_mcore.attention.backends` (also used by the
context-parallel path and the layer-spec builders); add a backend there.
"""

from __future__ import annotations

import contextlib

import torch

from ps_mcore.attention import backends
from ps_mcore.attention.backends import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    auto_choice,
    backend_names,
    check_backend_name,
    cp_backend_names,
    cp_kernel,
    register_backend,
    resolve_backend,
)
from ps_mcore.attention.gather_kv import default_scale
from ps_mcore.attention.variants import AttentionVariant, attention_variant
from ps_mcore.planner import TreePlan

# The built-in names (the table, :data:`ATTENTION_BACKENDS`, is what the code reads).
BACKENDS = backend_names()


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
    if q.size(1) == 0 or k.size(1) == 0 or q.size(2) == 0:
        raise ValueError(
            f"tree_attention needs Hq, Hkv and head dim D >= 1; got q {tuple(q.shape)}, "
            f"k/v {tuple(k.shape)}"
        )
    if q.size(1) % k.size(1) != 0:
        raise ValueError(f"GQA needs Hq % Hkv == 0; got Hq={q.size(1)}, Hkv={k.size(1)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q/k/v need one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q/k/v are on different devices: {q.device}, {k.device}, {v.device}")


# Under torch.compile tree attention runs eagerly between the compiled graphs: the plan's
# host-side layouts (numpy) and per-plan sizes are no graph material.
@torch.compiler.disable
def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreePlan,
    backend: str = "auto",
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence in ``plan``, computed once per shared token.

    Args:
        q: ``[T, Hq, D]`` packed queries (rows in plan order).
        k, v: ``[T, Hkv, D]`` (v may have its own head dim ``Dv``, e.g. MLA: the output is then
            ``[T, Hq, Dv]``); ``Hq % Hkv == 0`` (query head i reads kv head ``i // (Hq//Hkv)``).
        plan: the micro-batch's :class:`TreePlan` (moved to q's device, cached).
        backend: one of :data:`BACKENDS`.
        softmax_scale: defaults to ``1/sqrt(D)``.
        window: sliding window W: a token at depth d attends to the tokens of its own sample
            at depth > d - W (the last W positions, itself included; Hugging Face /
            FlashAttention ``window_size=(W-1, 0)``), across branch points.
        sinks: ``[Hq]`` attention-sink logits (GPT-OSS; Megatron ``softmax_type="learnable"``),
            one extra term ``exp(sink)`` in every row's softmax denominator; a number gives
            every head that logit (0: Megatron's ``"off-by-one"``). Differentiable.
        softcap: logit softcapping (Gemma 2): scores ``c * tanh(s / c)`` after scaling.

    Inside ``torch.autocast`` q/k/v are cast to the autocast dtype, as
    ``scaled_dot_product_attention`` casts them (RoPE leaves q/k in fp32 there), and the
    attention runs in that dtype.

    Returns:
        ``[T, Hq, D]`` in q's dtype. For every sequence s with rows ``r = unpack rows of s``,
        ``out[r]`` equals causal attention (with the variant) over ``q[r], k[r], v[r]``.
    """
    q, k, v = _autocast_inputs(q, k, v)
    _check_inputs(q, k, v, plan)
    variant = attention_variant(q, window, sinks, softcap)
    scale = default_scale(q.size(-1)) if softmax_scale is None else float(softmax_scale)
    with _no_autocast(q.device.type):  # the kernels' own precision, as sdpa's
        if v.size(-1) != q.size(-1):
            return _with_one_head_dim(q, k, v, plan, backend, scale, variant)
        plan = plan.to(q.device)
        if variant.window is not None and variant.window >= plan.max_seqlen_kv:
            # a window at least as long as every context masks nothing: plain causal attention
            variant = AttentionVariant(None, variant.sinks, variant.softcap)
        return ATTENTION_BACKENDS[_resolved_backend(backend, q, plan, variant)](q, k, v, plan, scale, variant)


def _resolved_backend(backend: str, q: torch.Tensor, plan: TreePlan, variant: AttentionVariant) -> str:
    """:func:`resolve_backend`, kept on the plan: every layer of a micro-batch asks the same."""
    key = (backend, q.device, q.dtype, q.size(1), q.size(2), variant.features,
           torch.is_grad_enabled() and q.requires_grad)
    choices = plan.memo.backend_choices
    name = choices.get(key)
    if name is None:
        name = choices[key] = resolve_backend(backend, q, plan, variant)
    return name


def _no_autocast(device: str):
    return torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()


def _autocast_inputs(q, k, v):
    """q/k/v in the autocast dtype when autocast is on for their device (sdpa's autocast
    policy); unchanged otherwise (a same-dtype ``to`` copies nothing)."""
    device = q.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (q, k, v))


def _with_one_head_dim(q, k, v, plan, backend, scale, variant) -> torch.Tensor:
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
    return tree_attention(q, k, v, plan, backend, scale, window=variant.window, sinks=variant.sinks,
                          softcap=variant.softcap)[..., :dv]


__all__ = ["BACKENDS", "tree_attention", *backends.__all__]
