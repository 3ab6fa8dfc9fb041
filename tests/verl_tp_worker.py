"""torchrun worker for tests/test_verl_megatron.py: verl 0.8.0's Megatron engine with TP=2
(gloo, CPU), patched vs stock, on one tiny tree-spec GPTModel (vocab-parallel LM head).

Usage: ``torchrun --standalone --nproc_per_node 2 verl_tp_worker.py OUT``; rank 0 writes a
JSON report of the largest differences to OUT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist


def main(out_path: str) -> None:
    from megatron_shims import build_gpt, init_cpu_megatron, layer_spec_args, randomize_, tiny_config, write_reports

    init_cpu_megatron(tp=2)
    from functools import partial

    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.config import McoreActorConfig as _Actor
    from verl_batches import (
        DISTILLATION_KEYS, WORKLOADS, cpu_forward_backward_func, distillation_loss, engine_shell, make_batch,
        sample_temperatures, with_statistics,
    )

    from ps_mcore import setup
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec
    from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig, PrefixSharingSetting

    impl.get_forward_backward_func = cpu_forward_backward_func
    cfg = tiny_config("qwen2", tensor_model_parallel_size=2)
    model = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)), vocab=128)
    randomize_(model)  # same seed on both ranks: replicated parameters agree
    rng = np.random.default_rng(11)
    data = make_batch(WORKLOADS["tree"](rng) + WORKLOADS["grpo"](rng, prompts=1), rng, temperature=0.8)
    setting = PrefixSharingSetting(True, PrefixGrouperConfig(mode="arbitrary_prefix", min_prefix_len=3, min_saved_fraction=0.0))
    loss_fn = partial(ppo_loss, config=McoreActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01))
    # sum_pi_squared and top-k distillation (vocab-parallel top-k ids and teacher-id log-probs),
    # per-sample temperatures
    distill_data = with_statistics(data.clone(), seed=12)
    distill_data["temperature"] = sample_temperatures(distill_data.batch_size[0], seed=12)
    distill_fn = distillation_loss(_Actor(rollout_n=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01), distill_data)
    stat_keys = ("sum_pi_squared",) + DISTILLATION_KEYS
    results = {}
    for name, patched in (("stock", False), ("tree", True)):
        setup.install() if patched else setup.uninstall()
        engine = engine_shell(impl.MegatronEngineWithLMHead, model, setting)
        infer = engine.forward_backward_batch(data.clone(), loss_function=None, forward_only=True)
        model.zero_grad(set_to_none=True)
        train = engine.forward_backward_batch(data.clone(), loss_function=loss_fn, forward_only=False)
        model.zero_grad(set_to_none=True)
        distill = engine.forward_backward_batch(distill_data.clone(), loss_function=distill_fn, forward_only=False)
        results[name] = {
            "stats": {k: distill["model_output"][k].values().detach().double() for k in stat_keys},
            "distill_loss": distill["loss"],
            "distill_tokens": [sum(distill["metrics"]["prefix_sharing/tokens_in"]), sum(distill["metrics"]["prefix_sharing/tokens_packed"])] if patched else None,
            "distill_grads": [p.grad.clone() for p in model.parameters()],
            "log_probs": infer["model_output"]["log_probs"],
            "entropy": infer["model_output"]["entropy"].values().detach(),
            "loss": train["loss"],
            "grads": [p.grad.clone() for p in model.parameters()],
            "metrics": infer["metrics"],
        }
    lp_s, lp_t = results["stock"]["log_probs"], results["tree"]["log_probs"]
    lens = lp_s.offsets().diff().tolist()
    keep = torch.ones(sum(lens), dtype=torch.bool)
    keep[torch.tensor(np.cumsum(lens) - 1)] = False
    report = {
        "rank": dist.get_rank(),
        "log_probs": float((lp_s.values()[keep] - lp_t.values()[keep]).abs().max()),
        "entropy": float((results["stock"]["entropy"] - results["tree"]["entropy"]).abs().max()),
        "loss": [results["stock"]["loss"], results["tree"]["loss"]],
        "grads": max(float((a - b).abs().max()) for a, b in zip(results["stock"]["grads"], results["tree"]["grads"])),
        "grad_scale": max(float(a.abs().max()) for a in results["stock"]["grads"]),
        "stats": {k: float((results["stock"]["stats"][k] - results["tree"]["stats"][k]).abs().max()) for k in stat_keys},
        "distill_loss": [results["stock"]["distill_loss"], results["tree"]["distill_loss"]],
        "distill_grads": max(float((a - b).abs().max()) for a, b in zip(results["stock"]["distill_grads"], results["tree"]["distill_grads"])),
        "distill_tokens": results["tree"]["distill_tokens"],
        "distill_grad_scale": max(float(a.abs().max()) for a in results["stock"]["distill_grads"]),
        "tokens": [sum(results["tree"]["metrics"]["prefix_sharing/tokens_in"]), sum(results["tree"]["metrics"]["prefix_sharing/tokens_packed"])],
    }
    write_reports(report, out_path)
    setup.uninstall()


if __name__ == "__main__":
    main(sys.argv[1])
