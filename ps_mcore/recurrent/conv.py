"""Depthwise causal convolution over a prefix forest (the short conv of GDN / Mamba layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ps_mcore.recurrent.tree import CallRecurrentTree, RecurrentTree


def conv_source(x: torch.Tensor, entry_windows: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows + 1 + entries * w, D]``: the rows a tree convolution gathers from, ``x``, a zero
    row and (a schedule call) the kept windows ``[entries, w, D]`` its entries continue."""
    parts = [x, x.new_zeros(1, x.size(1))]
    if entry_windows is not None and entry_windows.numel():
        parts.append(entry_windows.reshape(-1, x.size(1)).to(x.dtype))
    return torch.cat(parts, 0)


def tree_conv_windows(x: torch.Tensor, tree: CallRecurrentTree, kernel_size: int,
                      entry_windows: torch.Tensor | None = None) -> torch.Tensor:
    """``[exits, kernel_size - 1, D]`` the last ``kernel_size - 1`` conv inputs of each exit's
    root path (zeros before a root): the window a later call's convolution continues from.
    ``x``, ``entry_windows``: as :func:`tree_causal_conv1d`."""
    w = kernel_size - 1
    return conv_source(x, entry_windows).index_select(0, tree.exit_window_index(w)).view(tree.num_exits, w, x.size(1))


def tree_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tree: RecurrentTree,
    entry_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise convolution of every packed row over its root path (no activation).

    Each node reads the last ``K - 1`` inputs of its ancestor chain (zeros before a root), so
    every row equals what the unshared sequence computes. The gather's backward is a
    scatter-add: a shared input row's gradient is the sum over every sample that reads it.

    Args:
        x: ``[rows, D]`` packed inputs.
        weight: ``[D, K]`` or ``[D, 1, K]`` (``nn.Conv1d`` layout) depthwise kernel.
        bias: ``[D]`` or None.
        tree: the micro-batch's :class:`RecurrentTree` (``rows`` rows).
        entry_windows: a schedule call's ``[entries, K - 1, D]`` kept windows of the rows its
            entries continue (:class:`~ps_mcore.recurrent.tree.CallRecurrentTree`), else None.

    Returns:
        ``[rows, D]``.
    """
    if weight.dim() == 2:
        weight = weight.unsqueeze(1)
    d, _, k = weight.shape
    if x.dim() != 2 or x.size(1) != d or x.size(0) != tree.num_rows:
        raise ValueError(
            f"tree_causal_conv1d expects x of shape [{tree.num_rows}, {d}], got {tuple(x.shape)}"
        )
    ext_index, out_index = tree.conv_layout(k)
    ext = conv_source(x, entry_windows).index_select(0, ext_index)  # [E, D]
    y = F.conv1d(ext.t().unsqueeze(0), weight, bias, groups=d)[0]  # [D, E - K + 1]
    return y.t().index_select(0, out_index)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One sequence ``[L, D]`` with zero history: ``out[t] = sum_j w[:, j] x[t - K + 1 + j]``."""
    if weight.dim() == 3:
        weight = weight[:, 0]
    k = weight.size(1)
    xp = torch.cat([x.new_zeros(k - 1, x.size(1)), x], 0)
    out = sum(xp[j : j + x.size(0)] * weight[:, j] for j in range(k))
    return out if bias is None else out + bias
