"""``ps_mcore.flops.DecoderShape``, the FLOP "ideal" every benchmark reports, against (1) a
hand count of one small shape written out matmul by matmul, and (2) torch's FLOP counter on a
real Hugging Face Qwen2 of that shape (eager attention: every query-key pair, so the
attention term is L^2 per layer there). ``VisionShape`` (a vision-language model's vision
tower) the same way, against real Qwen2-VL and Qwen2.5-VL vision towers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_mcore import plan_prefix_tree
from ps_mcore.flops import DecoderShape, MoEShape, VisionShape, vlm_ideal_speedup

# layers=2, hidden=8, 4 query heads and 2 kv heads of dim 4, ffn=10, vocab=20
SHAPE = dict(layers=2, hidden=8, heads=4, kv_heads=2, head_dim=4, ffn=10, vocab=20)


def _hand_linear_macs_per_token(gated: bool) -> int:
    """Multiply-adds one token meets, by hand: a [1, in] x [in, out] matmul is in*out."""
    q_proj = 8 * (4 * 4)  # hidden -> heads * head_dim = 128
    k_proj = 8 * (2 * 4)  # hidden -> kv_heads * head_dim = 64
    v_proj = 8 * (2 * 4)  # 64
    o_proj = (4 * 4) * 8  # heads * head_dim -> hidden = 128
    gate = 8 * 10 if gated else 0  # SwiGLU gate, hidden -> ffn = 80
    up = 8 * 10  # 80
    down = 10 * 8  # ffn -> hidden = 80
    per_layer = q_proj + k_proj + v_proj + o_proj + gate + up + down  # 624 gated, 544 plain
    lm_head = 8 * 20  # hidden -> vocab = 160
    return 2 * per_layer + lm_head


def test_linear_flops_per_token_hand_count():
    assert _hand_linear_macs_per_token(True) == 2 * 624 + 160 == 1408
    assert _hand_linear_macs_per_token(False) == 2 * 544 + 160 == 1248
    for gated in (True, False):
        shape = DecoderShape(**SHAPE, gated=gated)
        assert shape.linear_flops_per_token() == 2 * _hand_linear_macs_per_token(gated)  # 1 MAC = 2 FLOPs


def test_moe_linear_flops_count_the_active_experts():
    """Router (hidden -> experts) and top-k expert MLPs replace the dense MLP: 8 x 3 = 24
    router MACs and 2 experts x (gate 8x5 + up 8x5 + down 5x8 = 120) per layer."""
    shape = MoEShape(**SHAPE, experts=3, topk=2, expert_ffn=5)
    attention = 128 + 64 + 64 + 128
    assert shape.linear_flops_per_token() == 2 * (2 * (attention + 24 + 2 * 120) + 160)


def test_attention_and_step_flops_hand_count():
    shape = DecoderShape(**SHAPE)
    # one (query, key) pair, one head: q.k is head_dim MACs, p * v is head_dim MACs
    per_pair_per_head = 2 * (4 + 4)  # FLOPs
    assert shape.attention_flops_per_pair() == 2 * 4 * per_pair_per_head == 128  # layers * heads
    # backward of a matmul is two matmuls of the same size (grad input, grad weight): 3x forward
    assert shape.step_flops(10, 55) == 3 * (10 * 2816 + 55 * 128)


def test_ideal_speedup_hand_count():
    """Two sequences of 6 sharing their first 4 tokens: N = 12, T = 8; causal pairs
    unshared 2 * (6 * 7 / 2) = 42, on the tree 4 * 5 / 2 + 2 * (2 * 4 + 2 * 3 / 2) = 32."""
    plan = plan_prefix_tree([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], min_prefix_len=1)
    stats = plan.stats()
    assert (stats["N"], stats["T"], stats["attn_pairs_unshared"], stats["attn_pairs_tree"]) == (12, 8, 42, 32)
    shape = DecoderShape(**SHAPE)
    assert shape.ideal_speedup(stats) == pytest.approx((12 * 2816 + 42 * 128) / (8 * 2816 + 32 * 128), rel=1e-15)


def test_matches_torch_flop_counter_on_qwen2():
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.Qwen2Config(
        vocab_size=20, hidden_size=8, intermediate_size=10, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    shape = DecoderShape(**SHAPE)
    length = 7
    ids = torch.randint(0, 20, (1, length))
    with FlopCounterMode(display=False) as forward:
        model(input_ids=ids)
    # eager attention scores every (query, key) pair, masked or not: L^2 pairs, not L(L+1)/2
    assert forward.get_total_flops() == length * shape.linear_flops_per_token() + length**2 * shape.attention_flops_per_pair()
    with FlopCounterMode(display=False) as step:
        model(input_ids=ids).logits.sum().backward()
    assert step.get_total_flops() == shape.step_flops(length, length**2)


def test_windowed_pairs_hand_count():
    """The same two sequences with a sliding window of 2 (each token sees itself and the one
    before): unshared 2 * (1 + 2 + 2 + 2 + 2 + 2) = 22; tree 1 + 2 + 2 + 2 for the shared 4,
    then 2 + 2 per branch = 15. A model with the window on 1 of its 2 layers weights each
    layer's pairs."""
    plan = plan_prefix_tree([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], min_prefix_len=1)
    stats = plan.stats(window=2)
    assert (stats["attn_pairs_unshared_window"], stats["attn_pairs_tree_window"]) == (22, 15)
    assert stats["attn_flop_ratio_window"] == 22 / 15 and stats["attn_pairs_tree"] == 32
    shape = DecoderShape(**SHAPE, window=2, window_layers=1)
    per_layer_pair = 128 / 2
    want = (12 * 2816 + per_layer_pair * (42 + 22)) / (8 * 2816 + per_layer_pair * (32 + 15))
    assert shape.ideal_speedup(stats) == pytest.approx(want, rel=1e-15)
    every_layer = DecoderShape(**SHAPE, window=2)
    assert every_layer.ideal_speedup(stats) == pytest.approx((12 * 2816 + 128 * 22) / (8 * 2816 + 128 * 15), rel=1e-15)
    with pytest.raises(ValueError, match=r"plan.stats\(window=2\)"):
        shape.ideal_speedup(plan.stats())
    with pytest.raises(ValueError, match="window_layers=3"):
        DecoderShape(**SHAPE, window=2, window_layers=3).layer_split()


@pytest.mark.parametrize("window", [1, 3, 10])
def test_windowed_pairs_count_the_tree_mask(window):
    """The pairs the FLOP ideal counts are the pairs the windowed tree mask allows (the
    reference backend's mask), and per sample the windowed causal pairs of its length."""
    from forests import random_forest

    from ps_mcore.attention.reference import tree_mask

    rng = np.random.default_rng(window)
    for _ in range(5):
        seqs = random_forest(rng, 10, 40)
        plan = plan_prefix_tree(seqs, min_prefix_len=1)
        stats = plan.stats(window=window)
        assert stats["attn_pairs_tree_window"] == int(tree_mask(plan, window).sum())
        brute = sum(min(p + 1, window) for s in seqs for p in range(len(s)))
        assert stats["attn_pairs_unshared_window"] == brute


# blocks=2, hidden=8, ffn=16, patches of 3 x 1 x 2 x 2 = 12 values, 2 x 2 merge, out 10
VISION = dict(blocks=2, hidden=8, ffn=16, patch_dim=12, merge=2, out_hidden=10)


def test_vision_flops_hand_count():
    """Per patch: embedding 12 x 8 = 96 MACs; per block qkv 8 x 24 + proj 8 x 8 = 256 and the
    MLP 3 x 8 x 16 = 384 (gated) or 2 x 8 x 16 = 256; the merger's 32 x 32 + 32 x 10 = 1344
    MACs per group of 4 patches = 336 per patch."""
    assert VisionShape(**VISION).linear_flops_per_patch() == 2 * (96 + 2 * (256 + 384) + 336)
    plain = VisionShape(**VISION, gated=False)
    assert plain.linear_flops_per_patch() == 2 * (96 + 2 * (256 + 256) + 336)
    # one (query, key) pair in one block: q.k and p.v over all heads = 2 x hidden MACs
    windowed = VisionShape(**VISION, full_blocks=1)
    per_patch = windowed.linear_flops_per_patch()
    assert windowed.step_flops(16, 256, 64) == 3 * (16 * per_patch + 4 * 8 * (256 + 64)) - 16 * 2 * 96
    assert plain.step_flops(16, 256, 64) == 3 * (16 * plain.linear_flops_per_patch() + 4 * 8 * 2 * 256) - 16 * 2 * 96


def test_vlm_ideal_counts_the_images_each_run_encodes():
    plan = plan_prefix_tree([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]], min_prefix_len=1)
    stats, decoder, vision = plan.stats(), DecoderShape(**SHAPE), VisionShape(**VISION)
    one = (16, 256, 0)  # one image of 16 patches; the stock run encodes it for both samples
    two = tuple(2 * x for x in one)
    unshared, tree = decoder.plan_flops(stats)
    want = (unshared + vision.step_flops(*two)) / (tree + vision.step_flops(*one))
    assert vlm_ideal_speedup(decoder, stats, vision, two, one) == pytest.approx(want, rel=1e-15)
    assert vlm_ideal_speedup(decoder, stats, vision, (0, 0, 0), (0, 0, 0)) == decoder.ideal_speedup(stats)


def _vision_tower(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(depth=2, num_heads=2, patch_size=2, temporal_patch_size=1, spatial_merge_size=2, in_channels=3)
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls

        config = transformers.Qwen2VLVisionConfig(embed_dim=8, hidden_size=10, mlp_ratio=2, **common)
        shape = VisionShape(**VISION, gated=False)
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as cls

        # windows of 8 // 2 // 2 = 2 x 2 merged patches (16 patches); block 1 attends to the whole image
        config = transformers.Qwen2_5_VLVisionConfig(hidden_size=8, intermediate_size=16, out_hidden_size=10,
                                                     window_size=8, fullatt_block_indexes=[1], **common)
        shape = VisionShape(**VISION, full_blocks=1)
    config._attn_implementation_internal = "eager"  # every (query, key) pair of each segment
    torch.manual_seed(0)
    return cls(config).float(), shape


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_flops_match_torch_flop_counter(kind):
    """Two images: grids (1, 8, 12) and (1, 6, 4): 96 + 24 patches; full attention 96^2 +
    24^2 pairs; Qwen2.5-VL's windows: 2 x 3 windows of 16 patches in the first image, one of
    16 and one of 8 in the second."""
    from torch.utils.flop_counter import FlopCounterMode

    tower, shape = _vision_tower(kind)
    grid = torch.tensor([[1, 8, 12], [1, 6, 4]])
    pixels = torch.randn(120, 12)
    full, window = 96**2 + 24**2, 6 * 16**2 + 16**2 + 8**2
    with FlopCounterMode(display=False) as forward:
        tower(pixels, grid_thw=grid)
    embed = 2 * 12 * 8 * 120
    assert forward.get_total_flops() == (shape.step_flops(120, full, window) + embed) / 3
    with FlopCounterMode(display=False) as step:
        tower(pixels, grid_thw=grid).pooler_output.sum().backward()
    assert step.get_total_flops() == shape.step_flops(120, full, window)
