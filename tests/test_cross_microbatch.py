"""Cross-micro-batch schedules on a real megatron-core GPTModel (CPU, gloo world 1, fp32):
every row of a mini-batch larger than the token budget computed once, log-probs and every
gradient equal to the unshared batch's. Random forests several budgets large, budgets that cut
inside nodes and at node edges, a prefix longer than the budget (K/V-kept calls recomputed at
their release), GQA and an odd head dim, Megatron's full and selective activation recompute,
and the steps through megatron-core's own no-pipelining schedule with gradient accumulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import grads_of, run_schedule  # noqa: E402
from forests import assert_branches  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, build_gpt, enable_cpu_pipeline, enable_cpu_recompute, init_cpu_megatron, layer_spec_args,
    randomize_, tiny_config,
)

init_cpu_megatron(1)

from ps_mcore.layer_specs import TreePackedSeqParams, get_gpt_layer_local_tree_spec  # noqa: E402
from ps_mcore.layer_specs.packed_params import call_entries  # noqa: E402
from ps_mcore.layer_specs.schedule import (  # noqa: E402
    forward_backward_schedule, gpt_call, schedule_refusal,
)
from ps_mcore.logprobs import token_logprobs  # noqa: E402
from ps_mcore.minibatch import plan_minibatch, schedule_tree  # noqa: E402
from ps_mcore.planner import plan_unshared  # noqa: E402

ENTROPY_COEF = 0.05


def branching(rng, prefix_len=20, turns=2, fanout=2, turn_len=(3, 9)):
    """A shared prefix, then a tree branching at every turn (asserted); one sample ends at a
    branch point."""
    seqs = [[int(x) for x in rng.integers(0, VOCAB, prefix_len)]]
    for _ in range(turns):
        seqs = [s + [int(x) for x in rng.integers(0, VOCAB, int(rng.integers(*turn_len)))]
                for s in seqs for _ in range(fanout)]
    return assert_branches(seqs + [seqs[0][: prefix_len + 2]], levels=turns)


def model_for(kind="qwen2", **overrides):
    config = tiny_config(kind, **overrides)
    model = build_gpt(config, get_gpt_layer_local_tree_spec(**layer_spec_args(config)))
    randomize_(model, seed=11)
    return model


def weights_of(seqs, seed=0):
    w = np.random.default_rng(seed).uniform(0.2, 2.0, len(seqs))
    return torch.tensor(np.repeat(w, [len(s) for s in seqs]), dtype=torch.float32)


def step_loss(out, w):
    return (out["log_probs"] * w).sum() + ENTROPY_COEF * (out["entropy"] * w).sum()


def unshared(model, seqs, w):
    """The unshared batch (one segment per sequence) through the same model: the reference."""
    plan = plan_unshared(seqs)
    psp = TreePackedSeqParams.from_plan(plan)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
    lp, ent = token_logprobs(logits, plan, compute_entropy=True)
    step_loss({"log_probs": lp, "entropy": ent}, w).backward()
    return lp.detach(), grads_of(model)


def scheduled(model, plan, w, loss=step_loss, entropy=True):
    """The plan's steps by hand: forward, ``loss(outputs, weights of the step's tokens)``,
    backward, release. Returns the log-probs ``[N]`` and the gradients."""
    model.zero_grad(set_to_none=True)
    lp = run_schedule(plan, gpt_call(model, compute_entropy=entropy), lambda out, t: loss(out, w[t]), w.dtype)
    return lp, grads_of(model)


def logprob_loss(out, w):
    return (out["log_probs"] * w).sum()


def assert_equal_runs(got, ref, tol=1e-4, lp_tol=1e-5):
    torch.testing.assert_close(got[0], ref[0], rtol=lp_tol, atol=lp_tol)
    assert got[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        rel = ((got[1][name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < tol, (name, rel)


def grpo_long_prompt(rng, prompt_len=36, group=6):
    prompt = [int(x) for x in rng.integers(0, VOCAB, prompt_len)]
    return [prompt + [int(x) for x in rng.integers(0, VOCAB, int(rng.integers(2, 7)))] for _ in range(group)]


CASES = {
    "branching": branching,
    "deep": lambda rng: branching(rng, prefix_len=12, turns=3, turn_len=(2, 6)),
    "grpo-long-prompt": grpo_long_prompt,
}


@pytest.fixture(scope="module")
def qwen2():
    return model_for("qwen2")


@pytest.mark.parametrize("case,budget,rho", [
    ("branching", 10, 0.15), ("deep", 20, 0.3), ("grpo-long-prompt", 12, 0.2), ("deep", 30, 1.0),
])
def test_schedule_equals_unshared(qwen2, case, budget, rho):
    seqs = CASES[case](np.random.default_rng(0))
    w = weights_of(seqs)
    plan = plan_minibatch(seqs, budget, kv_row_cost=rho, min_prefix_len=1)
    assert plan.num_steps > 1 and plan.tree.num_tokens > budget
    assert_equal_runs(scheduled(qwen2, plan, w), unshared(qwen2, seqs, w))


def test_odd_head_dim_and_qk_layernorm_cut_inside_nodes():
    model = model_for("qwen3")
    seqs = CASES["deep"](np.random.default_rng(1))
    w = weights_of(seqs, 1)
    plan = plan_minibatch(seqs, 11, kv_row_cost=0.2, min_prefix_len=1)
    assert plan.recomputed_tokens > 0  # the 12-token prefix is longer than the budget
    assert_equal_runs(scheduled(model, plan, w), unshared(model, seqs, w))


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
], ids=["full", "selective-core_attn"])
def test_activation_recompute(recompute):
    enable_cpu_recompute()
    model = model_for("qwen2", **recompute)
    seqs = CASES["branching"](np.random.default_rng(2))
    w = weights_of(seqs, 2)
    plan = plan_minibatch(seqs, 10, kv_row_cost=0.1, min_prefix_len=1)
    assert any(c.kept and c.recompute for c in plan.calls) and any(c.kept and not c.recompute for c in plan.calls)
    assert_equal_runs(scheduled(model, plan, w), unshared(model, seqs, w))


def test_through_megatron_forward_backward_func(qwen2):
    """Megatron's no-pipelining schedule runs the steps (gradient accumulation in its loop);
    the last releases run before its finalize_model_grads_func (the DP reduction)."""
    from megatron.core.utils import get_model_config

    seqs = CASES["deep"](np.random.default_rng(3))
    w = weights_of(seqs, 3)
    ref = unshared(qwen2, seqs, w)
    plan = plan_minibatch(seqs, 12, kv_row_cost=0.25, min_prefix_len=1)
    got, reports, lp_fwd = through_megatron(qwen2, plan, w)
    assert [r["step"] for r in reports] == list(range(plan.num_steps))
    assert_equal_runs(got, ref)
    torch.testing.assert_close(lp_fwd, ref[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="training=True but forward_only=True"):
        forward_backward_schedule(qwen2, plan, gpt_call(qwen2), lambda step, out: (out["log_probs"].sum(), {}),
                                  forward_only=True)


def through_megatron(model, plan, w):
    """``plan``'s steps through megatron-core's no-pipelining schedule with ``step_loss``, then
    the forward-only plan of the same forest and budget. Returns ``((log-probs, the gradients
    finalize_model_grads_func saw), the loss reports, forward-only log-probs)``."""
    from megatron.core.utils import get_model_config

    enable_cpu_pipeline()
    lp = torch.zeros(plan.tree.num_input_tokens, dtype=w.dtype)
    seen = []

    def loss_func(step, out):
        tokens = torch.from_numpy(plan.sample_tokens(step.samples))
        lp[tokens] = out["log_probs"].detach()
        seen.append(step.index)
        # Megatron divides the 2-tuple loss by num_microbatches: undo it to compare sums.
        return step_loss(out, w[tokens]) * plan.num_steps, {"step": step.index}

    config = get_model_config(model)
    finalized = []
    config.finalize_model_grads_func = lambda *a, **k: finalized.append(grads_of(model))
    try:
        model.zero_grad(set_to_none=True)
        reports = forward_backward_schedule(model, plan, gpt_call(model, compute_entropy=True), loss_func)
    finally:
        config.finalize_model_grads_func = None
    assert seen == list(range(plan.num_steps))
    assert len(finalized) == 1  # every release ran before the gradient reduction saw them

    fwd = schedule_tree(plan.tree, plan.max_tokens, plan.kv_row_cost, training=False, state_cost=plan.state_cost)
    lp_fwd = torch.zeros_like(lp)

    def record(step, out):
        lp_fwd[torch.from_numpy(fwd.sample_tokens(step.samples))] = out["log_probs"]
        return out["log_probs"].sum(), {}

    with torch.no_grad():
        forward_backward_schedule(model, fwd, gpt_call(model, compute_entropy=True), record, forward_only=True)
    return (lp, finalized[0]), reports, lp_fwd


def test_refusals_name_the_option(qwen2):
    assert schedule_refusal(qwen2) is None

    class Config:
        pipeline_model_parallel_size = 2

    class Fake(torch.nn.Module):
        config = Config()
        decoder = None

    assert "pipeline parallelism" in schedule_refusal(Fake())
    Config.pipeline_model_parallel_size, Config.context_parallel_size = 1, 2
    assert "context parallelism" in schedule_refusal(Fake())
    plan = plan_minibatch([[1] * 10 + [2, 3], [1] * 10 + [4]], 6, min_prefix_len=1)
    with pytest.raises(ValueError, match="Gated DeltaNet: a ContextPlan call runs inside a mini-batch schedule"):
        call_entries(plan.call_plan(1), 1, "Gated DeltaNet")  # a call without its schedule's runtime
    assert call_entries(plan.tree, 1, "Gated DeltaNet") == (None, None)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        TreePackedSeqParams.from_plan(plan.call_plan(1), pad_to_multiple_of=4, cp_size=2)


# ----------------------------------------------------------------------------- MoE


def test_moe_routing_and_expert_counts_across_micro_batches():
    """MoE layers under a schedule: routing, experts and shared experts are per token (exact);
    the expert-bias token counts, summed over the steps, count every shared row once per
    sample holding it, as the unshared batch does (a call weights its rows by their
    multiplicity in the whole mini-batch). With load-balancing losses on, each call's loss is
    the statistic over the unshared tokens it computes (docs/design.md)."""
    from megatron_shims import enable_cpu_moe
    from moe_cases import _routers, build_moe_model, moe_config, run_unshared, sample_coefs

    enable_cpu_moe()
    model = build_moe_model(moe_config(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True,
                                       moe_router_score_function="sigmoid", moe_token_dispatcher_type="alltoall",
                                       moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=False))
    seqs = CASES["branching"](np.random.default_rng(5))
    coef = sample_coefs(seqs, 5)
    ref = run_unshared(model, seqs, coef)
    for router in _routers(model):
        router.local_tokens_per_expert.zero_()
    plan = plan_minibatch(seqs, 14, kv_row_cost=0.25, min_prefix_len=1)
    assert plan.num_steps > 2 and any(c.kept for c in plan.calls)
    lp, grads = scheduled(model, plan, coef, logprob_loss, entropy=False)
    torch.testing.assert_close(lp, ref["lp"], rtol=0, atol=1e-5)
    for name, r in ref["grads"].items():
        scale = float(r.abs().max())
        assert float((grads[name] - r).abs().max()) <= 1e-5 * max(scale, 1e-12) or scale == 0, name
    counts = [r.local_tokens_per_expert for r in _routers(model)]
    assert all(torch.equal(got, want) for got, want in zip(counts, ref["counts"]))
    assert sum(float(c.sum()) for c in counts) == 2 * len(counts) * plan.tree.num_input_tokens  # topk=2


def test_moe_load_balancing_losses_run_per_call():
    """With aux and z losses on, every call attaches its multiplicity-weighted losses (they
    are logged per layer) and the log-probs stay the unshared batch's."""
    from megatron.core.transformer.moe import moe_utils
    from megatron_shims import enable_cpu_moe
    from moe_cases import MOE_CASES, build_moe_model, moe_config, run_unshared, sample_coefs

    enable_cpu_moe()
    model = build_moe_model(moe_config(**MOE_CASES["aux+z/allgather"]))
    seqs = CASES["deep"](np.random.default_rng(6))
    coef = sample_coefs(seqs, 6)
    ref = run_unshared(model, seqs, coef)
    moe_utils.clear_aux_losses_tracker()
    plan = plan_minibatch(seqs, 12, kv_row_cost=0.25, min_prefix_len=1)
    lp, _ = scheduled(model, plan, coef, logprob_loss, entropy=False)
    torch.testing.assert_close(lp, ref["lp"], rtol=0, atol=1e-5)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in ("load_balancing_loss", "z_loss"):
        values = tracker[name]["values"]
        assert torch.isfinite(values).all() and float(values.sum()) > 0
