"""HF bridge on the attention variants users train: sliding windows (Gemma 3's 5 local : 1
global, GPT-OSS's alternation, Mistral / Qwen2 windows), GPT-OSS's per-head sinks and MoE,
Gemma 2's logit softcapping. Real transformers classes with tiny random configs in float64 on
the CPU, on branching forests whose contexts are several windows long, against each sequence
run alone through the stock model (eager / sdpa, the model's own masks)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import forests  # noqa: E402
from conftest import assert_grads_close  # noqa: E402
from test_fsdp_bridge import (  # noqa: E402
    GRAD_TOL, VOCAB, _nasty, _sample_weights, assert_tree_matches, per_sequence_reference, schedule_run,
)

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.fsdp_bridge import TreeCall, forward_tree, prefix_tree_attention  # noqa: E402

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.2)


def _gpt_oss(window: int):
    # alternating sliding / full layers, GQA 2, per-head sinks, MoE (4 experts, top 2, eager experts)
    return transformers.GptOssConfig(
        **dict(SMALL, intermediate_size=32), num_hidden_layers=2, sliding_window=window, num_local_experts=4,
        num_experts_per_tok=2, attn_implementation="eager", experts_implementation="eager",
    )


# name -> (config builder, the window of its windowed layers)
CONFIGS = {
    "gemma3-5to1": (lambda w: transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=6, sliding_window=w, query_pre_attn_scalar=12, attn_implementation="eager"), 4),
    "gpt-oss": (_gpt_oss, 5),
    "mistral-window": (lambda w: transformers.MistralConfig(
        **SMALL, num_hidden_layers=2, sliding_window=w, attn_implementation="sdpa"), 3),
    "qwen2-window": (lambda w: transformers.Qwen2Config(
        **SMALL, num_hidden_layers=2, use_sliding_window=True, sliding_window=w, max_window_layers=1,
        attn_implementation="sdpa"), 6),
    "gemma2-softcap": (lambda w: transformers.Gemma2Config(
        **SMALL, num_hidden_layers=2, sliding_window=w, attn_logit_softcapping=3.0, final_logit_softcapping=20.0,
        query_pre_attn_scalar=16, attn_implementation="eager"), 4),
}


@functools.lru_cache(maxsize=None)
def _template(name: str, window: int):
    config = CONFIGS[name][0](window)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().train()
    for module in model.modules():  # sink logits of both signs, some dominating their rows
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            with torch.no_grad():
                module.sinks.copy_(torch.linspace(-3.0, 3.0, module.sinks.numel()))
    return model


def make_variant_model(name: str, window: int | None = None):
    """A fresh float64 copy (tree runs switch a model's attention; references need a stock one)."""
    return copy.deepcopy(_template(name, CONFIGS[name][1] if window is None else window))


window_forest = functools.partial(forests.window_forest, vocab=VOCAB)


NASTY = ("grpo", "deep-chain", "prefix-of-another", "single-tokens", "single")
# every model on two window forests; the nasty shapes on GPT-OSS (window, sinks, MoE) and Gemma 3
CASES = [(name, f"window-{i}") for name in CONFIGS for i in range(2)] + [
    ("gpt-oss", forest) for forest in NASTY] + [("gemma3-5to1", "deep-chain")]


def _forest(name: str, window: int) -> list[list[int]]:
    return window_forest(int(name.split("-")[1]), window) if name.startswith("window-") else _nasty(name)


@pytest.mark.parametrize("name, forest", CASES)
def test_variant_models_match_per_sequence(name, forest):
    model = make_variant_model(name)
    plan = assert_tree_matches(model, _forest(forest, CONFIGS[name][1]))
    if forest.startswith("window-"):
        assert plan.max_seqlen_kv >= 3 * CONFIGS[name][1]  # several windows of context
        assert plan.num_tokens < plan.num_input_tokens


@pytest.mark.parametrize("window", [1, 2, 7])
def test_windows_of_one_and_wider_than_branches(window):
    """A window of 1 (each token sees itself only), and windows beside the branch lengths."""
    assert_tree_matches(make_variant_model("mistral-window", window), window_forest(window, window))
    if window == 1:  # with sinks: a row's softmax is its own key against its sink
        assert_tree_matches(make_variant_model("gpt-oss", window), window_forest(10 + window, window))


def test_reference_backend_on_the_variants():
    assert_tree_matches(make_variant_model("gemma2-softcap"), window_forest(3, 4), backend="reference")
    assert_tree_matches(make_variant_model("gpt-oss"), window_forest(4, 5), backend="reference")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
    window=st.integers(1, 6),
    name=st.sampled_from(["gpt-oss", "gemma2-softcap"]),
    min_prefix_len=st.integers(1, 3),
)
def test_hypothesis_forests_match_per_sequence(seqs, window, name, min_prefix_len):
    # A 3-letter alphabet makes shared prefixes, duplicates and branch points common.
    assert_tree_matches(make_variant_model(name, window), seqs, min_prefix_len=min_prefix_len)


def test_sink_gradients_reach_the_parameters():
    model = make_variant_model("gpt-oss")
    plan = plan_prefix_tree(window_forest(0, 5), min_prefix_len=1)
    forward_tree(model, plan, compute_logprobs=True).logprobs.sum().backward()
    grads = [layer.self_attn.sinks.grad for layer in model.model.layers]
    assert all(g is not None and torch.all(g != 0) for g in grads)


@pytest.mark.parametrize("name", ["gpt-oss", "gemma2-softcap"])
def test_cross_micro_batch_schedule_on_the_variants(name):
    """A mini-batch plan's calls read kept K/V with their layer's variant: windows counted along
    each sample's path across calls (contexts several windows long, budgets cutting inside
    nodes), per-head sinks, softcapping; every row once, equal to each sequence alone."""
    model = make_variant_model(name)
    seqs = window_forest(7, CONFIGS[name][1])
    weights = _sample_weights(seqs)
    _, ref_lp, ref_ent, ref_grads = per_sequence_reference(copy.deepcopy(model), seqs, weights)
    lp, ent, grads = schedule_run(model, seqs, weights, budget=9, kv_row_cost=0.2)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.double(), rtol=1e-5, atol=1e-5)
    assert len(grads) == len(list(model.parameters()))
    assert_grads_close(grads, ref_grads, **GRAD_TOL)


# ----------------------------------------------------------------------------- refusals


def test_what_has_no_tree_form_is_refused_by_name():
    model = make_variant_model("mistral-window").eval()
    plan = plan_prefix_tree(_nasty("grpo"))
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, plan.num_tokens, 16, dtype=torch.float64)
    kv = torch.zeros(1, 2, plan.num_tokens, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="position bias"):
        prefix_tree_attention(attn, q, kv, kv, None, tree_call=TreeCall(plan), position_bias=torch.zeros(1, 4, 1, 1))
    per_token = torch.zeros(1, 4, plan.num_tokens, 1)
    with pytest.raises(NotImplementedError, match="per-token attention sinks"):
        prefix_tree_attention(attn, q, kv, kv, None, tree_call=TreeCall(plan), sinks=per_token)
