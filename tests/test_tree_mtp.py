"""Multi-token prediction (MTP) on a prefix tree at the model level, against stock MTP on the
unshared batch, on megatron-core 0.16 (verl 0.8.0) and 0.19 (verl 0.9.1).

Stock: a GPTModel built from megatron's own local layer spec and MTP block spec
(``use_transformer_engine=False``), the unshared samples right-padded into one sbhd batch with a
causal mask, verl's MTP postprocess patch (the loss verl trains with: its own on megatron-core
0.16, megatron's ``process_mtp_loss`` on 0.19), labels ``x[i+1]`` and loss mask ``m[i+1]`` as
verl hands them over; megatron rolls both per depth. Tree: the same weights in a tree-spec
model, the prefix forest, :func:`~ps_mcore.integrations.verl_common.mtp.tree_mtp_training`.
Each sample has its own loss mask and per-token weights (duplicates differ), so a shared row
must count once per sample and once per distinct continuation. Checked: the per-sample
weighted main loss, every gradient (MTP layers, decoder, embedding, output layer where the
MTP loss trains it) and megatron's MTP tracker (logged losses; acceptance counts on 0.19).
The same through verl's Megatron engine: tests/test_verl_megatron.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

from forests import branching_forest, small_nasty_forests  # noqa: E402
from megatron_shims import (  # noqa: E402
    build_gpt, causal_mask, enable_cpu_recompute, init_cpu_megatron, layer_spec_args, randomize_, tiny_config,
)
import verl_batches  # noqa: E402, F401  (verl 0.9.1 on a CPU-only machine: its CPU platform)

from ps_mcore import plan_prefix_tree  # noqa: E402

init_cpu_megatron(1)
enable_cpu_recompute()

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec  # noqa: E402
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from verl.utils.megatron_utils import patch_engine_mtp  # noqa: E402

from ps_mcore.integrations.verl_common.mtp import megatron_mtp_loss, tree_mtp_training  # noqa: E402
from ps_mcore.layer_specs import TreePackedSeqParams, get_gpt_layer_local_tree_spec  # noqa: E402


def _models(depths: int, detach: bool, tied: bool, **config):
    """(stock, tree): the same random weights, verl's MTP patches on both (as its engine applies
    them: postprocess, recompute, ``detach_encoder``)."""
    cfg = tiny_config("qwen2", mtp_num_layers=depths, **config)
    models = []
    for make_spec in (get_gpt_layer_local_spec, get_gpt_layer_local_tree_spec):
        spec = make_spec(**layer_spec_args(cfg))
        mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
        models.append(build_gpt(cfg, spec, mtp_block_spec=mtp, share_embeddings_and_output_weights=tied))
    stock, tree = models
    randomize_(stock, seed=11)
    tree.load_state_dict(stock.state_dict())
    for model in models:
        patch_engine_mtp(model, SimpleNamespace(mtp=SimpleNamespace(detach_encoder=detach)))
        model.train()
    return stock, tree


def _samples(seqs, seed: int):
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


def _next_logprobs(logits, seqs) -> torch.Tensor:
    """``[N]`` log-prob of each token's next token from per-sequence logits (0 at the last)."""
    out = []
    for lg, s in zip(logits, seqs):
        nxt = torch.tensor(list(s[1:]) + [0])
        out.append(torch.log_softmax(lg, -1).gather(1, nxt[:, None])[:, 0] * (torch.arange(len(s)) < len(s) - 1))
    return torch.cat(out)


def _tracker() -> dict:
    return {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if isinstance(v, torch.Tensor)}


def _run_stock(model, seqs, masks, weights):
    b, s = len(seqs), max(len(x) for x in seqs)
    ids, labels, loss_mask = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq) - 1] = torch.tensor(seq[1:])
        loss_mask[i, : len(seq) - 1] = mask[1:]
    positions = torch.arange(s)[None].expand(b, s)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=causal_mask(s), labels=labels,
                   loss_mask=loss_mask)  # [B, S, V]
    return (torch.cat(weights) * _next_logprobs([lg[: len(x)] for lg, x in zip(logits, seqs)], seqs)).sum()


def _run_tree(model, seqs, masks, weights, detach):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    with tree_mtp_training(model, plan, torch.cat(masks), detach):
        logits = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None], attention_mask=None,
                       packed_seq_params=psp)[0]
    rows = plan.unpack(logits[: plan.num_tokens])  # [N, V]
    offsets = np.cumsum([0] + [len(x) for x in seqs])
    per_sequence = [rows[offsets[i]: offsets[i + 1]] for i in range(len(seqs))]
    return (torch.cat(weights) * _next_logprobs(per_sequence, seqs)).sum(), plan


def _step(model, run):
    MTPLossLoggingHelper.tracker.clear()
    model.zero_grad(set_to_none=True)
    loss = run()
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, _tracker()


def _labelled(seqs, masks, depth: int) -> int:
    """Tokens whose depth-``depth`` prediction counts: (s, i) with mask m[i + depth + 1] = 1."""
    return sum(int(m[depth + 1:].sum()) for m in masks if len(m) > depth + 1)


def _check(seqs, depths=2, detach=False, tied=False, seed=1, **config):
    missing = [k for k in config if k not in TransformerConfig.__dataclass_fields__]
    if missing:
        pytest.skip(f"this megatron-core has no {missing}")
    masks, weights = _samples(seqs, seed)
    if not megatron_mtp_loss():
        # verl's own loss (megatron-core 0.16) divides by the depth's token count unclamped
        # (0/0 in stock too): keep the depths that score something
        while depths and not all(_labelled(seqs, masks, k) for k in range(1, depths + 1)):
            depths -= 1
        if not depths:
            pytest.skip("no MTP depth scores a token of this forest")
    stock, tree = _models(depths, detach, tied, **config)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    loss_s, grads_s, logged_s = _step(stock, lambda: _run_stock(stock, seqs, masks, weights))
    loss_t, grads_t, logged_t = _step(tree, lambda: _run_tree(tree, seqs, masks, weights, detach))
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_t.keys()
    for name in grads_s:
        scale = float(grads_s[name].abs().max()) + 1e-6
        torch.testing.assert_close(grads_t[name], grads_s[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert logged_s.keys() == logged_t.keys() and logged_s
    for key in logged_s:
        torch.testing.assert_close(logged_t[key], logged_s[key], rtol=1e-5, atol=1e-6, msg=key)
    return grads_t


@pytest.mark.parametrize("name", list(small_nasty_forests()))
def test_tree_mtp_matches_stock_on_nasty_forests(name):
    """Two MTP layers on one sequence, a deep chain, single tokens, duplicates and a prefix of
    another, a branching tree, no sharing, a random tree."""
    _check(small_nasty_forests()[name])


def _branching():
    return branching_forest(np.random.default_rng(4), roots=2, depth=3, fanout=3, node_len=(2, 5))


@pytest.mark.parametrize("options", [
    dict(depths=1),
    dict(depths=3),
    dict(detach=True),  # verl's detach_encoder
    dict(tied=True),  # the output layer is the embedding
    dict(calculate_per_token_loss=True),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(mtp_detach_heads=True),  # megatron-core 0.19
    dict(mtp_use_repeated_layer=True),  # megatron-core 0.19: one layer at every depth
    dict(mtp_loss_scaling_factor=0.7),
    dict(use_mup=True, mup_base_hidden_size=32),  # megatron-core 0.19: MuP scales the MTP logits too
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_tree_mtp_matches_stock_on_a_branching_forest(options):
    grads = _check(_branching(), **options)
    mtp = [g for n, g in grads.items() if n.startswith("mtp.")]
    assert mtp and all(float(g.abs().max()) > 0 for g in mtp)  # the MTP loss reached every MTP layer
