"""Stock MTP and tree MTP on one batch (tests/test_tree_mtp.py in-process, and its
tensor-parallel worlds through tests/mtp_parallel_worker.py).

Stock: a GPTModel built from megatron's own local layer spec and MTP block spec
(``use_transformer_engine=False``), the unshared samples right-padded into one sbhd batch with a
causal mask, verl's MTP postprocess patch, labels ``x[i+1]`` and loss mask ``m[i+1]`` as verl
hands them over; megatron rolls both per depth. Tree: the same weights in a tree-spec model,
the prefix forest, :func:`~ps_mcore.integrations.verl_common.mtp.tree_mtp_training`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from megatron_shims import build_gpt, causal_mask, layer_spec_args, tiny_config


def build_models(depths: int, detach: bool, tied: bool, block_spec=lambda spec, cfg: spec, **config):
    """(stock, tree, config): megatron's local spec and the tree spec (each through
    ``block_spec(spec, cfg)``, e.g. the SP norms), both with megatron's MTP block and verl's MTP
    patches (postprocess, recompute, ``detach_encoder``), in training mode; weights as built."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from verl.utils.megatron_utils import patch_engine_mtp

    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    cfg = tiny_config("qwen2", mtp_num_layers=depths, **config)
    models = []
    for make_spec in (get_gpt_layer_local_spec, get_gpt_layer_local_tree_spec):
        spec = block_spec(make_spec(**layer_spec_args(cfg)), cfg)
        mtp = block_spec(get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False), cfg)
        models.append(build_gpt(cfg, spec, mtp_block_spec=mtp, share_embeddings_and_output_weights=tied))
    for model in models:
        patch_engine_mtp(model, SimpleNamespace(mtp=SimpleNamespace(detach_encoder=detach)))
        model.train()
    return (*models, cfg)


def samples(seqs, seed: int):
    """Per sample: a loss mask ``[L]`` (0 at the first token, like a prompt, and at random
    others) and main-loss weights ``[L]`` on the next-token log-probs (0 at the last token)."""
    rng = np.random.default_rng(seed)
    masks, weights = [], []
    for s in seqs:
        mask = (rng.random(len(s)) > 0.25).astype(np.float32)
        mask[0] = 0
        weight = rng.normal(size=len(s)).astype(np.float32)
        weight[-1] = 0
        masks.append(torch.from_numpy(mask))
        weights.append(torch.from_numpy(weight))
    return masks, weights


def labelled(seqs, masks, depth: int) -> int:
    """Tokens whose depth-``depth`` prediction counts: (s, i) with mask m[i + depth + 1] = 1."""
    return sum(int(m[depth + 1:].sum()) for m in masks if len(m) > depth + 1)


def _next_logprobs(logits, seqs) -> torch.Tensor:
    """``[N]`` log-prob of each token's next token from per-sequence logits (0 at the last)."""
    out = []
    for lg, s in zip(logits, seqs):
        nxt = torch.tensor(list(s[1:]) + [0])
        out.append(torch.log_softmax(lg, -1).gather(1, nxt[:, None])[:, 0] * (torch.arange(len(s)) < len(s) - 1))
    return torch.cat(out)


def run_stock(model, seqs, masks, weights, full_vocab=lambda x: x, multiple: int = 1):
    """The per-sample weighted main loss of the stock model (MTP's loss rides in its backward);
    ``full_vocab``: the logits' vocab shards gathered; ``multiple``: the batch's sequence length
    is padded to it (sequence parallelism splits it across TP ranks)."""
    b, s = len(seqs), max(len(x) for x in seqs)
    s += -s % multiple
    ids, labels, loss_mask = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:])
        loss_mask[i, : len(seq) - 1] = mask[1:]
    positions = torch.arange(s)[None].expand(b, s)
    logits = full_vocab(model(input_ids=ids, position_ids=positions, attention_mask=causal_mask(s), labels=labels,
                              loss_mask=loss_mask))  # [B, S, V]
    return (torch.cat(weights) * _next_logprobs([lg[: len(x)] for lg, x in zip(logits, seqs)], seqs)).sum()


def run_tree(model, seqs, masks, weights, detach, full_vocab=lambda x: x, multiple: int = 1):
    """The same loss from the tree model (rows padded to ``multiple``)."""
    from ps_mcore import plan_prefix_tree
    from ps_mcore.integrations.verl_common.mtp import tree_mtp_training
    from ps_mcore.layer_specs import TreePackedSeqParams

    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=multiple)
    ids = torch.nn.functional.pad(plan.input_ids, (0, -plan.num_tokens % multiple))
    with tree_mtp_training(model, plan, torch.cat(masks), detach):
        logits = model(input_ids=ids[None], position_ids=psp.position_ids[None], attention_mask=None,
                       packed_seq_params=psp)
    rows = plan.unpack(full_vocab(logits)[0, : plan.num_tokens])  # [N, V]
    offsets = np.cumsum([0] + [len(x) for x in seqs])
    per_sequence = [rows[offsets[i]: offsets[i + 1]] for i in range(len(seqs))]
    return (torch.cat(weights) * _next_logprobs(per_sequence, seqs)).sum()


def tracker() -> dict:
    """megatron's MTP tracker (the logged losses; acceptance counts on megatron-core 0.19)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)}


def _own_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def step(model, run, full_grads=_own_grads):
    """(loss, grads, tracker) of one forward + backward; ``full_grads(model)``: the gradients
    reduced as megatron's DDP does and their TP shards gathered."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return loss.detach(), full_grads(model), tracker()
