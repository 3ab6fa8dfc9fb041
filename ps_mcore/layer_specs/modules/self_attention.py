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

Where Megatron would run its unfused RoPE (``apply_rope_fusion=False``, as verl sets it) on a
tree batch without context parallelism, on CUDA or the CPU, ``TreeSelfAttention`` rotates q and k
itself, right after the QKV projection where Megatron's forward would (:class:`PackedRope`): the
same arithmetic as Megatron's unfused THD path, bit for bit, but the table's cos/sin are computed
once per micro-batch instead of in every call. That path costs about 20 host-side tensor ops a
call, two calls a layer; on a micro-batch of a few thousand rows the GPU finishes a layer's
forward before the host has issued it, and sits idle behind them.

Multimodal RoPE (``mrope_section``: Qwen2-VL / Qwen2.5-VL) has no 1-D position to index by:
the caller passes GPTModel the temporal / height / width positions of every packed row
(``position_ids [3, 1, T_pad]``), so GPTModel's table already holds one row per packed row and
is used as it is.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as megatron_attention
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


# Megatron's unfused RoPE, whose arithmetic PackedRope repeats: checked to be Megatron's own code
# at every call (a framework that replaces it, as MindSpeed does on NPUs, keeps Megatron's path).
_UNFUSED_ROPE = ((megatron_attention, "apply_rotary_pos_emb"), (rope_utils, "_apply_rotary_pos_emb_thd"),
                 (rope_utils, "_apply_rotary_pos_emb_bshd"), (rope_utils, "_rotate_half"))


def _unfused_rope_is_megatrons() -> bool:
    return all(getattr(getattr(module, name, None), "__module__", None) == rope_utils.__name__
               for module, name in _UNFUSED_ROPE)


def _yarn_mscale(module: SelfAttention) -> float | None:
    """The RoPE ``mscale`` Megatron's forward passes (YaRN's concentration factor, else 1);
    None where this megatron-core keeps it elsewhere."""
    factor = getattr(module, "_yarn_concentration_factor", None)  # megatron-core 0.19
    if factor is None:
        try:  # megatron-core 0.16: computed from the config in every forward
            from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
                _yarn_get_concentration_factor_from_config,
            )
        except ImportError:
            return None
        factor = _yarn_get_concentration_factor_from_config(module.config)
    return float(factor)


@dataclass(frozen=True)
class PackedRope:
    """The tree RoPE of one layer call, applied to q and k right after the QKV projection.

    Megatron's unfused arithmetic (``rope_utils._apply_rotary_pos_emb_bshd``) on the first
    ``d_rot`` lanes: ``t * cos + rotate_half(t) * sin`` with ``cos = (cos(table) * mscale)`` in
    t's dtype, the rest of t passed through. cos/sin are computed once per micro-batch, table
    and dtype and kept on the packed params (``psp.rotary_cos_sin``).

    Attributes:
        q_table, k_table: ``[T_pad, 1, 1, d_rot]`` per-row tables (``tree_rotary_table``), or
            None (that tensor is not rotated, as in Megatron).
        psp: the micro-batch's packed params (holds the cos/sin).
        mscale, interleaved: Megatron's ``mscale`` and ``config.rotary_interleaved``.
    """

    q_table: torch.Tensor | None
    k_table: torch.Tensor | None
    psp: TreePackedSeqParams
    mscale: float
    interleaved: bool

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T_pad, 1, Hq, D]``, k ``[T_pad, 1, Hkv, D]`` (sbhd, b = 1) -> the same, rotated."""
        return self._rotate(query, self.q_table), self._rotate(key, self.k_table)

    def _rotate(self, t: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        if table is None:
            return t
        cos, sin = self._cos_sin(table, t.dtype)
        d_rot = cos.size(-1)
        whole = d_rot == t.size(-1)
        x = t if whole else t[..., :d_rot]
        x = x * cos + rope_utils._rotate_half(x, self.interleaved) * sin
        return x if whole else torch.cat((x, t[..., d_rot:]), dim=-1)

    def _cos_sin(self, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for kept, kept_dtype, mscale, cos, sin in self.psp.rotary_cos_sin:
            if kept is table and kept_dtype == dtype and mscale == self.mscale:
                return cos, sin
        cos = (torch.cos(table) * self.mscale).to(dtype)
        sin = (torch.sin(table) * self.mscale).to(dtype)
        self.psp.rotary_cos_sin.append((table, dtype, self.mscale, cos, sin))
        return cos, sin


def _plain_call(args: tuple, kwargs: dict) -> bool:
    """Whether a ``SelfAttention.forward`` call carries no tree batch and no inference cache,
    as Megatron's ``TransformerLayer`` calls it (hidden states positional, the rest by
    keyword): a batch that is not a tree then skips the signature binding, which costs host
    time in every layer of a call that is host-bound anyway (a few hundred rows)."""
    return (len(args) <= 1 and kwargs.get("inference_context") is None and kwargs.get("inference_params") is None
            and not any(isinstance(v, TreePackedSeqParams) for v in kwargs.values()))


class TreeSelfAttention(SelfAttention):
    """``SelfAttention`` that applies tree RoPE for :class:`TreePackedSeqParams` batches.

    Parameters and ``state_dict`` keys are the parent's. Other batches go to the parent
    unchanged.
    """

    def __init__(self, config, *args, **kwargs):
        _check_forward_signature(_FORWARD_SIGNATURE)
        super().__init__(config, *args, **kwargs)
        self._rope_mscale = _yarn_mscale(self)  # None: tree RoPE stays Megatron's

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

    # The tree RoPE this forward applies in get_query_key_value_tensors (None: none, or Megatron's).
    _pending_rope: PackedRope | None = None

    def forward(self, *args, **kwargs):
        """Same arguments as ``SelfAttention.forward``; returns ``(output, bias)``."""
        if _plain_call(args, kwargs):  # not a tree: the parent's forward, no binding
            set_current_tree_batch(None)
            self._pending_rope = None
            return super().forward(*args, **kwargs)
        args, kwargs = self._tree_arguments(args, kwargs)
        out = super().forward(*args, **kwargs)
        self._check_rope_applied()
        return out

    def get_query_key_value_tensors(self, *args, **kwargs):
        """The parent's q/k/v, q and k rotated by this call's :class:`PackedRope` if it has one."""
        return self._rotate_packed(super().get_query_key_value_tensors(*args, **kwargs))

    @torch.compiler.disable
    def _rotate_packed(self, qkv: tuple) -> tuple:
        packed, self._pending_rope = self._pending_rope, None
        if packed is None:
            return qkv
        query, key = packed.apply(qkv[0], qkv[1])
        return (query, key, *qkv[2:])

    @torch.compiler.disable
    def _check_rope_applied(self) -> None:
        if self._pending_rope is not None:
            self._pending_rope = None
            raise RuntimeError(
                "TreeSelfAttention prepared tree RoPE but SelfAttention.forward never called "
                "get_query_key_value_tensors: this megatron-core is not supported (tested: "
                "0.16.1-0.19.x)"
            )

    def _packed_rope(self, tables, psp: TreePackedSeqParams, device: torch.device) -> PackedRope | None:
        """This call's :class:`PackedRope`, or None where RoPE stays Megatron's: fused RoPE (TE's
        kernel already reads the per-row table in one call), context parallelism (Megatron cuts
        the table into this rank's chunks), MLA's or the fused-QKV RoPE, devices other than CUDA
        and the CPU, a replaced unfused RoPE, or a subclass with its own QKV projection."""
        config = self.config
        if (config.apply_rope_fusion or getattr(config, "multi_latent_attention", False)
                or getattr(config, "fused_single_qkv_rope", False) or psp.cp_size > 1
                or device.type not in ("cuda", "cpu") or not _unfused_rope_is_megatrons()
                or type(self).get_query_key_value_tensors is not TreeSelfAttention.get_query_key_value_tensors):
            return None
        if self._rope_mscale is None:
            return None
        q_table, k_table = tables if isinstance(tables, tuple) else (tables, tables)
        return PackedRope(q_table, k_table, psp, self._rope_mscale, bool(config.rotary_interleaved))

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
        self._pending_rope = None
        if isinstance(psp, TreePackedSeqParams):
            self._check_tree_batch(psp, arg["hidden_states"])
            rope = arg.get("rotary_pos_emb")
            if rope is not None:
                tables = _tree_rope(rope, psp, per_row=self._mrope)
                device = arg["hidden_states"].device
                self._pending_rope = self._packed_rope(tables, psp, device)
                if self._pending_rope is not None:  # applied in get_query_key_value_tensors
                    arg["rotary_pos_emb"] = None
                else:
                    arg["rotary_pos_emb"] = tables
                    if not self.config.apply_rope_fusion:  # bounds on the host: no device syncs
                        arg["packed_seq_params"] = psp.for_unfused_rope(device)
        return bound.args[1:], bound.kwargs
