"""The tree batch the current layer runs on, for modules that never see ``packed_seq_params``.

Megatron hands ``packed_seq_params`` to attention only; ``MoELayer.forward`` (0.16) gets the
hidden states and a padding mask. Every tree self attention (``TreeSelfAttention``,
``TreeMLASelfAttention``) records the batch it runs on here, ``None`` for any other batch, so
the MoE router of the same transformer layer (which runs right after it, also when full
recompute replays the layer in backward) reads the batch of its own layer. Nothing is kept
across batches: the next attention forward overwrites it.
"""

from __future__ import annotations

import threading

_STATE = threading.local()


def set_current_tree_batch(packed_seq_params) -> None:
    """Record the batch of the attention now running (a ``TreePackedSeqParams`` or None)."""
    _STATE.params = packed_seq_params


def current_tree_batch():
    """The ``TreePackedSeqParams`` the last attention forward of this thread ran on, or None."""
    return getattr(_STATE, "params", None)
