"""Prefix-aware micro-batching and DP balancing invariants on real verl 0.8.0 helpers:
every sample exactly once, sharing units kept together, dedup-token budgets respected,
verl's micro-batch count rules, output order restored; trainer group partitions and the
step metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from verl_batches import WORKLOADS, make_batch  # noqa: E402

from ps_mcore.integrations.verl_common.batch import plan_sequences  # noqa: E402
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig  # noqa: E402
from ps_mcore.integrations.verl_common.microbatch import prefix_aware_prepare_micro_batches, restore_order, sharing_units  # noqa: E402
from ps_mcore.integrations.verl_common.trainer import group_partitions, summarize_token_metrics  # noqa: E402


def _stock(**kwargs):
    from verl.workers.engine.utils import prepare_micro_batches

    return prepare_micro_batches(**kwargs)


def _mixed_samples(rng):
    samples = WORKLOADS["grpo"](rng, prompts=4, group=3) + WORKLOADS["stepwise"](rng) + WORKLOADS["tree"](rng)
    return [samples[i] for i in rng.permutation(len(samples))]


def _uids(data):
    return list(data["uid"])


def _check_partition(parts, n):
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n)), "every sample exactly once"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["prompt_only", "arbitrary_prefix"])
def test_dynamic_micro_batches_keep_units_and_respect_budget(seed, mode):
    rng = np.random.default_rng(seed)
    data = make_batch(_mixed_samples(rng), rng, use_dynamic_bsz=True, max_token_len_per_gpu=int(rng.integers(40, 90)))
    config = PrefixGrouperConfig(mode=mode, min_prefix_len=4)
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock)
    n = len(data)
    _check_partition(parts, n)
    budget = int(data["max_token_len_per_gpu"])
    from ps_mcore.integrations.verl_common.batch import group_ids, prompt_lengths, sequences

    seqs, prompts, groups = sequences(data), prompt_lengths(data), group_ids(data)
    units = sharing_units(seqs, config, prompts, groups)
    where = {i: j for j, p in enumerate(parts) for i in p}
    for mb, idx in zip(micro, parts):
        assert _uids(mb) == [groups[i] for i in idx]  # the TensorDict holds those samples
        plan = plan_sequences([seqs[i] for i in idx], config, prompts[idx], [groups[i] for i in idx])
        assert plan.num_tokens <= budget  # the budget counts deduplicated tokens
    split = [u for u in units if len({where[i] for i in u}) > 1]
    for u in split:  # a unit is split only when it alone exceeds the budget
        t = plan_sequences([seqs[i] for i in u], config, prompts[u], [groups[i] for i in u]).num_tokens
        assert t > budget
    stock_micro, _ = _stock(data=data)
    assert len(micro) <= len(stock_micro)  # dedup tokens never need more micro-batches


@pytest.mark.parametrize("use_dynamic_bsz", [True, False])
@pytest.mark.parametrize("mode", ["prompt_only", "arbitrary_prefix"])
def test_carried_plans_are_the_forward_plans(mode, use_dynamic_bsz):
    """Plan once: the plan carried with each micro-batch equals the one the forward would make
    from that micro-batch (plan_batch), row for row."""
    from ps_mcore.integrations.verl_common.batch import plan_batch

    rng = np.random.default_rng(7)
    if use_dynamic_bsz:
        samples, kwargs = _mixed_samples(rng), dict(max_token_len_per_gpu=60)
    else:  # 12 samples in 4 groups, shuffled so the micro-batcher reorders them
        grpo = WORKLOADS["grpo"](rng, prompts=4, group=3)
        samples, kwargs = [grpo[i] for i in rng.permutation(len(grpo))], dict(micro_batch_size_per_gpu=3)
    data = make_batch(samples, rng, use_dynamic_bsz=use_dynamic_bsz, **kwargs)
    config = PrefixGrouperConfig(mode=mode, min_prefix_len=4)
    plans: dict = {}
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, plans=plans)
    assert parts is not None and len(plans) == len(micro)
    for mb in micro:
        carried_batch, carried = plans[id(mb)]
        assert carried_batch is mb
        fresh = plan_batch(mb, config)
        assert carried.num_tokens == fresh.num_tokens and carried.num_input_tokens == fresh.num_input_tokens
        for name in ("input_ids", "position_ids", "unpack_index", "kv_index", "next_token_ids"):
            assert torch.equal(getattr(carried, name), getattr(fresh, name)), name


def test_dedup_budget_fits_more_samples_than_verl():
    rng = np.random.default_rng(0)
    samples = WORKLOADS["grpo"](rng, prompts=2, group=6)
    longest = max(len(p) + len(r) for p, r, _ in samples)
    data = make_batch(samples, rng, use_dynamic_bsz=True, max_token_len_per_gpu=2 * longest + 10)
    config = PrefixGrouperConfig(mode="prompt_only", min_prefix_len=4)
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock)
    stock_micro, _ = _stock(data=data)
    assert len(micro) < len(stock_micro)
    for p in parts:  # each prompt group in one micro-batch
        assert len({_uids(data)[i] for i in p}) == 1


def test_micro_batch_count_rules_follow_verl():
    rng = np.random.default_rng(1)
    data = make_batch(WORKLOADS["grpo"](rng, prompts=3, group=2), rng, use_dynamic_bsz=True, max_token_len_per_gpu=4096)
    config = PrefixGrouperConfig(mode="prompt_only", min_prefix_len=4)
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, num_batches_divided_by=2)
    assert len(micro) == 2
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, min_num_micro_batch=5)
    assert len(micro) == 5  # more micro-batches than groups: groups are split
    _check_partition(parts, len(data))
    with pytest.raises(ValueError, match="only 6 samples"):
        prefix_aware_prepare_micro_batches(data, config, _stock, min_num_micro_batch=7)


def test_fixed_size_reorders_units_and_restores_order():
    rng = np.random.default_rng(2)
    samples = WORKLOADS["grpo"](rng, prompts=3, group=2)
    grouped = make_batch(samples, rng, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    config = PrefixGrouperConfig(mode="prompt_only", min_prefix_len=4)
    micro, parts = prefix_aware_prepare_micro_batches(grouped, config, _stock)
    assert parts is None and len(micro) == 3  # already in unit order: exactly verl's chunks
    order = [0, 2, 4, 1, 3, 5]
    shuffled = make_batch([samples[i] for i in order], rng, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    micro, parts = prefix_aware_prepare_micro_batches(shuffled, config, _stock)
    assert parts == [[0, 3], [1, 4], [2, 5]]
    for mb in micro:
        assert len(set(_uids(mb))) == 1
    values = [torch.nested.as_nested_tensor([torch.full((2,), float(i)) for i in p], layout=torch.jagged) for p in parts]
    from verl.workers.engine.utils import postprocess_batch_func

    out = postprocess_batch_func([{"model_output": {"x": v}} for v in values], parts, shuffled)
    out = restore_order(out, parts, shuffled)
    assert [float(t[0]) for t in out["model_output"]["x"].unbind()] == [0, 1, 2, 3, 4, 5]


def test_sharing_units_modes():
    a = np.arange(1, 11)
    seqs = [a, a.copy(), np.concatenate([a[:5], [99, 98]]), np.array([7, 7, 7])]
    prompts = np.array([5, 5, 5, 2])
    cfg_prompt = PrefixGrouperConfig(mode="prompt_only", min_prefix_len=4)
    assert sharing_units(seqs, cfg_prompt, prompts, ["g", "g", "h", "g"]) == [[0, 1], [2], [3]]
    assert sharing_units(seqs, cfg_prompt, prompts, None) == [[0, 1, 2], [3]]
    cfg_any = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=6)
    assert sharing_units(seqs, cfg_any, None, None) == [[0, 1], [2], [3]]


def test_group_partitions_keep_groups_and_equal_sizes():
    rng = np.random.default_rng(3)
    groups = [f"g{i // 4}" for i in range(16)]  # 4 groups of 4
    work = rng.integers(1, 100, 16).tolist()
    parts = group_partitions(work, groups, 2)
    assert sorted(len(p) for p in parts) == [8, 8]
    _check_partition(parts, 16)
    for p in parts:
        for g in {groups[i] for i in p}:
            assert sum(groups[i] == g for i in p) == 4  # whole group on one rank
    uneven = ["a"] * 5 + ["b"] * 2 + ["c"] * 1  # sizes cannot give equal halves without a split
    with pytest.warns(UserWarning, match="split a prefix-sharing group"):
        parts = group_partitions([1] * 8, uneven, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    _check_partition(parts, 8)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        group_partitions([1] * 7, ["a"] * 7, 2)


def test_step_metrics_summary():
    metrics = {
        "actor/pg_loss": [0.1, 0.2],
        "actor/prefix_sharing/tokens_in": [[100, 50], [80]],
        "actor/prefix_sharing/tokens_packed": [[40, 50], [30]],
        "critic/prefix_sharing/tokens_in": [10],
        "critic/prefix_sharing/tokens_packed": [5],
    }
    out = summarize_token_metrics(metrics)
    assert out["prefix_sharing/dedup_ratio"] == pytest.approx(230 / 120)
    assert out["prefix_sharing/tokens_saved"] == 110
    assert out["critic/prefix_sharing/dedup_ratio"] == 2.0
    assert not any(k.endswith("tokens_in") or k.endswith("tokens_packed") for k in out)
    from verl.trainer.ppo import ray_trainer

    from ps_mcore import setup

    setup.install()
    try:
        reduced = ray_trainer.reduce_metrics({"actor/prefix_sharing/tokens_in": [9, 3], "actor/prefix_sharing/tokens_packed": [3, 3]})
    finally:
        setup.uninstall()
    assert reduced == {"prefix_sharing/dedup_ratio": 2.0, "prefix_sharing/tokens_saved": 6.0}


class _Tags:
    """Stand-in for TransferQueue's KVBatchMeta (keys, tags, reorder), which needs a server."""

    def __init__(self, keys, seq_lens):
        self.keys, self.tags = list(keys), [{"seq_len": s} for s in seq_lens]

    def __len__(self):
        return len(self.keys)

    def reorder(self, idx):
        self.keys, self.tags = [self.keys[i] for i in idx], [self.tags[i] for i in idx]


def _trainer(cls, config_flag, dp):
    from omegaconf import OmegaConf
    from types import SimpleNamespace

    if getattr(cls, "__abstractmethods__", None):  # verl 0.9.1's v1 trainer is an ABC: its hooks are unused here
        cls = type(cls.__name__, (cls,), {})
        cls.__abstractmethods__ = frozenset()
    trainer = object.__new__(cls)
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_prefix_grouper": config_flag}}})
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
    trainer._get_dp_size = lambda wg, role: dp
    trainer._get_required_batch_multiple = lambda dp_size: dp_size
    trainer.tokenizer = SimpleNamespace(eos_token_id=0)
    return trainer


def test_both_trainers_keep_groups_on_one_rank():
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl_helpers import kv_trainer

    from ps_mcore import setup

    rng = np.random.default_rng(4)
    uids = [f"u{i}" for i in rng.permutation(np.repeat(np.arange(6), 2))]  # 6 groups of 2, scattered
    lens = rng.integers(3, 30, len(uids))
    mask = torch.zeros(len(uids), 32, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    setup.install()
    try:
        batch = DataProto.from_dict({"attention_mask": mask}, {"uid": np.array(uids, dtype=object)})
        metrics = {}
        _trainer(ray_trainer.RayPPOTrainer, True, 3)._balance_batch(batch, metrics)
        ranks = np.array_split(np.array(list(batch.non_tensor_batch["uid"])), 3)
        assert all(len(r) == 4 for r in ranks)
        assert sum(len(set(r)) for r in ranks) == 6  # no group on two ranks
        assert "global_seqlen/min" in metrics
        keys = [f"{u}_0_{i}" for i, u in enumerate(uids)]
        meta = _Tags(keys, lens.tolist())
        kv_module, _ = kv_trainer()  # verl's KVBatchMeta trainer (0.8.0 main_ppo_sync, 0.9.1 main_ppo)
        out = _trainer(kv_module.PPOTrainer, True, 3)._balance_batch(meta, {})
        ranks = np.array_split(np.array([k.rsplit("_", 2)[0] for k in out.keys]), 3)
        assert sum(len(set(r)) for r in ranks) == 6
        off = _Tags(keys, lens.tolist())  # flag off: verl's own balancing runs
        _trainer(kv_module.PPOTrainer, False, 3)._balance_batch(off, {})
        assert sorted(off.keys) == sorted(keys)
    finally:
        setup.uninstall()


@pytest.mark.parametrize("cp", [2, 4])
def test_dynamic_budget_counts_dedup_tokens_per_cp_rank(cp):
    """Under context parallelism verl's engine sets ``sp_size = cp``: each micro-batch's
    deduplicated tokens T fit ``cp * max_token_len_per_gpu`` (T / cp rows per CP rank), so the
    micro-batches are fewer than without CP and still keep units whole."""
    from verl.utils import tensordict_utils as tu

    from ps_mcore.integrations.verl_common.batch import group_ids, prompt_lengths, sequences

    rng = np.random.default_rng(cp)
    samples = _mixed_samples(rng)
    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=4)
    counts = {}
    for sp in (1, cp):
        data = make_batch(samples, np.random.default_rng(0), use_dynamic_bsz=True, max_token_len_per_gpu=30)
        tu.assign_non_tensor(data, sp_size=sp)
        micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock)
        _check_partition(parts, len(data))
        seqs, prompts, groups = sequences(data), prompt_lengths(data), group_ids(data)
        for idx in parts:
            plan = plan_sequences([seqs[i] for i in idx], config, prompts[idx], [groups[i] for i in idx])
            assert -(-plan.num_tokens // sp) <= 30  # per CP rank
        counts[sp] = len(parts)
    assert counts[cp] < counts[1]
