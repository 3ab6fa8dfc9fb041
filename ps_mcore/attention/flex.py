"""FlexAttention backend: one BlockMask over the packed rows from per-token subtree ends.

T is padded to a multiple of 128 so micro-batches of new lengths reuse compiled kernels.
Padded keys are never visible to real queries (``k <= q`` fails); each padded query sees only
itself, so no row is empty.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BUCKET = 128


def _bucket(t: int) -> int:
    return -(-t // BUCKET) * BUCKET


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(plan, device: torch.device):
    """The plan's BlockMask on ``device`` (cached on the plan)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device)
    masks = plan.memo.flex_block_masks
    if device not in masks:
        t, t_pad = plan.num_tokens, _bucket(plan.num_tokens)
        subtree_end = torch.arange(1, t_pad + 1, device=device)
        subtree_end[:t] = plan.subtree_end.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

        masks[device] = create_block_mask(
            mask_mod, B=None, H=None, Q_LEN=t_pad, KV_LEN=t_pad, device=device
        )
    return masks[device]


def flex_tree_attention(q, k, v, plan, softmax_scale: float) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    from torch.nn.attention.flex_attention import flex_attention

    t = q.size(0)
    pad = _bucket(t) - t

    def to_bhsd(x):
        return F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0)

    # Compiled on CUDA (the fused kernel); eager elsewhere, where flex runs its math path.
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out = fn(
        to_bhsd(q), to_bhsd(k), to_bhsd(v),
        block_mask=block_mask(plan, q.device), scale=softmax_scale,
        enable_gqa=q.size(1) != k.size(1),
    )
    return out[0].transpose(0, 1)[:t]
