"""FlexAttention backend: one BlockMask over the packed rows from per-token subtree ends.

T is padded to a multiple of 128 so micro-batches of new lengths reuse compiled kernels.
Padded keys are never visible to real queries (``k <= q`` fails); each padded query sees only
itself, so no row is empty.

Variants: a sliding window is part of the mask (``depth[q] - depth[k] < W``, so the BlockMask
skips blocks outside it), a softcap a ``score_mod``, attention sinks are applied from the
returned logsumexp (``out * exp(lse - logaddexp(lse, sink))``, differentiable as flex's lse is).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ps_mcore.attention.variants import PLAIN, AttentionVariant

BUCKET = 128


def _bucket(t: int) -> int:
    return -(-t // BUCKET) * BUCKET


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(plan, device: torch.device, window: int | None = None):
    """The plan's BlockMask on ``device`` (kept in ``plan.memo``, per device and window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (torch.device(device), window)
    masks = plan.memo.flex_block_masks
    if key not in masks:
        t, t_pad = plan.num_tokens, _bucket(plan.num_tokens)
        subtree_end = torch.arange(1, t_pad + 1, device=device)
        subtree_end[:t] = plan.subtree_end.to(device)
        depth = torch.zeros(t_pad, dtype=torch.long, device=device)  # padded rows see only themselves
        depth[:t] = plan.position_ids.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            tree = (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])
            return tree if window is None else tree & (depth[q_idx] - depth[kv_idx] < window)

        masks[key] = create_block_mask(
            mask_mod, B=None, H=None, Q_LEN=t_pad, KV_LEN=t_pad, device=device
        )
    return masks[key]


@functools.lru_cache(maxsize=None)
def _softcap_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def _lse_request(want: bool) -> dict:
    """Ask flex for its logsumexp: ``return_aux`` (torch >= 2.9) or ``return_lse``."""
    if not want:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def flex_tree_attention(q, k, v, plan, softmax_scale: float, variant: AttentionVariant = PLAIN) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    from torch.nn.attention.flex_attention import flex_attention

    t = q.size(0)
    pad = _bucket(t) - t

    def to_bhsd(x):
        return F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)

    # Compiled on CUDA (the fused kernel); eager elsewhere, where flex runs its math path.
    fn = _compiled_flex() if q.is_cuda else flex_attention
    sinks = variant.sinks
    result = fn(
        to_bhsd(q), to_bhsd(k), to_bhsd(v),
        score_mod=None if variant.softcap is None else _softcap_mod(variant.softcap),
        block_mask=block_mask(plan, q.device, variant.window), scale=softmax_scale,
        enable_gqa=q.size(1) != k.size(1), **_lse_request(sinks is not None),
    )
    if sinks is None:
        return result[0].transpose(0, 1)[:t]
    out, aux = result  # [1, H, T_pad, D], the logsumexp [1, H, T_pad] (natural log)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp64 kept
    lse = getattr(aux, "lse", aux)[0, :, :t].to(acc)
    keep = torch.exp(lse - torch.logaddexp(lse, sinks.to(acc)[:, None]))  # sigmoid(lse - sink)
    return (out[0, :, :t].to(acc) * keep[..., None]).to(q.dtype).transpose(0, 1)
