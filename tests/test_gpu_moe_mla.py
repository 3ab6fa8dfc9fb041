"""GPU + transformer-engine: TE-spec MoE (grouped GEMM, alltoall) and MLA models, the stock TE
model on the unshared THD batch vs ``to_tree_spec`` of the same spec on the prefix tree (bf16).
The tree's log-prob error against an fp32 reference must be no larger than the stock model's
(plus bf16 slack), per token, and so must each row of every gradient of a per-sample-weighted
loss (the stock model's gradients against the same reference set the bound). The MoE model
routes without near-ties (tests/flip_free_routing.py: a bf16 top-k flip moves a token's
log-prob and its gradient rows far in whichever run it happens, so no per-row bound could hold
otherwise), and the test checks that premise: every bf16 run picks the fp32 reference's top-k
for every token. Skips without CUDA or
Transformer Engine (``pip install --no-build-isolation "transformer_engine[pytorch]"``):
``python -m pytest -q tests/test_gpu_moe_mla.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_rows_close
from flip_free_routing import MEGATRON_NAMES, assert_same_routing, record_routing, route_by_token_
from forests import assert_branches

pytestmark = pytest.mark.gpu

GPU_MOE = dict(hidden=256, heads=8, kv_heads=2, head_dim=64, ffn=512, vocab=1024,
               experts=8, topk=2, expert_ffn=128)
GPU_MLA = dict(hidden=256, heads=8, kv_heads=8, head_dim=64, ffn=512, vocab=1024,
               q_lora=128, kv_lora=64, qk=32, rope=16, v=32)


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in fp32 (zeros where none reached it: an expert no token chose)."""
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad).float() for n, p in model.named_parameters()}


def _weighted_step(runs, model, logprobs):
    model.zero_grad(set_to_none=True)
    (logprobs(model).float() * runs.weights).sum().backward()
    return _grads(model)


@pytest.mark.parametrize("kind", ["moe", "mla"])
def test_te_model_tree_vs_stock_unshared_thd(kind):
    pytest.importorskip("transformer_engine")
    from benchmarks import moe_mla

    from ps_mcore.workloads import make_workload

    moe_mla.init_parallel("cuda")
    dims = GPU_MOE if kind == "moe" else GPU_MLA
    cfg = moe_mla.build_config(kind, dims, 2, torch.bfloat16, "cuda")
    stock, tree = moe_mla.build_pair(cfg, dims["vocab"], "cuda", tiny=False)
    if kind == "moe":
        for model in (stock, tree):
            route_by_token_(model, MEGATRON_NAMES, seed=0)
        stock_params = dict(stock.named_parameters())
        assert all(torch.equal(p, stock_params[n]) for n, p in tree.named_parameters())
    ref = moe_mla.build_reference(moe_mla.build_config(kind, dims, 2, torch.float32, "cuda"),
                                  tree, dims["vocab"], "cuda", tiny=False)
    for name in ("agent-tree", "step-wise"):
        w = make_workload(name, seed=0, scale=1 / 8, vocab=dims["vocab"])
        if name == "agent-tree":
            assert_branches(w.sequences, levels=3)  # every turn branches
        runs = moe_mla.Runs(stock, tree, w.sequences, "cuda")
        assert runs.plan.num_tokens < runs.plan.num_input_tokens
        with torch.no_grad(), record_routing(ref) as r32, record_routing(stock) as r_stock, \
                record_routing(tree) as r_tree:
            lp32 = runs.base_lp(ref).float()
            err_stock = (runs.base_lp().float() - lp32).abs()
            err_tree = (runs.tree_lp().float() - lp32).abs()
        if kind == "moe":  # the premise of the per-token and per-row bounds below
            assert_same_routing(r32, {"stock": (r_stock, None), "tree": (r_tree, runs.plan.unpack_index)},
                                k=dims["topk"])
        assert float(err_tree.mean()) <= 1.5 * float(err_stock.mean()) + 2e-3, (name, err_tree.mean(), err_stock.mean())
        assert float(err_tree.max()) <= 1.5 * float(err_stock.max()) + 2e-2, (name, err_tree.max(), err_stock.max())

        # Gradients: the stock TE model on the unshared batch, the tree model on the tree and the
        # fp32 reference on the unshared batch, one per-sample-weighted loss: each row of each
        # gradient of the tree within twice the stock model's error on that row plus 5% of the
        # tensor's largest value.
        g_stock = _weighted_step(runs, stock, runs.base_lp)
        g_tree = _weighted_step(runs, tree, runs.tree_lp)
        g_ref = _weighted_step(runs, ref, runs.base_lp)
        assert g_tree.keys() == g_stock.keys() == g_ref.keys()
        assert all(torch.isfinite(g).all() for g in g_tree.values())
        for pname, g in g_ref.items():
            assert_rows_close(g_tree[pname], g, 5e-2, f"{name} d {pname}", baseline=g_stock[pname])

