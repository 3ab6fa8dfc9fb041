"""FLOP-weighted ideal speedup of a decoder LM on a plan (training step, fwd+bwd).

Linear layers cost the same per token, so they shrink with the token dedup N/T; attention
scores cost per (query, key) pair, so they shrink with the attention-FLOP ratio. The ideal
speedup weights the two by the model's shape. Layers with a sliding window W (Gemma 3's local
layers, GPT-OSS's alternating ones) count only the pairs inside the window
(``plan.stats(window=W)``, :func:`ps_mcore.planner.causal_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated: bool = True
    window: int | None = None  # sliding window of the windowed layers (None: no layer has one)
    window_layers: int | None = None  # how many layers have it (None: all of them)

    def layer_split(self) -> tuple[int, int]:
        """``(full-attention layers, windowed layers)``."""
        if self.window is None:
            return self.layers, 0
        windowed = self.layers if self.window_layers is None else self.window_layers
        if not 0 <= windowed <= self.layers:
            raise ValueError(f"window_layers={windowed} is outside [0, layers={self.layers}]")
        return self.layers - windowed, windowed

    def linear_flops_per_token(self) -> float:
        """Forward multiply-adds x 2 of every matmul touching one token (LM head included)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return 2.0 * (self.layers * (q + kv + out + mlp) + self.hidden * self.vocab)

    def attention_flops_per_pair(self) -> float:
        """Forward QK^T and PV for one (query, key) pair over all heads and layers."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def step_flops(self, tokens: float, pairs: float, window_pairs: float | None = None) -> float:
        """Forward + backward (3x forward) FLOPs for ``tokens`` rows, ``pairs`` scores of a
        full-attention layer and ``window_pairs`` of a windowed one (needed with a window)."""
        full, windowed = self.layer_split()
        if windowed and window_pairs is None:
            raise ValueError(f"a model with a sliding window ({self.window}) needs the windowed pairs too")
        per_layer_pair = self.attention_flops_per_pair() / self.layers
        attention = per_layer_pair * (full * pairs + (windowed * window_pairs if windowed else 0.0))
        return 3.0 * (tokens * self.linear_flops_per_token() + attention)

    def ideal_speedup(self, stats: dict) -> float:
        """Unshared / tree FLOPs for a plan's ``stats()`` (``stats(window=W)`` for a model with
        a window W)."""
        windowed = self.layer_split()[1] > 0
        if windowed and stats.get("window") != self.window:
            raise ValueError(
                f"this shape has a sliding window of {self.window}: pass plan.stats(window={self.window}) "
                f"(got stats for window {stats.get('window')})"
            )
        unshared = self.step_flops(stats["N"], stats["attn_pairs_unshared"], stats.get("attn_pairs_unshared_window"))
        tree = self.step_flops(stats["T"], stats["attn_pairs_tree"], stats.get("attn_pairs_tree_window"))
        return unshared / tree


@dataclass(frozen=True)
class MoEShape(DecoderShape):
    """Active FLOPs of a top-k MoE decoder: attention projections, the router and ``topk``
    expert (gated) MLPs of ``expert_ffn`` per token (``ffn`` unused)."""

    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    def linear_flops_per_token(self) -> float:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        moe = self.hidden * self.experts + self.topk * (3 if self.gated else 2) * self.hidden * self.expert_ffn
        return 2.0 * (self.layers * (attn + moe) + self.hidden * self.vocab)
