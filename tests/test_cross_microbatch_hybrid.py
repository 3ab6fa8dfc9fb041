"""Cross-micro-batch schedules on hybrid megatron-core models (CPU, gloo world 1, fp64):
Gated DeltaNet + attention GPT models (``G*G``), Mamba + attention MambaModels (``M*M-``,
megatron-core 0.16) and HybridModels mixing all three (``GM*-``, megatron-core 0.19+), with the
tree modules and the torch recurrent kernels. Every row of a
mini-batch larger than the token budget is computed once; a kept call keeps each recurrent
layer's state and conv window where later calls continue its rows, and the log-probs and every
gradient (the recurrent layers' own parameters included) equal the unshared batch's (the same
model on one segment per sequence), in fp64: to 1e-6, where fp32 rounding of a wrong state
would not hide (megatron's Gated DeltaNet casts its output gate to fp32, which turns fp64
summation-order differences into ~1e-8; attention-only models agree to ~1e-14).

Forests: random branching forests several budgets large, budgets that cut inside nodes and at
node edges (every budget from a small one up), a prefix longer than the budget (a chain of
K/V-kept calls, each a prefix of the next, recomputed at release), nodes shorter than the conv
window (a continued window spans several calls), Megatron's full activation recompute, and the
steps through megatron-core's own no-pipelining schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

import test_cross_microbatch as xmb  # noqa: E402
from forests import assert_branches, random_forest  # noqa: E402
from gdn_shims import gdn_block_spec, gdn_config_overrides, sharpen_gdn_, shim_gdn_for_cpu  # noqa: E402
from mamba_shims import shim_mamba_for_cpu  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, SPTorchNorm, build_gpt, enable_cpu_recompute, init_cpu_megatron, layer_spec_args, randomize_,
    tiny_config,
)
from test_cross_microbatch import scheduled, through_megatron, unshared  # noqa: E402

init_cpu_megatron(1)
shim_gdn_for_cpu()
shim_mamba_for_cpu()

from ps_mcore.layer_specs import to_tree_spec  # noqa: E402
from ps_mcore.layer_specs.schedule import recurrent_state_cost, schedule_refusal  # noqa: E402
from ps_mcore.minibatch import BudgetTooSmall, plan_minibatch  # noqa: E402

DT = torch.float64
TOL = 1e-6


def _rand(rng, n):
    return [int(x) for x in rng.integers(0, VOCAB, n)]


def branching(rng, prefix_len=14, turns=2, fanout=2, turn_len=(1, 7)):
    """A shared prefix, a tree branching at every turn (nodes down to one token: shorter than
    the conv window), and one sample ending at a branch point."""
    seqs = [_rand(rng, prefix_len)]
    for _ in range(turns):
        seqs = [s + _rand(rng, int(rng.integers(*turn_len))) for s in seqs for _ in range(fanout)]
    return assert_branches(seqs + [seqs[0][: prefix_len + 1]], levels=turns)


def gdn_model(**overrides):
    cfg = tiny_config("qwen2", num_layers=3, **gdn_config_overrides(), **overrides)
    model = build_gpt(cfg, to_tree_spec(gdn_block_spec(cfg)))
    randomize_(model, seed=11)
    sharpen_gdn_(model)
    return model.to(DT)


def mamba_model():
    """MambaModel ``M*M-`` with megatron's local layers and TreeMambaMixer (test_mamba.py's)."""
    import dataclasses

    from mamba_oracle import mamba_config, sharpen_mamba_
    from megatron.core.models.gpt import gpt_layer_specs as stock_specs
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from test_mamba import _stack_spec

    from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

    cfg = mamba_config(2, 4, 5, 6, num_layers=4, params_dtype=DT)  # MambaLayer casts to params_dtype
    local = stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))
    attn_layer = dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, mlp=IdentityOp, pre_mlp_layernorm=IdentityOp, mlp_bda=IdentityFuncOp))
    stock_norm, mamba_block.TENorm = mamba_block.TENorm, SPTorchNorm  # the stack's final norm is TE's
    try:
        model = MambaModel(cfg, _stack_spec(cfg, TreeMambaMixer, to_tree_spec(attn_layer)), vocab_size=VOCAB,
                           max_sequence_length=256, hybrid_override_pattern="M*M-",
                           position_embedding_type="rope", rotary_base=1_000_000)
    finally:
        mamba_block.TENorm = stock_norm
    randomize_(model, seed=7)
    for layer in (0, 2):
        sharpen_mamba_(model.decoder.layers[layer].mixer)
    return model.to(DT)


def hybrid_model(pattern="GM*-"):
    """megatron-core 0.19+ HybridModel: Gated DeltaNet, Mamba, attention (with its MLP), MLP."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron_shims import local_hybrid_stack_spec

    cfg = tiny_config("qwen2", num_layers=len(pattern), mamba_num_groups=2, mamba_num_heads=4, mamba_head_dim=5,
                      mamba_state_dim=6, params_dtype=DT, **gdn_config_overrides())
    spec = to_tree_spec(local_hybrid_stack_spec(HybridStack, HybridStackSubmodules, cfg, mamba=True))
    stock_norm, hybrid_block.TENorm = hybrid_block.TENorm, SPTorchNorm  # the stack's final norm is TE's
    try:
        model = HybridModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=512, hybrid_layer_pattern=pattern,
                            position_embedding_type="rope", rotary_base=1_000_000)
    finally:
        hybrid_block.TENorm = stock_norm
    randomize_(model, seed=5)
    with torch.no_grad():  # slow decays and convs reaching across nodes
        for layer, kind in zip(model.decoder.layers, pattern):
            if kind == "G":
                gdn_mixer = layer.self_attention
                gdn_mixer.A_log.copy_(torch.linspace(-1.0, 0.5, gdn_mixer.A_log.numel()))
                gdn_mixer.conv1d.weight.mul_(4.0)
            elif kind == "M":
                layer.mixer.cp.get_A_log().copy_(torch.linspace(-3.0, 0.0, layer.mixer.cp.get_A_log().numel()))
                layer.mixer.cp.get_conv1d_weight().mul_(4.0)
    return model.to(DT)


@pytest.fixture(scope="module")
def gdn():
    return gdn_model()


@pytest.fixture(scope="module")
def mamba():
    import importlib.util

    if importlib.util.find_spec("megatron.core.models.hybrid") is not None:
        pytest.skip("megatron-core 0.19+: MambaModel is a HybridModel")
    return mamba_model()


def weights_of(seqs, seed=0):
    return xmb.weights_of(seqs, seed).to(DT)


def assert_equal_runs(got, ref):
    xmb.assert_equal_runs(got, ref, tol=TOL, lp_tol=TOL)


def continued_states(plan) -> int:
    """Recurrent states kept across calls: the exits of every call plan."""
    return sum(plan.call_plan(c.index).exit_rows.numel() for c in plan.calls if c.kept)


def check(model, seqs, budget, rho, seed=0, **plan_kw):
    w = weights_of(seqs, seed)
    plan = plan_minibatch(seqs, budget, kv_row_cost=rho, min_prefix_len=1, **plan_kw)
    assert plan.num_steps > 1 and plan.tree.num_tokens > 2 * budget
    assert continued_states(plan) > 0
    assert all(s.charge <= budget for s in plan.steps)
    assert_equal_runs(scheduled(model, plan, w), unshared(model, seqs, w))
    return plan


@pytest.mark.parametrize("seed,budget,rho", [(0, 9, 0.2), (1, 13, 0.5), (2, 17, 0.6), (3, 8, 0.15)])
def test_gdn_hybrid_schedule_equals_unshared(gdn, seed, budget, rho):
    check(gdn, branching(np.random.default_rng(seed)), budget, rho, seed)


@pytest.mark.parametrize("seed,budget,rho", [(0, 9, 0.2), (4, 12, 0.4)])
def test_mamba_hybrid_schedule_equals_unshared(mamba, seed, budget, rho):
    check(mamba, branching(np.random.default_rng(seed)), budget, rho, seed)


@pytest.mark.parametrize("seed,budget,rho", [(0, 12, 0.2), (13, 16, 0.4)])
def test_hybrid_model_mixing_gdn_mamba_and_attention(seed, budget, rho):
    pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel needs megatron-core 0.19+")
    from ps_mcore.layer_specs.modules.gdn import TreeGatedDeltaNet
    from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

    model = hybrid_model()
    assert type(model.decoder.layers[0].self_attention) is TreeGatedDeltaNet
    assert type(model.decoder.layers[1].mixer) is TreeMambaMixer
    check(model, branching(np.random.default_rng(seed)), budget, rho, seed,
          state_cost=recurrent_state_cost(model))


def test_every_budget_cuts_inside_nodes_and_at_edges(gdn):
    """One forest under every budget from 6 to 20: the cuts fall inside nodes and at node
    edges (both asserted over the sweep)."""
    seqs = branching(np.random.default_rng(5), turns=3, turn_len=(2, 5))
    tree = plan_minibatch(seqs, 10_000, min_prefix_len=1).tree
    starts = set(tree.cu_seqlens_q[:-1].tolist())
    inside = edge = 0
    for budget in range(8, 23, 2):
        plan = check(gdn, seqs, budget, 0.25, budget)
        ends = set(plan.range_ends[:-1])
        inside += len(ends - starts)
        edge += len(ends & starts)
    assert inside and edge


def test_prefix_longer_than_the_budget_is_a_chain_of_kept_calls(gdn):
    """A 30-token prompt under a budget of 8: a prefix of a prefix, each K/V-kept piece's
    recurrent state continued by the next and recomputed at its release."""
    rng = np.random.default_rng(6)
    prompt = _rand(rng, 30)
    seqs = [prompt + _rand(rng, int(n)) for n in rng.integers(1, 6, 5)]
    plan = check(gdn, seqs, 8, 0.2, 6)
    prompt_calls = [c for c in plan.calls if c.kept and c.rows[0] < 30]
    assert len(prompt_calls) >= 4 and all(c.recompute for c in prompt_calls)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_forests(gdn, seed):
    rng = np.random.default_rng(seed)
    seqs = random_forest(rng, max_seqs=8, max_len=24)
    while plan_minibatch(seqs, 10_000, min_prefix_len=1).tree.num_tokens < 30:
        seqs = random_forest(rng, max_seqs=8, max_len=24)
    t = plan_minibatch(seqs, 10_000, min_prefix_len=1).tree.num_tokens
    budget = int(rng.integers(12, max(13, t // 2)))
    w = weights_of(seqs, seed)
    plan = plan_minibatch(seqs, budget, kv_row_cost=float(rng.uniform(0.1, 0.5)), min_prefix_len=1)
    assert plan.num_steps > 1
    assert_equal_runs(scheduled(gdn, plan, w), unshared(gdn, seqs, w))


def test_full_activation_recompute():
    enable_cpu_recompute()
    model = gdn_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    plan = check(model, branching(np.random.default_rng(10)), 9, 0.1, 10)
    assert any(c.kept and c.recompute for c in plan.calls) and any(c.kept and not c.recompute for c in plan.calls)


def test_through_megatron_forward_backward_func(gdn):
    assert schedule_refusal(gdn) is None
    seqs = branching(np.random.default_rng(11))
    w = weights_of(seqs, 11)
    ref = unshared(gdn, seqs, w)
    got, _, lp_fwd = through_megatron(gdn, plan_minibatch(seqs, 10, kv_row_cost=0.3, min_prefix_len=1), w)
    assert_equal_runs(got, ref)
    torch.testing.assert_close(lp_fwd, ref[0], rtol=TOL, atol=TOL)


def test_kept_states_are_charged_to_the_budget(gdn):
    """``state_cost`` per kept node: every step's charge stays within the budget, a larger
    cost gives more steps, a cost no budget can hold is refused naming the knobs, and the run
    is exact either way. ``recurrent_state_cost`` estimates it from the model."""
    cost = recurrent_state_cost(gdn)
    assert cost > 0 and recurrent_state_cost(gdn, training=False) > 0
    seqs = branching(np.random.default_rng(12), turns=3, turn_len=(2, 5))
    free = plan_minibatch(seqs, 16, kv_row_cost=0.2, min_prefix_len=1)
    charged = check(gdn, seqs, 16, 0.2, 12, state_cost=1.0)
    assert charged.state_cost == 1.0 and charged.num_steps > free.num_steps
    with pytest.raises(BudgetTooSmall, match="state_cost=40"):
        plan_minibatch(seqs, 16, kv_row_cost=0.2, min_prefix_len=1, state_cost=40.0)


def test_stock_recurrent_layers_are_refused_by_name():
    from gdn_shims import gdn_block_spec as stock_spec

    cfg = tiny_config("qwen2", num_layers=3, **gdn_config_overrides())
    stock = build_gpt(cfg, stock_spec(cfg))
    assert "stock GatedDeltaNet layers" in schedule_refusal(stock)
