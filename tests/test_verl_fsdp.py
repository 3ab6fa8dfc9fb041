"""verl's FSDP engines (0.8.0: patchset ``verl080_fsdp``; 0.9.1: ``verl091_fsdp``), patched vs stock, on real transformers
models (tiny random Qwen2: GQA, qkv bias; fp32, CPU, sdpa as the stock attention).

verl's real ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` run their real
``forward_backward_batch`` -> ``prepare_micro_batches`` -> ``forward_step`` ->
``prepare_model_inputs`` / model / ``prepare_model_outputs`` -> loss on verl worker
TensorDicts (nested input_ids): GRPO groups, step-wise samples, a tree. The engine object is
built with its real ``__init__`` (gloo, world size 1) but without ``initialize()`` (model
loading from a checkpoint path, FSDP wrapping with CUDA mixed precision, optimizer): the test
sets ``engine.module`` to the model built here (plain, or wrapped with FSDP2's
``fully_shard`` on CPU) and ``_autocast_dtype`` to fp32 (what ``_build_fsdp_module`` sets
for fp32 parameters).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_warnings")  # each test sees its own one-time warnings

from verl_batches import (  # noqa: E402
    DISTILLATION_KEYS, RTOL, VOCAB, WORKLOADS, add_value_targets, assert_grads, assert_outputs, distillation_loss,
    forbid, long_units, make_batch, sample_temperatures, step_tokens, stock_then_ours, sum_pi_squared_loss,
    unshared_batch, with_statistics,
)
from verl_helpers import fsdp_patchset  # noqa: E402

from ps_mcore import setup  # noqa: E402
from ps_mcore.integrations import patching  # noqa: E402
from ps_mcore.integrations.verl_common import fsdp as fsdp_glue  # noqa: E402
from ps_mcore.integrations.verl_common.batch import sequences  # noqa: E402
from ps_mcore.integrations.verl_common.config import ENGINE_ATTR, PrefixGrouperConfig, PrefixSharingSetting  # noqa: E402
from ps_mcore.integrations.verl_common.fsdp import tree_model_inputs  # noqa: E402
from ps_mcore.integrations.verl_common.trainer import TOKENS_IN, TOKENS_PACKED  # noqa: E402
from ps_mcore.fsdp_bridge import hf_attention  # noqa: E402
from ps_mcore.attention import tree_attention  # noqa: E402
from ps_mcore.planner import plan_prefix_tree  # noqa: E402

PATCHSET = fsdp_patchset()
MODES = {"grpo": "prompt_only", "stepwise": "arbitrary_prefix", "tree": "arbitrary_prefix"}
# Fixed-size micro-batches of batches already in group order: prefix-aware micro-batching is
# verl's own there, so fallback runs must be bit-identical to stock over several micro-batches.
FIXED_MBS = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2)


@pytest.fixture(scope="module")
def impl():
    if not dist.is_initialized():  # an in-process store: no port, so xdist workers cannot collide
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from verl.workers.engine.fsdp import transformer_impl

    yield transformer_impl
    setup.uninstall()


def make_model(seed: int = 0, value: bool = False) -> torch.nn.Module:
    """Tiny random Qwen2 (4 query / 2 kv heads, head dim 24, qkv bias); ``value``: the token
    classification head (``num_labels=1``) verl's FSDP critic uses."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, attn_implementation="sdpa",
        num_labels=1, classifier_dropout=0.0,
    )
    torch.manual_seed(seed)
    auto = transformers.AutoModelForTokenClassification if value else transformers.AutoModelForCausalLM
    model = auto.from_config(config).float()
    model.train()
    return model


def _setting(mode, **kw):
    return PrefixSharingSetting(True, PrefixGrouperConfig(mode=mode, min_prefix_len=4, min_saved_fraction=0.0, **kw))


def make_engine(impl, cls, model, setting, **engine_options):
    """verl's engine class ``cls`` through its real ``__init__``, around ``model``
    (``engine_options``: more ``FSDPEngineConfig`` fields, e.g. the Ulysses SP size)."""
    from verl.workers.config import FSDPEngineConfig

    engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, **engine_options)
    if setting is not None:
        object.__setattr__(engine_config, ENGINE_ATTR, setting)
    model_config = SimpleNamespace(use_remove_padding=True, lora_rank=0)
    engine = cls(model_config=model_config, engine_config=engine_config, optimizer_config=None, checkpoint_config=None)
    engine.module = model
    engine._autocast_dtype = torch.float32
    return engine


def _grads(model):
    out = []
    for p in model.parameters():
        g = p.grad
        out.append(None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).clone())
    return out


def _run(impl, model, data, setting, patched, loss_fn=None, cls=None, engine_setup=None):
    """One forward(+backward) through the engine; returns (output, grads)."""
    if patched:
        setup.install([PATCHSET])
    else:
        setup.uninstall()
    engine = make_engine(impl, cls or impl.FSDPEngineWithLMHead, model, setting)
    if engine_setup is not None:
        engine_setup(engine)
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    return out, _grads(model)








def _assert_training_matches_stock(impl, model, data, setting, loss_fn, cls=None, keys=("log_probs", "entropy")):
    """A training step, stock vs patched: loss, every parameter gradient and the step's
    outputs. Returns the patched step's output."""
    stock, g_stock = _run(impl, model, data, setting, False, loss_fn, cls=cls)
    tree, g_tree = _run(impl, model, data, setting, True, loss_fn, cls=cls)
    np.testing.assert_allclose(sum(tree["loss"]), sum(stock["loss"]), rtol=RTOL)
    assert_grads(g_stock, g_tree)
    assert_outputs(stock, tree, keys)
    return tree


def _bit_identical(a, b, g_a=(), g_b=()):
    assert a["loss"] == b["loss"]
    for key, value in a["model_output"].items():
        assert torch.equal(value.values(), b["model_output"][key].values()), key
    assert all(torch.equal(x, y) for x, y in zip(g_a, g_b))


def _actor_config(loss_agg_mode="token-mean"):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01, loss_agg_mode=loss_agg_mode)


def _ppo(loss_agg_mode="token-mean"):
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=_actor_config(loss_agg_mode))




def _batch(workload, seed, **kw):
    rng = np.random.default_rng(seed)
    return make_batch(WORKLOADS[workload](rng), rng, **kw)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_log_probs_and_entropy_match_stock(impl, workload, remove_padding):
    model = make_model()
    data = _batch(workload, 1, use_remove_padding=remove_padding, temperature=0.8)
    setting = _setting(MODES[workload])
    stock, _ = _run(impl, model, data, setting, patched=False)
    tree, _ = _run(impl, model, data, setting, patched=True)
    assert_outputs(stock, tree)
    n, t = step_tokens(tree)
    assert n == int(data["input_ids"].offsets()[-1]) and t < n  # the tree path really ran


@pytest.mark.parametrize(
    "workload, loss_agg_mode, remove_padding",
    [("grpo", "token-mean", True), ("stepwise", "seq-mean-token-sum", False),
     ("tree", "seq-mean-token-mean", True), ("tree", "seq-mean-token-sum-norm", False)],
)
def test_ppo_loss_and_gradients_match_stock(impl, workload, loss_agg_mode, remove_padding):
    model = make_model(seed=1)
    data = _batch(workload, 2, temperature=0.7, use_remove_padding=remove_padding)
    setting = _setting(MODES[workload])
    tree = _assert_training_matches_stock(impl, model, data, setting, _ppo(loss_agg_mode))
    assert step_tokens(tree)[1] < step_tokens(tree)[0]


@pytest.mark.parametrize("cast_inputs", [False, True])
def test_fsdp2_wrapped_model_matches_stock(impl, monkeypatch, cast_inputs):
    """The model wrapped by FSDP2's ``fully_shard`` (what verl's fsdp2 strategy builds): the
    tree call passes through FSDP's forward hooks, the wrapped decoder is found.
    ``cast_inputs``: the ``MixedPrecisionPolicy(..., cast_forward_inputs=True)`` verl's engine
    builds (here with fp32 parameters, as its fp32 ``mixed_precision`` config does), whose hooks
    walk every module's forward kwargs: every layer's attention runs on the plan the glue made,
    and a plan linked to its moved copy, as a GPU run's plan is, passes too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    made, seen = [], []

    def linked_inputs(micro_batch, plan, *args_, **kwargs):
        inputs, args = tree_model_inputs(micro_batch, plan, *args_, **kwargs)
        args[fsdp_glue.PLAN_KEY].to("meta")  # host <-> moved copy, as plan.to("cuda") links them
        made.append(args[fsdp_glue.PLAN_KEY])
        return inputs, args

    def spied_attention(q, k, v, plan, *args, **kwargs):
        seen.append(plan)
        return tree_attention(q, k, v, plan, *args, **kwargs)

    monkeypatch.setattr(fsdp_glue, "tree_model_inputs", linked_inputs)
    monkeypatch.setattr(hf_attention, "tree_attention", spied_attention)
    dtype = torch.float32 if cast_inputs else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, cast_forward_inputs=cast_inputs)
    model = make_model(seed=2)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    data = _batch("tree", 3, temperature=0.9)
    tree = _assert_training_matches_stock(impl, model, data, _setting("arbitrary_prefix"), _ppo())
    assert step_tokens(tree)[1] < step_tokens(tree)[0]
    assert len(seen) >= 2 * len(made) > 0 and all(any(p is m for m in made) for p in seen)


def test_critic_values_and_value_loss_match_stock(impl):
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    critic = make_model(seed=3, value=True)
    data = _batch("stepwise", 8)
    gen = torch.Generator().manual_seed(8)  # independent of test order
    data["values"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]
    data["returns"] = torch.randn(data["responses"].shape, generator=gen) * data["response_mask"]
    setting = _setting("arbitrary_prefix")
    cls = impl.FSDPEngineWithValueHead
    stock, _ = _run(impl, critic, data, setting, False, cls=cls)
    tree, _ = _run(impl, critic, data, setting, True, cls=cls)
    assert_outputs(stock, tree, keys=("values",))
    assert step_tokens(tree)[1] < step_tokens(tree)[0]
    loss_fn = partial(value_loss, config=FSDPCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    _assert_training_matches_stock(impl, critic, data, setting, loss_fn, cls=cls, keys=("values",))


@pytest.mark.parametrize("dynamic", [True, False])
def test_micro_batched_outputs_restored_in_batch_order(impl, dynamic):
    """Groups shuffled through the batch: the FSDP module's ``prepare_micro_batches`` is the
    prefix-aware one (every micro-batch shares), outputs come back in batch order."""
    model = make_model(seed=4)
    rng = np.random.default_rng(5)
    samples = WORKLOADS["grpo"](rng, prompts=3, group=2)
    samples = [samples[i] for i in rng.permutation(len(samples))]
    kw = dict(use_dynamic_bsz=True, max_token_len_per_gpu=45) if dynamic else FIXED_MBS
    data = make_batch(samples, rng, **kw)
    tree = _assert_training_matches_stock(impl, model, data, _setting("prompt_only"), _ppo())
    per_micro = list(zip(tree["metrics"][TOKENS_IN], tree["metrics"][TOKENS_PACKED]))
    assert len(per_micro) >= 2 and all(t < n for n, t in per_micro)  # several micro-batches, all sharing


# ----------------------------------------------------------------------------- stock paths


def test_disabled_by_env_is_bit_identical(impl, monkeypatch):
    model = make_model(seed=5)
    data = _batch("tree", 3, use_dynamic_bsz=True, max_token_len_per_gpu=40)
    setting = _setting("arbitrary_prefix")
    _run(impl, model, data, setting, True)  # the tree path switched the model's attention
    stock, g_stock = _run(impl, model, data, setting, False, _ppo())
    assert model.config._attn_implementation == "sdpa"  # uninstall switched it back
    _run(impl, model, data, setting, True)
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "0")
    off, g_off = _run(impl, model, data, setting, True, _ppo())
    assert model.config._attn_implementation == "prefix_tree"  # unshared calls: its base (sdpa)
    _bit_identical(stock, off, g_stock, g_off)
    assert TOKENS_IN not in off["metrics"]
    stock_i, _ = _run(impl, model, data, setting, False)
    off_i, _ = _run(impl, model, data, setting, True)
    _bit_identical(stock_i, off_i)


def test_engine_without_setting_is_bit_identical(impl):
    model = make_model()
    data = _batch("grpo", 4)
    stock, g_stock = _run(impl, model, data, None, False, _ppo())
    patched, g_patched = _run(impl, model, data, None, True, _ppo())
    _bit_identical(stock, patched, g_stock, g_patched)
    assert model.config._attn_implementation == "sdpa"


def test_fallback_when_savings_too_small(impl):
    """Two of three samples share 3 tokens of 70 (under the default 5%): verl's forward, with
    the step's token counts recorded."""
    model = make_model()
    rng = np.random.default_rng(6)
    head = rng.integers(1, VOCAB, 3).tolist()
    samples = [(head + rng.integers(1, VOCAB, 19).tolist(), rng.integers(1, VOCAB, 2).tolist(), f"u{i}") for i in range(2)]
    samples.append((rng.integers(1, VOCAB, 20).tolist(), rng.integers(1, VOCAB, 2).tolist(), "u2"))
    data = make_batch(samples, rng)
    setting = PrefixSharingSetting(True, PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=3))
    stock, _ = _run(impl, model, data, setting, False)
    tree, _ = _run(impl, model, data, setting, True)
    _bit_identical(stock, tree)
    assert step_tokens(tree) == (70, 70)


def test_a_batch_sharing_nothing_is_verls_own_run(impl, monkeypatch):
    """No two samples share a token: verl's micro-batches and forward, unplanned and unchecked
    (no host work of ours per micro-batch), bit for bit, with each micro-batch's token counts."""
    data = unshared_batch(VOCAB)
    (stock, stock_train, g_stock), (tree, tree_train, g_tree) = stock_then_ours(
        partial(_run, impl, make_model()), data, _setting("arbitrary_prefix"), _ppo,
        lambda: forbid(monkeypatch, fsdp_glue, "plan_or_stock", "fsdp_batch_refusal"))
    _bit_identical(stock, tree)
    _bit_identical(stock_train, tree_train, g_stock, g_tree)
    per_micro = list(zip(tree["metrics"][TOKENS_IN], tree["metrics"][TOKENS_PACKED]))
    n = int(data["input_ids"].offsets()[-1])
    assert len(per_micro) >= 2 and all(a == b for a, b in per_micro) and step_tokens(tree) == (n, n)


def _fallback_case(impl, model, data, setting, match, engine_setup=None, cls=None):
    """Stock numbers, bit for bit, over several micro-batches (inference, then a ppo training
    step: loss and every gradient), with one warning for both steps."""
    stock, _ = _run(impl, model, data, setting, False, cls=cls, engine_setup=engine_setup)
    stock_train, g_stock = _run(impl, model, data, setting, False, _ppo(), cls=cls, engine_setup=engine_setup)
    with pytest.warns(UserWarning, match=match) as record:
        tree, _ = _run(impl, model, data, setting, True, cls=cls, engine_setup=engine_setup)
        tree_train, g_tree = _run(impl, model, data, setting, True, _ppo(), cls=cls, engine_setup=engine_setup)
    assert len([w for w in record if match in str(w.message)]) == 1
    _bit_identical(stock, tree)
    _bit_identical(stock_train, tree_train, g_stock, g_tree)
    n = int(data["input_ids"].offsets()[-1])
    assert len(tree["metrics"][TOKENS_IN]) >= 2 and step_tokens(tree) == (n, n)


@pytest.mark.parametrize("remove_padding", [True, False])
@pytest.mark.parametrize("workload", ["grpo", "tree"])
def test_per_sample_temperature_matches_stock(impl, workload, remove_padding):
    """Per-sample temperatures (verl's ``[B]`` tensor) take the tree path: a shared row is
    normalised once per distinct temperature among its samples. Log-probs, entropy, the PPO
    loss and every gradient equal verl's stock per-sample division."""
    data = _batch(workload, 7, use_remove_padding=remove_padding)
    data["temperature"] = sample_temperatures(data.batch_size[0], seed=7)
    tree = _assert_training_matches_stock(impl, make_model(), data, _setting(MODES[workload]), _ppo())
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran


@pytest.mark.parametrize(
    "workload, temperature, clamp, remove_padding",
    [("grpo", "one", -5.0, True), ("stepwise", "per-sample", -5.0, False), ("tree", "one", None, True),
     ("tree", "per-sample", -5.0, True)],
)
def test_topk_distillation_and_sum_pi_squared_match_stock(impl, workload, temperature, clamp, remove_padding):
    """``calculate_sum_pi_squared`` and top-k distillation (verl's ``distillation_ppo_loss``:
    forward KL on the teacher's top-k ids, each sample's own) run on the tree: every row
    statistic once per (row, temperature) pair, each token its own teacher ids. Outputs, the
    distillation + PPO loss and every gradient equal verl's stock logits processor."""
    data = with_statistics(_batch(workload, 21, temperature=0.8, use_remove_padding=remove_padding), seed=21)
    if temperature == "per-sample":
        data["temperature"] = sample_temperatures(data.batch_size[0], seed=21)
    loss = distillation_loss(_actor_config(), data, clamp)
    keys = ("log_probs", "entropy", "sum_pi_squared") + DISTILLATION_KEYS
    tree = _assert_training_matches_stock(impl, make_model(seed=2), data, _setting(MODES[workload]), loss, keys=keys)
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran


def test_sum_pi_squared_log_prob_pass_and_gradients_match_stock(impl):
    """A log-prob pass with ``calculate_sum_pi_squared`` (what verl's trainer asks for the
    optimal-baseline estimators) and a loss with a gradient through it, per-sample temperatures:
    equal to stock."""
    data = with_statistics(_batch("tree", 22), seed=22, distillation=False)
    data["temperature"] = sample_temperatures(data.batch_size[0], seed=22)
    model, setting = make_model(seed=3), _setting("arbitrary_prefix")
    stock, _ = _run(impl, model, data, setting, False)
    tree, _ = _run(impl, model, data, setting, True)
    assert_outputs(stock, tree, ("log_probs", "entropy", "sum_pi_squared"))
    assert step_tokens(tree)[1] < step_tokens(tree)[0]
    _assert_training_matches_stock(impl, model, data, setting, sum_pi_squared_loss(_ppo()), keys=("sum_pi_squared",))


def test_row_statistics_refusals_name_the_option(impl):
    """What the tree path cannot compute falls back by name: top-k distillation behind a logits
    processor other than verl's ``distillation_ppo_loss`` or a strategy the installed verl's top-k
    loss does not dispatch, and both statistics under fused kernels (verl's fused forward refuses calculate_sum_pi_squared and
    computes distillation only in VeOmni's kernels). A schedule refuses them (its calls return
    log-probs and entropy only)."""
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, make_model(), _setting("arbitrary_prefix"))
    data = with_statistics(_batch("tree", 23), seed=23)
    assert fsdp_glue.fsdp_batch_refusal(engine, data, distillation_loss(_actor_config(), data)) is None
    assert "other than verl's distillation_ppo_loss" in fsdp_glue.fsdp_batch_refusal(engine, data, _ppo())
    other = _actor_config()
    object.__setattr__(other, "strategy", "other")  # verl 0.8.0 also refuses fsdp2 there, 0.9.1 not
    assert "strategy 'other'" in fsdp_glue.fsdp_batch_refusal(engine, data, distillation_loss(other, data))
    assert "calculate_sum_pi_squared" in fsdp_glue._fused_refusal(engine, data)
    data = with_statistics(_batch("tree", 23), seed=23, distillation=False)
    assert "calculate_sum_pi_squared" in fsdp_glue.fsdp_schedule_refusal(engine, data)
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, calculate_sum_pi_squared=False, distillation_use_topk=True)
    assert "distillation_use_topk" in fsdp_glue.fsdp_schedule_refusal(engine, data)
    assert "distillation top-k" in fsdp_glue._fused_refusal(engine, data)


def _dropout_model(seed: int = 0) -> torch.nn.Module:
    """Tiny Phi-3 in training mode with residual dropout (``resid_pdrop``)."""
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        resid_pdrop=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _seeded(engine):
    torch.manual_seed(11)  # both runs draw the same dropout masks


def test_fallback_active_dropout_names_the_keys(impl):
    """A training model with residual dropout runs verl's stock forward (same masks, same
    numbers), with one warning naming the dropouts, their key and the opt-in key."""
    data = _batch("tree", 8, **FIXED_MBS)
    _fallback_case(impl, _dropout_model(), data, _setting("arbitrary_prefix"), "config key resid_pdrop", engine_setup=_seeded)
    patching._WARNED.clear()
    with pytest.warns(UserWarning, match="resid_attn_dropout") as record:
        _run(impl, _dropout_model(), data, _setting("arbitrary_prefix"), True, engine_setup=_seeded)
    messages = [str(w.message) for w in record if "resid_attn_dropout" in str(w.message)]
    assert len(messages) == 1 and "actor_rollout_ref.actor.prefix_grouper.shared_dropout=true" in messages[0]


def test_shared_dropout_opt_in_runs_the_tree(impl, recwarn):
    """prefix_grouper.shared_dropout=true: the tree path runs the dropouts on the packed rows
    (reproducible under a seed, different from eval), no warning."""
    data = _batch("tree", 8, **FIXED_MBS)
    setting = _setting("arbitrary_prefix", shared_dropout=True)
    model = _dropout_model()
    first, _ = _run(impl, model, data, setting, True, engine_setup=_seeded)
    again, _ = _run(impl, model, data, setting, True, engine_setup=_seeded)
    assert not [w for w in recwarn if "stock forward" in str(w.message)]
    tokens_in, tokens_packed = step_tokens(first)
    assert tokens_packed < tokens_in
    _bit_identical(first, again)
    model.eval()
    without, _ = _run(impl, model, data, setting, True)
    assert not torch.equal(first["model_output"]["log_probs"].values(), without["model_output"]["log_probs"].values())


def test_fallback_engine_subclass_overriding_seams(impl):
    class Subclass(impl.FSDPEngineWithLMHead):  # as VeOmni's engine: post-processes verl's inputs
        def prepare_model_inputs(self, micro_batch):
            return super().prepare_model_inputs(micro_batch)

    data = _batch("tree", 8, **FIXED_MBS)
    _fallback_case(impl, make_model(), data, _setting("arbitrary_prefix"), "Subclass overrides", cls=Subclass)


def _partitions(impl, engine, data):
    """The FSDP module's ``prepare_micro_batches`` as ``forward_backward_batch`` calls it."""
    from ps_mcore.integrations.verl_common.engine import with_engine_context

    def forward_backward_batch(_engine):
        return impl.prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)[1]

    return with_engine_context(forward_backward_batch)(engine)


@pytest.mark.parametrize(
    "flags", [dict(use_fused_kernels=True, use_remove_padding=False), dict(use_fused_kernels=True), {}]
)
def test_whole_batch_fallback_keeps_verl_micro_batches(impl, flags):
    """Fused kernels without remove-padding on verl 0.8.0: every micro-batch runs verl's stock
    forward, so micro-batching stays verl's (raw-token budget); otherwise (verl 0.9.1, Ulysses
    SP and fused kernels included) it is the prefix-aware one."""
    rng = np.random.default_rng(10)
    samples = WORKLOADS["grpo"](rng, prompts=3, group=2)
    samples = [samples[i] for i in rng.permutation(len(samples))]
    data = make_batch(samples, rng, use_dynamic_bsz=True, max_token_len_per_gpu=45, **flags)
    setting = _setting("prompt_only")
    setup.uninstall()
    stock = _partitions(impl, make_engine(impl, impl.FSDPEngineWithLMHead, make_model(), setting), data)
    setup.install([PATCHSET])
    patched = _partitions(impl, make_engine(impl, impl.FSDPEngineWithLMHead, make_model(), setting), data)
    whole_batch_stock = flags.get("use_remove_padding") is False and fsdp_glue.fused_output_is_response_padded()
    assert (patched == stock) is whole_batch_stock
    uids = list(data["uid"])
    assert whole_batch_stock or all(len({uids[i] for i in part}) == 1 for part in patched)


@pytest.fixture
def fused_model(monkeypatch):
    """``make_model`` with verl's real fused forward (``patch_forward_with_backends`` swaps the
    model class's ``forward``; restored after the test); ``backend`` "torch" runs on CPU.

    The patchset is uninstalled first: its tree wrapper of the class's fused forward would
    otherwise be undone by a later test's uninstall, putting verl's fused forward back on the
    restored class."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    def build(seed=6, backend="torch"):
        model = make_model(seed=seed)
        monkeypatch.setattr(type(model), "forward", type(model).forward)
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
        return model

    yield build
    setup.uninstall()  # before monkeypatch restores the class (this fixture tears down first)


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_fused_kernels_match_stock(impl, fused_model, workload):
    """``use_fused_kernels=True`` (verl's torch kernel, ``FusedLinearForPPO``): the decoder runs
    the tree, the kernel runs on the distinct (row, next-token) pairs; log-probs, entropy, the
    PPO loss and every gradient equal verl's fused forward on the unshared batch."""
    data = _batch(workload, 13, use_fused_kernels=True, temperature=0.8)
    tree = _assert_training_matches_stock(impl, fused_model(), data, _setting(MODES[workload]), _ppo())
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran


def test_fused_kernels_run_verl_fused_forward_on_labelled_rows(impl, fused_model, monkeypatch):
    """The kernel the tree path calls is verl's, on U = T + (extra labels at branch points)
    rows, each with its own label; without the fused forward the engine would find no
    ``log_probs`` in the output."""
    from verl.utils.experimental import torch_functional

    calls = []
    stock_apply = torch_functional.FusedLinearForPPOFunction.apply

    def recording(hidden, weight, labels, *args):
        calls.append((hidden.shape[0], labels.clone()))
        return stock_apply(hidden, weight, labels, *args)

    monkeypatch.setattr(torch_functional.FusedLinearForPPOFunction, "apply", recording)
    data = _batch("tree", 14, use_fused_kernels=True)
    setting = _setting("arbitrary_prefix")
    tree, _ = _run(impl, fused_model(), data, setting, True)
    from ps_mcore.integrations.verl_common.batch import plan_batch
    from ps_mcore.logprobs import labelled_rows

    plan = plan_batch(data, setting.config)
    rows = labelled_rows(plan)
    assert len(calls) == 1 and calls[0][0] == rows.num_pairs > plan.num_tokens
    assert torch.equal(calls[0][1], rows.labels)
    assert step_tokens(tree) == (plan.num_input_tokens, plan.num_tokens)


def test_fused_kernels_without_remove_padding_match_stock(impl, fused_model):
    """verl 0.9.1's fused forward without remove-padding (the padded ``[B, S]`` batch, its
    results packed back per token): the tree path, log-probs, entropy, the PPO loss and every
    gradient equal to it."""
    if fsdp_glue.fused_output_is_response_padded():
        pytest.skip("verl 0.8.0 returns a response-padded layout here (its fallback test covers it)")
    data = _batch("tree", 18, use_fused_kernels=True, use_remove_padding=False, temperature=0.7)
    tree = _assert_training_matches_stock(impl, fused_model(), data, _setting("arbitrary_prefix"), _ppo())
    n, t = step_tokens(tree)
    assert t < n  # the tree path ran


def test_fallback_fused_kernels_without_remove_padding(impl, fused_model):
    """verl 0.8.0's fused forward without remove-padding returns ``[B, response_length]``
    columns of the padded batch, padding rows included (its own PPO loss cannot read that
    layout): forward only, stock bit for bit."""
    if not fsdp_glue.fused_output_is_response_padded():
        pytest.skip("this verl packs its fused output per token (the tree path runs it)")
    model, setting = fused_model(), _setting("prompt_only")
    data = _batch("grpo", 15, use_fused_kernels=True, use_remove_padding=False, **FIXED_MBS)
    stock, _ = _run(impl, model, data, setting, False)
    with pytest.warns(UserWarning, match="use_remove_padding=False"):
        tree, _ = _run(impl, model, data, setting, True)
    _bit_identical(stock, tree)
    n = int(data["input_ids"].offsets()[-1])
    assert len(tree["metrics"][TOKENS_IN]) >= 2 and step_tokens(tree) == (n, n)


def test_fallback_fused_kernels_liger_backend(impl, fused_model):
    """verl 0.9.1's ``fused_kernels_backend: liger`` (Liger's kernel inside verl's torch-backend
    forward; verl's torch kernel where Liger is not installed): stock, the backend named."""
    import inspect

    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    if "impl_backend" not in inspect.signature(FusedLinearForPPO).parameters:
        pytest.skip("this verl has no liger fused-kernel backend")
    data = _batch("grpo", 17, use_fused_kernels=True, **FIXED_MBS)
    _fallback_case(impl, fused_model(backend="liger"), data, _setting("prompt_only"), "fused_kernels_backend='liger'")


def test_fused_forward_is_recognised_through_wrappers(monkeypatch):
    """verl's dense fused forward wrapped by a profiler or decorator (``functools.wraps``),
    on the class or in verl's module, still selects verl's kernel: an identity check would send
    the model to the stock fused forward."""
    import functools

    from verl.models.transformers import dense_common

    from ps_mcore.integrations.verl_common.fused import fused_kernel, torch_fused_kernel, triton_fused_kernel

    def wrap(fn):
        return functools.wraps(fn)(lambda *a, **k: fn(*a, **k))

    model = make_model(seed=6)
    monkeypatch.setattr(type(model), "forward", wrap(dense_common.forward_with_torch_backend))
    assert fused_kernel(type(model)) is torch_fused_kernel
    monkeypatch.setattr(dense_common, "forward_with_triton_backend", wrap(dense_common.forward_with_triton_backend))
    monkeypatch.setattr(type(model), "forward", dense_common.forward_with_triton_backend.__wrapped__)
    assert fused_kernel(type(model)) is triton_fused_kernel
    monkeypatch.setattr(type(model), "forward", wrap(lambda self, *a, **k: None))
    assert fused_kernel(type(model)) is None


def test_fallback_fused_forward_of_another_model(impl, monkeypatch):
    """A fused forward that is not verl's dense one (the VLM models have their own): stock."""
    model = make_model(seed=6)

    def own_fused_forward(self, *args, **kwargs):
        return type(self).__mro__[1].forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", own_fused_forward)
    data = _batch("grpo", 16, use_fused_kernels=True, **FIXED_MBS)
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, model, _setting("prompt_only"))
    setup.install([PATCHSET])
    with pytest.warns(UserWarning, match="own fused forward"):
        inputs, _ = engine.prepare_model_inputs(data)
    assert "shift_labels" in inputs and "tree_call" not in inputs  # verl's fused-kernel inputs


def test_fallback_position_ids_not_offsets(impl):
    data = _batch("grpo", 11, **FIXED_MBS)
    pos = data["position_ids"]
    data["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 3, offsets=pos.offsets())
    _fallback_case(impl, make_model(), data, _setting("prompt_only"), "position_ids other than")


# ----------------------------------------------------------------------------- install


def _targets(impl):
    lm, value = impl.FSDPEngineWithLMHead, impl.FSDPEngineWithValueHead
    return [
        (impl.FSDPEngine, "forward_backward_batch"), (lm, "forward_step"), (lm, "prepare_model_inputs"),
        (lm, "prepare_model_outputs"), (value, "prepare_model_outputs"),
        (impl, "prepare_micro_batches"), (impl, "postprocess_batch_func"),
    ]


def _snapshot(impl):
    return {(id(o), n): (n in vars(o), vars(o).get(n)) for o, n in _targets(impl)}


def test_install_and_uninstall_restore_exactly(impl):
    setup.uninstall()
    assert setup.detect()[PATCHSET].available
    before = _snapshot(impl)
    assert PATCHSET in setup.install([PATCHSET])
    after = _snapshot(impl)
    assert all(before[k] != after[k] for k in before)  # every target patched
    value, lm = impl.FSDPEngineWithValueHead, impl.FSDPEngineWithLMHead
    assert "prepare_model_inputs" not in vars(value) and value.forward_step is lm.forward_step  # inherited
    assert setup.install([PATCHSET]) == setup.installed() and _snapshot(impl) == after  # idempotent
    setup.uninstall()
    assert _snapshot(impl) == before  # the same objects, no new attributes


# ----------------------------------------------------------------------------- schedules

BUDGET = 40


def _long_batch(seed, **kw):
    """Sharing units 2-3 token budgets large (:func:`long_units`) under ``BUDGET``."""
    rng = np.random.default_rng(seed)
    return make_batch(long_units(rng), rng, max_token_len_per_gpu=BUDGET, **kw)


def _unique_tokens(data):
    return plan_prefix_tree(sequences(data), min_prefix_len=4).num_tokens


def _fully_shard(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@pytest.mark.parametrize("wrap", ["plain", "fsdp2", "checkpointing"])
def test_schedule_update_actor_matches_stock(impl, wrap):
    """update_actor with units larger than the token budget: one cross-micro-batch schedule
    (every row computed once over the steps, a prefix's backward once after its last
    continuation) equals verl's stock micro-batches: PPO loss, every gradient, log-probs and
    entropy. FSDP2-wrapped (its hooks around every call and release) and with activation
    checkpointing too."""
    model = make_model(seed=4)
    if wrap == "fsdp2":
        _fully_shard(model)
    elif wrap == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = _long_batch(0, temperature=0.8)
    tree = _assert_training_matches_stock(impl, model, data, _setting("arbitrary_prefix"), _ppo())
    n, t = step_tokens(tree)
    assert n == int(data["input_ids"].offsets()[-1])
    assert t == _unique_tokens(data)  # every row once across micro-batches


def test_schedule_log_prob_pass_matches_stock(impl):
    model = make_model(seed=5)
    data = _long_batch(1, temperature=0.7)
    setting = _setting("arbitrary_prefix")
    stock, _ = _run(impl, model, data, setting, patched=False)
    tree, _ = _run(impl, model, data, setting, patched=True)
    assert_outputs(stock, tree)
    assert step_tokens(tree)[1] == _unique_tokens(data)


def test_schedule_off_splits_the_units(impl, recwarn):
    """``cross_microbatch: false``: units larger than the budget are split into pieces that
    each recompute their prefix (as before the schedule), exact, without a warning."""
    data = _long_batch(2)
    tree = _assert_training_matches_stock(impl, make_model(seed=6), data,
                                          _setting("arbitrary_prefix", cross_microbatch=False), _ppo())
    assert step_tokens(tree)[1] > _unique_tokens(data)
    assert not [w for w in recwarn if "cross-micro-batch" in str(w.message)]


def test_schedule_critic_values_and_value_loss_match_stock(impl, monkeypatch):
    """verl 0.8.0's value loss is a mean per micro-batch, so its gradient depends on how
    samples are grouped: the stock reference runs on the schedule's own micro-batches."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    critic = make_model(seed=7, value=True)
    data = _long_batch(3)
    add_value_targets(data)
    setting, cls = _setting("arbitrary_prefix"), impl.FSDPEngineWithValueHead
    stock, _ = _run(impl, critic, data, setting, False, cls=cls)
    tree, _ = _run(impl, critic, data, setting, True, cls=cls)
    assert_outputs(stock, tree, keys=("values",))
    assert step_tokens(tree)[1] == _unique_tokens(data)

    seen = []
    postprocess = impl.postprocess_batch_func
    monkeypatch.setattr(impl, "postprocess_batch_func", lambda output_lst, indices, data: (
        seen.append(indices), postprocess(output_lst=output_lst, indices=indices, data=data))[1])
    loss_fn = partial(value_loss, config=FSDPCriticConfig(ppo_micro_batch_size_per_gpu=2, rollout_n=1))
    tree, g_tree = _run(impl, critic, data, setting, True, loss_fn, cls=cls)
    parts = seen[-1]
    assert len(parts) > 2
    setup.uninstall()  # before replacing what uninstalling would put back
    monkeypatch.setattr(impl, "prepare_micro_batches", lambda data, **_: (
        [tu.index_select_tensor_dict(data, p) for p in parts], parts))
    stock, g_stock = _run(impl, critic, data, setting, False, loss_fn, cls=cls)
    np.testing.assert_allclose(tree["loss"], stock["loss"], rtol=RTOL)
    assert_grads(g_stock, g_tree)


def test_schedule_refusal_splits_with_one_warning(impl):
    """Per-sample temperatures run on the tree per micro-batch but not in a schedule (its calls
    score one temperature): the units are split, saying so once by name; still exact."""
    model = make_model(seed=8)
    data = _long_batch(4)
    data["temperature"] = torch.linspace(0.5, 1.0, len(data["input_ids"]))
    setting = _setting("arbitrary_prefix")
    stock, _ = _run(impl, model, data, setting, patched=False)
    with pytest.warns(UserWarning, match="no cross-micro-batch schedule.*per-sample temperatures"):
        tree, _ = _run(impl, model, data, setting, patched=True)
    assert_outputs(stock, tree)
    n, computed = step_tokens(tree)
    assert _unique_tokens(data) < computed < n  # split, each piece shared


def test_schedule_refusals_name_the_option(impl, monkeypatch):
    """What a schedule cannot run exactly is refused by name (its units are then split): more
    than one data-parallel rank without FSDP2, Ulysses SP, verl's fused kernels, active
    dropout."""
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, make_model(seed=9), _setting("arbitrary_prefix"))
    data = _long_batch(5)
    assert fsdp_glue.fsdp_schedule_refusal(engine, data) is None
    fused = _long_batch(5, use_fused_kernels=True)
    assert "use_fused_kernels" in fsdp_glue.fsdp_schedule_refusal(engine, fused)
    monkeypatch.setattr(engine, "use_ulysses_sp", True, raising=False)
    assert "Ulysses" in fsdp_glue.fsdp_schedule_refusal(engine, data)
    monkeypatch.setattr(engine, "use_ulysses_sp", False)
    monkeypatch.setattr(engine, "get_data_parallel_size", lambda: 2)  # FSDP2 runs it (test below)
    assert "without FSDP2 with more than one data-parallel rank" in fsdp_glue.fsdp_schedule_refusal(engine, data)
    critic = make_model(seed=9, value=True)
    critic.dropout.p = 0.1  # the token-classification head's classifier_dropout
    engine = make_engine(impl, impl.FSDPEngineWithValueHead, critic, _setting("arbitrary_prefix", shared_dropout=True))
    assert "active dropout" in fsdp_glue.fsdp_schedule_refusal(engine, data)  # shared or not
    critic.eval()
    assert fsdp_glue.fsdp_schedule_refusal(engine, data) is None


def test_gradient_sync_stays_off_while_gathered(impl):
    """verl 0.9.1 turns FSDP2's gradient sync off for a non-last micro-batch and on again after
    it; inside ``gathered_once`` (a schedule on several ranks) it stays off, or the ranks'
    different call counts would reduce-scatter different numbers of times. Outside, verl's own."""
    if not hasattr(impl.FSDPEngine, "_gradient_sync_context"):
        pytest.skip("verl 0.8.0 has no deferred gradient sync")
    from ps_mcore.fsdp_bridge.lockstep import _groups, fsdp2_modules, gathered_once

    model = _fully_shard(make_model(seed=3))
    setup.install([PATCHSET])
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, model, _setting("arbitrary_prefix"))
    assert engine.engine_config.use_no_sync_for_gradient_accumulation

    def syncing():
        return {g.reduce_grads for m in fsdp2_modules(model) for g in _groups(m)}

    with gathered_once(model, training=False, reduction_pass=None):
        with engine._gradient_sync_context(is_last_micro_batch=False):
            assert syncing() == {False}
        assert syncing() == {False}
    assert syncing() == {True}
    with engine._gradient_sync_context(is_last_micro_batch=False):
        assert syncing() == {False}
    assert syncing() == {True}


def _dp_reports(tmp_path, device):
    from megatron_shims import run_torchrun

    out = tmp_path / "dp.json"
    run_torchrun(Path(__file__).with_name("verl_fsdp_dp_worker.py"), 2, out, device, timeout=900)
    return json.loads(out.read_text())


def _check_dp(reports):
    """Each rank's log-probs, PPO loss and every (reduced) gradient equal verl's stock run; the
    ranks that schedule compute each row once (the other rank's units fit: split pieces, each
    shared); parameters are sharded again wherever verl's stock run leaves them sharded."""
    assert len(reports) == 2
    for rep in reports:
        for case in ("both", "rank0_only"):
            r = rep[case]
            assert r["log_probs"] < 1e-5 and r["entropy"] < 1e-5, (case, rep)
            np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=RTOL)
            assert r["grad_rel"] <= RTOL and r["grads_complete"] and r["resharded"], (case, rep)
            n, t, unique = r["tokens"]
            scheduled = case == "both" or rep["rank"] == 0
            assert t == unique if scheduled else unique < t < n, (case, rep)


@pytest.mark.slow
def test_schedule_on_two_data_parallel_ranks_with_fsdp2(tmp_path):
    """Two DP ranks, FSDP2 over both, different mini-batches (different call counts, or a
    schedule on one rank only): parameters gathered once and gradients reduced once per engine
    step, equal to verl's stock run (``tests/verl_fsdp_dp_worker.py``)."""
    _check_dp(_dp_reports(tmp_path, "cpu"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_schedule_on_two_data_parallel_ranks_with_fsdp2_nccl(tmp_path):
    _check_dp(_dp_reports(tmp_path, "cuda"))


def test_batch_layout_refusals_name_the_cause(impl):
    """What the tree path cannot read keeps verl's stock forward, by name: an engine subclass
    that redefines the model input/output methods the glue patches (it expects verl's own
    layout), a padded batch layout, position ids that do not count from 0 in every sequence, and
    fused kernels with a temperature tensor (verl's fused forward refuses that itself)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    setting = _setting("arbitrary_prefix")
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, make_model(), setting)
    data = _batch("tree", 24)
    assert fsdp_glue.fsdp_batch_refusal(engine, data) is None

    class OwnInputs(impl.FSDPEngineWithLMHead):
        def prepare_model_inputs(self, *args, **kwargs):
            return super().prepare_model_inputs(*args, **kwargs)

    own = make_engine(impl, OwnInputs, make_model(), setting)
    assert "OwnInputs overrides" in fsdp_glue.fsdp_batch_refusal(own, data)

    padded = _batch("tree", 24)
    tu.assign_non_tensor(padded, pad_mode=DatasetPadMode.LEFT_RIGHT)
    assert "no-padding batch layout" in fsdp_glue.fsdp_batch_refusal(engine, padded)

    shifted = _batch("tree", 24)
    pos = shifted["position_ids"]
    shifted["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())
    assert "0..len-1" in fsdp_glue.fsdp_batch_refusal(engine, shifted)

    fused = _batch("tree", 24)
    fused["temperature"] = sample_temperatures(fused.batch_size[0], seed=24)
    tu.assign_non_tensor(fused, use_fused_kernels=True)
    assert "temperature tensor" in fsdp_glue.fsdp_batch_refusal(engine, fused)
