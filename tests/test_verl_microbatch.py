"""Prefix-aware micro-batching and DP balancing invariants on real verl 0.8.0 helpers:
every sample exactly once, sharing units kept together, dedup-token budgets respected,
verl's micro-batch count rules, output order restored; trainer group partitions and the
step metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from verl_batches import WORKLOADS, driver_batch, make_batch, unshared_samples  # noqa: E402

from ps_mcore.integrations.verl_common.batch import plan_sequences, sequences  # noqa: E402
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
    # uneven sizes weighed by what each group computes: whole groups a+b (21) and c+d (35),
    # where the raw weights (a: 9, b: 4, c: 5, d: 3) split d across the ranks
    sizes = {"a": 3, "b": 1, "c": 2, "d": 2}
    labels = [g for g, n in sizes.items() for _ in range(n)]
    raw = [1, 3, 5, 4, 4, 1, 1, 2]
    assert all("d" in {labels[i] for i in p} for p in group_partitions(raw, labels, 2))  # d split
    parts = group_partitions(raw, labels, 2, {"a": 1, "b": 20, "c": 16, "d": 19})
    assert sorted(sorted({labels[i] for i in p}) for p in parts) == [["a", "b"], ["c", "d"]]
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


def _trainer(cls, config_flag, dp, grouper=None):
    from omegaconf import OmegaConf
    from types import SimpleNamespace

    if getattr(cls, "__abstractmethods__", None):  # verl 0.9.1's v1 trainer is an ABC: its hooks are unused here
        cls = type(cls.__name__, (cls,), {})
        cls.__abstractmethods__ = frozenset()
    trainer = object.__new__(cls)
    actor = {"use_prefix_grouper": config_flag}
    if grouper is not None:
        actor["prefix_grouper"] = grouper
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"actor": actor}})
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
    prompt = {u: rng.integers(1, 100, 2).tolist() for u in uids}
    samples = [(prompt[u], rng.integers(1, 100, n - 2).tolist(), u) for u, n in zip(uids, lens)]
    setup.install()
    try:
        batch = driver_batch(samples)
        assert isinstance(batch, DataProto)
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


def _computed_workload(seqs) -> int:
    """What a rank computes for one sharing group, in verl's workload units, from first
    principles: the deduplicated rows are the distinct prefixes; a row at position d (1-based)
    costs verl's calculate_workload(d) - calculate_workload(d - 1) = 24576 + 2d - 1."""
    rows = {tuple(s[:d]) for s in seqs for d in range(1, len(s) + 1)}
    return sum(24576 + 2 * len(r) - 1 for r in rows)


def _rank_loads(parts, samples):
    """Per partition (rank), the computed workload of the groups it holds (whole groups)."""
    loads = []
    for p in parts:
        by_group = {}
        for i in p:
            by_group.setdefault(samples[i][2], []).append(list(samples[i][0]) + list(samples[i][1]))
        loads.append(sum(_computed_workload(s) for s in by_group.values()))
    return loads


def _balanced_order(trainer, samples):
    """Run the (patched) trainer's ``_balance_batch``; the partitions as sample indices."""
    batch = driver_batch(samples)
    batch.non_tensor_batch["index"] = np.arange(len(samples))
    trainer._balance_batch(batch, {})
    return batch.non_tensor_batch["index"].tolist()


def _raw_partitions(samples, k):
    """The partitions balancing raw sequences (the groups' summed calculate_workload)."""
    from verl.utils.seqlen_balancing import calculate_workload

    lens = torch.tensor([len(p) + len(r) for p, r, _ in samples])
    return group_partitions(calculate_workload(lens).tolist(), [u for _, _, u in samples], k)


def _grpo_group(rng, uid, prompt_len, response_len, size=4):
    """A group of one prompt and ``size`` responses that differ from their first token."""
    prompt = rng.integers(1, 1000, prompt_len).tolist()
    return [(prompt, [1000 + j] + rng.integers(1, 1000, response_len - 1).tolist(), uid) for j in range(size)]


def test_plan_workload_is_verl_workload_of_computed_rows():
    from verl.utils.seqlen_balancing import calculate_workload

    from ps_mcore.integrations.verl_common.batch import plan_workload
    from ps_mcore.planner import plan_prefix_tree, plan_unshared

    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 50, n).tolist() for n in (1, 7, 30)]
    assert plan_workload(plan_unshared(seqs)) == int(calculate_workload(torch.tensor([1, 7, 30])).sum())
    tree = [list(p) + list(r) for p, r, _ in _mixed_samples(rng)]
    plan = plan_prefix_tree(tree, min_prefix_len=1, min_group_size=1)
    assert plan_workload(plan) == _computed_workload(tree)


def test_dp_balancing_weighs_groups_by_their_trees():
    """Four groups, two ranks. Raw tokens pair the two heavily shared groups (A: 160 tokens,
    B: 480) against the two that share little (C, D: 320 each), a perfect raw split that
    leaves one rank computing ~3x the other; weighed by their trees, each rank gets one of
    each kind."""
    from verl.trainer.ppo import ray_trainer

    from ps_mcore import setup

    rng = np.random.default_rng(1)
    samples = (
        _grpo_group(rng, "A", 36, 4) + _grpo_group(rng, "C", 8, 72) + _grpo_group(rng, "B", 108, 12)
        + _grpo_group(rng, "D", 8, 72)
    )
    groups = {u: [list(p) + list(r) for p, r, g in samples if g == u] for u in "ABCD"}
    w = {u: _computed_workload(s) for u, s in groups.items()}
    raw = _rank_loads(_raw_partitions(samples, 2), samples)
    assert sorted(raw) == sorted([w["A"] + w["B"], w["C"] + w["D"]])
    assert max(raw) / min(raw) > 2.5
    setup.install()
    try:
        order = _balanced_order(_trainer(ray_trainer.RayPPOTrainer, True, 2), samples)
    finally:
        setup.uninstall()
    parts = [order[:8], order[8:]]
    assert sorted(_rank_loads(parts, samples)) == sorted([w["A"] + w["C"], w["B"] + w["D"]])
    assert [len({samples[i][2] for i in p}) for p in parts] == [2, 2]  # whole groups


def test_dp_balancing_without_prompts_weighs_raw_sequences():
    """``prompt_only`` cannot plan a batch without ``prompts``: one warning naming the option,
    and the groups weigh their raw sequences (the partitions raw balancing gives)."""
    from verl.trainer.ppo import ray_trainer

    from ps_mcore import setup

    rng = np.random.default_rng(3)
    samples = [s for g in range(4) for s in _grpo_group(rng, f"u{g}", int(rng.integers(8, 40)), int(rng.integers(2, 30)))]
    batch = driver_batch(samples)
    batch.pop(batch_keys=["prompts"])
    batch.non_tensor_batch["index"] = np.arange(len(samples))
    setup.install()
    try:
        with pytest.warns(UserWarning, match=r"prefix_grouper\.mode=prompt_only needs the batch's 'prompts'"):
            _trainer(ray_trainer.RayPPOTrainer, True, 2)._balance_batch(batch, {})
    finally:
        setup.uninstall()
    raw = _raw_partitions(samples, 2)
    assert batch.non_tensor_batch["index"].tolist() == [i for p in raw for i in p]


@pytest.mark.parametrize("flag, env", [(False, "1"), (True, "0")])
def test_dp_balancing_is_verls_when_sharing_is_off(flag, env, monkeypatch):
    from verl.trainer.ppo import ray_trainer

    from ps_mcore import setup

    rng = np.random.default_rng(2)
    samples = [s for g in range(6) for s in _grpo_group(rng, f"u{g}", int(rng.integers(8, 40)), int(rng.integers(2, 30)))]
    stock = _balanced_order(_trainer(ray_trainer.RayPPOTrainer, flag, 3), samples)
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", env)
    setup.install()
    try:
        patched = _balanced_order(_trainer(ray_trainer.RayPPOTrainer, flag, 3), samples)
    finally:
        setup.uninstall()
    assert patched == stock
    assert stock != list(range(len(samples)))  # verl did reorder


def _branching_group(rng, uid, size=4):
    """A prompt and ``size`` samples branching from one another at random depths (some
    duplicates, some a prefix of another)."""
    prompt = rng.integers(1, 1000, int(rng.integers(8, 80))).tolist()
    out = [rng.integers(1, 1000, int(rng.integers(2, 60))).tolist()]
    for _ in range(size - 1):
        base = out[int(rng.integers(len(out)))]
        cut = int(rng.integers(0, len(base) + 1))
        out.append(base[:cut] + rng.integers(1, 1000, int(rng.integers(0, 40))).tolist())
    return [(prompt, r or [1], uid) for r in out]


def test_dp_balancing_by_trees_is_no_worse_than_raw():
    """Random batches (12 branching groups, 3 ranks): the ranks' computed workloads are never
    further apart (max / min) than raw balancing leaves them, and closer on most batches."""
    from verl.trainer.ppo import ray_trainer

    from ps_mcore import setup
    from ps_mcore.integrations.verl_common.trainer import sharing_group_workloads

    k, grouper = 3, {"mode": "arbitrary_prefix", "min_prefix_len": 1, "min_group_size": 1}
    closer = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        samples = [s for g in range(4 * k) for s in _branching_group(rng, f"g{g}")]
        samples = [samples[i] for i in rng.permutation(len(samples))]
        uids = [u for _, _, u in samples]
        trees = sharing_group_workloads(driver_batch(samples).batch, PrefixGrouperConfig(**grouper), uids)
        for u in set(uids):  # the planner's statistic is the rows it computes
            assert trees[u] == _computed_workload([list(p) + list(r) for p, r, g in samples if g == u])
        setup.install()
        try:
            order = _balanced_order(_trainer(ray_trainer.RayPPOTrainer, True, k, grouper), samples)
        finally:
            setup.uninstall()
        parts = [order[j * len(order) // k : (j + 1) * len(order) // k] for j in range(k)]
        assert all(len({samples[i][2] for i in p}) == 4 for p in parts)  # whole groups
        tree_loads, raw_loads = _rank_loads(parts, samples), _rank_loads(_raw_partitions(samples, k), samples)
        tree_ratio, raw_ratio = max(tree_loads) / min(tree_loads), max(raw_loads) / min(raw_loads)
        assert tree_ratio <= raw_ratio
        closer += tree_ratio < raw_ratio
    assert closer >= 4


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


def _header_bound_batch(header, budget, seed=3):
    """Six GRPO groups of four behind one ``header``-token chat header, and a way to count the
    deduplicated tokens of any of its samples."""
    from ps_mcore.integrations.verl_common.batch import group_ids, prompt_lengths
    from verl_batches import header_bound_groups

    rng = np.random.default_rng(seed)
    data = make_batch(header_bound_groups(rng, header=header), rng, use_dynamic_bsz=True,
                      max_token_len_per_gpu=budget)
    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=4)
    seqs, prompts, groups = sequences(data), prompt_lengths(data), group_ids(data)

    def tokens(idx):
        idx = list(idx)
        return plan_sequences([seqs[i] for i in idx], config, prompts[idx], [groups[i] for i in idx]).num_tokens

    return data, config, groups, tokens


def test_header_bound_unit_splits_between_groups_into_balanced_pieces(fresh_warnings, caplog):
    """One short chat header binds six GRPO groups into one unit larger than the budget: it is
    split between groups (each piece repeats only the header) into pieces of balanced size,
    not a budget-full piece and a small one; the schedule's kept header call would cost more."""
    from ps_mcore.integrations.verl_common.schedule import MiniBatchScheduler

    budget = 720
    data, config, groups, tokens = _header_bound_batch(header=5, budget=budget)
    everyone = range(len(data))
    assert len(sharing_units(sequences(data), config, None, groups)) == 1
    assert budget < tokens(everyone) < 2 * budget

    scheduler = MiniBatchScheduler(config, training=True, kv_row_cost=0.05)
    with caplog.at_level("INFO", logger="ps_mcore"):
        micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, scheduler=scheduler)
    assert scheduler.schedule is None  # the pieces cost less than the schedule
    assert [r.message for r in caplog.records if "run as pieces" in r.message and "(5 rows here)" in r.message]
    assert parts == prefix_aware_prepare_micro_batches(data, config, _stock)[1]
    _check_partition(parts, len(data))
    assert len(parts) == 2
    assert not {groups[i] for i in parts[0]} & {groups[i] for i in parts[1]}  # whole groups
    piece_tokens = [tokens(p) for p in parts]
    assert sum(piece_tokens) == tokens(everyone) + 5  # the header, once more
    largest_group = max(tokens(i for i in everyone if groups[i] == g) for g in set(groups))
    assert max(piece_tokens) <= budget and abs(piece_tokens[0] - piece_tokens[1]) <= largest_group


def test_long_shared_prefix_still_runs_as_a_schedule():
    """The same groups bound by a long prefix: repeating it in every piece costs more than the
    schedule's kept call, so the unit runs as one schedule (every row once)."""
    from ps_mcore.integrations.verl_common.schedule import MiniBatchScheduler

    data, config, groups, tokens = _header_bound_batch(header=200, budget=900)
    scheduler = MiniBatchScheduler(config, training=True, kv_row_cost=0.05)
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, scheduler=scheduler)
    assert scheduler.schedule is not None
    _check_partition(parts, len(data))
    assert scheduler.schedule.plan.computed_tokens == tokens(range(len(data)))


def test_scheduler_walks_the_model_only_for_a_unit_over_the_budget():
    """The refusal and the cost estimates walk the model: an engine step whose units all fit
    the budget calls none of them; one with a unit over it calls each once."""
    from ps_mcore.integrations.verl_common.schedule import scheduler_for

    calls = []

    def counted(name, value):
        return lambda: calls.append(name) or value

    def scheduler(config):
        return scheduler_for(config, True, counted("estimate", 0.05), counted("refusal", None),
                             counted("states", 0.0))

    data, config, _, tokens = _header_bound_batch(header=200, budget=900)
    assert tokens(range(len(data))) > 900
    over = scheduler(config)
    prefix_aware_prepare_micro_batches(data, config, _stock, scheduler=over)
    assert over.schedule is not None and sorted(calls) == ["estimate", "refusal", "states"]

    calls.clear()
    data, config, _, _ = _header_bound_batch(header=200, budget=10**6)
    fits = scheduler(config)
    prefix_aware_prepare_micro_batches(data, config, _stock, scheduler=fits)
    assert fits.schedule is None and calls == []


@pytest.mark.parametrize("seed", range(6))
def test_run_token_estimate_is_the_plan_where_nothing_dissolves(seed):
    """Splits size runs of a unit's sorted members without planning: sum of lengths minus what
    each member shares with the one before. That is the plan's count when every shared run is
    kept (min_prefix_len=1), a lower bound when short runs are dissolved; pieces whose plan
    exceeds the budget are split again by exact counts."""
    from forests import branching_forest, nasty_forests, random_forest

    from ps_mcore.integrations.verl_common.microbatch import _RunTokens, _Units

    rng = np.random.default_rng(seed)
    forests = [random_forest(rng, max_seqs=12), branching_forest(rng)] + list(nasty_forests(seed).values())
    for seqs in forests:
        seqs = [np.asarray(s, dtype=np.int64) for s in seqs if len(s)]
        for min_prefix_len in (1, 4):
            config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=min_prefix_len)
            units = _Units(seqs, config, None, None)
            for members in units.members:
                run = _RunTokens(units, members)
                for a in range(len(members)):
                    for b in range(a + 1, len(members) + 1):
                        exact = units._tokens(members[a:b])
                        assert run.tokens(a, b) == exact if min_prefix_len == 1 else run.tokens(a, b) <= exact
            budget = max(int(s.size) for s in seqs) + int(rng.integers(0, 20))
            units.split_larger_than(budget)
            assert max(units.tokens) <= budget
            assert units.tokens == [units._tokens(m) for m in units.members]
            assert sorted(i for m in units.members for i in m) == list(range(len(seqs)))


def test_pieces_the_planner_shares_less_in_are_split_again():
    """A 4-token header binds six pairs whose own shared runs (2 tokens) are shorter than
    min_prefix_len=4: the planner duplicates them, so a piece sized by the estimate can hold
    more tokens than the budget; it is split again by exact counts."""
    from ps_mcore.integrations.verl_common.microbatch import _RunTokens, _Units

    rng = np.random.default_rng(0)
    header = [1, 2, 3, 4]
    seqs = []
    for p in range(6):
        pair = [10 + p, 20 + p]
        seqs += [np.asarray(header + pair + rng.integers(30, 99, 8).tolist()) for _ in range(2)]
    config = PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=4)
    units = _Units(seqs, config, None, None)
    assert len(units.members) == 1
    members = units.members[0]
    run = _RunTokens(units, members)
    budget = 40
    estimated = run.fill(run.subtrees(0, len(members), budget), budget)
    assert any(units._tokens(members[a:b]) > budget for a, b in estimated)  # the estimate alone would overflow
    units.split_larger_than(budget)
    assert max(units.tokens) <= budget and units.tokens == [units._tokens(m) for m in units.members]


def test_a_deeply_nested_unit_splits():
    """A comb: 1200 samples, sample k the first k tokens of one spine and a token of its own
    (agent steps that each branch off the trajectory), so every subtree nests in the next, deeper
    than Python's recursion limit; about two budgets: every piece fits."""
    from ps_mcore.integrations.verl_common.microbatch import _Units

    spine = np.arange(1, 1201, dtype=np.int64)
    seqs = [np.append(spine[:k], 5000 + k) for k in range(1, 1201)]
    units = _Units(seqs, PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=1), None, None)
    assert len(units.members) == 1 and units.tokens[0] > 1.9 * 1210
    units.split_larger_than(1210)
    assert len(units.members) >= 2 and max(units.tokens) <= 1210
    assert sorted(i for m in units.members for i in m) == list(range(1200))


@pytest.mark.parametrize("use_dynamic_bsz", [True, False])
@pytest.mark.parametrize("mode", ["prompt_only", "arbitrary_prefix"])
def test_a_batch_sharing_nothing_gets_verls_micro_batches(mode, use_dynamic_bsz):
    """Nothing to share: verl's own micro-batches (same samples, same order), each listed in
    ``unshared`` with its input tokens; a batch that shares lists none."""
    rng = np.random.default_rng(3)
    options = dict(max_token_len_per_gpu=30) if use_dynamic_bsz else dict(micro_batch_size_per_gpu=2)
    data = make_batch(unshared_samples(rng, 100, count=6), rng, use_dynamic_bsz=use_dynamic_bsz, **options)
    config = PrefixGrouperConfig(mode=mode, min_prefix_len=1)
    unshared = {}
    micro, parts = prefix_aware_prepare_micro_batches(data, config, _stock, plans={}, unshared=unshared)
    stock_micro, stock_parts = _stock(data=data)
    assert parts == stock_parts and len(micro) == len(stock_micro) > 1
    lengths = [len(s) for s in sequences(data)]
    chunks = parts if parts is not None else np.array_split(np.arange(len(lengths)), len(micro))
    for batch, stock_batch, chunk in zip(micro, stock_micro, chunks):
        assert _uids(batch) == _uids(stock_batch)
        assert unshared[id(batch)] == (batch, sum(lengths[i] for i in chunk))
    sharing = make_batch(WORKLOADS["grpo"](rng, prompts=2, group=3), rng, use_dynamic_bsz=use_dynamic_bsz, **options)
    unshared = {}
    prefix_aware_prepare_micro_batches(sharing, config, _stock, unshared=unshared)
    assert unshared == {}
