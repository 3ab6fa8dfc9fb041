"""verl's fused LM-head kernels on a prefix tree (``use_fused_kernels=True``).

verl's fused forward (``patch_forward_with_backends``: the model class's ``forward`` becomes
``dense_common.forward_with_torch_backend`` or ``forward_with_triton_backend``) runs the decoder,
then one kernel that takes the last hidden states, the LM-head weight and one label per row
and returns each row's log-prob and entropy without materialising ``[rows, V]`` logits
(``FusedLinearForPPO`` in torch, ``linear_cross_entropy`` in Triton).

On a tree, the decoder runs the ``T`` packed rows and the same kernel runs on the distinct
(row, next-token label) pairs (:func:`ps_mcore.logprobs.labelled_rows`): every row inside a
node once, the last row of a node with k children k times (its hidden state gathered, so the
backward scatter-adds into the shared row). Each original token then reads its own pair.
Under Ulysses SP each rank runs the kernel on the pairs whose row it holds
(:class:`~ps_mcore.fsdp_bridge.sequence_parallel.LocalPairs`); the glue gathers the ``[U]``
results over the SP group with verl's gradient scaling.

FSDP engine: the model class's forward is wrapped (:func:`tree_fused_forward`, on first use,
undone with the patchset) so that a call carrying :data:`FUSED_ROWS_KWARG` takes this path;
every other call runs verl's fused forward unchanged. Megatron engine: verl's fused GPTModel
forward runs as it is on the tree rows, its kernel (``linear_cross_entropy``) swapped for the
call by :func:`on_labelled_rows` (``ps_mcore.integrations.verl_common.megatron``).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ps_mcore.fsdp_bridge import unwrap_model
from ps_mcore.fsdp_bridge.sequence_parallel import LocalPairs
from ps_mcore.logprobs import LabelledRows, TokenStatistics

FUSED_ROWS_KWARG = "ps_mcore_fused_rows"  # model kwarg: the LabelledRows (LocalPairs under SP) of a tree call
_TREE_FUSED = "_ps_mcore_tree_fused"  # marks the wrapped class forward


def torch_fused_kernel(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """verl's torch fused kernel: ``(log_probs [U] fp32, entropy [U])`` of ``hidden [U, D]``."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    return FusedLinearForPPO()(hidden, weight, labels, temperature)


def triton_fused_kernel(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """verl's Triton kernel (CUDA): ``(log_probs [U] fp32, entropy [U] fp32)``."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, float(temperature), "none")


def on_labelled_rows(kernel: Callable, rows: LabelledRows | LocalPairs) -> Callable:
    """``kernel`` (``(hidden, weight, labels, temperature, *rest) -> (log_probs, entropy)``)
    run on the labelled rows of the packed hidden states instead of on every row with one
    label each: ``hidden [..., D]`` (``[1, T, D]`` or ``[T_pad, 1, D]``, rows in packed
    order) -> ``hidden[rows.rows] [U, D]`` with ``rows.labels``; the gather's backward
    scatter-adds into shared rows. The caller's ``labels`` are unused."""

    def run(hidden: torch.Tensor, weight: torch.Tensor, labels, temperature, *rest):
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.rows)  # [U, D]
        return kernel(picked, weight, rows.labels, temperature, *rest)

    return run


def labelled_statistics(rows: LabelledRows, log_probs: torch.Tensor, entropy: torch.Tensor | None) -> TokenStatistics:
    """The kernel's ``[U]`` per-pair results (``[1, U]`` accepted) -> per original token."""
    flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
    return TokenStatistics(*rows.per_token(flat(log_probs), flat(entropy)))


def _stock_forward(cls: type) -> Callable:
    forward = cls.forward
    return getattr(forward, "__ps_mcore_original__", forward) if getattr(forward, _TREE_FUSED, False) else forward


def same_function(fn: Callable | None, target: Callable) -> bool:
    """Whether ``fn`` is ``target`` once ``functools.wraps``-style wrappers (a profiler's ranges,
    a user's decorator) are taken off either side."""
    return fn is not None and inspect.unwrap(fn) is inspect.unwrap(target)


def fused_kernel(cls: type) -> Callable | None:
    """The kernel behind ``cls.forward`` when it is verl's dense fused forward (torch or
    Triton backend), else None.

    Returns: ``kernel(hidden [U, D], weight [V, D], labels [U], temperature) ->
    (log_probs [U] float32, entropy [U])``.
    """
    from verl.models.transformers import dense_common

    forward = _stock_forward(cls)
    if same_function(forward, dense_common.forward_with_torch_backend):
        return torch_fused_kernel
    if same_function(forward, dense_common.forward_with_triton_backend):
        return triton_fused_kernel
    return None


def fused_forward_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s fused forward cannot run on a tree (None: it can)."""
    inner = unwrap_model(model)
    cls = type(inner)
    if fused_kernel(cls) is None:
        return (
            f"use_fused_kernels=True with {cls.__name__}'s own fused forward (only verl's dense "
            "forward_with_torch_backend / forward_with_triton_backend run on a tree)"
        )
    if getattr(inner, "_verl_fused_kernels_backend", None) == "liger":  # verl 0.9.1
        return "use_fused_kernels=True with fused_kernels_backend='liger' (the tree runs verl's torch or Triton kernel)"
    return None


def tree_fused_forward(original: Callable, kernel: Callable) -> Callable:
    """``original`` (verl's fused class forward), running a call that carries
    :data:`FUSED_ROWS_KWARG` on the tree: the decoder over the packed rows (``tree_call``
    reaches the ``"prefix_tree"`` attention), then ``kernel`` on the labelled rows.

    Shapes: ``input_ids`` / ``position_ids`` ``[1, T]``; returns ``log_probs`` / ``entropy``
    ``[1, U]``, one per labelled row (:class:`~ps_mcore.logprobs.LabelledRows`). Under Ulysses
    SP: ``[1, c]`` this rank's rows and ``[1, u]`` its pairs (:class:`LocalPairs`).
    """
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    def forward(self, *args, **kwargs):
        rows: LabelledRows | LocalPairs | None = kwargs.pop(FUSED_ROWS_KWARG, None)
        if rows is None:
            return original(self, *args, **kwargs)
        temperature = kwargs.pop("temperature", 1.0)
        for key in ("return_dict", "use_cache", "shift_labels", "labels"):
            kwargs.pop(key, None)
        outputs = self.model(*args, use_cache=False, **kwargs)
        log_probs, entropy = on_labelled_rows(kernel, rows)(outputs[0], self.lm_head.weight, None, temperature)
        return CausalLMOutputForPPO(log_probs=log_probs[None], entropy=entropy[None])

    setattr(forward, _TREE_FUSED, True)
    return forward


def enable_tree_fused_forward(model: torch.nn.Module, patcher) -> None:
    """Wrap the fused forward of ``model``'s class (once; recorded in ``patcher``)."""
    cls = type(unwrap_model(model))
    if getattr(cls.forward, _TREE_FUSED, False):
        return
    kernel = fused_kernel(cls)
    if kernel is None:
        raise ValueError(fused_forward_refusal(model))
    patcher.wrap(cls, "forward", lambda original: tree_fused_forward(original, kernel))
