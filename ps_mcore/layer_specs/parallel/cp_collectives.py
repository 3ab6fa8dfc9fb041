"""The collectives of context parallelism for tree batches, as autograd functions.

Every layer all-gathers K/V over the CP group (backward: reduce-scatter of dK/dV); outputs
gather back into plan order or sum over ranks with disjoint supports. The backward rules
assume every CP rank computes the same loss from a gathered result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ps_mcore.layer_specs.parallel.cp_layout import CPLayout




def check_cp_group(layout: CPLayout, group) -> None:
    if group is None:
        raise ValueError(
            f"a CP layout (cp_size={layout.cp_size}) needs the context-parallel process group"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (layout.cp_size, layout.cp_rank):
        raise ValueError(
            f"the packed params were built for CP rank {layout.cp_rank} of {layout.cp_size}, but "
            f"this is rank {rank} of a CP group of {size}; pass cp_size/cp_rank of the model's "
            "CP group to TreePackedSeqParams.from_plan"
        )


def all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """``[t, ...]`` on every rank -> ``[size * t, ...]`` rank-major."""
    x = x.contiguous()
    out = x.new_empty((size * x.size(0),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


class AllGatherKV(torch.autograd.Function):
    """Rank-major all-gather; backward reduce-scatters (each rank's dK/dV is partial: it comes
    from its own queries only)."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        return all_gather_rows(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.size(0) // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None


class GatherRows(torch.autograd.Function):
    """``[t, ...]`` on every CP rank -> ``[T_pad, ...]`` in plan order; backward keeps this
    rank's rows of the gradient (every rank computed the same loss from the result)."""

    @staticmethod
    def forward(ctx, x, layout, group):
        ctx.layout = layout
        return all_gather_rows(x, group, layout.cp_size).index_select(0, layout.plan_order)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.layout.local_rows), None, None


class SumDisjoint(torch.autograd.Function):
    """All-reduce (sum) of per-rank tensors with disjoint supports; backward: identity (every
    rank computed the same loss from the combined result)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cp_group_or_default(cp_group):
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()
