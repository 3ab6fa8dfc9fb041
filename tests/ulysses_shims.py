"""Test-only shims for DeepSpeed-Ulysses sequence parallelism on machines without its hardware.

* :func:`emulate_all_to_all`: gloo (the CPU backend) has no ``all_to_all``. Each rank
  all-gathers every rank's input list and keeps the pieces addressed to it: the same result
  as ``dist.all_to_all``, at ``world`` times the traffic. Installed only on gloo; NCCL runs
  the real collective. verl's ``SeqAllToAll`` and ps-mcore's ``AllToAll`` both call it.
* :func:`varlen_attention_from_position_ids`: verl's Ulysses attention wraps transformers'
  ``_flash_attention_forward`` (flash-attn's varlen kernel; sequence boundaries where
  ``position_ids`` restart at 0). flash-attn needs CUDA and is absent on CPU (and on the
  GPU machine); this is the same computation in plain torch: causal attention within each
  segment, GQA by repeating key/value heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def emulate_all_to_all() -> None:
    """Replace ``dist.all_to_all`` by an all-gather emulation when the backend is gloo."""
    if dist.get_backend() != "gloo" or getattr(dist.all_to_all, "_emulated", False):
        return

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        assert not async_op
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for dst in range(size):  # round dst: every rank contributes its piece for dst
            gathered = [torch.empty_like(output_tensor_list[src]) for src in range(size)]
            dist.all_gather(gathered, input_tensor_list[dst].contiguous(), group=group)
            if dst == rank:
                for src in range(size):
                    output_tensor_list[src].copy_(gathered[src])

    all_to_all._emulated = True
    dist.all_to_all = all_to_all


def varlen_attention_from_position_ids(
    query, key, value, attention_mask, query_length, *args, position_ids=None, softmax_scale=None, **kwargs
):
    """``[B=1, S, Hq, D]`` q and ``[1, S, Hkv, D]`` k/v -> ``[1, S, Hq, D]``: causal attention
    within each run of rows whose ``position_ids`` start at 0."""
    assert query.size(0) == 1 and attention_mask is None
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    rep = query.size(2) // key.size(2)
    q = query[0].transpose(0, 1)
    k, v = (x[0].repeat_interleave(rep, dim=1).transpose(0, 1) for x in (key, value))
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=softmax_scale))
    return torch.cat(out, dim=1).transpose(0, 1)[None]
