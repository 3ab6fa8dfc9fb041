"""Per-token log-probabilities and per-row statistics (entropy, sum of squared
probabilities, log-probs of given token ids, top-k ids) from packed LM-head logits.

Every packed row is normalised once (a branch-point row predicting k different next tokens
computes its logsumexp, entropy and sum of squared probabilities once) and each original
token then reads its row's statistics and its own label logits, so no ``[N, V]`` tensor
exists. Vocab-parallel shards (Megatron TP) combine through two
all-reduces per chunk, as Megatron's vocab-parallel cross entropy does. Backward recomputes
the softmax chunk by chunk from the saved logits: peak extra memory is one fp32 chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from ps_mcore.planner import TreePlan

CHUNK_ELEMENTS = 1 << 26  # fp32 elements per working chunk (256 MiB)


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


@dataclass(frozen=True, eq=False)
class ScoredRows:
    """The (packed row, temperature) pairs a batch normalises, and the pair each token reads.

    With one temperature the pairs are the packed rows themselves. With per-sample
    temperatures a shared row is scored once per distinct temperature among the samples that
    hold it (a GRPO prompt under responses sampled at 0.6 and 1.0 is normalised twice, each
    response's own tokens once).

    Shapes: ``T`` packed rows, ``P >= T`` pairs (sorted by row, then temperature), ``N`` tokens.

    Attributes:
        rows: ``[P]`` packed row of each pair, or None when pair ``p`` is row ``p`` (P = T).
        temperature: one float for every pair, or ``[P]`` float64 per pair.
        token_pair: ``[N]`` the pair each original token reads (its row at its temperature).
        first_pair: host ``[T+1]`` index of each row's first pair (rows are contiguous runs).
    """

    rows: torch.Tensor | None
    temperature: float | torch.Tensor
    token_pair: torch.Tensor
    first_pair: np.ndarray

    @property
    def num_pairs(self) -> int:
        return int(self.first_pair[-1])

    def to(self, device) -> "ScoredRows":
        def move(x):
            return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x

        return ScoredRows(move(self.rows), move(self.temperature), move(self.token_pair), self.first_pair)

    def chunks(self, vocab: int):
        """``(a, b, pa, pb)``: rows ``[a, b)`` and their pairs ``[pa, pb)``, about
        ``CHUNK_ELEMENTS`` fp32 elements per chunk (a row never splits)."""
        first, num_rows = self.first_pair, len(self.first_pair) - 1
        step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
        a = 0
        while a < num_rows:
            b = int(np.searchsorted(first, first[a] + step, side="right")) - 1
            b = min(max(b, a + 1), num_rows)
            yield a, b, int(first[a]), int(first[b])
            a = b


def _check_temperature(temperature) -> None:
    values = torch.as_tensor(temperature, dtype=torch.float64)
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        shown = float(temperature) if values.dim() == 0 else "a tensor with non-finite or non-positive entries"
        raise ValueError(f"temperature must be a finite positive number, got {shown}")


def token_temperatures(plan: "TreePlan | TokenRows", temperature: torch.Tensor) -> torch.Tensor:
    """Host ``[N]`` float64 temperature of every original token of ``plan`` from a per-sample
    ``[B]`` (a :class:`TreePlan`'s sequences, batch order) or per-token ``[N]`` tensor."""
    values = temperature.detach().to("cpu", torch.float64).reshape(-1)
    n = int(plan.unpack_index.numel())
    seq_lens = getattr(plan, "seq_lens", None)
    if seq_lens is not None and values.numel() == len(seq_lens):
        return torch.repeat_interleave(values, torch.tensor(seq_lens, dtype=torch.long))
    if values.numel() == n:
        return values
    per_sample = f"[B={len(seq_lens)}] per sample or " if seq_lens is not None else ""
    raise ValueError(f"temperature tensor must be {per_sample}[N={n}] per token, got {tuple(temperature.shape)}")


def scored_rows(plan: "TreePlan | TokenRows", temperature: float | torch.Tensor = 1.0) -> ScoredRows:
    """The pairs to normalise (host arrays; move with :meth:`ScoredRows.to`).

    Args:
        plan: the packed rows and the row each token reads.
        temperature: one float, or a tensor ``[B]`` per sample / ``[N]`` per token.
    """
    _check_temperature(temperature)
    num_rows = plan.num_tokens
    identity = np.arange(num_rows + 1)
    temps = None
    if isinstance(temperature, torch.Tensor):
        temps = token_temperatures(plan, temperature)
        distinct = torch.unique(temps)
        if distinct.numel() <= 1:
            temperature, temps = (float(distinct[0]) if distinct.numel() else 1.0), None
    if temps is None:
        return ScoredRows(None, float(temperature), plan.unpack_index, identity)
    host = getattr(plan, "host", plan)
    token_rows = host.unpack_index.detach().cpu().numpy().astype(np.int64)
    distinct, temp_id = np.unique(temps.numpy(), return_inverse=True)
    key = token_rows * len(distinct) + temp_id
    pairs, token_pair = np.unique(key, return_inverse=True)
    pair_rows = pairs // len(distinct)
    pair_temp = torch.from_numpy(distinct[pairs % len(distinct)])
    first_pair = np.searchsorted(pair_rows, identity)
    same_rows = len(pairs) == num_rows and np.array_equal(pair_rows, identity[:-1])
    rows = None if same_rows else torch.from_numpy(pair_rows)
    return ScoredRows(rows, pair_temp, torch.from_numpy(token_pair.reshape(-1)), first_pair)


class _RowStats(torch.autograd.Function):
    """logits ``[T, V_local]`` -> (logsumexp ``[P]``, entropy ``[P]`` (``[0]`` unless
    ``want_ent``), sum of squared probabilities ``[P]`` (``[0]`` unless ``want_sq``), label
    logit ``[R]``) of ``logits[row] / temperature`` per scored pair, for label pairs (pair
    ``label_pairs[i]``, global vocab id ``labels[i]``). A row scored at several temperatures
    gets the sum of its pairs' gradients (summed in fp32).

    Only the statistics asked for are computed, and the backward drops the terms whose
    gradient is absent: a log-prob loss costs one fp32 pass to read a chunk, two in place
    (``exp(z - lse)``, times the row's gradient) and one cast back, as Megatron's
    vocab-parallel cross entropy does."""

    @staticmethod
    def forward(ctx, logits, scored, label_pairs, labels, vocab_start, group, want_ent=True, want_sq=False):
        ctx.set_materialize_grads(False)
        v_local = logits.size(1)
        ctx.acc = acc = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(scored.num_pairs, dtype=acc, device=logits.device)
        ent = torch.empty(scored.num_pairs if want_ent else 0, dtype=acc, device=logits.device)
        sq = torch.empty(scored.num_pairs if want_sq else 0, dtype=acc, device=logits.device)
        for a, b, pa, pb in scored.chunks(v_local):
            z = _scaled(logits, scored, a, b, pa, pb, acc)
            zmax = _all_reduce(z.max(-1).values, dist.ReduceOp.MAX, group)
            e = torch.exp(z - zmax[:, None])
            parts = [e.sum(-1)] + ([(e * z).sum(-1)] if want_ent else []) + ([(e * e).sum(-1)] if want_sq else [])
            sums = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group)
            lse[pa:pb] = zmax + torch.log(sums[0])
            if want_ent:
                ent[pa:pb] = lse[pa:pb] - sums[1] / sums[0]  # H = lse - E_p[z]
            if want_sq:
                sq[pa:pb] = sums[-1] / sums[0] ** 2  # sum_v p_v^2
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        label_rows = label_pairs if scored.rows is None else scored.rows[label_pairs]
        picked = logits[label_rows, local.clamp(0, v_local - 1)].to(acc)
        picked = picked / _pair_temperature(scored, label_pairs, acc)
        label_logit = _all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, label_pairs, local, in_shard, lse, ent, sq)
        ctx.scored = scored
        return lse, ent, sq, label_logit

    @staticmethod
    def backward(ctx, g_lse, g_ent, g_sq, g_label):
        logits, label_pairs, local, in_shard, lse, ent, sq = ctx.saved_tensors
        scored, acc = ctx.scored, ctx.acc
        v_local = logits.size(1)
        if g_lse is None and g_ent is None and g_sq is None and g_label is None:
            return None, None, None, None, None, None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
        g_ent = g_ent if g_ent is not None and ent.numel() else None
        g_sq = g_sq if g_sq is not None and sq.numel() else None
        g_label = torch.where(in_shard, g_label, 0.0) if g_label is not None else None
        for a, b, pa, pb in scored.chunks(v_local):
            # d lse / dz = p;  d H / dz = -p (z - lse + H);  d sum_v p_v^2 / dz = 2 p (p - sum_v p_v^2);
            # d z[label] / dz = one-hot.  dz below is d/dz; d/dlogits divides it by the temperature.
            lse_c = lse[pa:pb, None]
            z = _scaled(logits, scored, a, b, pa, pb, acc)
            if g_ent is None and g_sq is None:
                dz = z.sub_(lse_c).exp_().mul_(g_lse[pa:pb, None])  # in place: one chunk alive
            else:
                p = torch.exp(z - lse_c)
                dz = p * g_lse[pa:pb, None]
                if g_ent is not None:
                    dz -= g_ent[pa:pb, None] * p * (z - lse_c + ent[pa:pb, None])
                if g_sq is not None:
                    dz += 2 * g_sq[pa:pb, None] * p * (p - sq[pa:pb, None])
            if g_label is not None:
                # Every label adds into this chunk, those outside it (or the shard) add 0 at a
                # clamped index: no boolean-mask select, so no device sync per chunk.
                inside = (label_pairs >= pa) & (label_pairs < pb)
                flat = (label_pairs - pa).clamp(0, pb - pa - 1) * v_local + local.clamp(0, v_local - 1)
                dz.view(-1).index_add_(0, flat, torch.where(inside, g_label, 0.0))
            t = _chunk_temperature(scored, pa, pb, acc)
            if not _is_one(t):
                dz /= t
            if scored.rows is not None:  # a row's pairs sum in fp32 before the cast
                dz = dz.new_zeros(b - a, v_local).index_add_(0, scored.rows[pa:pb] - a, dz)
            grad[a:b] = dz
        return grad, None, None, None, None, None, None, None


@torch.no_grad()
def _pair_topk(logits, scored: ScoredRows, lse: torch.Tensor, k: int, vocab_start: int, group) -> torch.Tensor:
    """``[P, k]`` global vocab ids of each pair's ``k`` largest log-probabilities (descending;
    vocab-parallel shards: each shard's top-k, all-gathered, then the top-k of those)."""
    v_local = logits.size(1)
    ids = torch.empty(scored.num_pairs, k, dtype=torch.long, device=logits.device)
    world = dist.get_world_size(group) if group is not None else 1
    for a, b, pa, pb in scored.chunks(v_local):
        logp = _scaled(logits, scored, a, b, pa, pb, lse.dtype) - lse[pa:pb, None]
        values, local_ids = torch.topk(logp, k=min(k, v_local), dim=-1)
        local_ids = local_ids + vocab_start
        if world > 1:
            all_values = [torch.empty_like(values) for _ in range(world)]
            all_ids = [torch.empty_like(local_ids) for _ in range(world)]
            dist.all_gather(all_values, values, group=group)
            dist.all_gather(all_ids, local_ids, group=group)
            values, local_ids = torch.cat(all_values, -1), torch.cat(all_ids, -1)
            positions = torch.topk(values, k=k, dim=-1).indices
            local_ids = torch.gather(local_ids, -1, positions)
        ids[pa:pb] = local_ids
    return ids


def _chunk_temperature(scored: ScoredRows, pa: int, pb: int, acc) -> float | torch.Tensor:
    t = scored.temperature
    return t if not isinstance(t, torch.Tensor) else t[pa:pb, None].to(acc)


def _pair_temperature(scored: ScoredRows, pairs: torch.Tensor, acc) -> float | torch.Tensor:
    t = scored.temperature
    return t if not isinstance(t, torch.Tensor) else t[pairs].to(acc)


def _scaled(logits, scored: ScoredRows, a: int, b: int, pa: int, pb: int, acc) -> torch.Tensor:
    """``[pb - pa, V_local]`` the chunk's pairs: their rows' logits over their temperature
    (a new tensor: callers may write into it)."""
    x = logits[a:b] if scored.rows is None else logits[a:b].index_select(0, scored.rows[pa:pb] - a)
    t = _chunk_temperature(scored, pa, pb, acc)
    return x.to(acc, copy=True) if _is_one(t) else x.to(acc) / t


def _is_one(t: float | torch.Tensor) -> bool:
    """A temperature of one float 1.0: dividing by it is skipped."""
    return isinstance(t, float) and t == 1.0


@dataclass(frozen=True, eq=False)
class LabelledRows:
    """The distinct (packed row, next-token label) pairs of a plan: what a kernel that scores
    one label per row (verl's fused linear + log-prob/entropy kernels) runs on. A row inside a
    node has one label; the last row of a node with k children has k, so ``U = T + sum(k - 1)``
    over branch points.

    Attributes:
        rows: ``[U]`` packed row of each pair (sorted by row, then label).
        labels: ``[U]`` label of each pair (a row whose tokens all end their sequence gets 0).
        token_pair: ``[N]`` the pair each original token reads.
        next_token_mask: ``[N]`` False at each sequence's last token (it predicts nothing).
        row_offsets: ``[T + 1]`` on the host: the pairs of rows ``[a, b)`` are
            ``[row_offsets[a], row_offsets[b])`` (what a rank holding those rows scores).
    """

    rows: torch.Tensor
    labels: torch.Tensor
    token_pair: torch.Tensor
    next_token_mask: torch.Tensor
    row_offsets: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.rows.numel())

    def to(self, device) -> "LabelledRows":
        fields = (self.rows, self.labels, self.token_pair, self.next_token_mask)
        return LabelledRows(*(x.to(device, non_blocking=True) for x in fields), self.row_offsets)

    def per_token(self, logprobs: torch.Tensor, entropy: torch.Tensor | None = None):
        """``[U]`` per-pair results -> ``[N]`` per token: log-probs (0 at each sequence's
        last token, which predicts nothing) and entropy (or None)."""
        lp = torch.where(self.next_token_mask, logprobs[self.token_pair], 0.0)
        return lp, (None if entropy is None else entropy[self.token_pair])


def labelled_rows(plan: TreePlan) -> LabelledRows:
    """:class:`LabelledRows` of ``plan``, built on its host copy (no device sync)."""
    host = plan.host
    rows = host.unpack_index.cpu().numpy().astype(np.int64)
    labels = host.next_token_ids.cpu().numpy().astype(np.int64)
    mask = host.next_token_mask.cpu().numpy()
    # a sequence's last token reads any pair of its row: one of the row's labels, else 0
    row_label = np.zeros(plan.num_tokens, dtype=np.int64)
    row_label[rows[mask]] = labels[mask]
    labels = np.where(mask, labels, row_label[rows])
    width = int(labels.max(initial=0)) + 1
    pairs, token_pair = np.unique(rows * width + labels, return_inverse=True)
    pair_rows = pairs // width
    return LabelledRows(
        torch.from_numpy(pair_rows),
        torch.from_numpy(pairs % width),
        torch.from_numpy(token_pair.reshape(-1)),
        host.next_token_mask.cpu(),
        torch.from_numpy(np.searchsorted(pair_rows, np.arange(plan.num_tokens + 1))),
    ).to(plan.device)


class TokenRows(Protocol):
    """What :func:`token_logprobs` reads: which packed row each original token reads.

    A :class:`~ps_mcore.planner.TreePlan` is one; so is one CP rank's share of a plan
    (:class:`LocalTokenRows`).

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


@dataclass(frozen=True)
class LocalTokenRows:
    """The original tokens whose packed row is on this rank (a :class:`TokenRows`): one CP
    rank's rows, one sequence-parallel rank's chunk.

    Attributes:
        num_tokens: t, this rank's rows.
        unpack_index: ``[n]`` local row of each such token.
        next_token_ids, next_token_mask: ``[n]`` their next-token labels and validity.
        max_token_id: the largest token id of the whole plan.
        token_index: ``[n]`` the tokens' indices among the plan's ``N`` original tokens.
    """

    num_tokens: int
    unpack_index: torch.Tensor
    next_token_ids: torch.Tensor
    next_token_mask: torch.Tensor
    max_token_id: int
    token_index: torch.Tensor

    @classmethod
    def select(cls, plan: TreePlan, token_index: torch.Tensor, token_rows: torch.Tensor, num_rows: int):
        """Original token ``token_index[i]`` reads local row ``token_rows[i]`` of ``num_rows``."""
        dev = token_rows.device
        return cls(
            num_tokens=num_rows,
            unpack_index=token_rows,
            next_token_ids=plan.next_token_ids.to(dev).index_select(0, token_index),
            next_token_mask=plan.next_token_mask.to(dev).index_select(0, token_index),
            max_token_id=plan.max_token_id,
            token_index=token_index,
        )

    def to(self, device) -> "LocalTokenRows":
        if self.unpack_index.device == torch.device(device):
            return self
        moved = (self.unpack_index, self.next_token_ids, self.next_token_mask)
        return LocalTokenRows(
            self.num_tokens, *(x.to(device) for x in moved), self.max_token_id, self.token_index.to(device)
        )


@dataclass(frozen=True)
class TokenStatistics:
    """Per original token, statistics of its predictive distribution (``logits[row] /
    temperature`` of the packed row it reads); the fields not asked for are None.

    Shapes: ``N`` original tokens, ``K`` ids per token.

    Attributes:
        logprobs: ``[N]`` log-probability of the token's successor (0 at each sequence's last
            token, which predicts nothing).
        entropy: ``[N]`` entropy.
        sum_pi_squared: ``[N]`` ``sum_v p(v)^2``.
        label_logprobs: ``[N, K]`` log-probability of each of the ids asked for
            (``label_ids[n, k]``).
        topk_ids: ``[N, K]`` the ids of the ``K`` most probable tokens, descending (no grad).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    label_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None

    def map(self, fn) -> "TokenStatistics":
        """``fn`` applied to every field present (each is indexed by token along dim 0)."""
        fields = (self.logprobs, self.entropy, self.sum_pi_squared, self.label_logprobs, self.topk_ids)
        return TokenStatistics(*(None if x is None else fn(x) for x in fields))


def token_statistics(
    logits: torch.Tensor,
    plan: TreePlan | TokenRows,
    temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
    *,
    compute_sum_pi_squared: bool = False,
    label_ids: torch.Tensor | None = None,
    topk: int = 0,
) -> TokenStatistics:
    """Log-probability of each original token's successor and statistics of its predictive
    distribution, from packed logits: every (row, temperature) pair is normalised once.

    Args:
        logits: ``[T, V_local]`` packed LM-head output (a vocab-parallel shard under TP; rows
            past T, e.g. TP padding, are ignored).
        plan: the micro-batch's :class:`TreePlan`.
        temperature: logits are divided by it first (as verl does): one float, or a tensor
            ``[B]`` per sample (batch order) or ``[N]`` per token. A shared row is normalised
            once per distinct temperature among the samples that hold it.
        compute_entropy: also the entropy of each token's predictive distribution.
        tp_group: the tensor-parallel group holding the vocab shards (None: full vocab here).
        compute_sum_pi_squared: also ``sum_v p(v)^2`` per token.
        label_ids: ``[N, K]`` global vocab ids per token whose log-probabilities to return
            (e.g. a teacher's top-k ids for distillation); differentiable like ``logprobs``.
        topk: also the ids of each token's ``topk`` most probable tokens (0: no).

    Returns:
        :class:`TokenStatistics`; float32 (float64 for float64 logits).
    """
    if logits.dim() != 2 or logits.size(0) < plan.num_tokens:
        raise ValueError(
            f"token_logprobs expects logits [T>={plan.num_tokens}, V], got {tuple(logits.shape)}"
        )
    if logits.size(1) == 0:
        raise ValueError(f"token_logprobs needs a non-empty vocab dimension, got {tuple(logits.shape)}")
    # A label past the vocab would silently read a logit of 0 (the in-shard mask drops it).
    vocab = logits.size(1) * (dist.get_world_size(tp_group) if tp_group is not None else 1)
    if plan.max_token_id >= vocab:  # cached per plan: no sync for a CPU plan
        raise ValueError(
            f"token id {plan.max_token_id} is outside the vocab of the logits (V={vocab}); "
            "pass the full (or TP-sharded) LM-head output"
        )
    if topk > vocab:
        raise ValueError(f"topk={topk} is larger than the vocab of the logits (V={vocab})")
    plan = plan.to(logits.device)
    scored = scored_rows(plan, temperature).to(logits.device)  # pairs built on the plan's host copy
    logits = logits[: plan.num_tokens]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_start = rank * logits.size(1)
    pairs, labels = scored.token_pair, plan.next_token_ids
    label_pairs = pairs
    if label_ids is not None:
        label_ids = _checked_label_ids(label_ids, pairs.numel(), vocab).to(logits.device)
        k = label_ids.size(1)
        labels = torch.cat([labels, label_ids.reshape(-1)])
        label_pairs = torch.cat([pairs, pairs.repeat_interleave(k)])
    lse, ent, sq, label_logit = _RowStats.apply(
        logits, scored, label_pairs, labels, vocab_start, tp_group, compute_entropy, compute_sum_pi_squared
    )
    n = pairs.numel()
    token_lse = lse[pairs]
    logprobs = torch.where(plan.next_token_mask, label_logit[:n] - token_lse, 0.0)
    return TokenStatistics(
        logprobs,
        entropy=ent[pairs] if compute_entropy else None,
        sum_pi_squared=sq[pairs] if compute_sum_pi_squared else None,
        label_logprobs=None if label_ids is None else label_logit[n:].view(n, -1) - token_lse[:, None],
        topk_ids=None if topk <= 0 else _pair_topk(logits, scored, lse.detach(), topk, vocab_start, tp_group)[pairs],
    )


def _checked_label_ids(label_ids: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    if label_ids.dim() != 2 or label_ids.size(0) != n:
        raise ValueError(f"label_ids must be [N={n}, K] per token, got {tuple(label_ids.shape)}")
    if label_ids.numel():
        low, high = (int(x) for x in torch.stack(torch.aminmax(label_ids)).tolist())  # one sync
        if low < 0 or high >= vocab:
            raise ValueError(f"label_ids must be token ids in [0, {vocab}), got ids in [{low}, {high}]")
    return label_ids.long()


def token_logprobs(
    logits: torch.Tensor,
    plan: TreePlan | TokenRows,
    temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each original token's successor, from packed logits
    (:func:`token_statistics` without the other statistics).

    Returns:
        ``logprobs [N]`` (float32, or float64 for float64 logits) with ``logprobs[n] = log p(token n+1 | tokens <= n)`` in its
        sequence (0 at each sequence's last token), and ``entropy [N]`` or None.
    """
    stats = token_statistics(logits, plan, temperature, compute_entropy, tp_group)
    return stats.logprobs, stats.entropy
