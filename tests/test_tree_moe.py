"""Tree-aware MoE on a real megatron-core GPTModel (CPU, gloo world 1, fp32).

Oracle: megatron-core's own result on the unshared THD batch of the same samples (the same
model and weights, ordinary ``PackedSeqParams``: its router is the stock ``TopKRouter`` code
path). Loss: a per-sample weighted sum of token log-probs; the router's losses attach to it
through megatron's ``MoEAuxLossAutoScaler`` as in training.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from forests import nasty_forests, random_forest  # noqa: E402
from megatron_shims import enable_cpu_moe, init_cpu_megatron, run_torchrun, tiny_config  # noqa: E402

init_cpu_megatron(1)
enable_cpu_moe()

from moe_cases import (  # noqa: E402
    MOE_CASES, sample_coefs, assert_same, build_moe_model, moe_config, run_tree, run_unshared,
)

from ps_mcore.layer_specs import megatron_dropout_refusal  # noqa: E402
from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter, moe_refusal  # noqa: E402


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_tree_equals_unshared_thd(case):
    model = build_moe_model(moe_config(**MOE_CASES[case]))
    forests = [random_forest(np.random.default_rng(s), max_seqs=6, max_len=16) for s in (1, 2)]
    forests.append(nasty_forests(3)["tree"])
    for i, seqs in enumerate(forests):
        coef = sample_coefs(seqs, i)
        ref = run_unshared(model, seqs, coef)
        tree, plan = run_tree(model, seqs, coef, pad_to=4)
        assert_same(tree, ref)
    # the router terms really are in play: something was logged / counted
    assert ref["losses"] or ref["counts"] or case == "pre_softmax/none"


@pytest.mark.parametrize("name", sorted(nasty_forests(0)))
def test_moe_nasty_shapes(name):
    model = build_moe_model(moe_config(**MOE_CASES["aux+z/allgather"], moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid"))
    seqs = nasty_forests(0)[name]
    coef = sample_coefs(seqs, 7)
    assert_same(run_tree(model, seqs, coef)[0], run_unshared(model, seqs, coef))


def test_hidden_dropout_after_the_moe_layer_is_refused():
    """The MoE layer's output goes through the bias-dropout-add with hidden_dropout: a
    training tree batch is refused naming the key (eval is what the tests above run)."""
    model = build_moe_model(moe_config(**MOE_CASES["aux+z/allgather"], hidden_dropout=0.1))
    seqs = nasty_forests(0)["tree"]
    with pytest.raises(ValueError, match="hidden_dropout.*MLP/MoE"):
        run_tree(model, seqs, sample_coefs(seqs, 0))
    assert "decoder.layers.*.hidden_dropout (p=0.1, config key config.hidden_dropout)" in megatron_dropout_refusal(model)


def test_stock_router_would_be_wrong():
    """Without weighting (each shared row counted once) the router terms differ: the test
    above is sensitive to the weighting."""
    cfg = moe_config(**MOE_CASES["aux+z/allgather"], moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid")
    model = build_moe_model(cfg)
    seqs = nasty_forests(3)["tree"]
    coef = sample_coefs(seqs, 0)
    ref = run_unshared(model, seqs, coef)
    tree, _ = run_tree(model, seqs, coef)
    real = TreeTopKRouter._tree_weight
    try:  # all-ones weights = the stock router on the packed rows
        TreeTopKRouter._tree_weight = lambda self, rows: (
            None if real(self, rows) is None else torch.ones(rows))
        flat, _ = run_tree(model, seqs, coef)
    finally:
        TreeTopKRouter._tree_weight = real
    assert not torch.equal(flat["counts"][0], ref["counts"][0])
    assert not torch.allclose(flat["losses"]["z_loss"], ref["losses"]["z_loss"], rtol=1e-6)


@pytest.mark.parametrize("option, value, word", [
    ("moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor"),
    ("moe_input_jitter_eps", 0.01, "moe_input_jitter_eps"),
    ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
])
def test_inexact_options_refused_naming_them(option, value, word):
    overrides = {option: value}
    if word == "sinkhorn":
        overrides["moe_aux_loss_coeff"] = 0.0
    cfg = moe_config(**overrides)
    assert word in moe_refusal(cfg)
    model = build_moe_model(cfg)
    seqs = nasty_forests(0)["grpo"]
    with pytest.raises(NotImplementedError, match=word):
        run_tree(model, seqs, sample_coefs(seqs, 0))
    run_unshared(model, seqs, sample_coefs(seqs, 0))  # the same model still runs unshared batches


def test_supported_config_has_no_refusal():
    assert moe_refusal(moe_config(**MOE_CASES["aux+z/allgather"])) is None
    assert moe_refusal(tiny_config("qwen2")) is None


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_expert_parallel_ep2(dispatcher, tmp_path):
    from pathlib import Path

    out = tmp_path / "ep.pt"
    run_torchrun(Path(__file__).parent / "moe_ep_worker.py", 2, dispatcher, out, timeout=600)
    result = torch.load(out)
    assert result["ranks"] == 2 and result["max_logprob_err"] <= 1e-5


def test_flip_free_routing_keeps_every_bf16_top_k():
    """The premise of the GPU tests' per-row bf16 comparisons (tests/flip_free_routing.py): with
    the routers re-initialised, the tree-spec MoE model in bf16 picks the fp32 model's top-k for
    every token, on the unshared batch and on the tree, with margins of 2/(E-1)."""
    from benchmarks import moe_mla
    from flip_free_routing import MEGATRON_NAMES, assert_same_routing, record_routing, route_by_token_

    from ps_mcore.workloads import make_workload

    dims = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=256, experts=8, topk=2, expert_ffn=32)
    model, _ = moe_mla.build_pair(moe_mla.build_config("moe", dims, 2, torch.bfloat16, "cpu"), dims["vocab"],
                                  "cpu", tiny=True)
    route_by_token_(model, MEGATRON_NAMES, seed=0)
    ref = moe_mla.build_reference(moe_mla.build_config("moe", dims, 2, torch.float32, "cpu"), model,
                                  dims["vocab"], "cpu", tiny=True)
    runs = moe_mla.Runs(model, model, make_workload("step-wise", seed=0, scale=1 / 16, vocab=dims["vocab"]).sequences,
                        "cpu")
    with torch.no_grad():
        with record_routing(ref) as r32:
            runs.base_lp(ref)
        with record_routing(model) as r_base:
            runs.base_lp()
        with record_routing(model) as r_tree:
            runs.tree_lp()
    assert_same_routing(r32, {"unshared": (r_base, None), "tree": (r_tree, runs.plan.unpack_index)},
                        k=dims["topk"], min_margin=0.25)
    assert all(bool(c.routing_map.any(0).all()) for c in r32)  # every expert chosen by some token
