"""The stock-vs-tree oracle of the recurrent (hybrid) model tests: a model's logits at every
original token plus every parameter gradient of a per-sample-weighted loss, tree vs each
sequence alone through the stock model."""

from __future__ import annotations

import torch
from conftest import grads_of
from megatron_shims import stock_forward


def tree_vs_each_sequence(stock, tree, seqs, pad_to_multiple_of=4):
    """(tree, reference) logits ``[N, V]`` at every original token and parameter gradients of a
    per-sample-weighted loss; ``tree`` runs the packed forest, ``stock`` each sequence alone."""
    from ps_mcore import plan_prefix_tree
    from ps_mcore.layer_specs import TreePackedSeqParams

    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    dtype = next(stock.parameters()).dtype
    w = torch.cat([torch.full((len(s),), 0.3 + 0.4 * i, dtype=dtype) for i, s in enumerate(seqs)])
    ref = torch.cat([stock_forward(stock, s) for s in seqs])  # [N, V] (V / tp: a vocab shard)
    probe = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (w[:, None] * ref * probe).sum().backward()
    ref_grads = grads_of(stock)

    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad_to_multiple_of)
    logits = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                  attention_mask=None, packed_seq_params=psp)[0]
    got = plan.unpack(logits)
    (w[:, None] * got * probe).sum().backward()
    return (got.detach(), ref.detach()), (grads_of(tree), ref_grads)
