"""verl 0.8.0 Megatron engine, patched vs stock, on a real tiny megatron-core GPTModel (CPU).

The engine's real ``forward_backward_batch`` / ``forward_step`` / ``postprocess`` run
verl's real ``gptmodel_forward_model_engine`` (stock) or the patched tree path on verl
worker TensorDicts (nested input_ids): GRPO groups, step-wise samples, a tree. The model
uses tree layer specs in both runs (its stock THD path is per-sequence causal attention,
the only THD attention that runs on CPU). Test-only shims: ``tests/megatron_shims.py``
(CUDA device, RNG tracker) and a CPU stand-in for megatron's no-pipelining schedule
(``verl_batches.cpu_forward_backward_func``: megatron's allocates a CUDA counter).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

from megatron_shims import (  # noqa: E402
    build_gpt, cpu_linear_cross_entropy, init_cpu_megatron, layer_spec_args, randomize_, tiny_config,
)
from verl_batches import (  # noqa: E402
    DISTILLATION_KEYS, RTOL, WORKLOADS, add_value_targets, assert_grads, assert_outputs, cpu_forward_backward_func,
    distillation_loss, engine_shell, forbid, make_batch, sample_temperatures, step_tokens, stock_then_ours,
    sum_pi_squared_loss, tiny_critic, unshared_batch, with_statistics,
)
from verl_helpers import megatron_patchset  # noqa: E402

from ps_mcore import setup  # noqa: E402
from ps_mcore.integrations import patching  # noqa: E402
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting  # noqa: E402
from ps_mcore.integrations.verl_common.trainer import TOKENS_IN  # noqa: E402

MODES = {"grpo": "prompt_only", "stepwise": "arbitrary_prefix", "tree": "arbitrary_prefix"}


@pytest.fixture(scope="module")
def env():
    init_cpu_megatron()
    from verl.workers.engine.megatron import transformer_impl as impl

    stock_schedule = impl.get_forward_backward_func
    impl.get_forward_backward_func = cpu_forward_backward_func
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    cfg = tiny_config("qwen2")
    model = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    randomize_(model)
    yield impl, model
    impl.get_forward_backward_func = stock_schedule
    setup.uninstall()


def _tree_spec(cfg):
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    return get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))


def _setting(mode, **kw):
    return PrefixSharingSetting(True, PrefixGrouperConfig(mode=mode, min_prefix_len=4, min_saved_fraction=0.0, **kw))


def _run(impl, model, data, setting, patched, loss_fn=None, cls=None, env_value=None, monkeypatch=None,
         engine_setup=None):
    """One forward(+backward) through the engine; returns (output, grads)."""
    if patched:
        setup.install([megatron_patchset()])
    else:
        setup.uninstall()
    if monkeypatch is not None and env_value is not None:
        monkeypatch.setenv("ENABLE_PREFIX_SHARING", env_value)
    engine = engine_shell(cls or impl.MegatronEngineWithLMHead, model, setting)
    if engine_setup is not None:
        engine_setup(engine)
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out, grads








def _actor_config(loss_agg_mode="token-mean"):
    from verl.workers.config import McoreActorConfig

    return McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01, loss_agg_mode=loss_agg_mode)


def _ppo(loss_agg_mode="token-mean"):
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=_actor_config(loss_agg_mode))




@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_log_probs_and_entropy_match_stock(env, workload):
    impl, model = env
    rng = np.random.default_rng(1)
    data = make_batch(WORKLOADS[workload](rng), rng)
    setting = _setting(MODES[workload])
    stock, _ = _run(impl, model, data, setting, patched=False)
    tree, _ = _run(impl, model, data, setting, patched=True)
    assert_outputs(stock, tree)
    n, t = step_tokens(tree)
    assert n == int(data["input_ids"].offsets()[-1]) and t < n  # the tree path really ran


@pytest.mark.parametrize(
    "workload, loss_agg_mode",
    [("grpo", "token-mean"), ("stepwise", "seq-mean-token-sum"), ("tree", "seq-mean-token-mean"),
     ("tree", "seq-mean-token-sum-norm")],
)
def test_ppo_loss_and_gradients_match_stock(env, workload, loss_agg_mode):
    impl, model = env
    rng = np.random.default_rng(2)
    data = make_batch(WORKLOADS[workload](rng), rng, temperature=0.7)
    setting = _setting(MODES[workload])
    loss_fn = _ppo(loss_agg_mode)
    stock, g_stock = _run(impl, model, data, setting, False, loss_fn)
    tree, g_tree = _run(impl, model, data, setting, True, loss_fn)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


def test_disabled_by_env_is_bit_identical(env, monkeypatch):
    impl, model = env
    rng = np.random.default_rng(3)
    data = make_batch(WORKLOADS["tree"](rng), rng, use_dynamic_bsz=True, max_token_len_per_gpu=40)
    setting = _setting("arbitrary_prefix")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    off, g_off = _run(impl, model, data, setting, True, _ppo(), env_value="0", monkeypatch=monkeypatch)
    assert off["loss"] == stock["loss"]
    assert TOKENS_IN not in off["metrics"]
    assert all(torch.equal(a, b) for a, b in zip(g_stock, g_off))
    stock_i, _ = _run(impl, model, data, setting, False)
    off_i, _ = _run(impl, model, data, setting, True, env_value="0", monkeypatch=monkeypatch)
    for key in ("log_probs", "entropy"):
        assert torch.equal(stock_i["model_output"][key].values(), off_i["model_output"][key].values())


def test_engine_without_setting_is_bit_identical(env):
    impl, model = env
    rng = np.random.default_rng(4)
    data = make_batch(WORKLOADS["grpo"](rng), rng)
    stock, _ = _run(impl, model, data, None, False)
    patched, _ = _run(impl, model, data, None, True)
    assert torch.equal(stock["model_output"]["log_probs"].values(), patched["model_output"]["log_probs"].values())


@pytest.mark.parametrize("dynamic", [True, False])
def test_micro_batched_outputs_restored_in_batch_order(env, dynamic):
    impl, model = env
    rng = np.random.default_rng(5)
    samples = WORKLOADS["grpo"](rng, prompts=3, group=2)
    order = rng.permutation(len(samples))  # groups no longer contiguous
    samples = [samples[i] for i in order]
    kw = dict(use_dynamic_bsz=True, max_token_len_per_gpu=45) if dynamic else dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    data = make_batch(samples, rng, **kw)
    setting = _setting("prompt_only")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert_grads(g_stock, g_tree)
    stock_i, _ = _run(impl, model, data, setting, False)
    tree_i, _ = _run(impl, model, data, setting, True)
    assert_outputs(stock_i, tree_i)
    n, t = step_tokens(tree_i)
    assert t < n and len(tree_i["metrics"][TOKENS_IN]) >= 2  # several micro-batches, all sharing


def _ints(rng, n):
    return [int(x) for x in rng.integers(1, 128, n)]


def test_fallback_when_savings_too_small(env):
    """Two of three samples share 3 tokens of 70 (under the default 5%): verl's forward."""
    impl, model = env
    rng = np.random.default_rng(6)
    head = _ints(rng, 3)
    samples = [(head + _ints(rng, 19), _ints(rng, 2), f"u{i}") for i in range(2)] + [(_ints(rng, 20), _ints(rng, 2), "u2")]
    data = make_batch(samples, rng)
    setting = PrefixSharingSetting(True, PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=3))
    stock, _ = _run(impl, model, data, setting, False)
    tree, _ = _run(impl, model, data, setting, True)
    assert torch.equal(stock["model_output"]["log_probs"].values(), tree["model_output"]["log_probs"].values())
    n, t = step_tokens(tree)
    assert n == t == 70


def test_a_batch_sharing_nothing_is_verls_own_run(env, monkeypatch):
    """No two samples share a token: verl's micro-batches and forward, unplanned and unchecked,
    bit for bit (outputs, loss, every gradient), with each micro-batch's token counts."""
    from ps_mcore.integrations.verl_common import megatron as glue

    impl, model = env
    data = unshared_batch(128)
    (stock, stock_train, g_stock), (tree, tree_train, g_tree) = stock_then_ours(
        partial(_run, impl, model), data, _setting("arbitrary_prefix"), _ppo,
        lambda: forbid(monkeypatch, glue, "plan_or_stock", "megatron_batch_refusal"))
    assert torch.equal(stock["model_output"]["log_probs"].values(), tree["model_output"]["log_probs"].values())
    assert [float(x) for x in tree_train["loss"]] == [float(x) for x in stock_train["loss"]]
    assert all(torch.equal(a, b) for a, b in zip(g_stock, g_tree) if a is not None)
    n = int(data["input_ids"].offsets()[-1])
    assert len(tree["metrics"][TOKENS_IN]) >= 2 and step_tokens(tree) == (n, n)


@pytest.mark.parametrize("workload", ["grpo", "tree"])
def test_per_sample_temperature_matches_stock(env, workload):
    """Per-sample temperatures (verl's ``[B]`` tensor) take the tree path: log-probs, entropy,
    the PPO loss and every gradient equal verl's stock per-sample division."""
    impl, model = env
    rng = np.random.default_rng(7)
    samples = WORKLOADS[workload](rng)
    data = make_batch(samples, rng)
    data["temperature"] = sample_temperatures(len(samples), seed=7)
    setting = _setting(MODES[workload])
    stock, _ = _run(impl, model, data, setting, False)
    tree, _ = _run(impl, model, data, setting, True)
    assert_outputs(stock, tree)
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


def _assert_training_matches_stock(impl, model, data, setting, loss_fn, keys):
    """A training step, stock vs patched: loss, every gradient and the outputs ``keys``; the
    tree path ran."""
    stock, g_stock = _run(impl, model, data, setting, False, loss_fn)
    tree, g_tree = _run(impl, model, data, setting, True, loss_fn)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)
    assert_outputs(stock, tree, keys)
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran


@pytest.mark.parametrize(
    "workload, temperature, clamp", [("grpo", "one", -5.0), ("stepwise", "per-sample", None), ("tree", "per-sample", -5.0)]
)
def test_topk_distillation_and_sum_pi_squared_match_stock(env, workload, temperature, clamp):
    """``calculate_sum_pi_squared`` and top-k distillation (verl's ``distillation_ppo_loss`` as
    the logits processor: vocab-parallel forward KL on the teacher's top-k ids, each sample's
    own) run on the tree, every row statistic once per (row, temperature) pair. Outputs, the
    distillation + PPO loss and every gradient equal verl's stock logits processor."""
    impl, model = env
    rng = np.random.default_rng(21)
    data = with_statistics(make_batch(WORKLOADS[workload](rng), rng, temperature=0.8), seed=21)
    if temperature == "per-sample":
        data["temperature"] = sample_temperatures(data.batch_size[0], seed=21)
    keys = ("log_probs", "entropy", "sum_pi_squared") + DISTILLATION_KEYS
    _assert_training_matches_stock(impl, model, data, _setting(MODES[workload]), distillation_loss(_actor_config(), data, clamp), keys)


def test_sum_pi_squared_log_prob_pass_and_gradients_match_stock(env):
    """A log-prob pass with ``calculate_sum_pi_squared`` and a loss with a gradient through it,
    per-sample temperatures: equal to stock."""
    impl, model = env
    rng = np.random.default_rng(22)
    data = with_statistics(make_batch(WORKLOADS["tree"](rng), rng), seed=22, distillation=False)
    data["temperature"] = sample_temperatures(data.batch_size[0], seed=22)
    setting = _setting("arbitrary_prefix")
    stock, _ = _run(impl, model, data, setting, False)
    tree, _ = _run(impl, model, data, setting, True)
    assert_outputs(stock, tree, ("log_probs", "entropy", "sum_pi_squared"))
    _assert_training_matches_stock(impl, model, data, setting, sum_pi_squared_loss(_ppo()), ("sum_pi_squared",))


def test_row_statistics_refusals_name_the_option(env):
    """Top-k distillation behind a logits processor other than verl's ``distillation_ppo_loss``
    takes verl's stock forward by name; a schedule refuses both statistics (its calls return
    log-probs and entropy only)."""
    from ps_mcore.integrations.verl_common import megatron as glue
    from ps_mcore.integrations.verl_common.schedule import lm_schedule_refusal

    impl, model = env
    rng = np.random.default_rng(23)
    data = with_statistics(make_batch(WORKLOADS["tree"](rng), rng), seed=23)
    args = {"logits_processor": lambda *a, **k: None}
    assert glue.megatron_batch_refusal(model, args, data, distillation_loss(_actor_config(), data)) is None
    assert "other than verl's distillation_ppo_loss" in glue.megatron_batch_refusal(model, args, data, _ppo())
    assert "calculate_sum_pi_squared" in lm_schedule_refusal(data)


def test_critic_values_and_value_loss_match_stock(env):
    impl, _ = env
    from verl.workers.config import McoreCriticConfig
    from verl.workers.utils.losses import value_loss

    critic = tiny_critic()
    rng = np.random.default_rng(8)
    data = make_batch(WORKLOADS["stepwise"](rng), rng)
    add_value_targets(data)
    setting = _setting("arbitrary_prefix")
    cls = impl.MegatronEngineWithValueHead
    stock, _ = _run(impl, critic, data, setting, False, cls=cls)
    tree, _ = _run(impl, critic, data, setting, True, cls=cls)
    assert_outputs(stock, tree, keys=("values",))
    loss_fn = partial(value_loss, config=McoreCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    stock, g_stock = _run(impl, critic, data, setting, False, loss_fn, cls=cls)
    tree, g_tree = _run(impl, critic, data, setting, True, loss_fn, cls=cls)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


class _ModelConfig(dict):
    """verl's HFModelConfig surface that ``_build_megatron_module`` reads."""

    __getattr__ = dict.__getitem__


class _MBridgeStandIn:
    """mbridge's model-building surface (mbridge is not installed here): ``get_model``
    builds through ``self._get_transformer_layer_spec(vp_stage)`` as mbridge's
    ``LLMBridge._model_provider`` does; the stock spec is megatron's local one."""

    def __init__(self, config):
        self.config = config
        self.specs_seen = []

    def _get_transformer_layer_spec(self, vp_stage=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(**layer_spec_args(self.config))

    def get_model(self, post_model_creation_callbacks=(), wrap_with_ddp=False, **_):
        spec = self._get_transformer_layer_spec(None)
        self.specs_seen.append(spec)
        return [build_gpt(self.config, spec)]

    def load_weights(self, module, path):
        pass


def _mbridge_engine(impl, monkeypatch, config, **engine_config):
    """A Megatron LM engine whose ``_build_megatron_module`` builds through the mbridge
    stand-in (forward-only: no DDP wrapping); ``engine_config`` overrides its engine config."""
    import sys
    import types

    # verl imports mbridge's callbacks module for the value-model hook; mbridge is absent here
    stub = types.ModuleType("verl.models.mcore.mbridge")
    stub.freeze_moe_router = stub.make_value_model = stub.AutoBridge = None
    monkeypatch.setitem(sys.modules, "verl.models.mcore.mbridge", stub)
    engine = engine_shell(impl.MegatronEngineWithLMHead, SimpleNamespace(config=config), _setting("prompt_only"))
    for key, value in dict(forward_only=True, **engine_config).items():
        object.__setattr__(engine.engine_config, key, value)
    engine.tf_config = config
    engine.bridge = _MBridgeStandIn(config)
    engine.provider, engine.peft_cls, engine.vanilla_bridge, engine.enable_routing_replay = None, None, True, False
    engine.model_config = _ModelConfig(
        model_type="language_model", hf_config=SimpleNamespace(rope_theta=1e6, tie_word_embeddings=False),
        local_path="unused", lora=None,
    )
    return engine


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_model_build_gets_tree_specs_through_mbridge(env, monkeypatch, enabled):
    from ps_mcore.layer_specs import TreeCoreAttention
    from ps_mcore.integrations.verl_common.megatron import has_tree_attention

    impl, _ = env
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", enabled)
    setup.install([megatron_patchset()])
    config = tiny_config("qwen2")
    config.apply_rope_fusion = True  # as a TE build would have it (cannot be built so on CPU)
    engine = _mbridge_engine(impl, monkeypatch, config)
    module = engine._build_megatron_module()
    tree = any(isinstance(m, TreeCoreAttention) for m in module[0].modules())
    assert tree is (enabled == "1") and has_tree_attention(module[0]) is tree
    assert config.apply_rope_fusion is True  # kept: fused THD RoPE is exact on tree batches
    assert "_get_transformer_layer_spec" not in vars(engine.bridge)  # instance hook removed


def test_tree_path_serves_padded_bshd_configs(env):
    """``use_remove_padding=False`` (verl's bshd forward): the tree path packs the batch
    itself, so its numbers equal verl's THD stock forward."""
    impl, model = env
    rng = np.random.default_rng(9)
    data = make_batch(WORKLOADS["tree"](rng), rng)
    setting = _setting("arbitrary_prefix")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    setup.install([megatron_patchset()])
    engine = engine_shell(impl.MegatronEngineWithLMHead, model, setting, use_remove_padding=False)
    model.zero_grad(set_to_none=True)
    tree = engine.forward_backward_batch(data.clone(), loss_function=_ppo(), forward_only=False)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, [p.grad for p in model.parameters()])


def test_tensor_parallel_2_matches_stock(tmp_path):
    """TP=2 under torchrun (gloo): vocab-parallel log-probs / entropy, TP-multiple padding of
    the packed rows, ppo loss and every rank's gradients equal verl's stock path; so do
    ``sum_pi_squared`` and top-k distillation (vocab-parallel top-k ids, teacher ids in either
    shard) with per-sample temperatures, their loss and gradients."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("verl_tp_worker.py")
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rep in json.loads(out.read_text()):
        assert rep["log_probs"] < 1e-5 and rep["entropy"] < 1e-5, rep
        np.testing.assert_allclose(rep["loss"][1], rep["loss"][0], rtol=RTOL)
        assert rep["grads"] <= 1e-5 * max(1.0, rep["grad_scale"]), rep
        assert rep["tokens"][1] < rep["tokens"][0], rep
        assert max(rep["stats"].values()) < 1e-5 and rep["distill_tokens"][1] < rep["distill_tokens"][0], rep
        np.testing.assert_allclose(rep["distill_loss"][1], rep["distill_loss"][0], rtol=RTOL)
        assert rep["distill_grads"] <= 1e-5 * max(1.0, rep["distill_grad_scale"]), rep


# ----------------------------------------------------------------------------- fallbacks
# Each option the tree path does not support: every micro-batch takes verl's stock forward
# (the option really active there), one warning names the option, and the step's outputs,
# loss and gradients are the stock ones bit for bit.


def _fallback_batch(seed):
    """GRPO groups of 2 in group order, micro-batches of 2: prefix-aware micro-batching is
    verl's own there, so the fallback step must be stock bit for bit over 3 micro-batches."""
    rng = np.random.default_rng(seed)
    return make_batch(WORKLOADS["grpo"](rng, prompts=3, group=2), rng, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)


def _fallback_case(impl, model, data, match, engine_setup=None):
    """Inference and a ppo training step, stock vs patched: one warning containing ``match``,
    bit-identical outputs, loss and gradients, every micro-batch recorded as unshared.
    Returns the patched inference output."""

    def run(patched, loss_fn=None):
        setup.install([megatron_patchset()]) if patched else setup.uninstall()
        engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting("prompt_only"))
        if engine_setup is not None:
            engine_setup(engine)
        model.zero_grad(set_to_none=True)
        out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
        return out, [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    stock, _ = run(False)
    stock_train, g_stock = run(False, _ppo())
    with pytest.warns(UserWarning) as record:
        tree, _ = run(True)
        tree_train, g_tree = run(True, _ppo())
    assert len([w for w in record if match in str(w.message)]) == 1, [str(w.message) for w in record]
    for key in ("log_probs", "entropy"):
        assert torch.equal(stock["model_output"][key].values(), tree["model_output"][key].values()), key
    assert tree_train["loss"] == stock_train["loss"]
    assert all(torch.equal(a, b) for a, b in zip(g_stock, g_tree) if a is not None)
    n = int(data["input_ids"].offsets()[-1])
    assert len(tree["metrics"][TOKENS_IN]) == 3 and step_tokens(tree) == (n, n)  # stock, every micro-batch
    return tree


def _dropout_model():
    """megatron-core's default hidden_dropout (0.1), training mode."""
    cfg = tiny_config("qwen2", hidden_dropout=0.1)
    model = build_gpt(cfg, _tree_spec(cfg))
    randomize_(model, seed=6)
    return model.train()


def _seeded(engine):
    torch.manual_seed(13)  # stock and patched runs draw the same dropout masks


def test_fallback_hidden_dropout_names_verl_keys(env, fresh_warnings):
    """hidden_dropout > 0 in training: verl's stock forward (same masks, same numbers), one
    warning naming the override key that turns it off and the opt-in key."""
    impl, _ = env
    model = _dropout_model()
    key = "+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout to 0"
    _fallback_case(impl, model, _fallback_batch(25), key, _seeded)
    patching._WARNED.clear()
    with pytest.warns(UserWarning, match="embedding_dropout") as record:
        _run(impl, model, _fallback_batch(25), _setting("prompt_only"), True)
    messages = [str(w.message) for w in record if "embedding_dropout" in str(w.message)]
    assert len(messages) == 1 and "actor_rollout_ref.actor.prefix_grouper.shared_dropout=true" in messages[0]


def test_shared_dropout_opt_in_runs_the_tree(env, recwarn):
    """prefix_grouper.shared_dropout=true: the tree path runs hidden dropout on the packed rows
    (the packed params carry the opt-in), reproducible under a seed, different from eval."""
    impl, _ = env
    model = _dropout_model()
    rng = np.random.default_rng(3)
    data = make_batch(WORKLOADS["tree"](rng), rng)
    setting = _setting("arbitrary_prefix", shared_dropout=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(21)
        runs.append(_run(impl, model, data, setting, True)[0])
    assert not [w for w in recwarn if "stock forward" in str(w.message)]
    n, t = step_tokens(runs[0])
    assert t < n
    first, again = (r["model_output"]["log_probs"].values() for r in runs)
    assert torch.equal(first, again)
    model.eval()
    without = _run(impl, model, data, setting, True)[0]["model_output"]["log_probs"].values()
    assert not torch.equal(first, without)


def _spy(monkeypatch, module, name):
    """Record the keyword arguments of every call of ``module.name`` (still called)."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("fp8", ["e4m3", "hybrid"])
def test_fp8_config_runs_the_tree_with_rows_padded_for_fp8(env, monkeypatch, fp8):
    """``config.fp8``: the tree path runs, its packed rows padded to a multiple of 128 (verl's
    FP8 THD rule: TE's FP8 GEMMs need 16-, 32- or 128-row alignment by recipe), while verl's
    stock forward pads each sequence by its FP8 rule. The FP8 GEMMs themselves need Transformer
    Engine on a GPU (tests/test_gpu_fp8.py); the local-spec model here computes in fp32, so
    outputs, loss and gradients equal stock's."""
    from verl.models.mcore import model_forward

    from ps_mcore.layer_specs import TreePackedSeqParams

    impl, _ = env
    cfg = tiny_config("qwen2")
    model = build_gpt(cfg, _tree_spec(cfg))
    randomize_(model, seed=4)
    model.config.fp8 = fp8
    stock_calls = _spy(monkeypatch, model_forward, "preprocess_thd_engine")
    rows = []
    from_plan = TreePackedSeqParams.from_plan.__func__

    def recording(cls, plan, *args, **kwargs):
        psp = from_plan(cls, plan, *args, **kwargs)
        rows.append((plan.num_tokens, int(psp.position_ids.numel())))
        return psp

    monkeypatch.setattr(TreePackedSeqParams, "from_plan", classmethod(recording))
    rng = np.random.default_rng(20)
    data = make_batch(WORKLOADS["tree"](rng), rng, temperature=0.8)
    setting = _setting("arbitrary_prefix")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)
    assert stock_calls and all(c["use_fp8_padding"] for c in stock_calls)
    assert rows and all(t_pad % 128 == 0 and t_pad - t < 128 for t, t_pad in rows)
    n, t = step_tokens(tree)
    assert t < n


def test_fp8_refusals_and_row_multiple(env):
    from types import SimpleNamespace as NS

    from ps_mcore.layer_specs.fp8 import fp8_tree_refusal, tree_row_multiple

    assert tree_row_multiple(NS(fp8=None), tp=2) == 2 and tree_row_multiple(NS(fp8="e4m3"), tp=2) == 256
    assert tree_row_multiple(NS(fp8="hybrid"), tp=2, cp=2) == 8 * 128
    assert fp8_tree_refusal(NS(fp8=None, fp8_dot_product_attention=True)) is None
    assert "fp8_dot_product_attention" in fp8_tree_refusal(NS(fp8="e4m3", fp8_dot_product_attention=True))
    assert "MoE" in fp8_tree_refusal(NS(fp8="e4m3", num_moe_experts=4))
    assert fp8_tree_refusal(NS(fp8="e4m3")) is None


@pytest.mark.parametrize("lengths", [[5, 17, 33], [128], [1, 1, 1, 200]])
def test_fp8_thd_layout_is_verls(env, lengths):
    """``fp8_thd_layout`` (the stock FP8 baseline of tests/test_gpu_fp8.py and the model
    benchmark) pads like verl's own ``preprocess_thd_engine(use_fp8_padding=True)``."""
    from verl.models.mcore.model_forward import preprocess_thd_engine

    from ps_mcore.layer_specs.fp8 import fp8_thd_layout

    ids = torch.nested.as_nested_tensor([torch.arange(1, n + 1) for n in lengths], layout=torch.jagged)
    packed, verl_params, _ = preprocess_thd_engine(ids, pre_process=True, use_fp8_padding=True)
    params, rows = fp8_thd_layout(lengths)
    assert torch.equal(params.cu_seqlens_q_padded.cpu(), verl_params.cu_seqlens_q_padded.cpu())
    assert torch.equal(params.cu_seqlens_q.cpu(), verl_params.cu_seqlens_q.cpu())
    assert params.max_seqlen_q == verl_params.max_seqlen_q
    assert torch.equal(packed.reshape(-1)[rows], ids.values())  # verl puts the tokens where we read them


def _moe_model(seed=0, **options):
    """A tiny MoE GPTModel with tree specs (TreeTopKRouter), CPU shims on."""
    from megatron_shims import enable_cpu_moe

    enable_cpu_moe()
    from moe_cases import build_moe_model, moe_config

    return build_moe_model(moe_config(**options), seed)


def test_fallback_moe_token_dropping(env, fresh_warnings):
    """``moe_expert_capacity_factor=1.0`` (capacity and drops depend on the token count and
    order): verl's stock forward runs every micro-batch instead of the tree router raising
    inside the model, one warning names the option, the step is stock bit for bit."""
    impl, _ = env
    _fallback_case(impl, _moe_model(5, moe_expert_capacity_factor=1.0), _fallback_batch(24),
                   "moe_expert_capacity_factor=1.0")


@pytest.mark.parametrize("options, word", [
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
    (dict(), None),  # exact MoE options: the tree path runs it
])
def test_moe_fallback_decision(env, options, word):
    from ps_mcore.integrations.verl_common.megatron import megatron_batch_refusal

    reason = megatron_batch_refusal(_moe_model(**options), {}, None)
    assert reason is None if word is None else word in reason, reason


def _mtp_model(depths: int, detach: bool, seed: int = 5, **config):
    """A real megatron-core MTP block (``depths`` layers, tree specs like the decoder's) with
    verl's MTP patches, as ``MegatronEngine`` applies them (``patch_engine_mtp``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from verl.utils.megatron_utils import patch_engine_mtp

    cfg = tiny_config("qwen2", mtp_num_layers=depths, **config)
    spec = _tree_spec(cfg)
    model = build_gpt(cfg, spec, mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
    randomize_(model, seed=seed)
    patch_engine_mtp(model, SimpleNamespace(mtp=SimpleNamespace(detach_encoder=detach)))
    return model


def _mtp_engine(engine, detach: bool = False):
    engine.model_config.mtp = SimpleNamespace(enable=True, enable_train=True, detach_encoder=detach)


def _mtp_run(impl, model, data, patched, detach, loss_fn=None, **setting):
    setup.install([megatron_patchset()]) if patched else setup.uninstall()
    engine = engine_shell(impl.MegatronEngineWithLMHead, model, _setting("arbitrary_prefix", **setting))
    _mtp_engine(engine, detach)
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    return out, {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("depths, detach, config", [
    (1, False, {}), (2, False, {}), (2, True, {}),
    # verl 0.9.1 then scales megatron's process_mtp_loss by its mtp_loss_normalization_factor
    (1, False, dict(calculate_per_token_loss=True)),
], ids=["d1", "d2", "d2-detach", "d1-per-token"])
def test_multi_token_prediction_matches_stock(env, fresh_warnings, depths, detach, config):
    """MTP training on the tree: each depth's rows follow every sample's own path (a shared
    row predicts once per distinct continuation, weighted by the samples behind it). Against
    verl's stock MTP (megatron's block, rolled ids / labels / mask per sequence) on the
    unshared batch: log-probs, entropy, the PPO loss, every gradient (MTP layers, embedding
    and decoder, which the MTP loss reaches unless ``detach_encoder``) and the logged MTP
    losses. Branching tree, GRPO groups and step-wise samples, several micro-batches. The loss
    is verl's own on megatron-core 0.16, megatron's ``process_mtp_loss`` on 0.19 (which trains
    the output layer too). Model-level checks on nasty shapes: tests/test_tree_mtp.py."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    impl, _ = env
    MTPLossLoggingHelper.tracker.clear()  # sized by the first model's depth count
    model = _mtp_model(depths, detach, **config)
    rng = np.random.default_rng(30 + depths)
    samples = WORKLOADS["tree"](rng) + WORKLOADS["grpo"](rng, prompts=1) + WORKLOADS["stepwise"](rng, steps=3)
    # fixed micro-batches of whole groups (the same in both runs: the logged MTP loss is a mean
    # of per-micro-batch means)
    data = make_batch(samples, rng, temperature=0.9, use_dynamic_bsz=False, micro_batch_size_per_gpu=6)
    stock, _ = _mtp_run(impl, model, data, False, detach)
    tree, _ = _mtp_run(impl, model, data, True, detach)
    assert_outputs(stock, tree)
    n, t = step_tokens(tree)
    assert t < n and len(tree["metrics"][TOKENS_IN]) >= 2  # the tree path ran, several micro-batches
    stock_t, g_stock = _mtp_run(impl, model, data, False, detach, _ppo())
    tree_t, g_tree = _mtp_run(impl, model, data, True, detach, _ppo())
    np.testing.assert_allclose(tree_t["loss"], stock_t["loss"], rtol=RTOL)  # per micro-batch
    mtp_keys = sorted(k for k in stock_t["metrics"] if k.startswith("mtp_losses/"))
    assert len(mtp_keys) == depths and mtp_keys == sorted(k for k in tree_t["metrics"] if k.startswith("mtp_losses/"))
    for key in mtp_keys:
        np.testing.assert_allclose(np.sum(tree_t["metrics"][key]), np.sum(stock_t["metrics"][key]), rtol=RTOL)
    assert g_stock.keys() == g_tree.keys()
    assert_grads([g_stock[k] for k in g_stock], [g_tree[k] for k in g_stock])
    # the MTP loss really reached the MTP layers (and, without detach, the decoder's embedding)
    assert all(float(g.abs().max()) > 0 for k, g in g_tree.items() if k.startswith("mtp."))


def test_multi_token_prediction_with_shared_dropout(env, recwarn):
    """prefix_grouper.shared_dropout=true with hidden dropout in training: the MTP layers' own
    tree batches (one per depth) carry the opt-in too, so the step runs on the tree, the MTP
    loss reaching the MTP layers, reproducible under a seed."""
    impl, _ = env
    model = _mtp_model(1, False, hidden_dropout=0.1).train()
    rng = np.random.default_rng(33)
    data = make_batch(WORKLOADS["tree"](rng), rng, temperature=0.9)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(_mtp_run(impl, model, data, True, False, _ppo(), shared_dropout=True))
    assert not [w for w in recwarn if "stock forward" in str(w.message)]
    (first, g_first), (again, g_again) = runs
    n, t = step_tokens(first)
    assert t < n
    np.testing.assert_array_equal(first["loss"], again["loss"])
    assert all(torch.equal(g_first[k], g_again[k]) for k in g_first if g_first[k] is not None)
    assert all(float(g.abs().max()) > 0 for k, g in g_first.items() if k.startswith("mtp."))


def test_multi_token_prediction_layout_refusal_names_it(env):
    from ps_mcore.integrations.verl_common.megatron import megatron_batch_refusal

    model = _mtp_model(1, False)
    model.config.num_moe_experts = 4  # only the decision is checked: the model is not run
    try:
        reason = megatron_batch_refusal(model, {"mtp_enable_train": True}, None)
    finally:
        model.config.num_moe_experts = None
    assert "multi-token prediction (MTP) training" in reason and "MoE" in reason
    model.mtp.mtp_layer_pattern = "*"  # megatron-core 0.19's hybrid MTP layers (decision only)
    try:
        reason = megatron_batch_refusal(model, {"mtp_enable_train": True}, None)
    finally:
        model.mtp.mtp_layer_pattern = None
    assert "mtp_hybrid_override_pattern" in reason
    assert megatron_batch_refusal(model, {"mtp_enable_train": True, "logits_processor": None}, None) is None


@pytest.mark.parametrize("sizes, words", [
    (dict(context=2), "context parallelism"),
    (dict(pipeline=2), "pipeline parallelism"),
    (dict(tensor=2), None),  # TP (and SP) runs on the tree: tests/test_tree_mtp.py's TP worlds
])
def test_multi_token_prediction_model_parallel_refusal(env, sizes, words, monkeypatch):
    """Which model-parallel layouts MTP training refuses on a tree (the decision only, the
    layout's world sizes faked)."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.integrations.verl_common.mtp import mtp_refusal

    model = _mtp_model(1, False)
    for kind, size in sizes.items():
        monkeypatch.setattr(mpu, f"get_{kind}_model_parallel_world_size" if kind != "context"
                            else "get_context_parallel_world_size", lambda size=size: size)
    reason = mtp_refusal(model)
    assert reason is None if words is None else words in reason


class _VisionLanguageStandIn(torch.nn.Module):
    """What verl's VLM forward hands a Megatron vision-language model (mbridge's Qwen2.5-VL):
    padded ``input_ids [B, S]`` with a bool ``attention_mask``, THD ``packed_seq_params`` and
    the image tensors. Test-only: the vision tower (HF processor outputs, weights) is absent;
    this packs the text tokens into one THD row for the tiny GPTModel and records its inputs."""

    def __init__(self, language_model):
        super().__init__()
        self.language_model = language_model
        self.config = language_model.config
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids, packed_seq_params, pixel_values=None, image_grid_thw=None):
        self.calls.append(dict(shape=tuple(input_ids.shape), mask=attention_mask is not None, pixel_values=pixel_values))
        tokens = input_ids[attention_mask][None]  # row-major: the sequences one after another
        return self.language_model(input_ids=tokens, position_ids=None, attention_mask=None,
                                   packed_seq_params=packed_seq_params)


@pytest.mark.parametrize("images", [True, False], ids=["images", "text-only"])
def test_fallback_vision_language(env, fresh_warnings, images):
    """A VLM (``vision_config`` in the HF config) on a batch with or without images: verl's
    stock VLM forward (bshd ids + mask, ``pixel_values`` from ``multi_modal_inputs``)."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    impl, _ = env
    cfg = tiny_config("qwen2")
    lm = build_gpt(cfg, _tree_spec(cfg))
    randomize_(lm, seed=6)
    model = _VisionLanguageStandIn(lm)
    data = _fallback_batch(22)
    if images:
        gen = torch.Generator().manual_seed(22)
        data["multi_modal_inputs"] = NonTensorStack.from_list(
            [NonTensorData({"pixel_values": torch.randn(4, 6, generator=gen)}) for _ in range(data.batch_size[0])])

    def vlm(engine):
        engine.model_config.hf_config = SimpleNamespace(
            architectures=["Qwen2_5_VLForConditionalGeneration"], vision_config=SimpleNamespace())

    _fallback_case(impl, model, data, "vision-language", vlm)
    assert model.calls and all(c["mask"] and len(c["shape"]) == 2 for c in model.calls)  # verl's VLM inputs
    assert all((c["pixel_values"] is not None) is images for c in model.calls)


def test_parallel_layout_refusals_name_the_feature(env):
    """Static CP builds tree specs (the glue shares under CP); dynamic CP builds stock specs and
    its micro-batches (``local_cp_size``) take the stock forward, each naming the feature."""
    from types import SimpleNamespace

    from ps_mcore.integrations.verl_common.megatron import megatron_batch_refusal, tree_build_refusal

    impl, model = env
    engine = SimpleNamespace(engine_config=SimpleNamespace(context_parallel_size=2, dynamic_context_parallel=False))
    assert tree_build_refusal(engine) is None
    engine.engine_config.dynamic_context_parallel = True
    assert tree_build_refusal(engine) == "dynamic context parallelism"
    rng = np.random.default_rng(10)
    batch = make_batch(WORKLOADS["grpo"](rng), rng)
    reason = megatron_batch_refusal(model, {"local_cp_size": 2}, batch)
    assert reason is not None and "dynamic context parallelism (local_cp_size)" in reason
    assert megatron_batch_refusal(model, {"logits_processor": None}, batch) is None


# ----------------------------------------------------------------------------- attention variants


def test_windows_and_sinks_model_matches_stock(env, fresh_warnings):
    """A model with megatron's sliding windows (every other layer) and learnable sinks
    (``softmax_type="learnable"``): verl's engine with prefix sharing equals its stock forward
    (log-probs, entropy, PPO loss and every gradient, the sink logits' included)."""
    impl, _ = env
    cfg = tiny_config("qwen2-swa-sinks")
    model = build_gpt(cfg, _tree_spec(cfg))
    randomize_(model, seed=12)
    assert [layer.self_attention.core_attention.window for layer in model.decoder.layers] == [3, None]
    rng = np.random.default_rng(13)
    data = make_batch(WORKLOADS["tree"](rng), rng)
    setting = _setting("arbitrary_prefix")
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    tree, g_tree = _run(impl, model, data, setting, True, _ppo())
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)
    sinks = [i for i, (n, _) in enumerate(model.named_parameters()) if n.endswith("softmax_offset")]
    assert sinks and all(float(g_stock[i].abs().min()) > 0 for i in sinks)
    stock_i, _ = _run(impl, model, data, setting, False)
    tree_i, _ = _run(impl, model, data, setting, True)
    assert_outputs(stock_i, tree_i)
    n, t = step_tokens(tree_i)
    assert t < n


@pytest.mark.parametrize("window_size, tree", [((2, 0), True), ((2, 1), False)])
def test_model_build_with_windows_and_sinks(env, monkeypatch, fresh_warnings, window_size, tree):
    """The mbridge build of a windowed, sink-softmax model gets tree specs; a window with a
    right side (no tree form) builds stock specs with one warning naming it."""
    from ps_mcore.integrations.verl_common.megatron import has_tree_attention

    impl, _ = env
    setup.install([megatron_patchset()])
    config = tiny_config("qwen2-swa-sinks")
    object.__setattr__(config, "window_size", window_size)
    engine = _mbridge_engine(impl, monkeypatch, config)
    if tree:
        module = engine._build_megatron_module()
    else:
        with pytest.warns(UserWarning, match=r"stock specs: window_size=\(2, 1\): a right window"):
            module = engine._build_megatron_module()
    assert has_tree_attention(module[0]) is tree
    if not tree:  # Megatron-Bridge: verl's tf_config is None until the model exists; the provider is the config
        from ps_mcore.integrations.verl_common.megatron import tree_build_refusal

        bridge_engine = SimpleNamespace(engine_config=engine.engine_config, tf_config=None, provider=config)
        assert "window_size=(2, 1)" in tree_build_refusal(bridge_engine)


# ----------------------------------------------------------------------------- fused kernels


@pytest.fixture
def fused_env(env, monkeypatch):
    """The env model with verl's fused GPTModel forward (``patch_fused_forward``, as the engine
    does for ``use_fused_kernels``); its kernel, Triton's ``linear_cross_entropy`` (CUDA), is
    verl's torch kernel ``FusedLinearForPPO`` here (``cpu_linear_cross_entropy``). Yields
    (impl, model, rows the kernel saw per call)."""
    from verl.models.mcore import model_forward_fused

    calls = []
    monkeypatch.setattr(model_forward_fused, "linear_cross_entropy", partial(cpu_linear_cross_entropy, rows_seen=calls))
    impl, model = env
    model_forward_fused.patch_fused_forward(model)
    yield impl, model, calls
    for name in ("forward", "forward_backup", "_verl_fused_forward_mode"):  # the shared model as it was
        model.__dict__.pop(name, None)


def _fused_engine(engine):
    engine.engine_config.use_fused_kernels = True  # verl 0.9.1 checks the batch flag against it


@pytest.mark.parametrize("workload, loss_agg_mode", [("grpo", "token-mean"), ("stepwise", "seq-mean-token-sum"),
                                                     ("tree", "seq-mean-token-mean")])
def test_fused_kernels_match_stock(fused_env, workload, loss_agg_mode):
    """``use_fused_kernels=True``: verl's fused GPTModel forward runs the packed tree rows and
    its kernel the labelled rows (fewer than the batch's tokens); log-probs, entropy, the PPO
    loss and every gradient equal verl's stock fused run."""
    impl, model, calls = fused_env
    rng = np.random.default_rng(31)
    data = make_batch(WORKLOADS[workload](rng), rng, temperature=0.7, use_fused_kernels=True)
    n = int(data["input_ids"].offsets()[-1])
    setting = _setting(MODES[workload])
    run = partial(_run, impl, model, data, setting, engine_setup=_fused_engine)
    stock, _ = run(False)
    assert sum(calls) == n  # stock: the kernel on every token
    calls.clear()
    tree, _ = run(True)
    assert_outputs(stock, tree)
    tokens_in, packed = step_tokens(tree)
    assert tokens_in == n and packed < n and packed <= sum(calls) < n
    loss_fn = _ppo(loss_agg_mode)
    stock, g_stock = run(False, loss_fn)
    tree, g_tree = run(True, loss_fn)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


def test_fused_kernels_refusals_name_the_feature(fused_env, monkeypatch):
    """What the fused tree path does not run takes verl's stock fused forward, named: context
    parallelism, a vision-language model, MTP layers (verl turns fused kernels off with MTP),
    a forward other than verl's fused GPTModel one."""
    from megatron.core import parallel_state as mpu

    from ps_mcore.integrations.verl_common.megatron import megatron_fused_refusal

    _, model, _ = fused_env
    assert megatron_fused_refusal(model, {}) is None
    with monkeypatch.context() as m:  # through the engine: tests/test_verl_megatron_parallel.py (CP=2)
        m.setattr(mpu, "get_context_parallel_world_size", lambda: 2)
        assert "context parallelism" in megatron_fused_refusal(model, {})
    assert "vision-language" in megatron_fused_refusal(model, {"multi_modal_inputs": {"pixel_values": torch.zeros(1)}})
    with monkeypatch.context() as m:
        m.setattr(model.config, "mtp_num_layers", 1)
        assert "MTP layers" in megatron_fused_refusal(model, {})
    patched = {name: model.__dict__.pop(name) for name in ("forward", "_verl_fused_forward_mode") if name in model.__dict__}
    try:
        assert "not verl's fused GPTModel forward" in megatron_fused_refusal(model, {})
    finally:
        model.__dict__.update(patched)


def test_fused_forward_is_recognised_through_wrappers(fused_env, monkeypatch):
    """verl's fused GPTModel forward is still recognised when a profiler or decorator wraps the
    module's function (``functools.wraps``, as ``--profile-idle`` does) or the instance's: the
    tree path runs, where an identity check would fall back to verl's stock fused forward."""
    import functools

    from verl.models.mcore import model_forward_fused as fused

    from ps_mcore.integrations.verl_common.megatron import megatron_fused_refusal, verl_fused_call_kwargs

    _, model, _ = fused_env
    if "_verl_fused_forward_mode" in model.__dict__:  # verl 0.9.1 on megatron-core >= 0.18: a hook, no forward
        pytest.skip("this verl marks its fused forward by an attribute")
    original = fused._fused_GPTModel_forward
    wrapped = functools.wraps(original)(lambda *a, **k: original(*a, **k))
    monkeypatch.setattr(fused, "_fused_GPTModel_forward", wrapped)
    assert megatron_fused_refusal(model, {}) is None
    assert verl_fused_call_kwargs(model, 0.5) == {"temperature": 0.5}
    bound = model.__dict__["forward"]
    monkeypatch.setitem(model.__dict__, "forward", functools.wraps(bound.__func__)(lambda *a, **k: None).__get__(model))
    assert verl_fused_call_kwargs(model, 0.5) == {"temperature": 0.5}
    monkeypatch.setitem(model.__dict__, "forward", (lambda self: None).__get__(model))
    assert "not verl's fused GPTModel forward" in megatron_fused_refusal(model, {})
