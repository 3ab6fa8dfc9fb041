"""The oracle: dense tree mask from the plan, float32 math (float64 for float64 inputs), any device."""

from __future__ import annotations

import torch

from ps_mcore.attention.variants import PLAIN, AttentionVariant, softcap_scores, window_mask
from ps_mcore.planner import TreePlan


def tree_mask(plan: TreePlan, window: int | None = None) -> torch.Tensor:
    """``[T, T]`` bool, True where query row q may attend to key row k:
    ``k <= q < subtree_end[k]`` (k on q's root path, at or before it) and, with a sliding
    window W, ``depth[k] > depth[q] - W``."""
    rows = torch.arange(plan.num_tokens, device=plan.device)
    q, k = rows[:, None], rows[None, :]
    mask = (k <= q) & (q < plan.subtree_end[None, :])
    inside = window_mask(plan.position_ids, plan.position_ids, window)
    return mask if inside is None else mask & inside


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreePlan, softmax_scale: float,
    variant: AttentionVariant = PLAIN,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` (q's dtype), via a dense mask;
    softcap on the scaled scores, sinks as one more logit per row (dropped after the softmax)."""
    group = q.size(1) // k.size(1)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math, fp64 kept
    qf = q.to(acc).transpose(0, 1)  # [Hq, T, D]
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = softcap_scores(torch.matmul(qf, kf.transpose(1, 2)) * softmax_scale, variant.softcap)
    scores = scores.masked_fill(~tree_mask(plan, variant.window)[None], float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.to(acc)[:, None, None].expand(-1, scores.size(1), 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)
    return out.transpose(0, 1).to(q.dtype)
