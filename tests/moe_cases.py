"""Shared by tests/test_tree_moe.py and tests/moe_ep_worker.py: MoE configs, the tree run and
the unshared-THD oracle run of one batch, and the comparison. Import after megatron's parallel
state is initialised (and ``enable_cpu_moe()``)."""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.moe import moe_utils

from megatron_shims import build_gpt, randomize_, tiny_config
from ps_mcore import plan_prefix_tree
from ps_mcore.layer_specs import TreePackedSeqParams, get_gpt_decoder_block_tree_spec
from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter
from ps_mcore.logprobs import token_logprobs
from ps_mcore.planner import plan_unshared

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


def sample_coefs(seqs, seed):
    n = sum(len(s) for s in seqs)
    return torch.as_tensor(np.random.default_rng(seed).normal(size=n), dtype=torch.float32)
