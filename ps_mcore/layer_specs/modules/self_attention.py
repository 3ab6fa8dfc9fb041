"""``TreeSelfAttention``: Megatron's ``SelfAttention`` with per-token tree RoPE.

``position_ids`` never reach Megatron's attention: ``GPTModel`` builds a rotary table
``[S, 1, 1, d]`` and ``Attention.forward`` applies it. For a tree batch we hand the parent
``table[positions]`` (one row per packed token); in THD with ``freqs.size(0) ==
cu_seqlens[-1]`` Megatron then uses row i for token i, so every packed token is rotated by
its original position and rope scaling / interleaving stay Megatron's. RoPE fusion stays on:
the packed rows are ONE THD sequence (plus a padding sequence), so TE's fused THD kernel, which
rotates row j of a sequence by table row j, reads exactly the per-token table too. Under context
parallelism the table still covers all T_pad rows (global order) and Megatron's THD RoPE takes
this rank's 2*cp chunks of it, so each local row gets its global tree position.

Multimodal RoPE (``mrope_section``: Qwen2-VL / Qwen2.5-VL) has no 1-D position to index by:
the caller passes GPTModel the temporal / height / width positions of every packed row
(``position_ids [3, 1, T_pad]``), so GPTModel's table already holds one row per packed row and
is used as it is.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.attention import SelfAttention

from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention
from ps_mcore.layer_specs.modules.dropout import tree_batch_dropout_refusal
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams
from ps_mcore.layer_specs.modules.tree_context import set_current_tree_batch

_FORWARD_SIGNATURE = inspect.signature(SelfAttention.forward)
_BOUND_ARGUMENTS = ("hidden_states", "rotary_pos_emb", "packed_seq_params")


def _check_forward_signature(signature: inspect.Signature) -> None:
    """Tree RoPE rewrites ``rotary_pos_emb`` for ``packed_seq_params`` batches: both must be
    named parameters of ``SelfAttention.forward``. If a Megatron release hides them (e.g. wraps
    the forward in ``(*args, **kwargs)``), tree RoPE would be skipped silently: refuse instead."""
    missing = [name for name in _BOUND_ARGUMENTS if name not in signature.parameters]
    if missing:
        raise RuntimeError(
            f"TreeSelfAttention cannot bind {missing} in SelfAttention.forward{signature} of this "
            "megatron-core: tree RoPE would be skipped silently. This megatron-core version is "
            "not supported (tested: 0.16.1-0.19.x)"
        )


def tree_rotary_table(table: torch.Tensor, psp: TreePackedSeqParams) -> torch.Tensor:
    """``[S, 1, 1, d] -> [T_pad, 1, 1, d]``: the table row of every packed token's position.

    Every layer receives the same table from GPTModel (or, as Megatron-Bridge's Gemma 3 layers
    pick them, a view of one of a few tables): each is indexed once per micro-batch (kept on the
    packed params with the table itself, ``psp.rotary_tables``)."""
    for seen, out in psp.rotary_tables:
        if _same_view(seen, table):
            return out
    if table.size(0) < psp.plan.max_seqlen_kv:
        raise ValueError(
            f"rotary table has {table.size(0)} rows but the plan reaches position "
            f"{psp.plan.max_seqlen_kv - 1}; build packed params with TreePackedSeqParams.from_plan"
        )
    out = table.index_select(0, psp.position_ids.to(table.device))
    psp.rotary_tables.append((table, out))
    return out


def _same_view(kept: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether ``table`` is ``kept`` or the same view of its memory (``kept`` holds that memory,
    so no other tensor can have taken its address)."""
    return kept is table or (
        kept.data_ptr() == table.data_ptr() and kept.shape == table.shape and kept.stride() == table.stride()
        and kept.dtype == table.dtype and kept.device == table.device)


def packed_rows_table(table: torch.Tensor, psp: TreePackedSeqParams) -> torch.Tensor:
    """A multimodal-RoPE table ``[T_pad, 1, 1, d]``, built from per-row positions: checked, kept."""
    if table.size(0) != psp.num_rows:
        raise ValueError(
            f"multimodal RoPE on a tree: the rotary table has {table.size(0)} rows for {psp.num_rows} packed "
            "rows; pass GPTModel the mrope positions of every packed row (position_ids [3, 1, T_pad])"
        )
    return table


def _tree_rope(rope, psp: TreePackedSeqParams, per_row: bool = False):
    """A table, or a (q, k) tuple of tables (often one tensor twice: index it once);
    ``per_row``: the tables already hold one row per packed row (multimodal RoPE)."""
    make = packed_rows_table if per_row else tree_rotary_table
    if not isinstance(rope, tuple):
        return make(rope, psp)
    done: dict[int, torch.Tensor] = {}
    for r in rope:
        if r is not None and id(r) not in done:
            done[id(r)] = make(r, psp)
    return tuple(None if r is None else done[id(r)] for r in rope)


class TreeSelfAttention(SelfAttention):
    """``SelfAttention`` that applies tree RoPE for :class:`TreePackedSeqParams` batches.

    Parameters and ``state_dict`` keys are the parent's. Other batches go to the parent
    unchanged.
    """

    def __init__(self, config, *args, **kwargs):
        _check_forward_signature(_FORWARD_SIGNATURE)
        super().__init__(config, *args, **kwargs)

    def _tp_world_size(self) -> int:
        # megatron 0.16+ stores Attention.world_size; 0.15 does not.
        size = getattr(self, "world_size", None)
        if size is None:
            tp = getattr(getattr(self, "pg_collection", None), "tp", None)
            if tp is not None:
                size = torch.distributed.get_world_size(tp)
            else:
                from megatron.core import parallel_state

                size = parallel_state.get_tensor_model_parallel_world_size()
        return int(size)

    def _check_tree_batch(self, psp: TreePackedSeqParams, hidden_states: torch.Tensor) -> None:
        if psp.plan is None or psp.position_ids is None:
            raise ValueError("TreePackedSeqParams without a plan; build it with from_plan(plan)")
        dropout = tree_batch_dropout_refusal(self, psp)
        if dropout is not None:
            raise ValueError(dropout)
        rows = hidden_states.size(0)
        if self.config.sequence_parallel:  # each rank holds T_pad / cp / tp rows before the gather
            rows *= self._tp_world_size()
        if rows != psp.num_local_rows:
            raise ValueError(
                f"the layer got {rows} rows but the packed params describe {psp.num_local_rows} "
                f"(T={psp.plan.num_tokens} plan tokens + {psp.num_padding} padding"
                + (f", split over cp={psp.cp_size}" if psp.cp_size > 1 else "")
                + "); pad input_ids with TreePackedSeqParams.pad_rows (cp_shard under CP)"
            )
        if not isinstance(self.core_attention, TreeCoreAttention):
            raise TypeError(
                f"a tree batch reached core attention {type(self.core_attention).__name__}, "
                "which would silently ignore the tree mask; use a tree spec (to_tree_spec). "
                "Megatron-Bridge replaces core attention when attention_backend='local'."
            )
        if self._mrope and psp.cp_size > 1:
            raise NotImplementedError(
                "multimodal RoPE (mrope_section) on a tree under context parallelism: GPTModel's "
                "multimodal table takes its CP share in the sbhd chunk layout, not the THD one"
            )

    @property
    def _mrope(self) -> bool:
        return getattr(self.config, "mrope_section", None) is not None

    def forward(self, *args, **kwargs):
        """Same arguments as ``SelfAttention.forward``; returns ``(output, bias)``."""
        args, kwargs = self._tree_arguments(args, kwargs)
        return super().forward(*args, **kwargs)

    # Eager under torch.compile (signature binding, checks, the per-batch RoPE cache); the
    # parent's forward, which it feeds, compiles.
    @torch.compiler.disable
    def _tree_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The parent forward's arguments, tree RoPE applied for a tree batch."""
        bound = _FORWARD_SIGNATURE.bind(self, *args, **kwargs)
        arg = bound.arguments
        if arg.get("inference_context") is not None or arg.get("inference_params") is not None:
            raise NotImplementedError(
                "TreeSelfAttention does not support inference KV caches; generate with the stock "
                "spec (its weights and state_dict keys are identical)"
            )
        psp = arg.get("packed_seq_params")
        if not isinstance(psp, TreePackedSeqParams) and any(
            isinstance(v, TreePackedSeqParams) for v in list(bound.args) + list(bound.kwargs.values())
        ):
            raise RuntimeError(
                "a TreePackedSeqParams reached TreeSelfAttention but not as packed_seq_params "
                f"(SelfAttention.forward{_FORWARD_SIGNATURE}): tree RoPE cannot be applied"
            )
        # The MoE router of this layer never sees packed_seq_params: it reads them from here.
        set_current_tree_batch(psp if isinstance(psp, TreePackedSeqParams) else None)
        if isinstance(psp, TreePackedSeqParams):
            self._check_tree_batch(psp, arg["hidden_states"])
            rope = arg.get("rotary_pos_emb")
            if rope is not None:
                arg["rotary_pos_emb"] = _tree_rope(rope, psp, per_row=self._mrope)
                if not self.config.apply_rope_fusion:  # bounds on the host: no device syncs
                    arg["packed_seq_params"] = psp.for_unfused_rope(arg["hidden_states"].device)
        return bound.args[1:], bound.kwargs
