"""Tree-aware MoE routing: router statistics weighted by row multiplicity.

Everything an MoE layer computes per token (gating logits, top-k, expert MLPs, shared experts,
the combine) is exact on a prefix tree: a shared row has the hidden state every sample sharing
it would have. What is not per token are the router's statistics over the micro-batch's tokens:
the load-balancing losses (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``), the z-loss,
the expert-bias token counts (``moe_router_enable_expert_bias``) and the logged loss values.
On a tree they would see each shared row once. :class:`TreeTopKRouter` computes each of them
as megatron-core 0.16 does, with every packed row weighted by its multiplicity (the number of
samples sharing it; padding rows weigh 0), which is the statistic over the N tokens of the
unshared THD batch. Gradients follow: a row's loss term carries its weight, as the unshared
batch's copies of that token would each carry one.

``seq_aux_loss`` in THD: megatron reshapes the router input ``[s, b, h]`` by the batch
dimension, and a THD micro-batch is ``b = 1`` (all sequences packed into one), so on the
unshared THD batch megatron's seq-aux loss is the load-balancing loss of the whole micro-batch
with the seq-aux coefficient. The tree matches that reference (a per-sample seq-aux loss is
not what megatron computes for packed batches).

Refused on tree batches (clear error at the first tree forward; :func:`moe_refusal`
lets integrations fall back to the stock path per micro-batch instead): token dropping
(``moe_expert_capacity_factor``: capacity depends on the token count and drop order on token
order), sinkhorn routing (normalises over tokens), input jitter and forced load balancing
(random per token: a shared row would draw once), router replay (records per-token routes of
the unshared layout), and selective recompute of ``moe``/``mlp`` (the router would read the
tree batch at backward time; full recompute is fine).

The router reads the batch from :mod:`ps_mcore.layer_specs.modules.tree_context`, recorded by the tree
self attention of the same layer.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    save_to_aux_losses_tracker,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter

from ps_mcore.layer_specs.modules.tree_context import current_tree_batch


def moe_refusal(config) -> str | None:
    """Why tree batches cannot be exact for this config's MoE layers, or None when they can.

    For integrations: a non-None answer means "run this micro-batch unshared (stock THD)".
    """
    if not getattr(config, "num_moe_experts", None):
        return None
    checks = (
        (config.moe_expert_capacity_factor is not None,
         f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping: the "
         "capacity depends on the token count and what is dropped on the token order)"),
        (getattr(config, "moe_pad_expert_input_to_capacity", False),
         "moe_pad_expert_input_to_capacity=True (capacity padding depends on the token count)"),
        (config.moe_router_load_balancing_type == "sinkhorn"
         or (isinstance(config.moe_router_load_balancing_type, list)
             and "sinkhorn" in config.moe_router_load_balancing_type),
         "moe_router_load_balancing_type='sinkhorn' (sinkhorn normalises over the tokens)"),
        (config.moe_input_jitter_eps is not None,
         f"moe_input_jitter_eps={config.moe_input_jitter_eps} (random per token: a shared row "
         "would draw once for all its samples)"),
        (getattr(config, "moe_router_force_load_balancing", False),
         "moe_router_force_load_balancing=True (random logits per token)"),
        (getattr(config, "moe_enable_routing_replay", False),
         "moe_enable_routing_replay=True (replays per-token routes of the unshared layout)"),
        (config.recompute_granularity == "selective"
         and bool({"moe", "mlp"} & set(config.recompute_modules or ())),
         f"recompute_modules={config.recompute_modules} with 'moe'/'mlp' (the recomputed router "
         "would not know the tree batch; use full recompute or recompute other modules)"),
    )
    for failed, what in checks:
        if failed:
            return what
    return None


def _group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group`` (no communication for a group of one)."""
    if group is None or group.size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x.clone(), group)


def _group_size(group) -> int:
    return 1 if group is None else group.size()


_ATTACH_TAKES_NEEDS_DP_AVG = "needs_dp_avg" in inspect.signature(TopKRouter.attach_and_log_load_balancing_loss).parameters


class TreeTopKRouter(TopKRouter):
    """``TopKRouter`` whose token statistics count each packed row once per sample sharing it.

    Parameters, buffers and ``state_dict`` keys are the parent's; non-tree batches (and
    evaluation without grad, where no statistic is taken) go to the parent unchanged.
    """

    def _tree_weight(self, rows: int) -> torch.Tensor | None:
        """``[rows]`` multiplicity of the rows this router sees (integer; float32 where a
        statistic reads it), or None (no tree)."""
        psp = current_tree_batch()
        if psp is None or getattr(psp, "multiplicity", None) is None:
            return None
        reason = moe_refusal(self.config)
        if reason is not None:
            raise NotImplementedError(
                f"MoE on a prefix-tree batch cannot be exact with {reason}; run this micro-batch "
                "unshared (the stock THD path) or change the option"
            )
        weight = psp.local_multiplicity()
        if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            chunk = weight.numel() // self.tp_group.size()
            rank = torch.distributed.get_rank(self.tp_group)
            weight = weight[rank * chunk:(rank + 1) * chunk]
        if weight.numel() != rows:
            raise ValueError(
                f"the MoE router got {rows} rows but the tree batch of this layer has "
                f"{weight.numel()} (the multiplicity of TreePackedSeqParams is sharded like "
                "the rows: CP, then SP)"
            )
        return weight

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Same contract as ``TopKRouter.routing``: logits ``[s, b, E]`` ->
        (probs ``[s*b, E]``, routing_map ``[s*b, E]``)."""
        seq_length, bsz = logits.shape[:2]
        weight = self._tree_weight(seq_length * bsz)
        if weight is None:
            return super().routing(logits, padding_mask)
        if bsz != 1:
            raise ValueError(f"a tree batch is THD (batch dimension 1), the router got b={bsz}")
        logits = logits.view(-1, self.config.num_moe_experts)
        statistics = self._takes_token_statistics()
        if statistics:  # else the routing is per token: no launch reads the multiplicity
            weight = weight.to(logits.device, torch.float32)
            if padding_mask is not None:  # megatron's router convention: True = padding
                weight = weight * (~padding_mask.reshape(-1)).to(weight.dtype)

            # The unshared batch's token count as stock sees it on this rank: its local rows are
            # an equal share of the TP*CP group's tokens (SP/CP split them evenly; without SP every
            # TP rank holds them all). The tree's rows are split unevenly, so derive it from the sum.
            group_tokens = _group_sum(weight.sum(), self.tp_cp_group)
            stock_local_tokens = group_tokens / _group_size(self.tp_cp_group)
            logits = self._tree_z_loss(logits, weight, group_tokens, stock_local_tokens)
        probs, routing_map = topk_routing_with_score_function(
            logits,
            self.topk,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups,
            group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
            fused=self.config.moe_router_fusion,
            router_replay=self.router_replay,
        )
        if statistics and self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map_aux, scores_aux = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=self.config.moe_router_fusion
            )
            # This rank's weighted statistics, shared by the three loss kinds (only the group
            # they are summed over differs).
            weighted_scores = scores_aux * weight[:, None].to(scores_aux.dtype)
            local_counts = (routing_map_aux.float() * weight[:, None]).sum(0)
            for kind, name, group in (
                ("aux_loss", "load_balancing_loss", self.tp_cp_group),
                ("seq_aux_loss", "seq_load_balancing_loss", self.tp_cp_group),
                ("global_aux_loss", "global_load_balancing_loss", self.tp_dp_cp_group),
            ):
                probs = self._tree_balancing_loss(
                    probs, weighted_scores, local_counts, kind, name, group, stock_local_tokens
                )
        if statistics and self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += (routing_map.float() * weight[:, None]).sum(0)
        return probs, routing_map

    def _takes_token_statistics(self) -> bool:
        """Whether this forward takes a statistic over the tokens (the z-loss, a load-balancing
        loss, the expert-bias counts): the conditions of :meth:`_tree_z_loss` and of the aux-loss
        and expert-bias steps of :meth:`routing`."""
        grad = torch.is_grad_enabled()
        losses = self.training and grad and (self.config.moe_z_loss_coeff is not None or self.is_aux_loss_enabled())
        return losses or (self.enable_expert_bias and grad)

    def _tree_balancing_loss(self, probs, weighted_scores, local_counts, kind, name, group, local_tokens):
        """One load-balancing loss as ``TopKRouter._apply_{aux,seq_aux,global_aux}_loss``
        computes it on the unshared batch (b = 1), attached to ``probs``: ``weighted_scores``
        ``[rows, E]`` and ``local_counts`` ``[E]`` are this rank's multiplicity-weighted router
        scores and tokens per expert. Stock's token total is its local row count times the
        group size (every rank assumed to hold as many)."""
        coeff = self.get_aux_loss_coeff(kind)
        if coeff == 0:
            return probs
        tokens_per_expert = _group_sum(local_counts, group)
        total_tokens = local_tokens * _group_size(group)
        if kind == "global_aux_loss":
            self.global_tokens_per_expert += tokens_per_expert
            self.ga_steps += 1
            tokens_per_expert = self.global_tokens_per_expert / self.ga_steps
        # Unfused on purpose: TE's fused aux loss takes no per-row weight (the weighted sum
        # below is the same formula).
        loss = switch_load_balancing_loss_func(
            probs=weighted_scores,
            tokens_per_expert=tokens_per_expert,
            total_num_tokens=total_tokens,
            topk=self.topk,
            num_experts=self.config.num_moe_experts,
            moe_aux_loss_coeff=coeff,
            fused=False,
        )
        # The global loss's group already holds DP: 0.16 says so with reduce_group_has_dp=True,
        # 0.19 with needs_dp_avg=False.
        global_kwarg = (
            {"needs_dp_avg": kind != "global_aux_loss"} if _ATTACH_TAKES_NEEDS_DP_AVG
            else {"reduce_group_has_dp": kind == "global_aux_loss"}
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, loss, name, group, valid_token_count=local_tokens, **global_kwarg
        )

    def _tree_z_loss(self, logits, weight, group_tokens, local_tokens) -> torch.Tensor:
        """``TopKRouter.apply_z_loss`` over the unshared tokens: the weighted mean of
        ``logsumexp(logits)^2``. Stock takes each rank's mean over its rows divided by the
        TP*CP size; the weighted sum over this rank's rows divided by the group's total
        weight has the same sum over the group (and the same value when rows are
        replicated over TP)."""
        if self.config.moe_z_loss_coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        lse_sq = torch.square(torch.logsumexp(logits, dim=-1))
        coeff = self.config.moe_z_loss_coeff / _group_size(self.tp_cp_group)  # what stock logs against
        z_loss = (lse_sq * weight.to(lse_sq.dtype)).sum() / group_tokens.clamp(min=1.0) * self.config.moe_z_loss_coeff
        scale = local_tokens if self.calculate_per_token_loss else 1.0
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss * scale)
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number, num_layers)
        return logits
