"""FLOP-weighted ideal speedup of a decoder LM on a plan (training step, fwd+bwd).

Linear layers cost the same per token, so they shrink with the token dedup N/T; attention
scores cost per (query, key) pair, so they shrink with the attention-FLOP ratio. The ideal
speedup weights the two by the model's shape. Layers with a sliding window W (Gemma 3's local
layers, GPT-OSS's alternating ones) count only the pairs inside the window
(``plan.stats(window=W)``, :func:`ps_mcore.planner.causal_pairs`). A vision-language model
adds its vision tower (:class:`VisionShape`), whose cost scales with the images it encodes.
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

    def plan_flops(self, stats: dict) -> tuple[float, float]:
        """``(unshared, tree)`` step FLOPs for a plan's ``stats()`` (``stats(window=W)`` for a
        model with a window W)."""
        windowed = self.layer_split()[1] > 0
        if windowed and stats.get("window") != self.window:
            raise ValueError(
                f"this shape has a sliding window of {self.window}: pass plan.stats(window={self.window}) "
                f"(got stats for window {stats.get('window')})"
            )
        unshared = self.step_flops(stats["N"], stats["attn_pairs_unshared"], stats.get("attn_pairs_unshared_window"))
        tree = self.step_flops(stats["T"], stats["attn_pairs_tree"], stats.get("attn_pairs_tree_window"))
        return unshared, tree

    def ideal_speedup(self, stats: dict) -> float:
        """Unshared / tree FLOPs for a plan's ``stats()`` (``stats(window=W)`` for a model with
        a window W)."""
        unshared, tree = self.plan_flops(stats)
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


@dataclass(frozen=True)
class VisionShape:
    """A ViT image encoder with a patch merger (the vision tower of Qwen2-VL / Qwen2.5-VL).

    Per patch: the patch embedding (``patch_dim -> hidden``), ``blocks`` blocks of fused QKV
    and output projections and an MLP of ``ffn`` (gated: Qwen2.5-VL; plain: Qwen2-VL), and the
    merger MLP on groups of ``merge**2`` patches (``hidden * merge**2`` -> the same ->
    ``out_hidden``). Attention is bidirectional: an image (or video frame) of P patches has P^2
    (query, key) pairs in a full-attention block and the sum of its windows' squares in a
    windowed one; ``full_blocks`` of the blocks are full (None: all of them, Qwen2-VL)."""

    blocks: int
    hidden: int
    ffn: int
    patch_dim: int
    merge: int
    out_hidden: int
    gated: bool = True
    full_blocks: int | None = None

    def linear_flops_per_patch(self) -> float:
        """Forward multiply-adds x 2 of every matmul touching one patch (merger included)."""
        h = self.hidden
        block = 4 * h * h + (3 if self.gated else 2) * h * self.ffn
        wide = h * self.merge**2
        merger = (wide * wide + wide * self.out_hidden) / self.merge**2
        return 2.0 * (self.patch_dim * h + self.blocks * block + merger)

    def step_flops(self, patches: float, full_pairs: float, window_pairs: float = 0.0) -> float:
        """Forward + backward FLOPs for ``patches`` patches with ``full_pairs`` (query, key)
        pairs per full-attention block and ``window_pairs`` per windowed one. Backward is 2x
        forward except the patch embedding's: pixels need no gradient, only its weight does."""
        full = self.blocks if self.full_blocks is None else self.full_blocks
        attention = 4.0 * self.hidden * (full * full_pairs + (self.blocks - full) * window_pairs)
        embed = 2.0 * self.patch_dim * self.hidden * patches
        return 3.0 * (patches * self.linear_flops_per_patch() + attention) - embed


def vlm_ideal_speedup(decoder: DecoderShape, stats: dict, vision: VisionShape,
                      stock_images: tuple[float, float, float], tree_images: tuple[float, float, float]) -> float:
    """Unshared / tree FLOPs of a vision-language step: the decoder on the plan's ``stats()``
    plus the vision tower on the images each run encodes, ``(patches, full-attention pairs,
    windowed pairs)`` summed over those images (stock: every sample's; tree: those of the
    packed rows)."""
    unshared, tree = decoder.plan_flops(stats)
    return (unshared + vision.step_flops(*stock_images)) / (tree + vision.step_flops(*tree_images))
