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

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from ps_mcore.layer_specs.parallel.cp_layout import CPLayout, build_cp_layout
from ps_mcore.minibatch import ContextPlan
from ps_mcore.planner import TreePlan, plan_unshared


@dataclass
class TreePackedSeqParams(PackedSeqParams):
    """Packed-sequence parameters of one prefix-forest micro-batch.

    Attributes (besides the stock ``PackedSeqParams`` fields):
        plan: the micro-batch's :class:`TreePlan` (T packed tokens), or one call of a
            cross-micro-batch schedule (:class:`~ps_mcore.minibatch.ContextPlan`: its own rows,
            attending also to kept context K/V).
        position_ids: ``[T_pad]`` original position of every packed row (padding rows: 0).
        cp_layout: this context-parallel rank's share of the rows (None without CP).
        multiplicity: ``[T_pad]`` int64, samples sharing each packed row (padding rows: 0);
            ``local_multiplicity()`` is this CP rank's share, sharded like the rows.
        shared_dropout: a training model's ``hidden_dropout`` runs on the packed rows, one
            mask per shared row common to the samples holding it (each sample's own mask
            distribution is unchanged). False: the tree layers refuse it
            (:mod:`ps_mcore.layer_specs.modules.dropout`).

    Megatron hands this one object to every layer of the micro-batch, so what the layers
    derive from it is kept on it, in five attributes set by ``__post_init__`` (not dataclass
    fields: a copy made by ``dataclasses.replace``, as torch's input casting makes, derives
    them again): ``host_bounds`` (the host copy of ``cu_seqlens_q`` :meth:`from_plan` built it
    from), ``host_bounds_twin`` (:meth:`for_unfused_rope`), ``local_multiplicity_rows``
    (:meth:`local_multiplicity`), ``rotary_tables`` (``(table, table[positions])`` pairs of
    ``modules.self_attention.tree_rotary_table``) and ``rotary_cos_sin`` (``(table, dtype,
    mscale, cos, sin)`` entries of ``modules.self_attention.PackedRope``).
    """

    plan: TreePlan | ContextPlan | None = None
    position_ids: torch.Tensor | None = None
    cp_layout: CPLayout | None = None
    multiplicity: torch.Tensor | None = None
    shared_dropout: bool = False

    def __post_init__(self) -> None:
        stock = getattr(super(), "__post_init__", None)
        if stock is not None:  # megatron-core 0.19 derives seq_idx there
            stock()
        self.host_bounds: torch.Tensor | None = None
        self.host_bounds_twin: TreePackedSeqParams | None = None
        self.local_multiplicity_rows: torch.Tensor | None = None
        self.rotary_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rotary_cos_sin: list[tuple] = []

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
        if not isinstance(plan, (TreePlan, ContextPlan)):
            raise TypeError(f"from_plan expects a TreePlan or a ContextPlan, got {type(plan).__name__}")
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
        if cp_size > 1 and isinstance(plan, ContextPlan):
            raise NotImplementedError(
                "a cross-micro-batch call (ContextPlan) cannot run under context parallelism "
                f"(cp_size={cp_size}): its kept context K/V are not CP-sharded; plan mini-batches "
                "whose sharing units fit the token budget under CP"
            )
        t = plan.num_tokens
        t_pad = -(-t // multiple) * multiple
        if cp_size == 1:  # padding rows form their own sequence
            bounds, max_len, layout = [0, t] + ([t_pad] if t_pad > t else []), t, None
        else:  # one sequence, so Megatron's THD RoPE slices its chunks as this layout does
            bounds, max_len = [0, t_pad], t_pad
            layout = build_cp_layout(plan, t_pad, cp_size, int(cp_rank))
        # GPTModel's rotary table has max(max_seqlen_q, max_seqlen_kv) rows: a tree reaches depth
        # < T, a schedule call's rows may sit deeper than its own count.
        max_len = max(max_len, plan.max_seqlen_kv)
        # Built on the host and copied without waiting: torch.tensor(..., device=cuda) would
        # drain the GPU queue once per micro-batch. The host copy serves unfused RoPE.
        host_bounds = torch.tensor(bounds, dtype=torch.int32)
        cu = host_bounds.to(plan.device, non_blocking=True)
        positions = torch.zeros(t_pad, dtype=torch.long, device=plan.device)
        positions[:t] = plan.position_ids
        multiplicity = torch.zeros(t_pad, dtype=torch.long, device=plan.device)
        multiplicity[:t] = plan.multiplicity
        params = cls(
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
        params.host_bounds = host_bounds
        return params

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
        if self.host_bounds_twin is None:  # its own tensor; a copy made by replace() reads the device
            host = self.host_bounds.clone() if self.host_bounds is not None else self.cu_seqlens_q.to("cpu", copy=True)
            self.host_bounds_twin = replace(self, cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host)
        return self.host_bounds_twin

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
        if self.local_multiplicity_rows is None:
            self.local_multiplicity_rows = self.cp_shard(self.multiplicity)
        return self.local_multiplicity_rows

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


@dataclass(eq=False)
class ThdBatchMemo:
    """What the tree kernels derive from an ordinary THD batch (a standard ``PackedSeqParams``).

    Megatron hands one params object to every layer of a micro-batch, so this memo rides on it
    (one attribute, :func:`thd_batch_memo`): the sequence bounds are read to the host once per
    micro-batch (one device sync), not once per layer.

    Attributes:
        bounds: the ``cu_seqlens`` tensor everything here was derived from
            (``cu_seqlens_q_padded``, else ``cu_seqlens_q``). The tensor itself is held and
            compared by identity, so params whose bounds were replaced derive again; no
            recycled ``id`` can match.
        host_bounds: ``[B+1]`` int64, its host copy.
        plans: :func:`plan_for_thd`'s segment plans per ``(rows, device)``.
        cp_layouts: :func:`thd_cp_layout`'s layouts per ``(cp_size, cp_rank, device)``.
    """

    bounds: torch.Tensor
    host_bounds: np.ndarray
    plans: dict[tuple[int, torch.device], TreePlan] = field(default_factory=dict)
    cp_layouts: dict[tuple[int, int, torch.device], CPLayout] = field(default_factory=dict)


_THD_MEMO_ATTR = "ps_mcore_thd_memo"


def thd_batch_memo(packed_seq_params: PackedSeqParams) -> ThdBatchMemo:
    """The :class:`ThdBatchMemo` of an ordinary THD batch (made on first use, kept on it).

    Sequences are laid out by ``cu_seqlens_q_padded`` when set (TE's convention: padding rows
    sit at the end of each sequence, so causal masking keeps them from real rows), else by
    ``cu_seqlens_q``; the kv bounds must be the same (self attention)."""
    cu, cu_kv = packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_kv_padded
    if cu is None:
        cu, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    if cu is None:
        raise ValueError("THD packed_seq_params need cu_seqlens_q (got None)")
    memo = getattr(packed_seq_params, _THD_MEMO_ATTR, None)
    if memo is not None and memo.bounds is cu:
        return memo
    if cu_kv is not None and cu_kv is not cu and not torch.equal(cu_kv.cpu(), cu.cpu()):
        raise NotImplementedError("THD self attention with cu_seqlens_kv != cu_seqlens_q is not supported")
    host = cu.cpu().numpy().astype(np.int64)
    if host.size == 0 or host[0] != 0 or (np.diff(host) < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {host.tolist()}")
    memo = ThdBatchMemo(cu, host)
    setattr(packed_seq_params, _THD_MEMO_ATTR, memo)
    return memo


def plan_for_thd(packed_seq_params: PackedSeqParams, rows: int, device: torch.device) -> TreePlan:
    """The plan of an ordinary THD batch of ``rows`` rows: one node per sequence of
    :func:`thd_batch_memo`'s bounds; rows past the last boundary form one extra segment."""
    memo = thd_batch_memo(packed_seq_params)
    key = (rows, torch.device(device))
    if key not in memo.plans:
        bounds = memo.host_bounds
        if bounds[-1] > rows:
            raise ValueError(f"cu_seqlens end at {bounds[-1]} but the input has only {rows} rows")
        memo.plans[key] = segment_plan(np.diff(bounds).tolist() + [rows - int(bounds[-1])]).to(device)
    return memo.plans[key]


def thd_cp_layout(packed_seq_params: PackedSeqParams, cp_size: int, cp_rank: int, device: torch.device) -> CPLayout:
    """This CP rank's layout of an ordinary THD batch under context parallelism: every
    sequence of :func:`thd_batch_memo`'s bounds is its own node, cut into ``2*cp`` chunks on
    its own (verl's ``preprocess_thd_engine``)."""
    memo = thd_batch_memo(packed_seq_params)
    key = (cp_size, cp_rank, torch.device(device))
    if key not in memo.cp_layouts:
        bounds = memo.host_bounds
        lengths = np.diff(bounds)
        if (lengths % (2 * cp_size)).any():
            raise ValueError(
                f"under context parallelism (cp={cp_size}) every THD sequence must be padded to a "
                f"multiple of 2*cp={2 * cp_size} (cu_seqlens_q_padded), got {bounds.tolist()}"
            )
        plan = segment_plan(lengths.tolist()).to(device)
        memo.cp_layouts[key] = build_cp_layout(plan, int(bounds[-1]), cp_size, cp_rank, cu_seqlens=bounds)
    return memo.cp_layouts[key]


def call_entries(plan, key, layer: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(states [E, ...], windows [E, w, D])`` the segments of a cross-micro-batch schedule
    call continue (kept by earlier calls for recurrent layer ``key``), ``(None, None)`` when
    ``plan`` is not such a call or nothing is continued. ``layer`` names the layer in errors."""
    if not isinstance(plan, ContextPlan):
        return None, None
    runtime = getattr(plan, "runtime", None)
    if runtime is None:
        raise ValueError(
            f"{layer}: a ContextPlan call runs inside a mini-batch schedule (ps_mcore.schedule."
            "ScheduleRunner), which attaches the kept context; this plan has none"
        )
    kept = runtime.context_recurrent(key)
    return (None, None) if kept is None else kept
