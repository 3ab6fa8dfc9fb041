"""Driver-side glue: DP balancing that keeps sharing groups on one rank, and the
``prefix_sharing/*`` step metrics.

verl's trainers reorder the batch so every DP rank gets similar work (``_balance_batch``) and
then cut it into equal slices. The ``DataProto`` trainer (``RayPPOTrainer``: 0.8.0's
``main_ppo``, 0.9.1's ``main_ppo_v0``) keeps ``uid`` groups together under
``use_prefix_grouper`` only when their count divides the DP size (0.8.0: only when contiguous;
0.9.1 raises otherwise); the ``KVBatchMeta`` trainer (0.8.0's ``main_ppo_sync``, 0.9.1's
``main_ppo``: ``verl.trainer.ppo.v1``) never does. The patched ``_balance_batch`` (when
``actor.use_prefix_grouper`` is on and ``ENABLE_PREFIX_SHARING`` is not 0) partitions whole
groups with verl's Karmarkar-Karp balancing when that is possible, otherwise greedily
(largest first), splitting a group only when equal slices leave no other choice.

Each group weighs what its rank will compute: in the ``DataProto`` trainer, verl's workload
(``calculate_workload``'s units) of the group's deduplicated tree, planned under the actor's
``prefix_grouper`` config (:func:`sharing_group_workloads`), so a rank given heavily shared
groups is not left idle beside one given groups that share little. The ``KVBatchMeta``
trainer's driver holds only each sample's length (the tokens stay in TransferQueue), so there
groups weigh their raw sequences' workload, as in verl.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable

from ps_mcore.integrations.env import prefix_sharing_enabled
from ps_mcore.integrations.patching import warn_once
from ps_mcore.integrations.verl_common.batch import plan_sequences, plan_workload, prompt_lengths, sequences
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, setting_from_keys

TOKENS_IN = "prefix_sharing/tokens_in"
TOKENS_PACKED = "prefix_sharing/tokens_packed"
DEDUP_RATIO = "prefix_sharing/dedup_ratio"
TOKENS_SAVED = "prefix_sharing/tokens_saved"


# ----------------------------------------------------------------------------- balancing


def group_members(groups: list[Any]) -> dict[Any, list[int]]:
    """Each label's sample indices (batch order), labels in order of first appearance."""
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def group_partitions(
    workloads: list[int], groups: list[Any], k: int, group_workloads: Mapping[Any, int] | None = None
) -> list[list[int]]:
    """``k`` partitions of equal size (``len(workloads) / k`` samples) with balanced
    workload; samples with the same label stay in one partition whenever possible, and
    each group's samples are contiguous (in batch order) inside its partition.

    A group weighs the sum of its samples' ``workloads``. With ``group_workloads`` (by label:
    what a rank computes for the whole group) it weighs that instead, each sample carrying a
    share in proportion to its ``workloads`` (what a split group leaves on each rank); of the
    partitions balanced by these and by ``workloads``, the one whose ranks' computed
    workloads are closer (max / min) is kept, so it is never less balanced than raw
    balancing."""
    b = len(workloads)
    if b % k:
        raise ValueError(f"batch of {b} samples cannot be split evenly over {k} DP ranks")
    members = group_members(groups)
    group_list = list(members.values())
    raw_work = [sum(workloads[i] for i in m) for m in group_list]
    if group_workloads is None:
        return _group_bins(group_list, raw_work, workloads, k)
    tree_work = [group_workloads[g] for g in members]
    share = [0.0] * b
    for m, raw, tree in zip(group_list, raw_work, tree_work):
        for i in m:
            share[i] = tree * (workloads[i] / raw if raw else 1 / len(m))
    candidates = [_group_bins(group_list, tree_work, share, k), _group_bins(group_list, raw_work, workloads, k)]
    return min(candidates, key=lambda parts: _imbalance([sum(share[i] for i in p) for p in parts]))


def _imbalance(loads: list[float]) -> float:
    return max(loads) / min(loads) if min(loads) > 0 else (0.0 if max(loads) == 0 else float("inf"))


def _group_bins(group_list: list[list[int]], group_work: list, sample_work: list, k: int) -> list[list[int]]:
    """:func:`group_partitions` of groups weighing ``group_work`` (a piece of a split group:
    its samples' ``sample_work``)."""
    cap = sum(len(m) for m in group_list) // k
    sizes = {len(m) for m in group_list}
    if len(sizes) == 1 and len(group_list) % k == 0:
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

        parts = get_seqlen_balanced_partitions(group_work, k_partitions=k, equal_size=True)
        return [[i for g in p for i in group_list[g]] for p in parts]
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for g in sorted(range(len(group_list)), key=lambda g: -group_work[g]):
        m = group_list[g]
        fits = [j for j in range(k) if cap - len(bins[j]) >= len(m)]
        if fits:
            j = min(fits, key=lambda j: (load[j], j))
            bins[j].extend(m)
            load[j] += group_work[g]
            continue
        warn_once(
            "split-group",
            "DP balancing had to split a prefix-sharing group across ranks (group sizes do "
            "not add up to equal slices); those samples are shared per rank only",
        )
        rest = list(m)
        while rest:
            j = max(range(k), key=lambda j: (cap - len(bins[j]), -load[j]))
            take, rest = rest[: cap - len(bins[j])], rest[cap - len(bins[j]) :]
            bins[j].extend(take)
            load[j] += sum(sample_work[i] for i in take)
    return bins


def sharing_group_workloads(data, config: PrefixGrouperConfig, groups: list[Any]) -> dict[Any, int]:
    """Per group label, verl's workload of the deduplicated tree its samples make, planned
    alone under ``config`` (:func:`~ps_mcore.integrations.verl_common.batch.plan_workload`;
    each group planned once, on the host).

    Args:
        data: the driver batch's tensors (``DataProto.batch``): padded ``input_ids`` and
            ``attention_mask`` ``[B, S]``, ``prompts`` ``[B, P]`` (needed by ``prompt_only``).
        groups: ``[B]`` labels (``uid``).
    """
    seqs, prompts = sequences(data), prompt_lengths(data)
    return {
        g: plan_workload(
            plan_sequences(
                [seqs[i] for i in m], config, None if prompts is None else prompts[m], [groups[i] for i in m]
            )
        )
        for g, m in group_members(groups).items()
    }


def tree_balancing_refusal(data, config: PrefixGrouperConfig) -> str | None:
    """Why the driver batch's groups cannot be weighed by their trees (None: they can)."""
    if config.mode == "prompt_only" and "prompts" not in data.keys():
        return (
            "actor_rollout_ref.actor.prefix_grouper.mode=prompt_only needs the batch's 'prompts' "
            "to plan each group"
        )
    return None


def actor_grouper_config(config) -> PrefixGrouperConfig:
    """The actor's ``prefix_grouper`` config (defaults where unset) from the trainer config."""
    return setting_from_keys(dict(config.actor_rollout_ref.actor)).config or PrefixGrouperConfig()


def _grouping_on(config) -> bool:
    return bool(config.actor_rollout_ref.actor.get("use_prefix_grouper", False)) and prefix_sharing_enabled()


def ray_trainer_balance_batch(original: Callable) -> Callable:
    """``RayPPOTrainer._balance_batch`` (``main_ppo``) keeping ``uid`` groups on one rank,
    each weighed by its deduplicated tree (:func:`sharing_group_workloads`)."""

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not _grouping_on(self.config) or "uid" not in batch.non_tensor_batch:
            return original(self, batch, metrics, logging_prefix, keep_minibatch)
        import torch
        from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

        mask = batch.batch["attention_mask"]
        seqlens = mask.view(mask.shape[0], -1).sum(-1)
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        uids = list(batch.non_tensor_batch["uid"])
        config = actor_grouper_config(self.config)
        refusal = tree_balancing_refusal(batch.batch, config)
        if refusal is None:
            trees = sharing_group_workloads(batch.batch, config, uids)
        else:
            trees = None
            warn_once("tree-balancing", f"DP balancing weighs raw sequences, not their trees: {refusal}")
        parts = group_partitions(calculate_workload(seqlens).tolist(), uids, dp_size, trees)
        batch.reorder(torch.tensor([i for p in parts for i in p]))
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix=logging_prefix))

    return _balance_batch


def sync_trainer_balance_batch(original: Callable) -> Callable:
    """``PPOTrainer._balance_batch`` of the ``KVBatchMeta`` trainer (0.8.0's ``main_ppo_sync``,
    0.9.1's ``verl.trainer.ppo.v1.trainer_base``) keeping prompt groups on one rank (keys are
    ``{uid}_{session_id}_{index}``: the group is the ``uid``). verl's helpers are read from the
    module that defines the patched method."""

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not _grouping_on(self.config):
            return original(self, batch, metrics, logging_prefix, keep_minibatch)
        import torch

        m = sys.modules[original.__module__]
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        dp_size = max(worker_group._dispatch_info["actor"]) + 1
        multiple = self._get_required_batch_multiple(dp_size)
        batch = m.upsample_batch_to_divisible_size(batch, multiple, self.tokenizer.eos_token_id)
        seqlens = torch.tensor([tag["seq_len"] for tag in batch.tags], dtype=torch.int64)
        groups = [str(key).rsplit("_", 2)[0] for key in batch.keys]
        parts = group_partitions(m.calculate_workload(seqlens).tolist(), groups, dp_size)
        batch.reorder([i for p in parts for i in p])
        metrics.update(m.log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=parts, prefix=logging_prefix))
        return batch

    return _balance_batch


# ----------------------------------------------------------------------------- metrics


def _total(value: Any) -> float:
    if isinstance(value, (list, tuple)):
        return float(sum(_total(v) for v in value))
    values = getattr(value, "values", None)  # verl Metric
    if isinstance(values, list):
        return _total(values)
    return float(value)


def summarize_token_metrics(metrics: dict) -> dict:
    """Replace the raw per-micro-batch counts (``<role/>prefix_sharing/tokens_in`` and
    ``tokens_packed``) by ``prefix_sharing/dedup_ratio`` (N/T over the step) and
    ``prefix_sharing/tokens_saved`` (N - T); the actor's land without the ``actor/`` prefix."""
    for key in [k for k in metrics if k.endswith(TOKENS_IN)]:
        base = key[: -len(TOKENS_IN)]
        n = _total(metrics.pop(key))
        t = _total(metrics.pop(base + TOKENS_PACKED, n))
        prefix = "" if base == "actor/" else base
        metrics[prefix + DEDUP_RATIO] = n / t if t else 1.0
        metrics[prefix + TOKENS_SAVED] = n - t
    return metrics


def reduce_metrics_with_prefix_sharing(original: Callable) -> Callable:
    def reduce_metrics(metrics):
        return original(summarize_token_metrics(metrics))

    return reduce_metrics


# ----------------------------------------------------------------------------- ref / critic


def follow_actor_setting(config) -> None:
    """Write into the ref policy's and the critic's sections what they inherit from the actor
    (:meth:`PrefixSharingSetting.following`), so worker processes that never see the actor's
    config build the same setting."""
    from omegaconf import OmegaConf, open_dict

    actor = setting_from_keys(dict(config.actor_rollout_ref.actor))
    targets = [config.actor_rollout_ref.get("ref")]
    if config.get("critic") is not None:
        targets.append(config.critic)
    for node in targets:
        if node is None:
            continue
        setting = setting_from_keys(dict(node)).following(actor)
        with open_dict(node):
            if setting.enabled is not None:
                node.use_prefix_grouper = setting.enabled
            if setting.config is not None:
                node.prefix_grouper = OmegaConf.create(dict(setting.config))


def init_workers_following_actor(original: Callable) -> Callable:
    """Trainer ``init_workers`` that first lets ref and critic follow the actor's setting."""

    def init_workers(self, *args, **kwargs):
        follow_actor_setting(self.config)
        return original(self, *args, **kwargs)

    return init_workers


# ----------------------------------------------------------------------------- install


def install_trainer_patches(patcher, module, trainer: type, balance: Callable, setup_method: str) -> None:
    """The driver-side patches of one verl trainer class: ``_balance_batch`` (``balance``:
    :func:`ray_trainer_balance_batch` or :func:`sync_trainer_balance_batch`), the method that
    makes its workers (``init_workers`` / ``init``: ref and critic follow the actor first) and
    its module's ``reduce_metrics`` (the ``prefix_sharing/*`` step metrics)."""
    patcher.wrap(trainer, "_balance_batch", balance)
    patcher.wrap(trainer, setup_method, init_workers_following_actor)
    patcher.wrap(module, "reduce_metrics", reduce_metrics_with_prefix_sharing)
