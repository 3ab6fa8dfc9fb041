"""Ascend MindSpeed (branch ``core_r0.16.0``) wiring for verl 0.8.0's NPU Megatron engines.

* :mod:`ps_mcore.mindspeed.spec`: the ``--spec`` entry point
  ``[ps_mcore.mindspeed.spec, get_tree_spec]``, a layer spec built lazily from the stock
  builders after MindSpeed's patches (imports megatron-core; Megatron imports it itself).
* :mod:`ps_mcore.mindspeed.state`: MindSpeed's global sequence state for tree micro-batches
  (:func:`set_tree_sequence_state`) and the configurations that rule tree batches out
  (:func:`unsupported_reason`).
* :mod:`ps_mcore.mindspeed.patch`: the ``mindspeed_megatron`` engine building its model with
  the tree spec (``install_patches(patcher)`` for the patchset, ``install()`` /
  ``uninstall()`` on their own).

Importing this package imports neither MindSpeed, torch_npu, verl nor megatron-core. See
docs/mindspeed.md ("MindSpeed wiring").
"""

from ps_mcore.mindspeed.state import set_tree_sequence_state, unsupported_reason

__all__ = ["set_tree_sequence_state", "unsupported_reason"]
