"""torchrun worker for tests/test_verl_fsdp.py: verl's real FSDP engine on two data-parallel
ranks (gloo on CPU, or NCCL), the model wrapped by FSDP2's ``fully_shard`` over both, ranks
holding different mini-batches: cross-micro-batch schedules (different call counts per rank)
against verl's stock run of the same data.

Cases: both ranks schedule (different plans), and only rank 0 schedules (rank 1's units fit
the budget). Per rank: PPO loss, every gradient (the full tensors of FSDP2's sharded, reduced
gradients), log-probs / entropy of the log-prob pass, and the token counts (each row once).
On verl 0.9.1 the engine config's default defers gradient sync to the last micro-batch
(``use_no_sync_for_gradient_accumulation``), which must stay off inside ``gathered_once``.

Usage: ``torchrun --standalone --nproc_per_node 2 verl_fsdp_dp_worker.py OUT [cpu|cuda]``;
rank 0 writes every rank's JSON report to OUT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
from gloo_world import init_torchrun_world
import verl_batches  # noqa: F401  (before verl: verl 0.9.1 without a GPU gets the CPU platform)


def sharded_model(seed: int, device: torch.device):
    from test_verl_fsdp import _fully_shard, make_model

    return _fully_shard(make_model(seed=seed).to(device))


def _run(model, data, setting, loss_fn, patched):
    from test_verl_fsdp import make_engine
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl_helpers import fsdp_patchset

    from ps_mcore import setup

    if patched:
        setup.install([fsdp_patchset()])
    else:
        setup.uninstall()
    engine = make_engine(impl, impl.FSDPEngineWithLMHead, model, setting)
    model.zero_grad(set_to_none=True)
    out = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=loss_fn is None)
    grads = [None if p.grad is None else p.grad.full_tensor().detach().clone() for p in model.parameters()]
    sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())  # resharded afterwards
    return out, grads, sharded


def case_report(device, rank_seeds) -> dict:
    from functools import partial

    from test_verl_fsdp import _ppo, _setting, _unique_tokens
    from verl_batches import WORKLOADS, long_units, make_batch, seq_last_mask, step_tokens

    rank = dist.get_rank()
    seed = rank_seeds[rank]
    rng = np.random.default_rng(abs(seed))
    # negative: GRPO groups that fit the budget, as many samples as stock verl needs micro-batches
    samples = long_units(rng) if seed >= 0 else WORKLOADS["grpo"](rng, prompts=6, group=3)
    data = make_batch(samples, rng, temperature=0.8, max_token_len_per_gpu=40)
    model = sharded_model(seed=4, device=device)
    setting = _setting("arbitrary_prefix")
    loss_fn = partial(_ppo())
    stock_i, _, stock_sharded_i = _run(model, data, setting, None, patched=False)
    tree_i, _, sharded_i = _run(model, data, setting, None, patched=True)
    stock_t, g_stock, stock_sharded_t = _run(model, data, setting, loss_fn, patched=False)
    tree_t, g_tree, sharded_t = _run(model, data, setting, loss_fn, patched=True)
    s, t = stock_i["model_output"], tree_i["model_output"]
    keep = seq_last_mask(s["log_probs"])
    return {
        "log_probs": float((s["log_probs"].values()[keep] - t["log_probs"].values()[keep]).abs().max()),
        "entropy": float((s["entropy"].values() - t["entropy"].values()).abs().max()),
        "loss": [float(np.sum(stock_t["loss"])), float(np.sum(tree_t["loss"]))],
        "grad_rel": max(float((a - b).abs().max()) / max(float(a.abs().max()), 1e-12)
                        for a, b in zip(g_stock, g_tree)),
        "grads_complete": all(g is not None for g in g_tree),
        "tokens": [*step_tokens(tree_t), _unique_tokens(data)],
        # parameters sharded again wherever verl's stock run leaves them sharded
        "resharded": (sharded_i or not stock_sharded_i) and (sharded_t or not stock_sharded_t),
        "sharded": [stock_sharded_i, stock_sharded_t, sharded_i, sharded_t],
    }


def main(out_path: str, device: str = "cpu") -> None:
    from megatron_shims import write_reports

    dev = init_torchrun_world(device)
    report = {
        "rank": dist.get_rank(),
        "both": case_report(dev, (0, 1)),
        "rank0_only": case_report(dev, (2, -3)),
    }
    write_reports(report, out_path)
    from ps_mcore import setup

    setup.uninstall()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
