"""Recurrent layers (Gated DeltaNet, Mamba) over prefix forests: pure-torch core.

Each node of the plan's forest starts from its parent's final recurrent state and reads the
last ``kernel_size - 1`` inputs of its ancestors in its short convolution; roots start from
zero. No Megatron, verl or Hugging Face import (the Megatron modules are in
``ps_mcore.layer_specs.gdn`` / ``mamba``).
"""

from ps_mcore.recurrent.conv import causal_conv1d_reference, tree_causal_conv1d
from ps_mcore.recurrent.gated_delta import (
    GDN_BACKENDS,
    chunk_gated_delta_rule_torch,
    gated_delta_rule_recurrent,
    l2norm,
    resolve_gdn_backend,
    tree_gated_delta_rule,
    varlen_gated_delta_rule,
)
from ps_mcore.recurrent.tree import Level, RecurrentTree, recurrent_tree

__all__ = [
    "GDN_BACKENDS",
    "Level",
    "RecurrentTree",
    "causal_conv1d_reference",
    "chunk_gated_delta_rule_torch",
    "gated_delta_rule_recurrent",
    "l2norm",
    "recurrent_tree",
    "resolve_gdn_backend",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "varlen_gated_delta_rule",
]
