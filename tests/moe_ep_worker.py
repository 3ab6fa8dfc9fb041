"""torchrun worker for tests/test_tree_moe.py: expert parallelism (EP=2, gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node 2 moe_ep_worker.py DISPATCHER OUT``. Each rank
holds half of the experts and its own micro-batch (EP ranks are data-parallel ranks for the
dense layers); the dispatcher exchanges tokens between them. Each rank checks its tree run
against megatron's run on its unshared THD batch (log-probs, gradients of its parameters,
router losses, expert-bias counts) and rank 0 writes the largest errors to OUT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_shims import enable_cpu_moe, init_cpu_megatron


def main(dispatcher: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    init_cpu_megatron(1)  # gloo + CPU shims, then the EP layout
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    enable_cpu_moe()
    from forests import nasty_forests, random_forest
    from moe_cases import MOE_CASES, assert_same, build_moe_model, moe_config, run_tree, run_unshared, sample_coefs

    rank = dist.get_rank()
    cfg = moe_config(**{**MOE_CASES["aux+z/allgather"], "moe_token_dispatcher_type": dispatcher,
                        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                        "expert_model_parallel_size": 2})
    model = build_moe_model(cfg, seed=0)
    experts = [n for n, _ in model.named_parameters() if "experts" in n]
    assert experts and model.decoder.layers[0].mlp.num_local_experts == 2
    if dispatcher == "alltoall":  # any row counts per rank
        batches = [random_forest(np.random.default_rng(10 + rank), max_seqs=6, max_len=16),
                   nasty_forests(rank)["tree" if rank == 0 else "grpo"]]
        pad_to = 2
    else:  # megatron's allgather dispatcher all-gathers equal row counts over EP: same
        # sequence lengths on both ranks (different tokens), tree rows padded to one size
        batches = [nasty_forests(rank)["tree"], nasty_forests(rank)["deep-chain"]]
        pad_to = 128
    worst, shared = 0.0, False
    for i, seqs in enumerate(batches):
        coef = sample_coefs(seqs, i)
        ref = run_unshared(model, seqs, coef)
        tree, plan = run_tree(model, seqs, coef, pad_to=pad_to)
        shared = shared or plan.num_tokens < plan.num_input_tokens
        assert_same(tree, ref)
        worst = max(worst, float((tree["lp"] - ref["lp"]).abs().max()))
        assert any(float(g.abs().max()) > 0 for n, g in ref["grads"].items() if "experts" in n)
    assert shared  # some batch of this rank really shares rows
    if rank == 0:
        torch.save({"max_logprob_err": worst, "ranks": dist.get_world_size()}, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
