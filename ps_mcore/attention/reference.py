"""The oracle: dense tree mask from the plan, float32 math (float64 for float64 inputs), any device."""

from __future__ import annotations

import torch

from ps_mcore.planner import TreePlan


def tree_mask(plan: TreePlan) -> torch.Tensor:
    """``[T, T]`` bool, True where query row q may attend to key row k:
    ``k <= q < subtree_end[k]``."""
    rows = torch.arange(plan.num_tokens, device=plan.device)
    q, k = rows[:, None], rows[None, :]
    return (k <= q) & (q < plan.subtree_end[None, :])


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreePlan, softmax_scale: float
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` (q's dtype), via a dense mask."""
    group = q.size(1) // k.size(1)
    acc = torch.promote_types(q.dtype, torch.float32)  # fp64 stays fp64
    qf = q.to(acc).transpose(0, 1)  # [Hq, T, D]
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * softmax_scale
    scores = scores.masked_fill(~tree_mask(plan)[None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)
    return out.transpose(0, 1).to(q.dtype)
