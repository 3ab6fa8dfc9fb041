"""What verl 0.8.0 needs from the flash-attn package, for machines without it (benchmark
harness only; install with :func:`install`).

Stock verl cannot run its FSDP engine without flash-attn, found by running it:

* the model is loaded with ``attn_implementation="flash_attention_2"`` (verl's default for
  ``actor_rollout_ref.model.override_config.attn_implementation``); transformers refuses it
  without the package, and its ``sdpa`` on verl's packed rows (one ``[1, N]`` row, position ids
  restarting per sequence) builds a dense block-diagonal ``[N, N]`` mask: slow and O(N^2)
  memory, not what users run;
* the trainer's ``left_right_2_no_padding`` (and anything else calling
  ``verl.utils.attention_utils``) imports ``flash_attn.bert_padding`` at call time;
* ``verl.utils.torch_functional.logprobs_from_logits`` takes flash-attn's fused cross-entropy
  and otherwise loops over the rows of its ``[N, V]`` logits, one ``log_softmax`` per token
  (~60 us a token on an H200: a stock baseline several times slower than what users run).

:func:`install` registers ``"varlen_fa2"`` with transformers: FlashAttention-2's contract
(packed rows split at position-id restarts or at explicit ``cu_seq_lens_q/k``; a 2-D key
padding mask with bottom-right causal alignment, the form verl's PrefixGrouper hands its
attention function; ``is_causal=False`` for encoders) on torch's own varlen flash kernel (the
math kernel on a CPU), points ``verl.utils.attention_utils`` at verl's
pure-torch copy of ``flash_attn.bert_padding`` (``verl.utils.npu_flash_attn_utils``), and gives
``logprobs_from_logits`` flash-attn's cross-entropy contract on torch's vectorized one. The
Megatron engine needs neither (TE's attention runs THD itself).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ps_mcore.attention import _autocast_inputs, _no_autocast

ATTN_NAME = "varlen_fa2"
# The same function for a vision tower: transformers' Qwen2-VL / Qwen2.5-VL vision attention
# hands its cu_seqlens (images, windows) to an implementation whose name says "flash" and
# otherwise loops over them one attention call each (:func:`use_for_vision`).
VISION_ATTN_NAME = "flash_contract_varlen_fa2"


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def _varlen(q, k, v, cu_q, cu_k, scale, causal=True):
    """q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` -> ``[Tq, Hq, D]``, causal bottom-right (or
    full attention within each segment)."""
    from ps_mcore.attention.gather_kv import MATH_KERNEL, flash_kernel_for, gather_kv_attention

    kernel = flash_kernel_for(q.device) if q.dtype in (torch.float16, torch.bfloat16) else None
    max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    if not causal:
        return _full_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, kernel is not None)
    segments = SimpleNamespace(
        is_trivial=True, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k,
    )
    return gather_kv_attention(q, k, v, segments, scale, kernel or MATH_KERNEL)


def _full_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, flash: bool):
    """Bidirectional attention within each segment: torch's flash op (differentiable) where it
    runs, else one SDPA call per segment."""
    if flash:
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_q.int(), cu_k.int(), max_q, max_k, 0.0, False, False,
            scale=scale,
        )[0]
    group = q.size(1) // k.size(1)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    out = []
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        qs, ks, vs = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1))
    return torch.cat(out)


def varlen_fa2_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None, is_causal=None, **kwargs):
    """transformers attention function: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, Sk, D]``
    -> (``[B, S, Hq, D]``, None)."""
    if dropout:
        raise NotImplementedError(f"{ATTN_NAME}: attention dropout is not supported")
    # fp32 q/k/v (RoPE under autocast) in the autocast dtype, as transformers' flash_attention_2
    # casts them; the kernel then runs outside autocast
    query, key, value = _autocast_inputs(query, key, value)
    with _no_autocast(query.device.type):
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return _varlen_fa2_attention(query, key, value, attention_mask, scaling, position_ids, causal,
                                     cu_seq_lens_q, cu_seq_lens_k)


def _varlen_fa2_attention(query, key, value, attention_mask, scaling, position_ids, causal,
                          cu_seq_lens_q, cu_seq_lens_k):
    b, _, s, d = query.shape
    sk = key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, H, D]
    if attention_mask is not None:  # 2-D key padding mask; queries are its last S columns
        kmask = attention_mask.bool()
        qmask = kmask[:, -s:]
        rows = _varlen(q[qmask], k[kmask], v[kmask], _cu(qmask.sum(1)), _cu(kmask.sum(1)), scale, causal)
        return q.new_zeros(b, s, *rows.shape[1:]).index_put((qmask,), rows), None
    cu_k = None
    if b == 1 and cu_seq_lens_q is not None:  # explicit segments (a vision tower's images / windows)
        cu = cu_seq_lens_q.to(torch.int32)
        cu_k = cu if cu_seq_lens_k is None else cu_seq_lens_k.to(torch.int32)
    elif b == 1 and position_ids is not None and s == sk:  # verl's packed row
        starts = torch.nonzero(position_ids.reshape(-1)[:s] == 0).reshape(-1)
        if starts.numel() == 0 or int(starts[0]) != 0:
            starts = F.pad(starts, (1, 0))
        cu = torch.cat([starts, starts.new_tensor([s])]).to(torch.int32)
    else:
        cu = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
        if s != sk:
            raise ValueError(f"{ATTN_NAME}: query and key lengths differ without a padding mask")
    out = _varlen(q.reshape(b * s, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
                  v.reshape(b * sk, *v.shape[2:]), cu, cu if cu_k is None else cu_k, scale, causal)
    return out.reshape(b, s, *out.shape[1:]), None


def _pure_torch_bert_padding():
    from verl.utils import npu_flash_attn_utils as padding

    return padding.index_first_axis, padding.pad_input, padding.rearrange, padding.unpad_input


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True):
    """flash-attn's ``cross_entropy_loss`` contract: logits ``[N, V]``, labels ``[N]`` ->
    (losses ``[N]`` fp32, z-losses ``[N]``), computed in fp32 as flash-attn's kernel does."""
    losses = F.cross_entropy(logits.float(), labels, reduction="none")
    return losses, torch.zeros_like(losses)


def register_attention() -> None:
    """Register ``varlen_fa2`` with transformers (attention + FA2 mask function), and its
    vision-tower name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN_NAME, varlen_fa2_attention)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)
    AttentionInterface.register(VISION_ATTN_NAME, varlen_fa2_attention)


def use_for_vision(vision_config) -> None:
    """Run a built model's vision tower on ``varlen_fa2`` through its flash-attention path (one
    varlen call over the cu_seqlens of its images or windows, as with flash_attention_2). Set on
    the built model's config: at build time transformers would take the name for a flash-attn
    kernel to load."""
    register_attention()
    vision_config._attn_implementation_internal = VISION_ATTN_NAME


def install() -> None:
    """:func:`register_attention` and, when flash-attn is missing, give
    ``verl.utils.attention_utils`` the pure-torch padding helpers and
    ``verl.utils.torch_functional`` a vectorized cross-entropy."""
    register_attention()
    try:
        import flash_attn.bert_padding  # noqa: F401
    except ImportError:
        from verl.utils import attention_utils, torch_functional

        attention_utils._get_attention_functions = _pure_torch_bert_padding
        torch_functional.cross_entropy_loss = cross_entropy_loss
        torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = True  # verl's spelling


def wrap_for_prefix_grouper() -> None:
    """verl's ``apply_prefix_grouper_patch`` wraps the attention names it knows; wrap
    ``varlen_fa2`` with verl's own wrapper the same way."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.models.transformers import monkey_patch

    monkey_patch.apply_prefix_grouper_patch()
    fn = ALL_ATTENTION_FUNCTIONS[ATTN_NAME]
    if not getattr(fn, "_verl_prefix_grouper", False):
        wrapped = monkey_patch._create_prefix_grouper_wrapper(fn)
        wrapped._verl_prefix_grouper = True
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = wrapped
