"""verl's Megatron engine (the installed release: 0.8.0 or 0.9.1) with sharing units larger
than the token budget: the cross-micro-batch schedule (every shared prefix computed once per
mini-batch) against verl's stock path on the unshared batch, on a real tiny megatron-core GPTModel (CPU, fp32), through
megatron-core's real no-pipelining schedule (test-only shim: its token counter on the CPU).

Checked: update_actor's PPO loss and every gradient (gradient accumulation over the steps,
the last releases before ``finalize_model_grads_func``), the log-prob pass (forward only),
the critic's values, the token metrics (each row once), the ``cross_microbatch: false``
split path and a refusal that falls back to it with one warning.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

from megatron_shims import build_gpt, enable_cpu_pipeline, init_cpu_megatron, layer_spec_args, randomize_, tiny_config  # noqa: E402
from verl_batches import (  # noqa: E402
    RTOL, add_value_targets, assert_grads, assert_outputs, engine_shell, long_units, make_batch, seq_last_mask,
    step_tokens, tiny_critic,
)
from verl_helpers import megatron_patchset  # noqa: E402

from ps_mcore import setup  # noqa: E402
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting  # noqa: E402
from ps_mcore.planner import plan_prefix_tree  # noqa: E402

BUDGET = 40


@pytest.fixture(scope="module")
def env():
    init_cpu_megatron()
    enable_cpu_pipeline()
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec
    from verl.workers.engine.megatron import transformer_impl as impl

    cfg = tiny_config("qwen2")
    model = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    randomize_(model)
    yield impl, model
    setup.uninstall()


def _setting(**kw):
    return PrefixSharingSetting(True, PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=4,
                                                          min_saved_fraction=0.0, **kw))


def _ppo():
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01, loss_agg_mode="token-mean")
    return partial(ppo_loss, config=cfg)


def _run(impl, model, data, setting, patched, loss_fn=None, cls=None):
    """One engine step through megatron-core's real schedule (whatever another test module
    set the engine's schedule name to); returns (output, grads)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    setup.uninstall()
    previous = impl.get_forward_backward_func
    impl.get_forward_backward_func = get_forward_backward_func
    if patched:
        setup.install([megatron_patchset()])
    engine = engine_shell(cls or impl.MegatronEngineWithLMHead, model, setting)
    model.zero_grad(set_to_none=True)
    config = get_model_config(model)
    reduced = []  # the gradients finalize_model_grads (the DP reduction) sees
    config.finalize_model_grads_func = lambda *a, **k: reduced.append(
        [None if p.grad is None else p.grad.clone() for p in model.parameters()])
    try:
        out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    finally:
        config.finalize_model_grads_func = None
        setup.uninstall()
        impl.get_forward_backward_func = previous
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    if loss_fn is not None:
        assert len(reduced) == 1
        assert all(torch.equal(a, b) for a, b in zip(reduced[0], grads))  # nothing added after it
    return out, grads


def _unique_tokens(data):
    from ps_mcore.integrations.verl_common.batch import sequences

    return plan_prefix_tree(sequences(data), min_prefix_len=4).num_tokens


def _update_actor_matches_stock(impl, model, data):
    """update_actor's PPO loss and every gradient equal to stock, every row computed once;
    returns stock's gradients."""
    stock, g_stock = _run(impl, model, data, _setting(), False, _ppo())
    tree, g_tree = _run(impl, model, data, _setting(), True, _ppo())
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert_grads(g_stock, g_tree)
    n, t = step_tokens(tree)
    assert n == int(data["input_ids"].offsets()[-1])
    assert t == _unique_tokens(data)  # every row once across micro-batches
    return g_stock


def test_update_actor_loss_and_gradients_match_stock(env):
    impl, model = env
    rng = np.random.default_rng(0)
    data = make_batch(long_units(rng), rng, temperature=0.8, max_token_len_per_gpu=BUDGET)
    g_stock = _update_actor_matches_stock(impl, model, data)
    t = _unique_tokens(data)

    split, g_split = _run(impl, model, data, _setting(cross_microbatch=False), True, _ppo())
    assert_grads(g_stock, g_split)
    assert step_tokens(split)[1] > t  # the pieces recompute their prefixes


def test_header_bound_groups_split_silently_and_match_stock(env):
    """GRPO groups bound into one unit by a short chat header, larger than the budget: the
    pieces (whole groups, each repeating the header) cost less than a schedule's kept header
    call, so the engine runs plain tree micro-batches, with no warning, equal to stock."""
    import warnings

    from verl_batches import header_bound_groups

    impl, model = env
    rng = np.random.default_rng(3)
    data = make_batch(header_bound_groups(rng, header=5), rng, max_token_len_per_gpu=720)
    assert 720 < _unique_tokens(data) < 2 * 720
    stock, g_stock = _run(impl, model, data, _setting(), False, _ppo())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree, g_tree = _run(impl, model, data, _setting(), True, _ppo())
    assert not [str(w.message) for w in caught if "[prefix_sharing]" in str(w.message)]
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert_grads(g_stock, g_tree)
    assert step_tokens(tree)[1] == _unique_tokens(data) + 5  # two pieces: the header once more


def test_log_prob_pass_matches_stock(env):
    impl, model = env
    rng = np.random.default_rng(1)
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    stock, _ = _run(impl, model, data, _setting(), False)
    tree, _ = _run(impl, model, data, _setting(), True)
    assert_outputs(stock, tree)
    assert step_tokens(tree)[1] == _unique_tokens(data)


def test_a_refusal_splits_with_one_warning(env):
    """Per-sample temperatures run on the tree per micro-batch but not inside a schedule (its
    calls score one temperature): the mini-batch is split as before, its micro-batches take
    the tree path, and it stays equal to stock."""
    impl, model = env
    rng = np.random.default_rng(2)
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    data["temperature"] = torch.linspace(0.5, 1.0, len(data["input_ids"]))
    stock, _ = _run(impl, model, data, _setting(), False)
    with pytest.warns(UserWarning, match="no cross-micro-batch schedule.*per-sample temperatures"):
        tree, _ = _run(impl, model, data, _setting(), True)
    keep = seq_last_mask(data["input_ids"])  # stock's last row reads the next sample's first token
    for key, rows in (("log_probs", keep), ("entropy", slice(None))):
        torch.testing.assert_close(tree["model_output"][key].values()[rows],
                                   stock["model_output"][key].values()[rows], rtol=RTOL, atol=1e-6)
    n, computed = step_tokens(tree)
    assert n == int(data["input_ids"].offsets()[-1]) and _unique_tokens(data) < computed < n  # split, shared


def test_per_micro_batch_options_refuse_the_schedule(env):
    """Options the tree path runs per micro-batch but a schedule's calls do not (FP8's 128-row
    padding, verl's Megatron fused forward, per-sample temperatures) refuse the schedule by
    name; the same batch without them schedules."""
    from ps_mcore.integrations.verl_common.megatron import megatron_schedule_refusal

    impl, model = env
    rng = np.random.default_rng(5)
    engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting())
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    assert megatron_schedule_refusal(engine, model, data) is None
    fused = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET, use_fused_kernels=True)
    assert "use_fused_kernels" in megatron_schedule_refusal(engine, model, fused)
    data["temperature"] = torch.linspace(0.5, 1.0, len(data["input_ids"]))
    assert "per-sample temperatures" in megatron_schedule_refusal(engine, model, data)
    data["temperature"] = torch.full((len(data["input_ids"]),), 0.7)  # one value: schedules
    assert megatron_schedule_refusal(engine, model, data) is None
    model.config.fp8 = "hybrid"  # only the decision is checked: the model is not run
    try:
        assert "fp8" in megatron_schedule_refusal(engine, model, data)
    finally:
        model.config.fp8 = None


def test_active_dropout_refuses_the_schedule(env):
    """A K/V-kept prefix runs its forward again at its release, which would draw other dropout
    masks: a training model with hidden_dropout splits its large units (even with
    prefix_grouper.shared_dropout, which covers the units that fit); in eval mode it schedules."""
    from ps_mcore.integrations.verl_common.megatron import megatron_schedule_refusal
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    impl, _ = env
    cfg = tiny_config("qwen2", hidden_dropout=0.1)
    model = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))).train()
    rng = np.random.default_rng(4)
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting(shared_dropout=True))
    assert "active dropout" in megatron_schedule_refusal(engine, model, data)
    assert megatron_schedule_refusal(engine, model.eval(), data) is None


def test_pad_to_length_refuses_the_schedule(env):
    """verl 0.9.1's ``pad_to_length`` pads every micro-batch to a length bucket, which a
    schedule's calls do not: its large units split (and their micro-batches run stock)."""
    from ps_mcore.integrations.verl_common.megatron import megatron_schedule_refusal

    impl, model = env
    rng = np.random.default_rng(5)
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting())
    assert megatron_schedule_refusal(engine, model, data) is None
    if not hasattr(engine.engine_config, "pad_to_length"):
        pytest.skip("the installed verl has no pad_to_length (0.9.1 added it)")
    object.__setattr__(engine.engine_config, "pad_to_length", True)
    assert "pad_to_length" in megatron_schedule_refusal(engine, model, data)


def test_critic_values_and_value_loss_match_stock(env, monkeypatch):
    """verl 0.8.0's value loss is a mean per micro-batch, so its gradient depends on how
    samples are grouped: the stock reference runs on the schedule's own micro-batches (0.9.1
    normalises over the mini-batch; the same reference holds)."""
    impl, _ = env
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    critic = tiny_critic()
    rng = np.random.default_rng(3)
    data = make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET)
    add_value_targets(data)
    cls = impl.MegatronEngineWithValueHead
    stock, _ = _run(impl, critic, data, _setting(), False, cls=cls)
    tree, _ = _run(impl, critic, data, _setting(), True, cls=cls)
    assert_outputs(stock, tree, keys=("values",))

    seen = []
    postprocess = impl.postprocess_batch_func
    monkeypatch.setattr(impl, "postprocess_batch_func", lambda output_lst, indices, data: (
        seen.append(indices), postprocess(output_lst=output_lst, indices=indices, data=data))[1])
    loss_fn = partial(value_loss, config=McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    tree, g_tree = _run(impl, critic, data, _setting(), True, loss_fn, cls=cls)
    parts = seen[-1]
    assert len(parts) > 2
    monkeypatch.setattr(impl, "prepare_micro_batches", lambda data, **_: (
        [tu.index_select_tensor_dict(data, p) for p in parts], parts))
    stock, g_stock = _run(impl, critic, data, _setting(), False, loss_fn, cls=cls)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


def test_gdn_hybrid_update_actor_and_log_probs_match_stock(env):
    """A hybrid model (Gated DeltaNet, attention, Gated DeltaNet; torch kernels): its large
    units run the schedule, which keeps the recurrent states and conv windows of the shared
    prefixes across micro-batches (charged to the budget) and equals verl's stock path (the
    same model on ordinary THD batches) in the loss, every gradient and the log-probs."""
    from gdn_shims import gdn_block_spec, gdn_config_overrides, sharpen_gdn_, shim_gdn_for_cpu

    from ps_mcore.integrations.verl_common.megatron import megatron_scheduler
    from ps_mcore.layer_specs import to_tree_spec

    shim_gdn_for_cpu()
    impl, _ = env
    cfg = tiny_config("qwen2", num_layers=3, **gdn_config_overrides())
    model = build_gpt(cfg, to_tree_spec(gdn_block_spec(cfg)))
    randomize_(model)
    sharpen_gdn_(model)
    rng = np.random.default_rng(6)
    data = make_batch(long_units(rng), rng, temperature=0.8, max_token_len_per_gpu=BUDGET)
    _update_actor_matches_stock(impl, model, data)

    stock, _ = _run(impl, model, data, _setting(), False)
    tree, _ = _run(impl, model, data, _setting(), True)
    assert_outputs(stock, tree)
    assert step_tokens(tree)[1] == _unique_tokens(data)

    class Step:
        engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting())
        forward_only = False

    scheduler = megatron_scheduler(Step, _setting(), data)
    assert scheduler.refusal is None and scheduler.state_cost > 0
