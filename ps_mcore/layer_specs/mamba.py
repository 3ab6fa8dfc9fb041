"""``TreeMambaMixer``: megatron-core's Mamba-2 mixer guarded against prefix-tree batches.

Not implemented: a tree needs each node's chunk scan to start from its parent's final SSM
state (per-sequence ``initial_states`` in one varlen call) and its causal conv from the
ancestors' last inputs; mamba-ssm's ``mamba_chunk_scan_combined`` takes initial states per
batch row, not per varlen sequence. Until that is built, a tree batch raises a clear error
instead of running the stock varlen path, which would carry state across branches. Ordinary
batches (sbhd, THD) run the stock forward unchanged. Importing this module needs what
megatron's ``mamba_mixer`` needs (triton; mamba-ssm to build the layer).
"""

from __future__ import annotations

from megatron.core.ssm.mamba_mixer import MambaMixer

from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.recurrent_specs import refuse_tree_batch


class TreeMambaMixer(MambaMixer):
    """Stock ``MambaMixer``; refuses :class:`TreePackedSeqParams` batches."""

    def forward(self, hidden_states, inference_context=None, *, inference_params=None,
                packed_seq_params=None):
        if isinstance(packed_seq_params, TreePackedSeqParams):
            refuse_tree_batch(
                "Mamba (MambaMixer)",
                "tree-aware Mamba state forking is not implemented (it needs per-sequence "
                "initial SSM states in mamba-ssm's varlen chunk scan)",
            )
        return super().forward(hidden_states, inference_context, inference_params=inference_params,
                               packed_seq_params=packed_seq_params)
