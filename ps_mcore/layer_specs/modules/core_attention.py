"""``TreeCoreAttention``: Megatron's core-attention protocol on top of ``tree_attention``.

One module serves every batch a GPT model sees:

* ``TreePackedSeqParams`` (a prefix forest): ``tree_attention`` over the plan; for one call of
  a cross-micro-batch schedule (a :class:`~ps_mcore.minibatch.ContextPlan`), its rows against
  the kept context K/V plus their own (:func:`~ps_mcore.attention.context.context_attention`,
  keyed by ``layer_number``).
* any other batch (ordinary THD ``PackedSeqParams``, or no packed params: sbhd) goes to the
  stock core attention the spec had (``to_tree_spec`` hands it over as ``stock_core_attention``;
  built with the same arguments, kept outside the module tree: no parameters, no checkpoint
  keys), so a batch that is not a tree runs exactly as in the stock model (Transformer
  Engine's core attention, Megatron-Bridge's). Where there is none (a ``TreeCoreAttention``
  built directly, megatron's local core attention, learnable sinks, whose parameter is this
  module's), ps-mcore's own kernels run it: THD as per-sequence causal attention through the
  same varlen kernels (a plan without sharing whose nodes are the sequences), sbhd as causal
  SDPA plus the boolean ``attention_mask`` if one is given.

Every batch kind applies the layer's sliding window and attention sinks as megatron-core's own
core attention reads them from the config (``window_size``, ``window_attn_skip_freq``,
``softmax_type``: :func:`layer_window`, :func:`megatron_attention_refusal`).

Under context parallelism (K/V all-gathered over the CP group, local queries against the
global rows: :mod:`ps_mcore.layer_specs.parallel.context_parallel`) tree batches run in one 2*cp chunk
layout over all packed rows; ordinary THD batches that no stock core attention takes, in
Megatron's / verl's per-sequence chunk layout (``cu_seqlens_q_padded``), so a verl micro-batch
that falls back to the stock forward still runs on a tree-spec model; sbhd batches are
refused there.

megatron-core (pinned and tested: 0.16) builds core attention with keywords ``config,
layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale`` and
``pg_collection`` (older releases passed ``model_comm_pgs``, still read; untested); unknown
keywords are accepted and ignored. From 0.16, the
config handed here may have a rewritten ``num_query_groups`` (when it is < TP), so head counts
are read from the tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from ps_mcore.attention import tree_attention
from ps_mcore.attention.backends import check_backend_name, cp_backend_names
from ps_mcore.attention.context import context_attention
from ps_mcore.layer_specs.parallel.context_parallel import cp_tree_attention
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams, plan_for_thd, thd_cp_layout
from ps_mcore.minibatch import ContextPlan

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def megatron_attention_refusal(config) -> str | None:
    """Why the attention options of ``config`` (a ``TransformerConfig``) have no tree form;
    None when every layer can run on trees.

    Runs: ``window_size=(left, 0)`` with ``window_attn_skip_freq`` (:func:`layer_window`) and
    ``softmax_type`` ``vanilla`` / ``off-by-one`` / ``learnable``. Refused: a right window
    (attention to later tokens), FP8 attention, and configs whose windows live in attention
    masks the layer never sees on a tree (mbridge's Gemma 3)."""
    softmax = getattr(config, "softmax_type", "vanilla")
    if softmax not in SOFTMAX_TYPES:
        return f"softmax_type={softmax!r} (tree attention computes {', '.join(SOFTMAX_TYPES)})"
    window = getattr(config, "window_size", None)
    if window is not None:
        reason = _window_size_refusal(window)
        if reason is not None:
            return reason
    if getattr(config, "fp8_dot_product_attention", False):
        return (
            "fp8_dot_product_attention (the tree kernels run in the activation dtype; turn it off "
            "for tree specs)"
        )
    if hasattr(config, "sliding_window_pattern"):
        return (
            f"{type(config).__name__}.sliding_window_pattern: this model applies its sliding "
            "windows through attention masks and a second RoPE table in its own layers "
            "(mbridge's Gemma 3), which a tree batch does not carry; megatron-core's window_size "
            "+ window_attn_skip_freq run on trees"
        )
    return None


def _window_size_refusal(window) -> str | None:
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        return f"window_size={window!r}: expected megatron-core's (left, right) pair of ints"
    if right != 0:
        return (
            f"window_size={tuple(window)}: a right window other than 0 (attention to later "
            "tokens) is not causal attention; tree attention computes (left, 0) windows"
        )
    if left < -1:
        return f"window_size={tuple(window)}: the left window must be >= 0, or -1 for none"
    return None


def layer_window(config, layer_number: int) -> int | None:
    """The sliding window W of layer ``layer_number`` (1-based) in tree attention's convention
    (a token at depth d attends to depths > d - W), or None for full causal attention.

    megatron-core's ``window_size=(left, 0)`` lets query i attend to keys ``i - left .. i``,
    so ``W = left + 1`` (``left = -1``: no window); which layers have it is megatron-core's own
    ``is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)`` (an int N:
    every N-th layer is full attention; a list: 1 marks a windowed layer), the helper its
    ``DotProductAttention`` and ``TEDotProductAttention`` ask."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # an older megatron-core: every layer windowed, as it then did
        if skip is not None:
            raise NotImplementedError(
                "window_attn_skip_freq needs megatron-core's is_layer_window_attention (0.16+)"
            ) from None
        windowed = True
    else:
        windowed = is_layer_window_attention(window, skip, layer_number)
    left = int(window[0])
    return left + 1 if windowed and left >= 0 else None


def _check_config(config, attention_type: str, attn_mask_type) -> None:
    if attention_type != "self":
        raise NotImplementedError(f"TreeCoreAttention is self attention only, got {attention_type!r}")
    if attn_mask_type not in _CAUSAL_TYPES:
        raise NotImplementedError(
            f"TreeCoreAttention computes causal attention; attn_mask_type={attn_mask_type} is not supported"
        )
    refusal = megatron_attention_refusal(config)
    if refusal is not None:
        raise NotImplementedError(f"TreeCoreAttention cannot run {refusal}")


def _tp_group(pgs):
    """The TP group of ``pg_collection`` (or an older release's ``model_comm_pgs``), else
    megatron's parallel state's."""
    group = getattr(pgs, "tp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def _cp_group(config, pg_collection, kwargs):
    """The CP group from ``pg_collection`` (or an older release's ``model_comm_pgs``), else
    Megatron's parallel state when the config asks for CP (None without CP)."""
    pgs = pg_collection if pg_collection is not None else kwargs.get("model_comm_pgs")
    group = getattr(pgs, "cp", None)
    if group is None and getattr(config, "context_parallel_size", 1) > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


def _stock_core_attention(spec, args: dict) -> torch.nn.Module | None:
    """The replaced core attention, built as megatron-core builds it. None without a spec, with
    learnable sinks (their parameter is ours; the stock module would hold another one), and
    where the stock module refuses this config (the stock model could not run such a batch
    either)."""
    if spec is None or getattr(args["config"], "softmax_type", "vanilla") == "learnable":
        return None
    if args["attention_dropout"] is None:
        del args["attention_dropout"]  # not a keyword megatron-core passes
    try:
        return build_module(spec, **args)
    except (AssertionError, NotImplementedError, ValueError, RuntimeError, ImportError):
        return None


class TreeCoreAttention(MegatronModule):
    """Core attention for prefix trees, packed batches and plain causal batches.

    Args:
        config: the layer's ``TransformerConfig``.
        layer_number: 1-based layer index.
        attn_mask_type: ``causal`` or ``padding_causal``.
        attention_type: must be ``"self"``.
        attention_dropout: overrides ``config.attention_dropout`` (must be 0 in training).
        softmax_scale: defaults to ``1/sqrt(head_dim)``. ``apply_query_key_layer_scaling``
            divides Megatron's matmul scale by the layer number and multiplies the softmax
            input back by it, so the effective scale is unchanged: our kernels use it directly.
        backend: a ``tree_attention`` backend; default ``config.tree_attention_backend`` if
            that attribute is set, else ``"auto"``.
        layer_config: ``layer_config(config, layer_number) -> config``, the config this layer's
            stock core attention really runs with, for stock core attentions that rewrite it per
            layer (Megatron-Bridge's Gemma 3: ``to_tree_spec`` sets it); None: ``config``.
        stock_core_attention: the spec (class, ``ModuleSpec`` or partial) of the core attention
            this module replaces (``to_tree_spec`` sets it): built with the same arguments, it
            runs every batch that is not a tree (module docstring). None: our kernels run them.

    Variants, as megatron-core's own core attention reads them from the config:
    ``window_size`` / ``window_attn_skip_freq`` give this layer's sliding window
    (:func:`layer_window`: ``self.window``, counted along each sample's path on a tree);
    ``softmax_type="learnable"`` adds the layer's sink logits, the parameter
    ``softmax_offset`` ``[heads per TP rank]`` (the stock key and shape; its gradient comes from
    the tree kernels), ``"off-by-one"`` a sink logit of 0. What has no tree form is refused at
    construction (:func:`megatron_attention_refusal`).

    Context parallelism: tree batches (``TreePackedSeqParams.from_plan(..., cp_size=,
    cp_rank=)``) and, where no stock core attention runs them, ordinary THD batches in the
    per-sequence chunk layout; K/V are all-gathered over the CP group whatever ``cp_comm_type``
    says, and the local queries attend to the global rows
    (:mod:`ps_mcore.layer_specs.parallel.context_parallel`).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str | None = None,
        layer_config=None,
        stock_core_attention=None,
        **kwargs,
    ):
        stock_args = dict(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                          attention_type=attention_type, attention_dropout=attention_dropout,
                          softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                          pg_collection=pg_collection, **kwargs)
        if layer_config is not None:
            config = layer_config(config, layer_number)
        super().__init__(config=config)
        _check_config(config, attention_type, attn_mask_type)
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)
        if backend is None:
            backend = getattr(config, "tree_attention_backend", None) or "auto"
        check_backend_name(backend)
        self.backend = backend
        self.window = layer_window(config, self.layer_number)
        self._pgs = pg_collection if pg_collection is not None else kwargs.get("model_comm_pgs")
        self._init_softmax_offset(config)
        self.cp_group = _cp_group(config, pg_collection, kwargs)
        self.cp_size = 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)
        if self.cp_size > 1 and backend not in cp_backend_names():
            raise NotImplementedError(
                f"tree attention backend {backend!r} cannot run under context parallelism "
                f"(cp={self.cp_size}): it needs a gather-KV kernel; use one of {cp_backend_names()}"
            )
        # Not a submodule: its state stays out of state_dict and parameters(); train() and
        # _apply() below carry mode and device moves over to it.
        object.__setattr__(self, "stock_core_attention", _stock_core_attention(stock_core_attention, stock_args))

    def train(self, mode: bool = True):
        super().train(mode)
        if self.stock_core_attention is not None:
            self.stock_core_attention.train(mode)
        return self

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        if self.stock_core_attention is not None:
            self.stock_core_attention._apply(fn, recurse)
        return self

    def _stock_for(self, packed_seq_params) -> torch.nn.Module | None:
        """The stock core attention where it runs this batch: any batch but a tree."""
        if isinstance(packed_seq_params, TreePackedSeqParams) or getattr(packed_seq_params, "plan", None) is not None:
            return None
        return self.stock_core_attention

    @property
    def tp_group(self):
        return _tp_group(self._pgs)

    def _init_softmax_offset(self, config) -> None:
        """``softmax_offset`` as the stock core attention this module replaces has it: None
        (vanilla), a zeros tensor (off-by-one, not a parameter) or the learnable parameter."""
        kind = getattr(config, "softmax_type", "vanilla")
        if kind == "vanilla":
            self.softmax_offset = None
            return
        heads = config.num_attention_heads // torch.distributed.get_world_size(self.tp_group)
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        if kind == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
        else:
            self.softmax_offset = torch.nn.Parameter(self._new_sink_logits(config, heads, device))

    def _new_sink_logits(self, config, heads: int, device) -> torch.Tensor:
        """Megatron's local ``DotProductAttention``: ``params_dtype``, its ``init_method``."""
        sinks = torch.empty(heads, device=device, dtype=config.params_dtype)
        if config.perform_initialization:
            config.init_method(sinks)
        return sinks

    def _variant(self) -> dict:
        """The ``tree_attention`` variant keywords of this layer (off-by-one: a 0 sink logit)."""
        kind = getattr(self.config, "softmax_type", "vanilla")
        sinks = self.softmax_offset if kind == "learnable" else (0.0 if kind == "off-by-one" else None)
        return dict(window=self.window, sinks=sinks)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """As megatron-core's core attentions: the learnable ``softmax_offset`` split over TP
        along its head axis, nothing otherwise."""
        if getattr(self.config, "softmax_type", "vanilla") != "learnable":
            return {}
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )

    def _scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.softmax_scale is None else self.softmax_scale

    # Under torch.compile core attention runs eagerly between the compiled graphs: the plan's
    # checks and host-side layouts are no graph material, and the graphs hold no plan constants.
    @torch.compiler.disable
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """thd: q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np*hn]``;
        sbhd: q ``[s, b, np, hn]``, k/v ``[s, b, ng, hn]`` -> ``[s, b, np*hn]``.
        v may have its own head dim ``hv`` (MLA): the output is then ``np*hv`` wide."""
        stock = self._stock_for(packed_seq_params)
        if stock is not None:  # not a tree: exactly the stock model's attention
            return stock(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                         attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by TreeCoreAttention")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_TYPES:
            raise NotImplementedError(f"attn_mask_type={attn_mask_type} is not supported (causal only)")
        if self.training and self.dropout_p > 0:
            raise ValueError(
                f"attention dropout {self.dropout_p} is not supported by TreeCoreAttention in "
                "training (set attention_dropout=0.0, as RL fine-tuning configs do)"
            )
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(
                    f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported"
                )
            return self._thd(query, key, value, packed_seq_params)
        self._refuse_cp("plain (sbhd) batches")
        return self._sbhd(query, key, value, attention_mask)

    def _refuse_cp(self, what: str) -> None:
        if self.cp_size > 1:
            raise NotImplementedError(
                f"TreeCoreAttention under context parallelism (cp={self.cp_size}) runs THD "
                f"batches only, not {what}: build TreePackedSeqParams.from_plan(plan, "
                "pad_to_multiple_of=2*cp*tp, cp_size=cp, cp_rank=rank) (an unshared batch is a "
                "plan too)"
            )

    def _thd(self, q, k, v, psp) -> torch.Tensor:
        if q.dim() != 3:
            raise ValueError(f"thd core attention expects q [t, heads, dim], got {tuple(q.shape)}")
        rows = q.size(0)
        scale = self._scale(q.size(-1))
        plan = getattr(psp, "plan", None)
        if plan is None and self.cp_size > 1:  # ordinary packed batch, per-sequence CP chunks
            group = self.cp_group
            layout = thd_cp_layout(
                psp, torch.distributed.get_world_size(group), torch.distributed.get_rank(group), q.device
            )
            if rows != layout.num_local_rows:
                raise ValueError(
                    f"core attention got {rows} rows but this CP rank holds {layout.num_local_rows} "
                    f"of the {layout.num_rows} padded THD rows"
                )
            return cp_tree_attention(q, k, v, layout, self.cp_group, self.backend, scale,
                                     **self._variant()).reshape(rows, -1)
        if plan is None:  # ordinary packed batch: one node per sequence, no gather
            plan = plan_for_thd(psp, rows, q.device)
            return tree_attention(q, k, v, plan, self.backend, scale, **self._variant()).reshape(rows, -1)
        layout = getattr(psp, "cp_layout", None)
        if layout is not None or self.cp_size > 1:
            return self._thd_cp(q, k, v, layout, scale).reshape(rows, -1)
        variant = self._variant()
        if isinstance(plan, ContextPlan):  # one call of a cross-micro-batch schedule
            attend = lambda q, k, v: context_attention(  # noqa: E731
                q, k, v, plan, self.layer_number, self.backend, scale, **variant)
        else:
            attend = lambda q, k, v: tree_attention(q, k, v, plan, self.backend, scale, **variant)  # noqa: E731
        t = plan.num_tokens
        expected = psp.num_rows if isinstance(psp, TreePackedSeqParams) else t
        if rows != expected:
            raise ValueError(
                f"core attention got {rows} rows but the packed params describe {expected} "
                f"(T={t} plan tokens + padding); pad input_ids with TreePackedSeqParams.pad_rows"
            )
        out = attend(q[:t], k[:t], v[:t])
        if rows > t:  # padding rows: zero output, never mixed with real rows
            out = torch.cat([out, out.new_zeros((rows - t,) + tuple(out.shape[1:]))], 0)
        return out.reshape(rows, -1)

    def _thd_cp(self, q, k, v, layout, scale) -> torch.Tensor:
        if layout is None or layout.cp_size != self.cp_size:
            raise ValueError(
                f"the model runs context parallelism cp={self.cp_size} but the packed params were "
                f"built for cp={1 if layout is None else layout.cp_size}; use "
                "TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=2*cp*tp, cp_size=cp, cp_rank=rank)"
            )
        return cp_tree_attention(q, k, v, layout, self.cp_group, self.backend, scale, **self._variant())

    def _sbhd(self, q, k, v, attention_mask) -> torch.Tensor:
        if q.dim() != 4:
            raise ValueError(f"sbhd core attention expects q [s, b, heads, dim], got {tuple(q.shape)}")
        s, b, hq, d = q.shape
        if k.size(0) != s:
            raise NotImplementedError(
                f"query length {s} != key length {k.size(0)} (KV caches are not supported)"
            )
        group = hq // k.size(2)
        # [s, b, h, d] -> [b, h, s, d]; grouped GQA layout: query head i reads kv head i // group.
        qb = q.permute(1, 2, 0, 3)
        kb = k.permute(1, 2, 0, 3).repeat_interleave(group, 1)
        vb = v.permute(1, 2, 0, 3).repeat_interleave(group, 1)
        scale = self._scale(d)
        variant = self._variant()
        allowed = _sbhd_allowed(attention_mask, s, b, variant["window"], q.device)
        if variant["sinks"] is not None:
            out = _attention_with_sinks(qb, kb, vb, allowed, scale, variant["sinks"])
        elif allowed is None:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # v's head dim (MLA: != d)


def _sbhd_allowed(attention_mask, s: int, b: int, window: int | None, device) -> torch.Tensor | None:
    """``[b or 1, 1, s, s]`` bool, True where query row i may attend to key row j: causal,
    inside the sliding window (``j > i - W``), and what ``attention_mask`` allows. None: plain
    causal attention."""
    if attention_mask is None and window is None:
        return None
    i = torch.arange(s, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    if attention_mask is None:
        return allowed[None, None]
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
    if attention_mask.shape == (b, s):
        # verl's padded (bshd) path hands TE-style key-padding masks, True = token.
        # Padding keys are hidden; a padding query still sees the real keys before it.
        return allowed & attention_mask[:, None, None, :]
    return allowed & ~attention_mask


def _attention_with_sinks(q, k, v, allowed, scale: float, sinks) -> torch.Tensor:
    """Softmax attention ``[b, h, s, d]`` with one sink logit per head in every row's
    denominator (megatron's ``SoftmaxOne``), computed in fp32 (fp64 for fp64 inputs); a row
    that may attend to nothing gives 0. ``sinks``: ``[h]`` tensor or a number."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, h, s, _ = q.shape
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(acc) if isinstance(sinks, torch.Tensor) else torch.full((h,), float(sinks), dtype=acc, device=q.device)
    logits = torch.cat([scores, sink.view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    probs = torch.softmax(logits, -1)[..., :-1]
    return torch.matmul(probs, v.to(acc)).to(q.dtype)


class TreeCoreAttentionTEState(TreeCoreAttention):
    """:class:`TreeCoreAttention` with the checkpoint keys of Transformer Engine's
    ``DotProductAttention`` (``to_tree_spec`` uses it where it replaces a TE core attention).

    TE stores ``core_attention._extra_state`` (its FP8 metadata; an empty uint8 tensor for a
    module that never ran FP8) in ``state_dict``, contributes nothing to megatron's
    ``sharded_state_dict`` with vanilla softmax (with ``learnable``: ``softmax_offset``, TE's
    float32 zeros-initialised parameter, split over TP, and the extra state) and tolerates the key
    missing on load. This module does the same, so a stock TE checkpoint loads strictly into
    the tree model and back. A non-empty state (a checkpoint trained with FP8 attention) is kept
    as it came and saved again unchanged; the tree kernels never read it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._te_extra_state: torch.Tensor | None = None
        self.register_load_state_dict_post_hook(_tolerate_missing_te_extra_state)

    def get_extra_state(self) -> torch.Tensor:
        """TE's format: a uint8 byte tensor, empty without FP8 metadata."""
        if self._te_extra_state is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._te_extra_state

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            self._te_extra_state = None
        elif isinstance(state, torch.Tensor):
            self._te_extra_state = state.detach().to("cpu", copy=True)
        else:
            raise RuntimeError(
                f"core_attention._extra_state of type {type(state).__name__}: TE's byte-tensor "
                "format expected (convert older TE checkpoints with TE first)"
            )

    def _new_sink_logits(self, config, heads: int, device) -> torch.Tensor:
        """TE's ``DotProductAttention``: float32 zeros (whatever ``params_dtype`` says)."""
        return torch.zeros(heads, device=device, dtype=torch.float32)


def _tolerate_missing_te_extra_state(module, incompatible_keys) -> None:
    # TE's DotProductAttention registers the same hook: checkpoints without the key (older TE,
    # megatron dist-checkpoints, which never store it) load strictly.
    for key in list(incompatible_keys.missing_keys):
        if key.endswith("core_attention._extra_state"):
            incompatible_keys.missing_keys.remove(key)
