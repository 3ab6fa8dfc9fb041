"""torchrun worker for tests/test_megatron_tp.py: the tree-spec GPTModel under TP=2 on gloo.

Usage: ``torchrun --standalone --nproc_per_node 2 megatron_tp_worker.py PAYLOAD OUT``.
PAYLOAD (written by the test) holds, per tiny config, the TP=1 weights, the forest, the
per-sequence weights and the logits probe; rank 0 writes the gathered TP=2 logits, log-probs
and full gradients to OUT.
"""

from __future__ import annotations

import sys

import torch

from megatron_shims import build_gpt, init_cpu_megatron, layer_spec_args, shard_, tiny_config, unshard

KINDS = ("qwen2", "qwen3")
PAD = 2  # pad T to a multiple of TP, as sequence parallelism needs


def tree_step(model, plan, w_tok, probe, tp_group=None) -> dict:
    """Forward + backward of ``sum(w * logprobs) + 1e-2 * <unpacked logits, probe>`` on one
    forest; returns this rank's logits ``[T, V_local]`` and log-probs ``[N]``."""
    from ps_mcore.layer_specs import TreePackedSeqParams, token_logprobs

    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=PAD)
    logits = model(
        input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
        attention_mask=None, packed_seq_params=psp,
    )[0]
    lp, _ = token_logprobs(logits, plan, tp_group=tp_group)
    loss = (w_tok * lp).sum() + 1e-2 * (plan.unpack(logits) * probe).sum()
    loss.backward()
    return {"logits": logits[: plan.num_tokens].detach(), "logprobs": lp.detach()}


def tree_model(kind: str):
    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    cfg = tiny_config(kind)
    return build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))


def _finalize_qk_norm_grads(model, group) -> None:
    """Megatron's finalize_model_grads rule (no DDP wrapper here): qk-layernorm weights are
    replicated but each rank normalises only its own heads, so their grads are TP-summed."""
    for name, p in model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            torch.distributed.all_reduce(p.grad, group=group)


def main(payload_path: str, out_path: str) -> None:
    init_cpu_megatron(tp=2)
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    payload = torch.load(payload_path, weights_only=False)
    results = {}
    for kind in KINDS:
        case = payload[kind]
        model = tree_model(kind)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(shard_(case["state"][name], p, rank, tp))
        probe = case["probe"].chunk(tp, dim=1)[rank]  # the vocab shard this rank's logits hold
        out = tree_step(model, case["plan"], case["w_tok"], probe, tp_group=group)
        parts = [torch.empty_like(out["logits"]) for _ in range(tp)]
        torch.distributed.all_gather(parts, out["logits"].contiguous(), group=group)
        _finalize_qk_norm_grads(model, group)
        grads = {n: unshard(p.grad, p, group) for n, p in model.named_parameters()}
        results[kind] = {"logits": torch.cat(parts, -1), "logprobs": out["logprobs"], "grads": grads}
    if rank == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
