"""Ascend MindSpeed (branch ``core_r0.16.0``) pieces of the NPU Megatron path; knows no verl.

* :mod:`ps_mcore.mindspeed.spec`: the ``--spec`` entry point
  ``[ps_mcore.mindspeed.spec, get_tree_spec]``, a layer spec built lazily from the stock
  builders after MindSpeed's patches (imports megatron-core; Megatron imports it itself).
* :mod:`ps_mcore.mindspeed.state`: MindSpeed's global sequence state for tree micro-batches
  (:func:`set_tree_sequence_state`) and the configurations that rule tree batches out
  (:func:`mindspeed_refusal`).

verl's ``mindspeed_megatron`` engine building its model with the tree spec is verl glue:
:mod:`ps_mcore.integrations.verl080.mindspeed`. Importing this package imports neither
MindSpeed, torch_npu, verl nor megatron-core. See docs/mindspeed.md ("MindSpeed wiring").
"""

from ps_mcore.mindspeed.state import mindspeed_refusal, set_tree_sequence_state

__all__ = ["mindspeed_refusal", "set_tree_sequence_state"]
