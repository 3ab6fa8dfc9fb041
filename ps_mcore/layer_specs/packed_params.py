"""``TreePackedSeqParams``: Megatron's ``PackedSeqParams`` carrying a :class:`TreePlan`.

Megatron hands ``packed_seq_params`` untouched from ``GPTModel.forward`` to every layer's self
attention and core attention (selective recompute included), so the plan travels with it.
The stock fields describe the packed rows as ONE sequence of T rows (plus, when padded, one
padding sequence): stock THD code (RoPE, rotary table length) accepts that, the THD RoPE path
then indexes our per-token table row by row, and no per-node ``.item()`` loop runs. Under
context parallelism the T_pad rows are one sequence (so Megatron's THD RoPE cuts the table into
the same 2*cp chunks as the rows) and ``cp_layout`` carries this rank's share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ps_mcore.layer_specs.cp_layout import CPLayout, build_cp_layout
from ps_mcore.planner import TreePlan, plan_unshared


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """Packed-sequence parameters of one prefix-forest micro-batch.

    Attributes (besides the stock ``PackedSeqParams`` fields):
        plan: the micro-batch's :class:`TreePlan` (T packed tokens).
        position_ids: ``[T_pad]`` original position of every packed row (padding rows: 0).
        cp_layout: this context-parallel rank's share of the rows (None without CP).
        multiplicity: ``[T_pad]`` int64, samples sharing each packed row (padding rows: 0);
            ``local_multiplicity()`` is this CP rank's share, sharded like the rows.
        shared_dropout: a training model's ``hidden_dropout`` runs on the packed rows, one
            mask per shared row common to the samples holding it (each sample's own mask
            distribution is unchanged). False: the tree layers refuse it
            (:mod:`ps_mcore.layer_specs.dropout`).
    """

    plan: TreePlan | None = None
    position_ids: torch.Tensor | None = None
    cp_layout: CPLayout | None = None
    multiplicity: torch.Tensor | None = None
    shared_dropout: bool = False

    @classmethod
    def from_plan(
        cls, plan: TreePlan, pad_to_multiple_of: int = 1, cp_size: int = 1, cp_rank: int = 0,
        shared_dropout: bool = False,
    ) -> "TreePackedSeqParams":
        """Parameters for ``plan`` (tensors on the plan's device).

        Args:
            plan: the micro-batch's plan (every rank of the model-parallel group plans the
                same tokens: see :func:`assert_same_plan`).
            pad_to_multiple_of: pad the packed rows to ``T_pad``, a multiple of this: the TP
                size for sequence parallelism, ``2*cp*tp`` under context parallelism (verl's
                THD rule). Padding rows never reach a real row, and their attention outputs
                are zero. Pad ``input_ids`` with :meth:`pad_rows` (or :meth:`cp_shard`).
            cp_size, cp_rank: the context-parallel group size and this rank. With CP the
                T_pad rows are one THD sequence in Megatron's ``2*cp`` chunk layout: feed the
                model ``cp_shard(plan.input_ids)``.
            shared_dropout: opt in to dropout masks shared on shared rows (see the class).
        """
        if not isinstance(plan, TreePlan):
            raise TypeError(f"from_plan expects a TreePlan, got {type(plan).__name__}")
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("cp_size", cp_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        multiple, cp_size = int(pad_to_multiple_of), int(cp_size)
        if cp_size > 1 and multiple % (2 * cp_size):
            raise ValueError(
                f"context parallelism (cp_size={cp_size}) cuts the rows into 2*cp chunks: "
                f"pad_to_multiple_of={multiple} must be a multiple of 2*cp_size={2 * cp_size} "
                "(use 2*cp*tp, as verl does)"
            )
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
        t = plan.num_tokens
        t_pad = -(-t // multiple) * multiple
        if cp_size == 1:  # padding rows form their own sequence
            bounds, max_len, layout = [0, t] + ([t_pad] if t_pad > t else []), t, None
        else:  # one sequence, so Megatron's THD RoPE slices its chunks as this layout does
            bounds, max_len = [0, t_pad], t_pad
            layout = build_cp_layout(plan, t_pad, cp_size, int(cp_rank))
        cu = torch.tensor(bounds, dtype=torch.int32, device=plan.device)
        positions = torch.zeros(t_pad, dtype=torch.long, device=plan.device)
        positions[:t] = plan.position_ids
        multiplicity = torch.zeros(t_pad, dtype=torch.long, device=plan.device)
        multiplicity[:t] = plan.multiplicity
        # The rotary table GPTModel builds has max(max_seqlen_q, max_seqlen_kv) rows; T covers
        # every tree depth (max depth <= T).
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
            plan=plan,
            position_ids=positions,
            cp_layout=layout,
            multiplicity=multiplicity,
            shared_dropout=bool(shared_dropout),
        )

    def for_unfused_rope(self, device: torch.device) -> "TreePackedSeqParams":
        """These parameters with ``cu_seqlens_{q,kv}_padded`` (same values) on the host (cached),
        for layers whose RoPE is Megatron's unfused THD path, running on ``device``.

        That path reads the bounds with ``.tolist()``, ``== cu_seqlens[-1]`` and ``.item()``:
        three device syncs per call, six per layer, each draining the GPU queue; on a host
        tensor they cost nothing. TE's fused THD kernel (and TE attention) want device bounds,
        so only unfused RoPE may get these. On NPUs MindSpeed replaces that RoPE (untested with
        host bounds): ``self`` unchanged."""
        if device.type == "npu":
            return self
        cached = self.__dict__.get("_host_bounds")
        if cached is None:
            host = self.cu_seqlens_q.to("cpu", copy=True)  # once per micro-batch; its own tensor
            cached = replace(self, cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host)
            self.__dict__["_host_bounds"] = cached
        return cached

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_layout is None else self.cp_layout.cp_size

    @property
    def num_local_rows(self) -> int:
        """Rows this CP rank feeds the model: T_pad / cp."""
        return self.num_rows // self.cp_size

    def cp_shard(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """``[T or T_pad, ...] -> [T_pad / cp, ...]``: this CP rank's rows of a per-row tensor
        (``T``-row inputs are padded with ``value`` first), e.g. ``plan.input_ids``."""
        if x.size(0) == self.plan.num_tokens:
            x = self.pad_rows(x, value)
        if x.size(0) != self.num_rows:
            raise ValueError(
                f"cp_shard expects T={self.plan.num_tokens} or T_pad={self.num_rows} rows, got "
                f"shape {tuple(x.shape)}"
            )
        if self.cp_layout is None:
            return x
        return x.index_select(0, self.cp_layout.local_rows.to(x.device))

    def local_multiplicity(self) -> torch.Tensor:
        """``[T_pad / cp]`` int64: the multiplicity of this CP rank's rows (cached)."""
        cached = self.__dict__.get("_local_multiplicity")
        if cached is None:
            cached = self.__dict__["_local_multiplicity"] = self.cp_shard(self.multiplicity)
        return cached

    @property
    def num_rows(self) -> int:
        """T_pad, the number of rows the model sees."""
        return int(self.position_ids.numel())

    @property
    def num_padding(self) -> int:
        """T_pad - T."""
        return self.num_rows - self.plan.num_tokens

    def pad_rows(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """``[T, ...] -> [T_pad, ...]`` filled with ``value`` (e.g. ``plan.input_ids``)."""
        if x.size(0) != self.plan.num_tokens:
            raise ValueError(
                f"pad_rows expects T={self.plan.num_tokens} rows, got shape {tuple(x.shape)}"
            )
        if self.num_padding == 0:
            return x
        pad = x.new_full((self.num_padding,) + tuple(x.shape[1:]), value)
        return torch.cat([x, pad], 0)


def segment_plan(lengths: list[int]) -> TreePlan:
    """A plan without sharing whose nodes are the given row segments, in order.

    Lets ordinary THD batches (standard ``PackedSeqParams``) run through the same kernels:
    every segment is its own group, so the planner shares nothing and keeps the order.
    """
    lengths = [int(n) for n in lengths if int(n) > 0]
    if not lengths:
        raise ValueError("packed_seq_params describe no rows (all sequence lengths are 0)")
    seqs = [np.zeros(n, dtype=np.int64) for n in lengths]
    return plan_unshared(seqs)


def plan_for_thd(packed_seq_params: PackedSeqParams, rows: int, device: torch.device) -> TreePlan:
    """The plan of an ordinary THD batch of ``rows`` rows (cached on ``packed_seq_params``).

    Sequences are laid out by ``cu_seqlens_q_padded`` when set (TE's convention: padding
    rows sit at the end of each sequence, so causal masking keeps them from real rows),
    else by ``cu_seqlens_q``; rows past the last boundary form one extra segment.
    """
    cu = packed_seq_params.cu_seqlens_q_padded
    cu_kv = packed_seq_params.cu_seqlens_kv_padded
    if cu is None:
        cu, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    if cu is None:
        raise ValueError("THD packed_seq_params need cu_seqlens_q (got None)")
    key = (id(cu), rows, str(device))
    cached = packed_seq_params.__dict__.get("_ps_mcore_plan")
    if cached is not None and cached[0] == key:
        return cached[1]
    if cu_kv is not None and cu_kv is not cu and not torch.equal(cu_kv.cpu(), cu.cpu()):
        raise NotImplementedError(
            "THD self attention with cu_seqlens_kv != cu_seqlens_q is not supported"
        )
    bounds = cu.tolist()
    if bounds[0] != 0 or any(prev > nxt for prev, nxt in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
    if bounds[-1] > rows:
        raise ValueError(f"cu_seqlens end at {bounds[-1]} but the input has only {rows} rows")
    lengths = np.diff(bounds).tolist() + [rows - bounds[-1]]
    plan = segment_plan(lengths).to(device)
    packed_seq_params.__dict__["_ps_mcore_plan"] = (key, plan)
    return plan


def thd_cp_layout(packed_seq_params: PackedSeqParams, cp_size: int, cp_rank: int, device: torch.device) -> CPLayout:
    """This CP rank's layout of an ordinary THD batch under context parallelism (cached on
    ``packed_seq_params``): every sequence of ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``)
    is its own node, cut into ``2*cp`` chunks on its own (verl's ``preprocess_thd_engine``)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    if cu is None:
        raise ValueError("THD packed_seq_params need cu_seqlens_q (got None)")
    key = (id(cu), cp_size, cp_rank, str(device))
    cached = packed_seq_params.__dict__.get("_ps_mcore_cp_layout")
    if cached is not None and cached[0] == key:
        return cached[1]
    kv = packed_seq_params.cu_seqlens_kv_padded
    if kv is None:
        kv = packed_seq_params.cu_seqlens_kv
    if kv is not None and kv is not cu and not torch.equal(kv.cpu(), cu.cpu()):
        raise NotImplementedError("THD self attention with cu_seqlens_kv != cu_seqlens_q is not supported")
    bounds = cu.cpu().numpy().astype(np.int64)
    lengths = np.diff(bounds)
    if bounds[0] != 0 or (lengths < 0).any() or (lengths % (2 * cp_size)).any():
        raise ValueError(
            f"under context parallelism (cp={cp_size}) every THD sequence must be padded to a "
            f"multiple of 2*cp={2 * cp_size} (cu_seqlens_q_padded), got {bounds.tolist()}"
        )
    plan = segment_plan(lengths.tolist()).to(device)
    layout = build_cp_layout(plan, int(bounds[-1]), cp_size, cp_rank, cu_seqlens=bounds)
    packed_seq_params.__dict__["_ps_mcore_cp_layout"] = (key, layout)
    return layout
