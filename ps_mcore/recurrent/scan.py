"""The level loop every recurrent kernel shares, and its backend choice.

A recurrent kernel here is a *varlen* kernel: independent sequences packed along rows, each from
its own initial state, returning the outputs and (when asked) every sequence's final state.
:func:`tree_scan` runs one such kernel over a prefix forest level by level; the gated delta
rule (``gated_delta.py``) and Mamba-2's SSD (``ssd.py``) are two kernels for it.

Kernel calling convention (keywords after the row tensors)::

    out, final = kernel(*tensors, cu_seqlens=, cu_seqlens_host=, initial_state=, output_final_state=)

with every tensor ``[R, ...]`` (rows first), ``cu_seqlens`` ``[n+1]`` int64 on the device,
``cu_seqlens_host`` the same on the host, ``initial_state`` ``[n, ...]`` or None (zeros), ``out``
``[R, ...]`` and ``final`` ``[n, ...]`` (or None when not asked).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Sequence

import torch

from ps_mcore.recurrent.tree import RecurrentTree

BACKENDS = ("auto", "fla", "torch")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The reference kernels' arithmetic: fp32 for half types, fp64 kept (exactness checks)."""
    return torch.promote_types(x.dtype, torch.float32)


@functools.lru_cache(maxsize=None)
def fla_op(module: str, name: str) -> Callable | None:
    """flash-linear-attention's ``module.name`` (e.g. ``fla.ops.simple_gla``,
    ``chunk_simple_gla``), None when fla is not installed. fla is optional (Triton, GPU)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def resolve_backend(backend: str, device: torch.device, fla_kernel: Callable | None, what: str) -> str:
    """``auto``: flash-linear-attention on CUDA when installed, else pure torch.

    Args:
        backend: one of :data:`BACKENDS`.
        device: where the inputs live.
        fla_kernel: the fla entry point, None when fla is not importable.
        what: the recurrence, for error messages (e.g. ``"gated delta rule"``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown {what} backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "fla" if device.type == "cuda" and fla_kernel is not None else "torch"
    if backend == "fla" and fla_kernel is None:
        raise ImportError(
            f"{what} backend 'fla' needs flash-linear-attention (pip install "
            "flash-linear-attention fla-core), which is not installed"
        )
    return backend


def fla_varlen(op: Callable, tensors: Sequence[torch.Tensor], cu_seqlens: torch.Tensor,
               cu_seqlens_host: torch.Tensor, **kwargs):
    """A flash-linear-attention chunk op over packed sequences: rows as one batch row with
    ``cu_seqlens`` (int64 device and host copies, which fla 0.6 takes; pass the same objects
    every call, fla memoises its chunk indices by identity); ``kwargs`` are the op's own
    (scale, initial_state, output_final_state). Returns ``(out [R, ...], final states)``."""
    out, final = op(*(t[None] for t in tensors), cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host,
                    **kwargs)
    return out[0], final


def varlen_by_sequence(kernel: Callable, tensors: Sequence[torch.Tensor], cu_seqlens_host: torch.Tensor,
                       initial_state: torch.Tensor | None, output_final_state: bool):
    """A varlen kernel from a one-sequence kernel ``kernel(*tensors, initial_state=) -> (out, final)``
    (``[L, ...]`` rows, ``[...]`` state): a Python loop over the sequences (CPU reference path)."""
    outs, finals = [], []
    bounds = cu_seqlens_host.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, final = kernel(*(t[a:b] for t in tensors),
                            initial_state=None if initial_state is None else initial_state[i])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs), (torch.stack(finals) if output_final_state else None)


def varlen_call(tensors: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor,
                initial_state: torch.Tensor | None, output_final_state: bool, *, scale, backend: str,
                fla_kernel: Callable | None, torch_kernel: Callable, what: str):
    """One varlen call of a recurrence through the kernel ``backend`` resolves to
    (:func:`resolve_backend`): fla's chunk op ``fla_kernel`` (:func:`fla_varlen`), or the
    one-sequence torch kernel ``torch_kernel(*tensors, scale=, initial_state=)`` per sequence
    (:func:`varlen_by_sequence`). Returns ``(out [R, ...], final states [n, ...] or None)``."""
    if resolve_backend(backend, tensors[0].device, fla_kernel, what) == "fla":
        return fla_varlen(fla_kernel, tensors, cu_seqlens, cu_seqlens_host, scale=scale,
                          initial_state=initial_state, output_final_state=output_final_state)
    return varlen_by_sequence(functools.partial(torch_kernel, scale=scale), tensors, cu_seqlens_host,
                              initial_state, output_final_state)


def tree_scan(kernel: Callable, tensors: Sequence[torch.Tensor], tree: RecurrentTree, what: str,
              entry_states: torch.Tensor | None = None, with_states: bool = False):
    """Run a varlen recurrent ``kernel`` over every packed row's root path.

    Level by level (all chains of one chain depth in one kernel call, see
    :class:`RecurrentTree`), each chain from the final state of the chain ending in its head's
    parent (roots from zero, a schedule call's entries from their kept state). The parent
    states reach the children through an ``index_select``, so autograd gives a shared state
    the sum of its children's gradients.

    Args:
        kernel: a varlen kernel (module docstring).
        tensors: its row inputs, each ``[rows, ...]``.
        tree: the micro-batch's :class:`RecurrentTree`.
        what: the caller's name, for errors.
        entry_states: ``[entries, ...]`` kept states a schedule call's entries start from
            (:class:`~ps_mcore.recurrent.tree.CallRecurrentTree`), else None.
        with_states: also return the final states of the tree's exits.

    Returns:
        ``[rows, ...]``: what each row's own sequence computes alone; with ``with_states``,
        ``(that, [exits, ...] final states)`` (None without exits).
    """
    if any(t.size(0) != tree.num_rows for t in tensors):
        raise ValueError(
            f"{what} expects {tree.num_rows} rows, got {[tuple(t.shape) for t in tensors]}"
        )
    if tree.num_entries and entry_states is None:
        raise ValueError(f"{what}: this call continues {tree.num_entries} kept states; pass entry_states")
    levels = tree.levels()
    if tree.is_flat:  # nothing forks: the rows are the level
        lvl = levels[0]
        out, _ = kernel(*tensors, cu_seqlens=lvl.cu_seqlens, cu_seqlens_host=lvl.cu_seqlens_host,
                        initial_state=None, output_final_state=False)
        return (out, None) if with_states else out
    # One gather per input into level-major order, split into one view per level: its backward
    # is one concatenation and one scatter per input, where a gather per level would add a
    # full-size zero gradient per level.
    order, sizes = tree.level_order()
    parts = [t.index_select(0, order).split(sizes) for t in tensors]
    outs, finals, final = [], [], None
    for i, lvl in enumerate(levels):
        init = None if lvl.parent_slot is None else final.index_select(0, lvl.parent_slot)
        if lvl.entry_slot is not None:
            chains = lvl.cu_seqlens_host.numel() - 1
            base = entry_states.new_zeros(chains, *entry_states.shape[1:]) if init is None else init
            init = base.index_copy(0, lvl.entry_slot, entry_states.index_select(0, lvl.entry_index).to(base.dtype))
        out, final = kernel(
            *(p[i] for p in parts), cu_seqlens=lvl.cu_seqlens, cu_seqlens_host=lvl.cu_seqlens_host,
            initial_state=init, output_final_state=bool(lvl.has_children.any()),
        )
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs).index_select(0, tree.level_inverse())
    if not with_states:
        return out
    exits = [finals[d][s] for d, s in tree.exit_where()]
    return out, (torch.stack(exits) if exits else None)
