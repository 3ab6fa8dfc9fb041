"""verl 0.9.1's Megatron engine building its model through Megatron-Bridge (its default
builder), patched vs stock, on CPU (gloo world 1, fp32).

The engine runs verl's own ``_build_tf_config`` (``AutoBridge.from_hf_pretrained`` on a
checkpoint the test writes, verl's provider overrides) and ``_build_megatron_module`` (the
provider builds the model, Bridge loads the HF weights); with the patchset installed the
provider builds tree layers. Stock: the same engine built and run with the patchset
uninstalled (the provider's own TE spec). Checkpoints: Qwen2, Qwen3-MoE, GPT-OSS (sliding
windows, learnable sinks, MoE with biases) and Gemma 3 (Bridge's own attention layers: 5 local
layers with a window of 4 tokens and their own RoPE base, 1 global). Checked on GRPO groups, step-wise samples and a tree:
log-probs, entropy, the PPO loss and every gradient equal stock's, also when GRPO groups larger
than the token budget run as one cross-micro-batch schedule; ``ENABLE_PREFIX_SHARING=0``
(at build and at run) is stock bit for bit. Test-only shims: tests/te_cpu_shims.py (TE needs a
GPU), tests/verl_batches.py (a CPU platform for verl 0.9.1).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
from bridge_helpers import require_bridge  # noqa: E402

require_bridge()

from bridge_helpers import bridge_engine, cpu_bridge, write_hf_checkpoint  # noqa: E402,F401
from verl_batches import RTOL, WORKLOADS, assert_outputs, cpu_forward_backward_func, grpo_samples, make_batch, step_tokens  # noqa: E402
from verl_helpers import megatron_patchset  # noqa: E402

from ps_mcore import setup  # noqa: E402
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting  # noqa: E402
from ps_mcore.integrations.verl_common.megatron import has_tree_attention  # noqa: E402
from ps_mcore.integrations.verl_common.batch import sequences  # noqa: E402
from ps_mcore.integrations.verl_common.trainer import TOKENS_IN  # noqa: E402
from ps_mcore.layer_specs import megatron_dropout_refusal  # noqa: E402
from ps_mcore.planner import plan_prefix_tree  # noqa: E402

MODES = {"grpo": "prompt_only", "stepwise": "arbitrary_prefix", "tree": "arbitrary_prefix"}


@pytest.fixture(scope="module")
def impl():
    from verl.workers.engine.megatron import transformer_impl as impl

    stock = impl.get_forward_backward_func
    impl.get_forward_backward_func = cpu_forward_backward_func
    yield impl
    impl.get_forward_backward_func = stock
    setup.uninstall()


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe", "gpt_oss", "gemma3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(request.param, path, seed=7)
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "gemma3":  # Bridge's own Gemma 3 spec, its TE modules on the CPU
            from te_cpu_shims import use_cpu_gemma3_spec

            use_cpu_gemma3_spec(patch)
        yield path


def _setting(mode):
    return PrefixSharingSetting(True, PrefixGrouperConfig(mode=mode, min_prefix_len=4, min_saved_fraction=0.0))


def _engine(impl, path, setting, patched, enabled="1", monkeypatch=None):
    if patched:
        setup.install([megatron_patchset()])
    else:
        setup.uninstall()
    if monkeypatch is not None:
        monkeypatch.setenv("ENABLE_PREFIX_SHARING", enabled)
    return bridge_engine(impl.MegatronEngineWithLMHead, path, setting)


def _step(engine, data, loss_fn=None):
    model = engine.module[0]
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ppo():
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01))


def _run_like_stock(impl, path, data, mode, monkeypatch):
    """The log-prob pass and a PPO update on ``data`` through the stock and the tree engine:
    outputs, the loss summed over micro-batches and every gradient must be equal. Returns the
    tree's log-prob pass output."""
    setting = _setting(mode)
    stock = _engine(impl, path, setting, patched=False)
    stock_i, _ = _step(stock, data)
    stock_t, g_stock = _step(stock, data, _ppo())
    tree = _engine(impl, path, setting, patched=True, monkeypatch=monkeypatch)
    tree_i, _ = _step(tree, data)
    tree_t, g_tree = _step(tree, data, _ppo())
    # fp32 rounding grows through the 6-layer Gemma 3 (embeddings scaled by sqrt(hidden)): up to
    # ~2.5e-5 relative on a log-prob; in fp64 its tree logits equal stock's to ~1e-15
    # (tests/test_megatron_bridge_gemma3.py)
    scale = 4.0 if path.name.startswith("gemma3") else 1.0
    assert_outputs(stock_i, tree_i, scale=scale)
    np.testing.assert_allclose(sum(tree_t["loss"]), sum(stock_t["loss"]), rtol=scale * RTOL)
    assert g_stock.keys() == g_tree.keys() and g_stock
    for name, g in g_stock.items():
        torch.testing.assert_close(g_tree[name], g, rtol=scale * RTOL, atol=scale * RTOL * float(g.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    return tree_i


def test_bridge_builds_tree_layers_only_when_patched(impl, checkpoint, monkeypatch):
    setting = _setting("arbitrary_prefix")
    tree = _engine(impl, checkpoint, setting, patched=True, monkeypatch=monkeypatch)
    stock = _engine(impl, checkpoint, setting, patched=False)
    off = _engine(impl, checkpoint, setting, patched=True, enabled="0", monkeypatch=monkeypatch)
    assert has_tree_attention(tree.module[0]) and not has_tree_attention(stock.module[0])
    # Bridge's Qwen providers set hidden_dropout 0: default training runs are not refused
    assert megatron_dropout_refusal(tree.module[0].train()) is None
    assert not has_tree_attention(off.module[0])
    assert tree.provider.transformer_layer_spec is stock.provider.transformer_layer_spec  # restored
    names = list(stock.module[0].state_dict())
    assert list(tree.module[0].state_dict()) == names
    for name, value in stock.module[0].state_dict().items():  # both loaded from the checkpoint
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.equal(tree.module[0].state_dict()[name], value), name


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_log_probs_loss_and_gradients_match_stock(impl, checkpoint, workload, monkeypatch):
    rng = np.random.default_rng(11)
    data = make_batch(WORKLOADS[workload](rng), rng, temperature=0.7)
    n, t = step_tokens(_run_like_stock(impl, checkpoint, data, MODES[workload], monkeypatch))
    assert n == int(data["input_ids"].offsets()[-1]) and t < n  # the tree path ran


def test_units_larger_than_the_budget_run_one_schedule_equal_to_stock(impl, checkpoint, monkeypatch):
    """``use_dynamic_bsz`` with GRPO groups larger than the token budget: the cross-micro-batch
    schedule computes every row once across micro-batches on the Bridge-built model;
    log-probs, entropy, the PPO loss summed over micro-batches and every gradient equal stock's
    (verl's raw-token micro-batches)."""
    rng = np.random.default_rng(13)
    samples, budget = grpo_samples(rng, prompts=2, group=4), 24
    for uid in {u for _, _, u in samples}:  # each group larger than the budget, every sample within it
        group = [p + r for p, r, u in samples if u == uid]
        assert plan_prefix_tree(group, min_prefix_len=4).num_tokens > budget >= max(map(len, group))
    data = make_batch(samples, rng, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    tree = _run_like_stock(impl, checkpoint, data, "arbitrary_prefix", monkeypatch)
    assert step_tokens(tree)[1] == plan_prefix_tree(sequences(data), min_prefix_len=4).num_tokens  # every row once


def test_disabled_by_env_is_bit_identical(impl, checkpoint, monkeypatch):
    rng = np.random.default_rng(12)
    data = make_batch(WORKLOADS["tree"](rng), rng, use_dynamic_bsz=True, max_token_len_per_gpu=40)
    setting = _setting("arbitrary_prefix")
    stock = _engine(impl, checkpoint, setting, patched=False)
    stock_i, _ = _step(stock, data)
    stock_t, g_stock = _step(stock, data, _ppo())
    off = _engine(impl, checkpoint, setting, patched=True, enabled="0", monkeypatch=monkeypatch)
    off_i, _ = _step(off, data)
    off_t, g_off = _step(off, data, _ppo())
    for key in ("log_probs", "entropy"):
        assert torch.equal(stock_i["model_output"][key].values(), off_i["model_output"][key].values())
    assert off_t["loss"] == stock_t["loss"] and TOKENS_IN not in off_i["metrics"]
    assert g_off.keys() == g_stock.keys() and all(torch.equal(g_off[n], g) for n, g in g_stock.items())
