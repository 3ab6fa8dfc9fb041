"""``TreeMLASelfAttention``: Megatron's multi-latent attention with per-token tree RoPE.

MLA builds its own rotary table inside ``get_query_key_value_tensors`` (``self.rotary_pos_emb(
seq_len, packed_seq=...)``) and rotates only the decoupled positional part of q and k
(``qk_pos_emb_head_dim``); the latent ("nope") part carries no position. For a tree batch the
table is replaced by ``table[tree positions]`` (one row per packed token, as
``TreeSelfAttention`` does for GQA), so megatron's THD RoPE rotates every packed token by its
original position. The q/k head dim (``qk_head_dim + qk_pos_emb_head_dim``) may differ from
``v_head_dim``: ``tree_attention`` pads to one head dim where a kernel needs it.

Refused (clear error at build): fused RoPE (``apply_rope_fusion``), absorbed MLA with cached
latents (``cache_mla_latents``, inference), DSA (``experimental_attention_variant='dsa'``),
context parallelism (not verified for MLA on trees). ``rope_type='yarn'`` is exact: yarn
only rescales the table, which is indexed by position like the plain one.
"""

from __future__ import annotations

import inspect

from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.modules.dropout import tree_batch_dropout_refusal
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.modules.self_attention import tree_rotary_table
from ps_mcore.layer_specs.modules.tree_context import set_current_tree_batch

_FORWARD_SIGNATURE = inspect.signature(MLASelfAttention.forward)


def mla_refusal(config) -> str | None:
    """Why an MLA layer with this config cannot run tree batches, or None."""
    if getattr(config, "apply_rope_fusion", False):
        return "apply_rope_fusion=True (the fused MLA RoPE kernels take no per-token positions)"
    if getattr(config, "cache_mla_latents", False):
        return "cache_mla_latents=True (absorbed MLA for inference)"
    if getattr(config, "experimental_attention_variant", None) is not None:
        return f"experimental_attention_variant={config.experimental_attention_variant!r} (DSA)"
    if getattr(config, "context_parallel_size", 1) > 1:
        return f"context_parallel_size={config.context_parallel_size} (MLA on trees under CP is not verified)"
    return None


class _TreeRotary:
    """Stands in for MLA's ``rotary_pos_emb`` module during a tree forward: the table (or the
    ``(table, mscale)`` of yarn) indexed by tree position; everything else delegates."""

    def __init__(self, owner: "TreeMLASelfAttention"):
        self._owner = owner

    def __getattr__(self, name):
        return getattr(self._owner._modules["rotary_pos_emb"], name)

    def __call__(self, *args, **kwargs):
        out = self._owner._modules["rotary_pos_emb"](*args, **kwargs)
        psp = self._owner._tree_batch
        if psp is None:
            return out
        if isinstance(out, tuple):  # yarn: (table, mscale)
            return (tree_rotary_table(out[0], psp),) + tuple(out[1:])
        return tree_rotary_table(out, psp)


class TreeMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` that applies tree RoPE for :class:`TreePackedSeqParams` batches.

    Parameters and ``state_dict`` keys are the parent's; other batches run the parent's code.
    """

    def __init__(self, config, *args, **kwargs):
        reason = mla_refusal(config)
        if reason is not None:
            raise NotImplementedError(f"multi-latent attention on tree batches does not support {reason}")
        super().__init__(config, *args, **kwargs)
        self._tree_batch = None
        # An instance attribute shadows the registered submodule for attribute lookup only:
        # state_dict, .to() and parameters still see the real RotaryEmbedding.
        object.__setattr__(self, "rotary_pos_emb", _TreeRotary(self))

    def forward(self, *args, **kwargs):
        """Same arguments as ``MLASelfAttention.forward``; returns ``(output, bias)``."""
        bound = _FORWARD_SIGNATURE.bind(self, *args, **kwargs)
        arg = bound.arguments
        psp = arg.get("packed_seq_params")
        tree = psp if isinstance(psp, TreePackedSeqParams) else None
        set_current_tree_batch(tree)  # for the MoE router of this layer
        if tree is not None:
            if arg.get("inference_context") is not None or arg.get("inference_params") is not None:
                raise NotImplementedError("TreeMLASelfAttention does not support inference KV caches")
            dropout = tree_batch_dropout_refusal(self, tree)
            if dropout is not None:
                raise ValueError(dropout)
            if not isinstance(self.core_attention, TreeCoreAttention):
                raise TypeError(
                    f"a tree batch reached core attention {type(self.core_attention).__name__}; "
                    "use a tree spec (to_tree_spec)"
                )
            rows = arg["hidden_states"].size(0) * (self.world_size if self.config.sequence_parallel else 1)
            if rows != tree.num_local_rows:
                raise ValueError(
                    f"the layer got {rows} rows but the packed params describe "
                    f"{tree.num_local_rows}; pad input_ids with TreePackedSeqParams.pad_rows"
                )
            arg["packed_seq_params"] = tree.for_unfused_rope(arg["hidden_states"].device)  # MLA's RoPE is unfused
        self._tree_batch = tree
        try:
            return super().forward(*bound.args[1:], **bound.kwargs)
        finally:
            self._tree_batch = None
