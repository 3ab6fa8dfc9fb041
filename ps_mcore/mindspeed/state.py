"""MindSpeed's global sequence state for tree micro-batches, and what MindSpeed rules out.

verl 0.8.0's THD preprocessing (``verl.models.mcore.util.preprocess_thd_engine``) calls
``preprocess_for_mindspeed``, which stores each stock micro-batch's ``cu_seqlens_padded``
(int32 ``[B+1]``, leading 0) with ``mindspeed.core.context_parallel.get_batch_utils.
set_actual_seq_len`` and per-row position ids (int32 ``[rows, 1]``) with
``mindspeed.utils.set_position_ids``. A tree micro-batch never runs that preprocessing, so
:func:`set_tree_sequence_state` sets the same two globals, in the same layout, to what the
model sees: the :class:`~ps_mcore.layer_specs.TreePackedSeqParams` rows (``cu_seqlens_q``,
one sequence of T rows plus padding) and every row's tree position. MindSpeed code that
reads them then sees this micro-batch, not the previous one.

In the supported configuration no MindSpeed code on the tree path reads them (our core
attention gets the plan from the packed params). The readers are MindSpeed's
reset-attention-mask feature (``GPTModel.forward`` wrapper: it *replaces* the model's
``packed_seq_params`` by ``PackedSeqParams(cu_seqlens=actual_seq_len)``, which drops the
plan, and its RoPE indexes the table by the global positions), its pipeline p2p of that
feature, and its context-parallel batch slicing. Tree batches are therefore refused under
reset-attention-mask and under context parallelism with MindSpeed (:func:`mindspeed_refusal`).

Only modules already loaded are touched: when MindSpeed was never imported, nothing can
read its state and nothing is imported here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

BATCH_UTILS = "mindspeed.core.context_parallel.get_batch_utils"  # verl's set_actual_seq_len
UTILS = "mindspeed.utils"  # verl's set_position_ids
ARGS_UTILS = "mindspeed.args_utils"
MEGATRON_GLOBAL_VARS = "megatron.training.global_vars"

RESET_ATTENTION_MASK_REFUSAL = (
    "MindSpeed's reset-attention-mask feature is on (verl's mindspeed engine default): its "
    "GPTModel.forward wrapper rebuilds packed_seq_params from MindSpeed's global "
    "actual_seq_len, which drops the prefix-tree plan; set reset_attention_mask=False "
    "(actor_rollout_ref.actor.mindspeed.mcore_kwargs, or megatron.override_transformer_config)"
)
CONTEXT_PARALLEL_REFUSAL = (
    "context parallelism under MindSpeed is not supported for tree batches (MindSpeed's CP "
    "algorithms patch attention and slice batches through its global state)"
)


def mindspeed_loaded() -> bool:
    """Whether MindSpeed is imported in this process (any submodule imports the package)."""
    return "mindspeed" in sys.modules


def _loaded_args() -> list[Any]:
    """The args namespaces MindSpeed's features read (``get_full_args``: Megatron-LM's global
    args when set, else MindSpeed's own), peeked without importing or parsing anything."""
    found = []
    for module, attr in ((MEGATRON_GLOBAL_VARS, "_GLOBAL_ARGS"), (ARGS_UTILS, "_MINDSPEED_ARGS")):
        value = getattr(sys.modules.get(module), attr, None)
        if value is not None:
            found.append(value)
    return found


def reset_attention_mask_active() -> bool:
    """True when MindSpeed is loaded and its args enable ``reset_attention_mask``."""
    return mindspeed_loaded() and any(getattr(a, "reset_attention_mask", False) for a in _loaded_args())


def _context_parallel_size() -> int:
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return 1
    return int(ps.get_context_parallel_world_size())


def mindspeed_refusal() -> str | None:
    """Why a tree micro-batch must take verl's stock forward under MindSpeed (None: fine,
    including when MindSpeed is not loaded)."""
    if not mindspeed_loaded():
        return None
    if reset_attention_mask_active():
        return RESET_ATTENTION_MASK_REFUSAL
    if _context_parallel_size() > 1:
        return CONTEXT_PARALLEL_REFUSAL
    return None


def tree_sequence_state(psp) -> tuple[torch.Tensor, torch.Tensor]:
    """``(actual_seq_len, position_ids)`` for a tree micro-batch, in verl's layout.

    Shapes: ``actual_seq_len`` int32 ``[2]`` or ``[3]`` (``psp.cu_seqlens_q``: ``[0, T]``,
    plus ``T_pad`` when padded; leading 0 as verl passes it); ``position_ids`` int32
    ``[T_pad, 1]`` (each packed row's original position; padding rows 0).
    """
    if getattr(psp, "plan", None) is None or getattr(psp, "position_ids", None) is None:
        raise ValueError("tree_sequence_state needs TreePackedSeqParams built with from_plan(plan)")
    cu = psp.cu_seqlens_q.to(torch.int32)
    positions = psp.position_ids.to(torch.int32).unsqueeze(1).contiguous()
    return cu, positions


def set_tree_sequence_state(psp) -> bool:
    """Point MindSpeed's global ``actual_seq_len`` / position ids at a tree micro-batch.

    Call it before the model call of every tree micro-batch (it is a no-op without
    MindSpeed). Returns True when MindSpeed's state was set.

    Raises:
        NotImplementedError: MindSpeed is loaded in a configuration that would silently
            replace or mis-rotate the tree batch (:func:`mindspeed_refusal`); the caller
            should have run the stock forward instead.
    """
    batch_utils, utils = sys.modules.get(BATCH_UTILS), sys.modules.get(UTILS)
    if batch_utils is None and utils is None:
        return False
    reason = mindspeed_refusal()
    if reason is not None:
        raise NotImplementedError(reason)
    if getattr(psp, "cp_layout", None) is not None:
        raise NotImplementedError(CONTEXT_PARALLEL_REFUSAL)
    cu, positions = tree_sequence_state(psp)
    if batch_utils is not None:
        batch_utils.set_actual_seq_len(cu)
    if utils is not None:
        utils.set_position_ids(positions)
    return True
