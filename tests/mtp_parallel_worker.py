"""torchrun worker for tests/test_tree_mtp.py: stock MTP and tree MTP under tensor parallelism
(TP=2, with or without sequence parallelism) on gloo.

Usage: ``torchrun --standalone --nproc_per_node 2 mtp_parallel_worker.py LAYOUT PAYLOAD OUT``.
LAYOUT: ``tp2`` or ``tp2sp``. PAYLOAD (written by the test) holds cases: the forest, loss masks
and weights, model options and the full TP=1 weights. Each rank loads its shards into the stock
and the tree model, runs both (the main loss on the gathered vocab; the MTP loss is each
model's own), reduces the gradients as megatron's DDP does (SP norm weights summed over TP) and
gathers the TP shards; rank 0 writes (loss, grads, MTP tracker) of both models per case to OUT.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron_shims import (
    enable_cpu_recompute,
    finalize_grads,
    init_cpu_megatron,
    shard_,
    sp_block_spec,
    sp_mtp_block_spec,
    unshard,
)
from mtp_cases import build_models, run_stock, run_tree, step

SEQUENCE_PARALLEL = {"tp2": False, "tp2sp": True}


def sp_specs(spec, config):
    """The decoder's layer spec as an SP block spec; the MTP block spec with SP norms."""
    if hasattr(spec, "layer_specs") and hasattr(spec.layer_specs[0].submodules, "enorm"):
        return sp_mtp_block_spec(spec)
    return sp_block_spec(spec, config.num_layers)


def run_case(case: dict, sequence_parallel: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    group, rank, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), 2
    specs = sp_specs if sequence_parallel else (lambda spec, cfg: spec)
    stock, tree, config = build_models(case["depths"], case["detach"], case["tied"], specs,
                                       sequence_parallel=sequence_parallel, tensor_model_parallel_size=tp,
                                       **case["config"])
    with torch.no_grad():
        for name, p in stock.named_parameters():
            p.copy_(shard_(case["state"][name], p, rank, tp))
    tree.load_state_dict(stock.state_dict())
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    seqs, masks, weights = case["seqs"], case["masks"], case["weights"]
    run = dict(full_vocab=gather_from_tensor_model_parallel_region, multiple=tp if sequence_parallel else 1)

    def full_grads(model) -> dict:
        finalize_grads(model, config, group)
        return {n: unshard(p.grad, p, group) for n, p in model.named_parameters()}

    return {
        "stock": step(stock, lambda: run_stock(stock, seqs, masks, weights, **run), full_grads),
        "tree": step(tree, lambda: run_tree(tree, seqs, masks, weights, case["detach"], **run), full_grads),
    }


def main(layout: str, payload_path: str, out_path: str) -> None:
    init_cpu_megatron(tp=2)
    enable_cpu_recompute()
    import verl_batches  # noqa: F401  (verl 0.9.1 on a CPU-only machine: its CPU platform)

    cases = torch.load(payload_path, weights_only=False)
    results = [run_case(case, SEQUENCE_PARALLEL[layout]) for case in cases]
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
