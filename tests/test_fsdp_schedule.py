"""Cross-micro-batch schedules on real transformers models (tiny random configs, fp32, CPU):
``hf_call`` through ``forward_tree`` per call of a mini-batch plan, every row computed once,
against each sequence run alone through the model's stock attention. Random branching forests
several budgets large, budgets that cut inside nodes and at node edges, a prefix longer than
the budget (a chain of K/V-kept calls, recomputed at their release), GQA, forward-only
log-prob plans and a value head."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_grads_close, grads_of  # noqa: E402
from forests import assert_branches, branching_forest  # noqa: E402
from test_fsdp_bridge import (  # noqa: E402
    GRAD_TOL, MODELS, VOCAB, _sample_weights, _tokens, make_config, make_model, per_sequence_reference, schedule_run,
)

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.fsdp_bridge import hf_call, hf_kv_row_cost, hf_schedule_refusal  # noqa: E402
from ps_mcore.minibatch import schedule_tree  # noqa: E402
from ps_mcore.schedule import ScheduleRunner  # noqa: E402


def cut_kinds(plan) -> set[str]:
    """``"edge"`` for a range that ends where a tree node ends, ``"inside"`` for one that ends
    inside a node (the planner's ranges, the last excluded)."""
    edges = set(plan.tree.cu_seqlens_q.tolist())
    return {"edge" if end in edges else "inside" for end in plan.range_ends[:-1]}


def assert_schedule_matches(model, seqs, plan, training=True):
    reference = copy.deepcopy(model)
    weights = _sample_weights(seqs)
    _, ref_lp, ref_ent, ref_grads = per_sequence_reference(reference, seqs, weights)
    lp, ent, grads = schedule_run(model, seqs, weights, plan=plan, training=training)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.double(), rtol=1e-5, atol=1e-5)
    if training:
        assert len(grads) == len(list(model.parameters()))
        assert_grads_close(grads, ref_grads, **GRAD_TOL)
    else:
        assert not grads


@pytest.mark.parametrize("model_name,seed", [("qwen2-gqa2-d24", 0), ("llama-gqa3-d16", 1), ("qwen3-mha-d40", 2)])
def test_random_branching_forests_several_budgets_large(model_name, seed):
    """Budgets of a third and a fifth of the forest and one shorter than its longest node:
    every cut kind occurs (asserted), every result equals the unshared run's."""
    rng = np.random.default_rng(seed)
    seqs = branching_forest(rng, roots=2, depth=3, fanout=3, node_len=(3, 10), vocab=VOCAB)
    tree = plan_prefix_tree(seqs, min_prefix_len=1)
    t = tree.num_tokens
    node = int(np.diff(tree.cu_seqlens_q.numpy()).max())
    model = make_model(model_name, seed=seed)
    kinds = set()
    for budget, rho in ((t // 3, 0.25), (t // 5, 0.15), (max(node - 2, 4), 0.1)):
        plan = schedule_tree(tree, budget, kv_row_cost=rho)
        assert plan.num_steps >= 3 and t >= 3 * budget
        assert plan.computed_tokens == t  # every row once
        kinds |= cut_kinds(plan)
        assert_schedule_matches(model, seqs, plan)
    assert kinds == {"edge", "inside"}


def test_prefix_longer_than_the_budget_is_a_chain_of_kept_calls():
    """A GRPO prompt 3x the budget: kept K/V-only calls, each the context of the next (a prefix
    of a prefix), recomputed before their single backward; GQA 3:1."""
    rng = np.random.default_rng(3)
    prompt = _tokens(rng, 36)
    mids = [[1 + i] + _tokens(rng, 2) for i in range(3)]
    seqs = assert_branches([prompt + mid + tail for mid in mids for tail in ([5, 6, 7], [8] + _tokens(rng, 3))])
    plan = schedule_tree(plan_prefix_tree(seqs, min_prefix_len=1), 12, kv_row_cost=0.1)
    kept = [c for c in plan.calls if c.kept]
    assert any(set(c.context) & {k.index for k in kept} for c in kept)  # nested
    assert plan.recomputed_tokens > 0
    assert_schedule_matches(make_model("llama-gqa3-d16", seed=4), seqs, plan)


def test_forward_only_plan_keeps_kv_and_recomputes_nothing():
    rng = np.random.default_rng(5)
    seqs = branching_forest(rng, roots=1, depth=3, node_len=(4, 9), vocab=VOCAB)
    plan = schedule_tree(plan_prefix_tree(seqs, min_prefix_len=1), 12, kv_row_cost=0.3, training=False)
    assert plan.recomputed_tokens == 0 and plan.num_steps > 2
    assert_schedule_matches(make_model("qwen2-gqa2-d24", seed=5), seqs, plan, training=False)


def test_value_head_values_and_gradients():
    """A token-classification head (a critic): per-token values and the gradients of a weighted
    value sum equal each sequence alone."""
    family, heads, kv_heads, head_dim = MODELS["qwen2-gqa2-d24"]
    config = make_config(family, heads, kv_heads, head_dim, num_labels=1, classifier_dropout=0.0)
    torch.manual_seed(6)
    model = transformers.AutoModelForTokenClassification.from_config(config).float().train()
    reference = copy.deepcopy(model)
    rng = np.random.default_rng(6)
    seqs = branching_forest(rng, roots=2, depth=3, node_len=(3, 8), vocab=VOCAB)
    w = torch.tensor(np.repeat(_sample_weights(seqs), [len(s) for s in seqs]), dtype=torch.float32)

    ref_values = torch.cat([reference(input_ids=torch.tensor(s)[None]).logits[0, :, 0] for s in seqs])
    (ref_values * w).sum().backward()
    plan = schedule_tree(plan_prefix_tree(seqs, min_prefix_len=1), 10, kv_row_cost=0.2)
    runner = ScheduleRunner(plan, hf_call(model, value_head=True))
    values = torch.zeros_like(ref_values)
    for j, step in enumerate(plan.steps):
        out = runner.forward(j)
        tokens = torch.from_numpy(plan.sample_tokens(step.samples))
        values[tokens] = out["values"].detach()
        (out["values"] * w[tokens]).sum().backward()
        runner.release(j)
    runner.finish()
    torch.testing.assert_close(values, ref_values.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_of(model), grads_of(reference), **GRAD_TOL)


def test_refusal_names_active_dropout():
    model = make_model("qwen2-gqa2-d24", hidden_dropout=0.0)
    assert hf_schedule_refusal(model) is None
    family, heads, kv_heads, head_dim = MODELS["qwen2-gqa2-d24"]
    config = make_config(family, heads, kv_heads, head_dim, num_labels=1, classifier_dropout=0.1)
    critic = transformers.AutoModelForTokenClassification.from_config(config).train()
    assert "active dropout" in hf_schedule_refusal(critic)
    assert hf_schedule_refusal(critic.eval()) is None


def test_kv_row_cost_of_the_model_shape():
    model = make_model("llama-gqa3-d16")
    train, infer = hf_kv_row_cost(model, training=True), hf_kv_row_cost(model, training=False)
    assert 0 < train <= 1 and 0 < infer <= 1
    model.gradient_checkpointing_enable()
    assert hf_kv_row_cost(model, training=True) > train  # fewer activations per token to weigh against
