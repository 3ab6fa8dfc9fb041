"""Transformer-engine specs on a GPU (skipped without CUDA or transformer-engine).

Real TE modules, bf16, NCCL world 1: ``to_tree_spec`` of TE layer / decoder-block specs,
``get_gpt_layer_with_tree_attention_spec``, log-prob and gradient parity of the tree model vs.
the stock TE model on the unshared THD batch (row by row, against an fp32 reference), strict
checkpoint round trips (plain state_dict and megatron dist-checkpointing), fused RoPE on tree
batches.

    python -m pytest -q tests/test_gpu_te.py        # on the GPU machine, TE installed
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("te_gpu_world")]
pytest.importorskip("megatron.core")

import torch.nn.functional as F  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from conftest import assert_rows_close  # noqa: E402
from forests import assert_branches  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.layer_specs import (  # noqa: E402
    TreePackedSeqParams, TreeSelfAttention, get_gpt_decoder_block_tree_spec,
    get_gpt_layer_with_tree_attention_spec, to_tree_spec,
)
from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttentionTEState  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

VOCAB = 512
EXTRA = "decoder.layers.0.self_attention.core_attention._extra_state"


def _config(fusion: bool = True, **kw) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, kv_channels=64,
        ffn_hidden_size=512, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0,
        hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, apply_rope_fusion=fusion,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**{**base, **kw})


def _gpt(config, spec):
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=4096,
                    position_embedding_type="rope", rotary_base=1_000_000,
                    share_embeddings_and_output_weights=False).cuda()


def _forest():
    """A 300-token prompt whose continuations branch at two nested depths (asserted), a prefix
    of it and an unrelated sequence."""
    rng = np.random.default_rng(0)
    prompt, turn = rng.integers(0, VOCAB, 300), rng.integers(0, VOCAB, 60)
    seqs = [np.concatenate([prompt, turn, rng.integers(0, VOCAB, n)]) for n in (120, 77)]
    seqs += [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (1, 200)]
    return assert_branches(seqs + [prompt[:50], rng.integers(0, VOCAB, 33)])


def _stock_thd_logprobs(model, seqs):
    flat = plan_unshared(seqs).to("cuda")
    lengths = [len(s) for s in seqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    logits = model(input_ids=flat.input_ids[None], position_ids=pos[None], attention_mask=None,
                   packed_seq_params=psp)[0]
    return token_logprobs(logits, flat)[0]


def _tree_logprobs(model, seqs):
    plan = plan_prefix_tree(seqs).to("cuda")
    psp = TreePackedSeqParams.from_plan(plan)
    logits = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
    return token_logprobs(logits, plan)[0]


def _pair(fusion=True):
    cfg = _config(fusion)
    spec = stock_specs.get_gpt_layer_with_transformer_engine_spec()
    stock = _gpt(cfg, spec)
    tree = _gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return cfg, spec, stock, tree


def test_te_spec_conversion():
    spec = stock_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    tree = get_gpt_layer_with_tree_attention_spec(qk_layernorm=True)
    for s in (tree, to_tree_spec(spec)):
        attn = s.submodules.self_attention
        assert attn.module is TreeSelfAttention
        assert attn.submodules.core_attention.module is TreeCoreAttentionTEState
        assert attn.submodules.linear_qkv is spec.submodules.self_attention.submodules.linear_qkv
    block = get_gpt_decoder_block_tree_spec(_config(num_layers=3), True)
    assert [s.submodules.self_attention.submodules.core_attention.module for s in block.layer_specs] == (
        [TreeCoreAttentionTEState] * 3)


def _fp32_reference(tree):
    """The tree-spec model in fp32 with the exact ``chunked`` kernel (TE's THD attention needs
    16-bit inputs), the tree's weights: run on the unshared THD batch, it is the reference."""
    cfg = _config(False, bf16=False, params_dtype=torch.float32)
    cfg.tree_attention_backend = "chunked"
    ref = _gpt(cfg, to_tree_spec(stock_specs.get_gpt_layer_with_transformer_engine_spec()))
    ref.load_state_dict(tree.state_dict(), strict=True)  # copies cast to fp32
    return ref


def _weighted_backward(model, logprobs, seqs):
    """``(log-probs, {name: gradient})`` of ``logprobs(model, seqs)`` under a per-sample weighted
    loss (sample i weighs 0.5 + i), from zeroed gradients; both in fp32."""
    model.zero_grad(set_to_none=True)
    lp = logprobs(model, seqs)
    weights = torch.cat([torch.full((len(s),), 0.5 + i, device=lp.device) for i, s in enumerate(seqs)])
    (lp.float() * weights).sum().backward()
    return lp.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fusion", [True, False])
def test_tree_matches_stock_te_on_the_unshared_batch(fusion):
    """bf16 log-probs and gradients of a per-sample weighted loss: tree model on the forest
    vs. the stock TE model (TE fused attention, fused or unfused RoPE) on the unshared THD
    batch, same weights: each token's log-prob within 0.15 of the stock model's, and each row
    of every gradient within twice the stock model's own error on that row against an fp32
    reference plus 5% of the tensor's largest value (bf16 rounding of two different attention
    kernels). A wrong position or mask gives O(1) differences."""
    _, _, stock, tree = _pair(fusion)
    seqs = _forest()
    fp32 = _fp32_reference(tree)
    runs = {name: _weighted_backward(model, logprobs, seqs)
            for name, model, logprobs in (("stock", stock, _stock_thd_logprobs), ("tree", tree, _tree_logprobs),
                                          ("fp32", fp32, _stock_thd_logprobs))}
    (ref, g_stock), (got, g_tree), (_, g32) = runs["stock"], runs["tree"], runs["fp32"]
    diff = (got - ref).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.02, (float(diff.max()), float(diff.mean()))
    assert g_tree.keys() == g_stock.keys() == g32.keys()
    for name, g in g32.items():
        assert_rows_close(g_tree[name], g, 5e-2, f"d {name}", baseline=g_stock[name])


def test_strict_checkpoint_round_trip_plain_and_dist(tmp_path):
    from megatron.core import dist_checkpointing

    cfg, spec, stock, tree = _pair()
    assert EXTRA in stock.state_dict() and list(tree.state_dict()) == list(stock.state_dict())
    back = _gpt(cfg, spec)
    back.load_state_dict(tree.state_dict(), strict=True)
    (tmp_path / "stock").mkdir()
    (tmp_path / "tree").mkdir()
    dist_checkpointing.save(stock.sharded_state_dict(), str(tmp_path / "stock"))
    fresh_tree = _gpt(cfg, to_tree_spec(spec))
    loaded = dist_checkpointing.load(fresh_tree.sharded_state_dict(), str(tmp_path / "stock"), strict="raise_all")
    fresh_tree.load_state_dict(loaded, strict=True)
    dist_checkpointing.save(fresh_tree.sharded_state_dict(), str(tmp_path / "tree"))
    fresh_stock = _gpt(cfg, spec)
    loaded = dist_checkpointing.load(fresh_stock.sharded_state_dict(), str(tmp_path / "tree"), strict="raise_all")
    fresh_stock.load_state_dict(loaded, strict=True)
    for (name, a), (_, b) in zip(fresh_stock.named_parameters(), stock.named_parameters()):
        assert torch.equal(a, b), name


def test_fused_rope_equals_unfused_on_tree_batches():
    _, _, _, fused = _pair(fusion=True)
    _, _, _, unfused = _pair(fusion=False)
    unfused.load_state_dict(fused.state_dict(), strict=True)
    seqs = _forest()
    with torch.no_grad():
        a, b = _tree_logprobs(fused, seqs), _tree_logprobs(unfused, seqs)
    assert float((a.float() - b.float()).abs().max()) < 0.05


@pytest.mark.parametrize("fusion", [True, False])
def test_batches_that_are_not_trees_run_te_attention_bit_for_bit(fusion):
    """An ordinary THD batch (what verl's stock forward hands a tree model when a micro-batch
    shares nothing) runs TE's own core attention, built as the stock spec builds it: log-probs
    equal the stock TE model's bit for bit, gradients within the stock model's own run-to-run
    difference (:func:`_assert_grads_within_run_to_run`)."""
    _, _, stock, tree = _pair(fusion)
    assert all(type(layer.self_attention.core_attention.stock_core_attention).__name__ == "TEDotProductAttention"
               for layer in tree.decoder.layers)
    seqs = _forest()
    runs = [_weighted_backward(model, _stock_thd_logprobs, seqs) for model in (tree, stock, stock, stock)]
    (lp_tree, g_tree), (lp_stock, g_stock), *again = runs
    assert torch.equal(lp_tree, lp_stock)
    _assert_grads_within_run_to_run(g_tree, g_stock, [g for _, g in again])


def _assert_grads_within_run_to_run(got: dict, ref: dict, repeats: list[dict]) -> None:
    """Every gradient in ``got`` differs from ``ref`` by no more than ``ref``'s own runs differ
    (``repeats``), or one bf16 step at the parameter's largest gradient. The attention backward
    accumulates dq with atomics, so repeated runs differ in a few elements by a bf16 step (seen
    on an H100: linear_qkv in most runs, the embedding in some); a wrong computation differs by
    the size of the gradient itself."""
    assert got.keys() == ref.keys()
    step = torch.finfo(torch.bfloat16).eps
    for name, g in ref.items():
        own = max(float((r[name] - g).abs().max()) for r in repeats)
        bound = max(own, step * float(g.abs().max()))
        assert float((got[name] - g).abs().max()) <= bound, (name, own, bound)


def test_packed_rope_is_megatrons_unfused_rope_bit_for_bit_in_bf16(monkeypatch):
    """Unfused RoPE on a tree batch runs through TreeSelfAttention's packed RoPE (cos/sin once
    per micro-batch): on the TE spec in bf16, log-probs equal those of Megatron's own unfused
    THD RoPE on the same table bit for bit, and every gradient differs from Megatron's path by
    no more than that path differs from itself over repeated runs
    (:func:`_assert_grads_within_run_to_run`). The CPU test holds the arithmetic to
    rtol=atol=0."""
    from ps_mcore.layer_specs.modules import self_attention

    _, _, _, tree = _pair(fusion=False)
    seqs = _forest()
    applied, apply = [], self_attention.PackedRope.apply
    monkeypatch.setattr(self_attention.PackedRope, "apply", lambda rope, q, k: applied.append(1) or apply(rope, q, k))
    runs = []
    for packed in (True, False, False, False):
        monkeypatch.setattr(self_attention, "_unfused_rope_is_megatrons", lambda: packed)
        runs.append(_weighted_backward(tree, _tree_logprobs, seqs))
        assert len(applied) == tree.config.num_layers  # once per layer, in the packed run only
    (lp_packed, g_packed), (lp_megatron, g_megatron), *again = runs
    torch.testing.assert_close(lp_packed, lp_megatron, rtol=0, atol=0)
    _assert_grads_within_run_to_run(g_packed, g_megatron, [g for _, g in again])


# ----------------------------------------------------------------------------- windows and sinks


VARIANTS = dict(window_size=(63, 0), window_attn_skip_freq=2, softmax_type="learnable")


def test_windows_and_sinks_match_stock_te():
    """megatron's sliding window (64, every other layer) and learnable sinks: the tree model
    (TreeCoreAttentionTEState, TE's float32 sink parameter loaded strictly) on the forest vs the
    stock TE model (TE's own window and learnable softmax) on the unshared THD batch, bf16.
    Each one's log-prob error against an fp32 reference (the tree-spec model in fp32 with the
    exact ``chunked`` kernel on the unshared THD batch) is compared: the tree's is no larger
    than stock's (x1.5 + bf16 noise). Skipped when this TE/cuDNN has no THD backend for
    learnable sinks (the test says why)."""
    cfg = _config(**VARIANTS)
    spec = stock_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=True)
    stock = _gpt(cfg, spec)
    with torch.no_grad():
        for layer in stock.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.copy_(torch.linspace(-2, 2, 8))
    tree = _gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    assert [l.self_attention.core_attention.window for l in tree.decoder.layers] == [64, None]
    seqs = _forest()
    weights = torch.cat([torch.full((len(s),), 0.5 + i, device="cuda") for i, s in enumerate(seqs)])
    try:
        ref = _stock_thd_logprobs(stock, seqs)
        (ref * weights).sum().backward()
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"stock TE cannot run windows + learnable sinks on THD here: {error}")
    got = _tree_logprobs(tree, seqs)
    (got * weights).sum().backward()
    cfg32 = _config(**VARIANTS, bf16=False, params_dtype=torch.float32)
    cfg32.tree_attention_backend = "chunked"
    exact = _gpt(cfg32, to_tree_spec(spec))
    exact.load_state_dict(tree.state_dict(), strict=True)
    with torch.no_grad():
        lp32 = _stock_thd_logprobs(exact, seqs).float()
    err_stock = float((ref.float() - lp32).abs().max())
    err_tree = float((got.float() - lp32).abs().max())
    assert err_tree <= 1.5 * err_stock + 0.02, (err_tree, err_stock)
    for (name, a), (_, b) in zip(tree.named_parameters(), stock.named_parameters()):
        rel = float((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm().clamp_min(1e-6))
        assert rel < 0.05, (name, rel)
