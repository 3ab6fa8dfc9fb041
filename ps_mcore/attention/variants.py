"""Attention variants on trees: sliding windows, attention sinks, logit softcapping.

Every row of a tree is one position of one (or several) samples' root path, at depth
``position_ids[row]``. The variants are defined on those paths exactly as on the unshared
samples:

* **Sliding window** W (Hugging Face / FlashAttention convention, Mistral, Gemma 2/3,
  GPT-OSS): a query at depth d attends to the keys of its own root path at depth > d - W,
  the last W positions including itself; the window counts positions along the sample's
  path, across branch points. A varlen kernel segment whose query and key rows are each
  consecutive positions of one path (a gather-KV context, a chain) takes it as its
  bottom-right-aligned window (FlashAttention ``window_size=(W-1, 0)``).
* **Attention sinks** (GPT-OSS learned per-head logits; Megatron ``softmax_type``
  ``learnable``, and ``off-by-one`` = a sink logit of 0): one extra logit ``s_h`` per query
  head in every row's softmax denominator, with no value. From a kernel's output ``o`` and
  its log-sum-exp ``lse`` (natural log, scale included):

      L = logaddexp(lse, s_h),   out = o * exp(lse - L) = o * sigmoid(lse - s_h)

  and the gradients stay exact: a flash-style backward handed ``(out, L)`` computes
  ``p = exp(score - L)`` and ``D = rowsum(dout * out)``, which are the sink softmax's own (the
  sink has no value, so it adds nothing to D), and ``d s_h = -sum_rows exp(s_h - L) * D``
  (:func:`sink_grad`). Where the cascade merges partial results by log-sum-exp, the sink is
  added once, after the merge.
* **Logit softcapping** (Gemma 2 ``attn_logit_softcapping``): ``score = c * tanh(score / c)``
  on the scaled scores, before the mask.

:class:`AttentionVariant` carries them; :func:`attention_variant` validates the user's
arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# feature name -> how messages name it (with the tree_attention keyword that asks for it)
FEATURES = {
    "window": "sliding-window attention (window=)",
    "sinks": "attention sinks (sinks=)",
    "softcap": "logit softcapping (softcap=)",
}


@dataclass(frozen=True)
class AttentionVariant:
    """What a tree-attention call applies on top of plain causal softmax attention.

    Attributes:
        window: sliding window W (keys at depth > d - W), or None (the whole path).
        sinks: ``[Hq]`` sink logits (any float dtype; differentiable), or None.
        softcap: logit softcap c > 0, or None.
    """

    window: int | None = None
    sinks: torch.Tensor | None = None
    softcap: float | None = None

    @property
    def features(self) -> tuple[str, ...]:
        """The names (keys of :data:`FEATURES`) of what is set, in a fixed order."""
        return tuple(name for name in FEATURES if getattr(self, name) is not None)

    @property
    def plain(self) -> bool:
        return not self.features

    def kernel_kwargs(self) -> dict:
        """The keywords a :class:`~ps_mcore.attention.gather_kv.VarlenKernel` takes for this
        variant (sinks are applied around the kernel, or passed separately)."""
        kw = {}
        if self.window is not None:
            kw["window"] = self.window
        if self.softcap is not None:
            kw["softcap"] = self.softcap
        return kw


PLAIN = AttentionVariant()


def attention_variant(q: torch.Tensor, window=None, sinks=None, softcap=None) -> AttentionVariant:
    """Validate ``tree_attention``'s variant arguments for queries ``q`` ``[T, Hq, D]``.

    ``window``: a positive int (a window of at least every context masks nothing, but is
    still a window; ``None`` = none). ``sinks``: a ``[Hq]`` float tensor, or a number (the
    same logit for every head: 0 is Megatron's ``off-by-one`` softmax). ``softcap``: a positive
    number (``None`` or 0 = none, as Hugging Face passes it)."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (a sliding window of W positions), got {window!r}")
    if sinks is not None:
        if isinstance(sinks, (int, float)) and not isinstance(sinks, bool):
            sinks = torch.full((q.size(1),), float(sinks), device=q.device, dtype=torch.float32)
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError(f"sinks must be a float tensor of shape [Hq] or a number, got {type(sinks).__name__}")
        if sinks.shape != (q.size(1),):
            raise ValueError(
                f"sinks must have one logit per query head, shape [Hq] = [{q.size(1)}]; got {tuple(sinks.shape)}"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
            raise ValueError(f"softcap must be a positive number, got {softcap!r}")
        softcap = float(softcap) if softcap > 0 else None  # 0: off, as flash-attn and HF read it
    return AttentionVariant(window, sinks, softcap)


# ----------------------------------------------------------------------------- sinks


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` ``[T, H, D]`` and ``lse`` ``[H, T]`` of softmax attention without sinks ->
    the same with one sink logit per head in every row's denominator (fp32 math, fp64 for a
    float64 ``lse``; ``out``'s dtype). Returns ``(out, L)``, L the sink softmax's log-sum-exp
    (in the math's dtype)."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    big = torch.logaddexp(lse.to(acc), sinks.detach().to(acc)[:, None])
    keep = torch.exp(lse.to(acc) - big).t().unsqueeze(-1)  # [T, H, 1], sigmoid(lse - sink)
    return (out.to(acc) * keep).to(out.dtype), big


def sink_grad(dout: torch.Tensor, out: torch.Tensor, big: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sink logits ``[H]``: ``-sum_t exp(s_h - L[h, t]) * D[t, h]`` with
    ``D = rowsum(dout * out)`` (``out`` and ``L`` those of the sink softmax, :func:`add_sinks`)."""
    acc = big.dtype  # add_sinks' math dtype: fp32, fp64 for fp64
    d = (dout.to(acc) * out.to(acc)).sum(-1).t()  # [H, T]
    p_sink = torch.exp(sinks.detach().to(acc)[:, None] - big)
    return -(p_sink * d).sum(-1).to(sinks.dtype)


def window_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """``[Tq, Tk]`` bool, True where key position ``pos_k`` is inside the window of query
    position ``pos_q`` (``pos_k > pos_q - W``); None without a window. Causality and the
    root-path condition are the caller's mask."""
    if window is None:
        return None
    return pos_k[None, :] > pos_q[:, None] - window


def softcap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``c * tanh(scores / c)`` (identity without a cap)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


__all__ = [
    "FEATURES",
    "PLAIN",
    "AttentionVariant",
    "add_sinks",
    "attention_variant",
    "sink_grad",
    "softcap_scores",
    "window_mask",
]
