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
from megatron_shims import build_gpt, enable_cpu_moe, init_cpu_megatron, randomize_, tiny_config  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402
from ps_mcore.planner import plan_unshared  # noqa: E402

init_cpu_megatron(1)

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402

from ps_mcore.layer_specs import TreePackedSeqParams, get_gpt_decoder_block_tree_spec  # noqa: E402
from ps_mcore.layer_specs.moe import TreeTopKRouter, tree_unsupported_reason  # noqa: E402

enable_cpu_moe()

MOE_CASES = {
    "aux+z/allgather": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.05,
                            moe_z_loss_coeff=0.01, moe_token_dispatcher_type="allgather"),
    "seq_aux/alltoall/shared": dict(moe_router_load_balancing_type="seq_aux_loss",
                                    moe_aux_loss_coeff=0.05, moe_token_dispatcher_type="alltoall",
                                    moe_shared_expert_intermediate_size=32,
                                    moe_shared_expert_overlap=False, moe_shared_expert_gate=True),
    "global_aux/group_limited": dict(moe_router_load_balancing_type="global_aux_loss",
                                     moe_aux_loss_coeff=0.05, moe_router_num_groups=2,
                                     moe_router_group_topk=1, moe_z_loss_coeff=0.01),
    "sigmoid/expert_bias/aux_list": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_pre_softmax=False,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.03, 0.02],
        moe_router_dtype="fp64", moe_token_dispatcher_type="alltoall"),
    "pre_softmax/none": dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="none"),
}


def moe_config(**overrides):
    base = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=40,
                moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=0.0)
    return tiny_config("qwen2", **{**base, **overrides})


def build_moe_model(cfg, seed=0):
    spec = get_gpt_decoder_block_tree_spec(cfg, False, normalization="RMSNorm")
    model = build_gpt(cfg, spec)
    randomize_(model, seed)
    model.train()
    return model


def _routers(model):
    return [m for m in model.modules() if isinstance(m, TreeTopKRouter)]


def _reset_stats(model):
    moe_utils.clear_aux_losses_tracker()
    for r in _routers(model):
        if r.local_tokens_per_expert is not None:
            r.local_tokens_per_expert.zero_()
        r.reset_global_aux_loss_tracker()
    model.zero_grad(set_to_none=True)


def _snapshot(model, lp):
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    return dict(
        lp=lp.detach().clone(),
        grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        losses={k: v["values"].clone() for k, v in tracker.items()},
        counts=[r.local_tokens_per_expert.clone() for r in _routers(model)
                if r.local_tokens_per_expert is not None],
        global_counts=[r.global_tokens_per_expert.clone() for r in _routers(model)
                       if r.global_tokens_per_expert is not None],
    )


def run_tree(model, seqs, coef, pad_to=1):
    _reset_stats(model)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad_to)
    ids, pos = psp.pad_rows(plan.input_ids), psp.position_ids
    logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                   packed_seq_params=psp)[0]
    lp, _ = token_logprobs(logits, plan)
    (lp * coef).sum().backward()
    return _snapshot(model, lp), plan


def run_unshared(model, seqs, coef):
    """megatron-core on the unshared THD batch: the samples packed as ordinary THD."""
    _reset_stats(model)
    plan = plan_unshared(seqs)
    lens = [len(s) for s in seqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    ids = torch.as_tensor(np.concatenate([np.asarray(s) for s in seqs]), dtype=torch.long)
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in lens]), dtype=torch.long)
    logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                   packed_seq_params=psp)[0]
    lp, _ = token_logprobs(logits, plan)
    (lp * coef).sum().backward()
    return _snapshot(model, lp)


def assert_same(tree, ref):
    torch.testing.assert_close(tree["lp"], ref["lp"], rtol=0, atol=1e-5)
    assert tree["grads"].keys() == ref["grads"].keys()
    for name, r in ref["grads"].items():
        scale = float(r.abs().max())
        if scale == 0:  # an expert no token was routed to
            assert float(tree["grads"][name].abs().max()) == 0, name
            continue
        err = float((tree["grads"][name] - r).abs().max()) / scale
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
    assert tree["losses"].keys() == ref["losses"].keys()
    for name, r in ref["losses"].items():
        torch.testing.assert_close(tree["losses"][name], r, rtol=1e-5, atol=1e-7, msg=name)
    for got, r in zip(tree["counts"] + tree["global_counts"], ref["counts"] + ref["global_counts"]):
        assert torch.equal(got, r), (got, r)  # integers held in fp32: identical


def _coef(seqs, seed):
    n = sum(len(s) for s in seqs)
    return torch.as_tensor(np.random.default_rng(seed).normal(size=n), dtype=torch.float32)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_tree_equals_unshared_thd(case):
    model = build_moe_model(moe_config(**MOE_CASES[case]))
    forests = [random_forest(np.random.default_rng(s), max_seqs=6, max_len=16) for s in (1, 2)]
    forests.append(nasty_forests(3)["tree"])
    for i, seqs in enumerate(forests):
        coef = _coef(seqs, i)
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
    coef = _coef(seqs, 7)
    assert_same(run_tree(model, seqs, coef)[0], run_unshared(model, seqs, coef))


def test_stock_router_would_be_wrong():
    """Without weighting (each shared row counted once) the router terms differ: the test
    above is sensitive to the weighting."""
    cfg = moe_config(**MOE_CASES["aux+z/allgather"], moe_router_enable_expert_bias=True,
                      moe_router_score_function="sigmoid")
    model = build_moe_model(cfg)
    seqs = nasty_forests(3)["tree"]
    coef = _coef(seqs, 0)
    ref = run_unshared(model, seqs, coef)
    tree, _ = run_tree(model, seqs, coef)
    import ps_mcore.layer_specs.moe as tree_moe

    real = TreeTopKRouter._tree_weight
    try:  # all-ones weights = the stock router on the packed rows
        TreeTopKRouter._tree_weight = lambda self, rows: (
            None if real(self, rows) is None else torch.ones(rows))
        flat, _ = run_tree(model, seqs, coef)
    finally:
        TreeTopKRouter._tree_weight = real
    assert tree_moe is not None
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
    assert word in tree_unsupported_reason(cfg)
    model = build_moe_model(cfg)
    seqs = nasty_forests(0)["grpo"]
    with pytest.raises(NotImplementedError, match=word):
        run_tree(model, seqs, _coef(seqs, 0))
    run_unshared(model, seqs, _coef(seqs, 0))  # the same model still runs unshared batches


def test_supported_config_has_no_reason():
    assert tree_unsupported_reason(moe_config(**MOE_CASES["aux+z/allgather"])) is None
    assert tree_unsupported_reason(tiny_config("qwen2")) is None
