"""FLOP-weighted ideal speedup of a decoder LM on a plan (training step, fwd+bwd).

Linear layers cost the same per token, so they shrink with the token dedup N/T; attention
scores cost per (query, key) pair, so they shrink with the attention-FLOP ratio. The ideal
speedup weights the two by the model's shape.
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

    def step_flops(self, tokens: float, pairs: float) -> float:
        """Forward + backward (3x forward) FLOPs for ``tokens`` rows and ``pairs`` scores."""
        return 3.0 * (tokens * self.linear_flops_per_token() + pairs * self.attention_flops_per_pair())

    def ideal_speedup(self, stats: dict) -> float:
        """Unshared / tree FLOPs for a plan's ``stats()``."""
        return self.step_flops(stats["N"], stats["attn_pairs_unshared"]) / self.step_flops(
            stats["T"], stats["attn_pairs_tree"]
        )
