"""Per-token log-probabilities and entropy from packed LM-head logits.

Every packed row is normalised once (a branch-point row predicting k different next tokens
computes its logsumexp and entropy once) and each original token then reads one label logit,
so no ``[N, V]`` tensor exists. Vocab-parallel shards (Megatron TP) combine through two
all-reduces per chunk, as Megatron's vocab-parallel cross entropy does. Backward recomputes
the softmax chunk by chunk from the saved logits: peak extra memory is one fp32 chunk.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist

from ps_mcore.planner import TreePlan

CHUNK_ELEMENTS = 1 << 26  # fp32 elements per working chunk (256 MiB)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _chunks(num_rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for a in range(0, num_rows, step):
        yield a, min(a + step, num_rows)


class _RowStats(torch.autograd.Function):
    """logits ``[T, V_local]`` -> (logsumexp ``[T]``, entropy ``[T]``, label logit ``[R]``) of
    ``logits / temperature``, for label pairs (row ``rows[i]``, global vocab id ``labels[i]``)."""

    @staticmethod
    def forward(ctx, logits, rows, labels, temperature, vocab_start, group):
        t, v_local = logits.shape
        ctx.acc = acc = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(t, dtype=acc, device=logits.device)
        ent = torch.empty_like(lse)
        for a, b in _chunks(t, v_local):
            z = logits[a:b].to(acc) / temperature
            zmax = _all_reduce(z.max(-1).values, dist.ReduceOp.MAX, group)
            e = torch.exp(z - zmax[:, None])
            sums = _all_reduce(torch.stack([e.sum(-1), (e * z).sum(-1)]), dist.ReduceOp.SUM, group)
            lse[a:b] = zmax + torch.log(sums[0])
            ent[a:b] = lse[a:b] - sums[1] / sums[0]  # H = lse - E_p[z]
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        picked = logits[rows, local.clamp(0, v_local - 1)].to(acc) / temperature
        label_logit = _all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, rows, local, in_shard, lse, ent)
        ctx.temperature = temperature
        return lse, ent, label_logit

    @staticmethod
    def backward(ctx, g_lse, g_ent, g_label):
        logits, rows, local, in_shard, lse, ent = ctx.saved_tensors
        temp = ctx.temperature
        t, v_local = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
        g_ent = torch.zeros_like(ent) if g_ent is None else g_ent
        g_label = torch.where(in_shard, g_label, 0.0) if g_label is not None else None
        for a, b in _chunks(t, v_local):
            z = logits[a:b].to(ctx.acc) / temp
            p = torch.exp(z - lse[a:b, None])
            # d lse / dz = p;  d H / dz = -p (z - lse + H);  d z[label] / dz = one-hot
            dz = p * (g_lse[a:b, None] - g_ent[a:b, None] * (z - lse[a:b, None] + ent[a:b, None]))
            if g_label is not None:
                # Every label adds into this chunk, those outside it (or the shard) add 0 at a
                # clamped index: no boolean-mask select, so no device sync per chunk.
                inside = (rows >= a) & (rows < b)
                flat = (rows - a).clamp(0, b - a - 1) * v_local + local.clamp(0, v_local - 1)
                dz.view(-1).index_add_(0, flat, torch.where(inside, g_label, 0.0))
            grad[a:b] = (dz / temp).to(grad.dtype)
        return grad, None, None, None, None, None


class TokenRows(Protocol):
    """What :func:`token_logprobs` reads: which packed row each original token reads.

    A :class:`~ps_mcore.planner.TreePlan` is one; so is one CP rank's share of a plan
    (:class:`ps_mcore.layer_specs.parallel.cp_logprobs.LocalTokenRows`).

    Attributes:
        num_tokens: T, the packed rows the logits hold (at least).
        unpack_index: ``[N]`` packed row of each original token.
        next_token_ids: ``[N]`` the token that follows each original token (its label).
        next_token_mask: ``[N]`` bool, False at each sequence's last token.
        max_token_id: the largest token id of the batch (labels past the vocab are refused).
    """

    num_tokens: int
    unpack_index: torch.Tensor
    next_token_ids: torch.Tensor
    next_token_mask: torch.Tensor
    max_token_id: int

    def to(self, device) -> "TokenRows": ...


def token_logprobs(
    logits: torch.Tensor,
    plan: TreePlan | TokenRows,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each original token's successor, from packed logits.

    Args:
        logits: ``[T, V_local]`` packed LM-head output (a vocab-parallel shard under TP; rows
            past T, e.g. TP padding, are ignored).
        plan: the micro-batch's :class:`TreePlan`.
        temperature: logits are divided by it first (as verl does).
        compute_entropy: also return the entropy of each token's predictive distribution.
        tp_group: the tensor-parallel group holding the vocab shards (None: full vocab here).

    Returns:
        ``logprobs [N]`` (float32, or float64 for float64 logits) with ``logprobs[n] = log p(token n+1 | tokens <= n)`` in its
        sequence (0 at each sequence's last token), and ``entropy [N]`` or None.
    """
    if logits.dim() != 2 or logits.size(0) < plan.num_tokens:
        raise ValueError(
            f"token_logprobs expects logits [T>={plan.num_tokens}, V], got {tuple(logits.shape)}"
        )
    if not math.isfinite(float(temperature)) or float(temperature) <= 0:
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    if logits.size(1) == 0:
        raise ValueError(f"token_logprobs needs a non-empty vocab dimension, got {tuple(logits.shape)}")
    # A label past the vocab would silently read a logit of 0 (the in-shard mask drops it).
    vocab = logits.size(1) * (dist.get_world_size(tp_group) if tp_group is not None else 1)
    if plan.max_token_id >= vocab:  # cached per plan: no sync for a CPU plan
        raise ValueError(
            f"token id {plan.max_token_id} is outside the vocab of the logits (V={vocab}); "
            "pass the full (or TP-sharded) LM-head output"
        )
    plan = plan.to(logits.device)
    logits = logits[: plan.num_tokens]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_start = rank * logits.size(1)
    rows = plan.unpack_index
    lse, ent, label_logit = _RowStats.apply(
        logits, rows, plan.next_token_ids, float(temperature), vocab_start, tp_group
    )
    logprobs = torch.where(plan.next_token_mask, label_logit - lse[rows], 0.0)
    return logprobs, (ent[rows] if compute_entropy else None)
