"""Recurrent layers (Gated DeltaNet, Mamba-2) over prefix forests: pure-torch core.

``tree.py`` lays the plan's nodes out by depth, ``scan.py`` runs any varlen recurrent kernel
over those levels, ``gated_delta.py`` (GDN) and ``ssd.py`` (Mamba-2's SSD) are the kernels,
``conv.py`` the short causal convolution. Each node of the plan's forest starts from its
parent's final recurrent state and reads the last ``kernel_size - 1`` inputs of its ancestors
in its short convolution; roots start from zero. No Megatron, verl or Hugging Face import (the Megatron modules are in
``ps_mcore.layer_specs.modules.gdn`` / ``mamba``).
"""

from ps_mcore.recurrent.conv import causal_conv1d_reference, tree_causal_conv1d, tree_conv_windows
from ps_mcore.recurrent.gated_delta import (
    GDN_BACKENDS,
    chunk_gated_delta_rule_torch,
    gated_delta_rule_recurrent,
    l2norm,
    resolve_gdn_backend,
    tree_gated_delta_rule,
    varlen_gated_delta_rule,
)
from ps_mcore.recurrent.scan import BACKENDS, resolve_backend, tree_scan, varlen_by_sequence
from ps_mcore.recurrent.ssd import (
    SSD_BACKENDS,
    chunk_simple_gla_torch,
    resolve_ssd_backend,
    simple_gla_recurrent,
    tree_mamba_chunk_scan,
    tree_simple_gla,
    varlen_simple_gla,
)
from ps_mcore.recurrent.tree import CallRecurrentTree, Level, RecurrentTree, recurrent_tree

__all__ = [
    "BACKENDS",
    "CallRecurrentTree",
    "GDN_BACKENDS",
    "SSD_BACKENDS",
    "Level",
    "RecurrentTree",
    "causal_conv1d_reference",
    "chunk_gated_delta_rule_torch",
    "chunk_simple_gla_torch",
    "gated_delta_rule_recurrent",
    "l2norm",
    "recurrent_tree",
    "resolve_backend",
    "resolve_gdn_backend",
    "resolve_ssd_backend",
    "simple_gla_recurrent",
    "tree_causal_conv1d",
    "tree_conv_windows",
    "tree_gated_delta_rule",
    "tree_mamba_chunk_scan",
    "tree_scan",
    "tree_simple_gla",
    "varlen_by_sequence",
    "varlen_gated_delta_rule",
    "varlen_simple_gla",
]
