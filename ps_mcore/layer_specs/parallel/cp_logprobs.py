"""Per-token log-probs under context parallelism: each rank normalises only its own rows.

:func:`ps_mcore.token_logprobs` reads a small protocol (:class:`ps_mcore.logprobs.TokenRows`);
:class:`~ps_mcore.logprobs.LocalTokenRows` is that protocol over one CP rank's rows, so no
stand-in plan is built.
"""

from __future__ import annotations

import torch

from ps_mcore.layer_specs.parallel.cp_collectives import SumDisjoint, check_cp_group, cp_group_or_default
from ps_mcore.layer_specs.parallel.cp_layout import CPLayout
from ps_mcore.logprobs import LocalTokenRows, TokenStatistics, token_statistics, token_temperatures
from ps_mcore.planner import TreePlan


def local_token_rows(plan: TreePlan, layout: CPLayout) -> LocalTokenRows:
    """Original token ``layout.token_index[i]`` reads local row ``layout.token_rows[i]``."""
    return LocalTokenRows.select(plan, layout.token_index, layout.token_rows, layout.num_local_rows)


def cp_token_statistics(
    logits: torch.Tensor,
    packed_seq_params,
    temperature: float | torch.Tensor = 1.0,
    compute_entropy: bool = False,
    tp_group=None,
    cp_group=None,
    **statistics,
) -> TokenStatistics:
    """:func:`ps_mcore.logprobs.token_statistics` from this CP rank's logits.

    Args:
        logits: ``[t, V_local]`` this rank's LM-head rows (a vocab shard under TP).
        packed_seq_params: the batch's ``TreePackedSeqParams`` (built with ``cp_size``).
        temperature: one float, or ``[B]`` per sample / ``[N]`` per token of the whole plan.
        tp_group: the vocab-parallel group; cp_group: the CP group (default: Megatron's).
        statistics: ``compute_sum_pi_squared``, ``label_ids`` (``[N, K]`` of the whole plan),
            ``topk``, as :func:`~ps_mcore.logprobs.token_statistics` takes them.

    Returns:
        every statistic per original token (``[N]`` / ``[N, K]``) on every CP rank: each rank
        normalises only its own rows (no ``[T_pad, V]`` gather), then the per-token results
        are combined. Backward: every CP rank must compute the same loss from them.
    """
    plan, layout = packed_seq_params.plan, packed_seq_params.cp_layout
    if layout is None:
        return token_statistics(logits, plan, temperature, compute_entropy, tp_group, **statistics)
    group = cp_group_or_default(cp_group)
    check_cp_group(layout, group)
    if logits.dim() != 2 or logits.size(0) != layout.num_local_rows:
        raise ValueError(
            f"cp_token_logprobs expects logits [{layout.num_local_rows}, V] (this CP rank's "
            f"rows), got {tuple(logits.shape)}"
        )
    if isinstance(temperature, torch.Tensor):  # this rank's tokens' temperatures
        temperature = token_temperatures(plan, temperature)[layout.token_index.cpu()]
    if statistics.get("label_ids") is not None:  # this rank's tokens' ids
        ids = statistics["label_ids"]
        statistics["label_ids"] = ids.index_select(0, layout.token_index.to(ids.device))
    stats = token_statistics(logits, local_token_rows(plan, layout), temperature, compute_entropy, tp_group, **statistics)

    def combine(x: torch.Tensor) -> torch.Tensor:
        full = x.new_zeros((plan.num_input_tokens,) + tuple(x.shape[1:])).index_copy(0, layout.token_index, x)
        return SumDisjoint.apply(full, group)

    return stats.map(combine)


def cp_token_logprobs(
    logits: torch.Tensor, packed_seq_params, temperature: float | torch.Tensor = 1.0, compute_entropy: bool = False,
    **groups,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`ps_mcore.token_logprobs` from this CP rank's logits (:func:`cp_token_statistics`
    without the other statistics; ``groups``: its ``tp_group`` / ``cp_group``): ``logprobs [N]``
    and ``entropy [N]`` or None."""
    stats = cp_token_statistics(logits, packed_seq_params, temperature, compute_entropy, **groups)
    return stats.logprobs, stats.entropy
