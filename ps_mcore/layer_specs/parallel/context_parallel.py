"""Context parallelism (CP) for tree batches: Megatron's 2*cp chunk layout over the packed rows.

The T_pad packed rows (plan order, padding last) are one THD sequence cut into ``2*cp`` equal
chunks; CP rank r holds chunks r and 2cp-1-r (Megatron's / verl's load-balanced layout, so
Megatron's THD RoPE slices the per-token rotary table the same way). Attention cannot stay
local in a tree (a query needs all its ancestors' K/V), so every layer all-gathers K/V over the
CP group (backward: reduce-scatter of dK/dV) and runs the gather-KV kernel for the local
queries only, against the global rows: query row q of node v attends to v's ancestor chain and
to v's own rows up to q, exactly as without CP.

Here: the attention of the local rows and :func:`gather_cp_rows`; the layout is
:mod:`~ps_mcore.layer_specs.parallel.cp_layout`, the collectives :mod:`~ps_mcore.layer_specs.parallel.cp_collectives`,
the log-probs :mod:`~ps_mcore.layer_specs.parallel.cp_logprobs`.

Outputs (logits, values) stay in this rank's rows: :func:`cp_token_logprobs` computes the
log-probs of the original tokens whose row is local and combines them over CP into ``[N]``;
:func:`gather_cp_rows` gathers any per-row tensor into plan order. Both assume every CP rank
then computes the same loss from the gathered result (the gradient of each local row is that
loss's gradient, not summed over ranks); parameter gradients are summed over CP afterwards, as
Megatron's DDP does over its data-and-context-parallel group.
"""

from __future__ import annotations

import torch

from ps_mcore.attention.backends import cp_backend_names, cp_kernel
from ps_mcore.attention.gather_kv import gather_kv_attention
from ps_mcore.attention.variants import attention_variant
from ps_mcore.layer_specs.parallel.cp_collectives import (
    AllGatherKV,
    GatherRows,
    check_cp_group,
    cp_group_or_default,
)
from ps_mcore.layer_specs.parallel.cp_layout import CPLayout

# Backends that run local queries against all-gathered K/V (a gather-KV kernel): read from
# the backend table (ps_mcore.attention.backends), which also gives ``cp_kernel``.
CP_BACKENDS = cp_backend_names()


# ----------------------------------------------------------------------------- attention


def cp_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: CPLayout,
    group,
    backend: str,
    softmax_scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Tree attention of this CP rank's rows.

    Args:
        q: ``[t, Hq, D]`` local queries (layout order); k/v: ``[t, Hkv, D]`` local keys/values.
        layout: this rank's :class:`CPLayout`; group: the CP process group.
        window, sinks: the variants of :func:`~ps_mcore.attention.tree_attention`. Every
            segment's context is its whole root path up to its last query, in depth order, so
            the kernel's bottom-right window is the window along the sample's path; each rank's
            sink gradient covers its own rows (summed over CP with the other parameters').

    Returns:
        ``[t, Hq, D]``: each local row's tree attention over the global rows (padding rows 0).
    """
    check_cp_group(layout, group)
    if q.size(0) != layout.num_local_rows or k.size(0) != layout.num_local_rows:
        raise ValueError(
            f"q/k have {q.size(0)}/{k.size(0)} rows but this CP rank holds {layout.num_local_rows}"
        )
    hkv = k.size(1)
    kv = AllGatherKV.apply(torch.cat([k, v], 1), group, layout.cp_size)  # one collective for both
    if layout.query_rows.numel() == 0:  # only padding here: stay in the backward's reduce-scatter
        return q.new_zeros(q.shape) + 0 * kv.sum()
    variant = attention_variant(q, window, sinks)
    kernel = cp_kernel(backend, q, variant=variant)
    queries = q if layout.all_rows_real else q.index_select(0, layout.query_rows)
    out = gather_kv_attention(queries, kv[:, :hkv], kv[:, hkv:], layout, softmax_scale, kernel, variant)
    if layout.all_rows_real:
        return out
    return q.new_zeros(q.shape).index_copy(0, layout.query_rows, out)


# ----------------------------------------------------------------------------- outputs


def gather_cp_rows(x: torch.Tensor, packed_seq_params, cp_group=None) -> torch.Tensor:
    """This CP rank's rows ``[t, ...]`` (e.g. logits, values) -> ``[T_pad, ...]`` in plan order.

    Without CP it returns ``x``. Backward keeps this rank's rows of the gradient: every CP rank
    must compute the same loss from the result. ``cp_group`` defaults to Megatron's CP group.
    """
    layout = packed_seq_params.cp_layout
    if layout is None:
        return x
    group = cp_group_or_default(cp_group)
    check_cp_group(layout, group)
    if x.size(0) != layout.num_local_rows:
        raise ValueError(f"expected {layout.num_local_rows} local rows, got shape {tuple(x.shape)}")
    return GatherRows.apply(x, layout, group)

