"""FP8 (Transformer Engine) on tree batches: what changes is only how many packed rows a
micro-batch has.

TE's FP8 linears quantize the activations of the packed rows; attention stays a tree kernel in
the activation dtype (bf16), so ``fp8_dot_product_attention`` is refused. The FP8 GEMMs need
the token dimension aligned: 16 rows for delayed and current (tensorwise) scaling, 32 for MXFP8
and 128-row tiles for the blockwise recipe. verl pads an FP8 THD batch to a total multiple of
``128 x`` its usual alignment (TP, or ``2*cp*tp`` under CP); the tree's packed rows (one
sequence) are padded the same way, which covers every recipe.

Scaling statistics: delayed and current scaling take the amax (max |x|) of each tensor; a
shared row is an exact duplicate of the rows it stands for in the forward, and a max does not
count duplicates, so forward scales are those of the unshared batch. In backward a shared
row's gradient is the sum over its samples (a different tensor from the unshared batch's
per-sample rows), so its amax differs: that is FP8 rounding of a different operand, bounded
like any FP8 GEMM, not a statistic that could be reweighted. The blockwise recipe scales 1x128
row tiles (per row: the same as the unshared row's) and, for the weight-gradient GEMM, 128-row
blocks along the tokens, which group different rows in the two layouts: again rounding only.
``tests/test_gpu_fp8.py`` measures the tree's error against a bf16 reference next to stock FP8's.
"""

from __future__ import annotations

FP8_ROW_ALIGN = 128  # rows per FP8 alignment unit (verl's THD rule): covers 16, 32 and 128-row tiles
PADDED_FP8 = ("e4m3", "hybrid")  # verl's use_fp8_padding


def tree_row_multiple(config, tp: int = 1, cp: int = 1) -> int:
    """The multiple a tree micro-batch's packed rows are padded to: TP (``2*cp*tp`` under CP),
    times :data:`FP8_ROW_ALIGN` when the model computes in FP8."""
    base = 2 * cp * tp if cp > 1 else tp
    return base * FP8_ROW_ALIGN if getattr(config, "fp8", None) in PADDED_FP8 else base


def fp8_tree_refusal(config) -> str | None:
    """Why an FP8 model cannot run a tree batch (None: it can, or it is not FP8)."""
    if not getattr(config, "fp8", None):
        return None
    if getattr(config, "fp8_dot_product_attention", False):
        return "fp8_dot_product_attention (tree attention runs in the activation dtype)"
    if getattr(config, "num_moe_experts", None):
        return "fp8 with MoE layers (expert token padding for FP8 is not verified on a tree)"
    return None


def fp8_thd_layout(lengths: list[int], align: int = 1, device=None):
    """verl's FP8 THD layout of an unshared batch (the stock baseline of an FP8 tree run): each
    sequence padded to a multiple of ``lcm(16, align)``, the last one further so the total is a
    multiple of ``128 * align``.

    Returns:
        ``(packed_seq_params, token_rows)``: Megatron ``PackedSeqParams`` whose segments are the
        padded sequences (as verl's: padding rows end each sequence, so causal attention never
        lets a real token read them) and ``[N]`` the row of every real token in the padded
        layout (scatter the tokens there; gather the outputs from there).
    """
    import math

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    per_seq = math.lcm(16, align)
    padded = [-(-n // per_seq) * per_seq for n in lengths]
    total_align = FP8_ROW_ALIGN * align
    padded[-1] += -sum(padded) % total_align
    pad = torch.tensor([0] + padded).cumsum(0).to(device=device, dtype=torch.int32)
    token_rows = torch.cat([torch.arange(n) + int(start) for n, start in zip(lengths, pad[:-1].tolist())])
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=pad, cu_seqlens_kv=pad, cu_seqlens_q_padded=pad,
        cu_seqlens_kv_padded=pad, max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )
    return params, token_rows.to(device)
