"""Prefix sharing for Hugging Face models (the FSDP side): the same planner and kernels.

* :func:`register_attention` registers the ``"prefix_tree"`` attention implementation with
  transformers (explicitly: importing ps_mcore registers nothing).
* :func:`enable_tree_attention` switches a model to it; unshared calls keep the model's own
  implementation (flash_attention_2 / sdpa / eager), calls with ``tree_call=TreeCall(plan)``
  run :func:`ps_mcore.tree_attention`.
* :func:`forward_tree` runs a model on a :class:`~ps_mcore.TreePlan` and returns packed
  logits / hidden states and per-token log-probs / entropy.
* :func:`hf_call` runs one call of a cross-micro-batch schedule
  (:class:`~ps_mcore.schedule.ScheduleRunner`): a forest larger than the token budget, every
  shared prefix computed once across micro-batches; :func:`gathered_once` runs such calls on
  several FSDP2 data-parallel ranks (parameters gathered once, gradients reduced once).
"""

from ps_mcore.fsdp_bridge.dropout import hf_dropout_refusal
from ps_mcore.fsdp_bridge.forward import TreeForwardOutput, forward_tree
from ps_mcore.fsdp_bridge.hf_attention import (
    ATTN_NAME,
    DeferredMask,
    TreeCall,
    base_implementation,
    disable_tree_attention,
    enable_tree_attention,
    prefix_tree_attention,
    register_attention,
)
from ps_mcore.fsdp_bridge.lockstep import gathered_once
from ps_mcore.fsdp_bridge.schedule import hf_call, hf_kv_row_cost, hf_schedule_refusal
from ps_mcore.fsdp_bridge.unwrap import unwrap_model

__all__ = [
    "ATTN_NAME",
    "DeferredMask",
    "TreeCall",
    "TreeForwardOutput",
    "base_implementation",
    "disable_tree_attention",
    "enable_tree_attention",
    "forward_tree",
    "gathered_once",
    "hf_call",
    "hf_dropout_refusal",
    "hf_kv_row_cost",
    "hf_schedule_refusal",
    "prefix_tree_attention",
    "register_attention",
    "unwrap_model",
]
