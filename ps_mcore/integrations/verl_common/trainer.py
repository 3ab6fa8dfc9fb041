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
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ps_mcore.integrations.env import prefix_sharing_enabled
from ps_mcore.integrations.patching import warn_once
from ps_mcore.integrations.verl_common.config import setting_from_keys

TOKENS_IN = "prefix_sharing/tokens_in"
TOKENS_PACKED = "prefix_sharing/tokens_packed"
DEDUP_RATIO = "prefix_sharing/dedup_ratio"
TOKENS_SAVED = "prefix_sharing/tokens_saved"


# ----------------------------------------------------------------------------- balancing


def group_partitions(workloads: list[int], groups: list[Any], k: int) -> list[list[int]]:
    """``k`` partitions of equal size (``len(workloads) / k`` samples) with balanced
    workload; samples with the same label stay in one partition whenever possible, and
    each group's samples are contiguous (in batch order) inside its partition."""
    b = len(workloads)
    if b % k:
        raise ValueError(f"batch of {b} samples cannot be split evenly over {k} DP ranks")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    group_list = list(members.values())
    group_work = [sum(workloads[i] for i in m) for m in group_list]
    sizes = {len(m) for m in group_list}
    if len(sizes) == 1 and len(group_list) % k == 0:
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

        parts = get_seqlen_balanced_partitions(group_work, k_partitions=k, equal_size=True)
        return [[i for g in p for i in group_list[g]] for p in parts]
    cap = b // k
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
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
            load[j] += sum(workloads[i] for i in take)
    return bins


def _grouping_on(config) -> bool:
    return bool(config.actor_rollout_ref.actor.get("use_prefix_grouper", False)) and prefix_sharing_enabled()


def ray_trainer_balance_batch(original: Callable) -> Callable:
    """``RayPPOTrainer._balance_batch`` (``main_ppo``) keeping ``uid`` groups on one rank."""

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not _grouping_on(self.config) or "uid" not in batch.non_tensor_batch:
            return original(self, batch, metrics, logging_prefix, keep_minibatch)
        import torch
        from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

        mask = batch.batch["attention_mask"]
        seqlens = mask.view(mask.shape[0], -1).sum(-1)
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        parts = group_partitions(
            calculate_workload(seqlens).tolist(), list(batch.non_tensor_batch["uid"]), dp_size
        )
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
