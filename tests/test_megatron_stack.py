"""The Megatron stack as users run it (CPU, real megatron-core, gloo world 1, fp32):
checkpoint keys of TE-spec models, strict plain and dist-checkpoint round trips, loud failure
on spec / forward drift, Megatron-Bridge providers' instance specs.

TE needs CUDA: a TE-like core attention (tests/megatron_shims.py) carries TE's checkpoint
behaviour; tests/test_gpu_te.py repeats the round trips with real TE on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from forests import assert_branches  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, assert_tree_matches_stock, build_gpt, enable_cpu_dist_checkpointing, init_cpu_megatron,
    layer_spec_args, randomize_, stock_forward, te_like_layer_spec, tiny_config,
)

from ps_mcore import plan_prefix_tree  # noqa: E402

init_cpu_megatron(1)

from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, to_tree_spec, tree_layer_spec,
    tree_layer_spec_from,
)
from ps_mcore.layer_specs.modules import self_attention as tree_self_attention  # noqa: E402
from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttentionTEState  # noqa: E402

EXTRA = "decoder.layers.{}.self_attention.core_attention._extra_state"


def _attn(spec):
    return spec.submodules.self_attention


def _specs(kind):
    cfg = tiny_config("qwen2")
    make = te_like_layer_spec if kind == "te" else stock_specs.get_gpt_layer_local_spec
    return cfg, make(**layer_spec_args(cfg))


def _pair(kind, seed=3):
    """(config, stock model, tree model): the tree model has fresh (different) weights."""
    cfg, stock_spec = _specs(kind)
    stock = build_gpt(cfg, stock_spec)
    randomize_(stock, seed=seed)
    tree = build_gpt(cfg, to_tree_spec(stock_spec))
    return cfg, stock, tree


def _assert_same_tensors(a: dict, b: dict):
    assert list(a) == list(b)
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name


def _forest():
    """Branches at depths 9 and 12 (asserted), and a prefix of the others."""
    rng = np.random.default_rng(5)
    p, turn = rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 3)
    seqs = [np.concatenate([p, turn, rng.integers(0, VOCAB, n)]) for n in (3, 2)]
    return assert_branches(seqs + [np.concatenate([p, rng.integers(0, VOCAB, 6)]), p[:4]])


def _assert_tree_matches_stock(stock, tree):
    assert_tree_matches_stock(stock, tree, _forest())


# ----------------------------------------------------------------------------- checkpoint keys


def test_te_spec_keys_and_strict_load_both_ways():
    cfg, stock, tree = _pair("te")
    keys = list(stock.state_dict())
    assert EXTRA.format(0) in keys and EXTRA.format(1) in keys  # the stock TE-like model has them
    assert list(tree.state_dict()) == keys
    assert type(tree.decoder.layers[0].self_attention.core_attention) is TreeCoreAttentionTEState
    assert tree.state_dict()[EXTRA.format(0)].dtype == torch.uint8  # TE's empty byte tensor
    assert tree.state_dict()[EXTRA.format(0)].numel() == 0
    tree.load_state_dict(stock.state_dict(), strict=True)
    _assert_tree_matches_stock(stock, tree)
    back = build_gpt(cfg, te_like_layer_spec(**layer_spec_args(cfg)))
    back.load_state_dict(tree.state_dict(), strict=True)
    _assert_same_tensors(back.state_dict(), stock.state_dict())


def test_te_extra_state_with_fp8_metadata_survives_the_tree_model():
    """A checkpoint trained with FP8 attention: the tree model keeps TE's bytes untouched and
    saves them again; a checkpoint without the key loads as into TE (tolerated)."""
    cfg, stock, tree = _pair("te")
    blob = torch.frombuffer(bytearray(b"fp8 metadata of layer 1"), dtype=torch.uint8)
    stock.decoder.layers[1].self_attention.core_attention.fp8_state = blob.clone()
    tree.load_state_dict(stock.state_dict(), strict=True)
    saved = tree.state_dict()
    assert torch.equal(saved[EXTRA.format(1)], blob) and saved[EXTRA.format(0)].numel() == 0
    back = build_gpt(cfg, te_like_layer_spec(**layer_spec_args(cfg)))
    back.load_state_dict(saved, strict=True)
    assert torch.equal(back.decoder.layers[1].self_attention.core_attention.fp8_state, blob)
    without = {k: v for k, v in saved.items() if not k.endswith("core_attention._extra_state")}
    tree.load_state_dict(without, strict=True)
    with pytest.raises(RuntimeError, match="byte-tensor"):
        tree.decoder.layers[0].self_attention.core_attention.set_extra_state({"not": "TE"})


def test_local_spec_keys_stay_the_local_specs():
    cfg, stock, tree = _pair("local")
    assert not any(k.endswith("core_attention._extra_state") for k in stock.state_dict())
    assert list(tree.state_dict()) == list(stock.state_dict())
    assert type(tree.decoder.layers[0].self_attention.core_attention) is TreeCoreAttention
    tree.load_state_dict(stock.state_dict(), strict=True)
    back = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    back.load_state_dict(tree.state_dict(), strict=True)
    _assert_same_tensors(back.state_dict(), stock.state_dict())
    # conversion is idempotent and keeps the key family
    spec = to_tree_spec(to_tree_spec(te_like_layer_spec()))
    assert _attn(spec).submodules.core_attention.module is TreeCoreAttentionTEState


@pytest.mark.parametrize("kind", ["local", "te"])
def test_dist_checkpoint_round_trip_strict(kind, tmp_path):
    """megatron dist-checkpointing: stock -> tree and tree -> stock, strict (raise_all)."""
    from megatron.core import dist_checkpointing

    enable_cpu_dist_checkpointing()
    cfg, stock, tree = _pair(kind)
    assert stock.sharded_state_dict().keys() == tree.sharded_state_dict().keys()
    (tmp_path / "stock").mkdir()
    (tmp_path / "tree").mkdir()
    dist_checkpointing.save(stock.sharded_state_dict(), str(tmp_path / "stock"))
    loaded = dist_checkpointing.load(tree.sharded_state_dict(), str(tmp_path / "stock"), strict="raise_all")
    tree.load_state_dict(loaded, strict=True)
    _assert_tree_matches_stock(stock, tree)
    dist_checkpointing.save(tree.sharded_state_dict(), str(tmp_path / "tree"))
    fresh = build_gpt(cfg, _specs(kind)[1])
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path / "tree"), strict="raise_all")
    fresh.load_state_dict(loaded, strict=True)
    _assert_same_tensors(
        {k: v for k, v in fresh.state_dict().items() if not k.endswith("_extra_state")},
        {k: v for k, v in stock.state_dict().items() if not k.endswith("_extra_state")},
    )


def test_fp8_attention_refused():
    cfg = dataclasses.replace(tiny_config("qwen2"))
    cfg.fp8_dot_product_attention = True
    with pytest.raises(NotImplementedError, match="fp8_dot_product_attention"):
        TreeCoreAttention(cfg, 1)


# ----------------------------------------------------------------------------- drift


def _with_attention(spec, attn):
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def test_to_tree_spec_converts_partial_self_attention():
    """megatron 0.17+ builds some layer parts as ``functools.partial(cls, submodules=...)``: a
    partial self attention (bare, or as a ModuleSpec's module) keeps its bound arguments and
    becomes a partial of TreeSelfAttention with tree core attention."""
    attn = _attn(stock_specs.get_gpt_layer_local_spec())
    local = stock_specs.get_gpt_layer_local_spec()
    bare = functools.partial(SelfAttention, submodules=attn.submodules, **attn.params)
    converted = _attn(to_tree_spec(_with_attention(local, bare)))
    assert converted.func is TreeSelfAttention and converted.keywords.keys() == bare.keywords.keys()
    assert converted.keywords["submodules"].core_attention.module is TreeCoreAttention
    assert converted.keywords["submodules"].linear_qkv is attn.submodules.linear_qkv
    assert bare.keywords["submodules"].core_attention is attn.submodules.core_attention  # untouched
    inner = dataclasses.replace(attn, module=functools.partial(SelfAttention, layer_number=1))
    converted = _attn(to_tree_spec(_with_attention(local, inner)))
    assert converted.module.func is TreeSelfAttention and converted.module.keywords == {"layer_number": 1}
    assert converted.submodules.core_attention.module is TreeCoreAttention


def test_to_tree_spec_raises_on_what_it_cannot_convert():
    local = stock_specs.get_gpt_layer_local_spec()
    custom = type("WrappedSelfAttention", (SelfAttention,), {})
    for bad in (
        functools.partial(custom, submodules=_attn(local).submodules),
        dataclasses.replace(_attn(local), module=functools.partial(custom)),
        functools.partial(SelfAttention),  # no submodules to convert
        SelfAttention,  # a bare class: no core attention spec
        lambda *a, **k: None,
    ):
        with pytest.raises(NotImplementedError, match="cannot convert"):
            to_tree_spec(_with_attention(local, bad))
    # a layer without attention (IdentityOp) stays as it is
    from megatron.core.transformer.identity_op import IdentityOp

    assert _attn(to_tree_spec(_with_attention(local, IdentityOp))) is IdentityOp


def test_tree_self_attention_refuses_a_forward_it_cannot_bind(monkeypatch):
    """A Megatron that wraps Attention.forward as (*args, **kwargs) would skip tree RoPE
    silently: TreeSelfAttention refuses to be built."""
    cfg = tiny_config("qwen2")
    spec = to_tree_spec(stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    build_gpt(cfg, spec)  # today's signature binds

    def wrapped(self, *args, **kwargs):
        pass

    monkeypatch.setattr(tree_self_attention, "_FORWARD_SIGNATURE", inspect.signature(wrapped))
    with pytest.raises(RuntimeError, match="cannot bind"):
        build_gpt(cfg, spec)


def test_sequence_parallel_rows_without_attention_world_size():
    """megatron 0.15 does not store Attention.world_size: the TP size comes from the groups."""
    cfg = tiny_config("qwen2")
    model = build_gpt(cfg, to_tree_spec(stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))))
    attn = model.decoder.layers[0].self_attention
    attn.__dict__.pop("world_size", None)
    if "world_size" in type(attn).__dict__:
        pytest.skip("world_size is a class attribute here")
    assert not hasattr(attn, "world_size") and attn._tp_world_size() == 1


# ----------------------------------------------------------------------------- Megatron-Bridge


def test_tree_layer_spec_honours_the_provider_instance_spec():
    def class_default(provider, vp_stage=None):
        return stock_specs.get_gpt_layer_local_spec()

    @dataclasses.dataclass
    class Provider:
        transformer_layer_spec: object = class_default
        attention_backend: object = None
        apply_rope_fusion: bool = False

    custom = stock_specs.get_gpt_layer_local_spec(qk_layernorm=True)
    provider = Provider(transformer_layer_spec=custom)
    spec = tree_layer_spec(provider)
    assert _attn(spec).module is TreeSelfAttention
    assert _attn(spec).submodules.q_layernorm is _attn(custom).submodules.q_layernorm
    # installed in place of the instance spec, it can only fall back to the class default ...
    provider.transformer_layer_spec = tree_layer_spec
    assert _attn(provider.transformer_layer_spec(provider)).submodules.q_layernorm is not (
        _attn(custom).submodules.q_layernorm)
    # ... tree_layer_spec_from keeps it (and wrapping twice converts once)
    provider.transformer_layer_spec = tree_layer_spec_from(tree_layer_spec_from(custom))
    spec = provider.transformer_layer_spec(provider, vp_stage=0)
    assert _attn(spec).submodules.q_layernorm is _attn(custom).submodules.q_layernorm
    assert _attn(spec).module is TreeSelfAttention
    assert tree_layer_spec_from(tree_layer_spec) is tree_layer_spec


def test_te_like_spec_tree_model_is_a_te_state_model_for_every_layer():
    cfg, spec = _specs("te")
    assert isinstance(spec, ModuleSpec)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block = to_tree_spec(TransformerBlockSubmodules(layer_specs=[spec] * 3))
    assert len({id(s) for s in block.layer_specs}) == 1
    assert _attn(block.layer_specs[0]).submodules.core_attention.module is TreeCoreAttentionTEState


# ----------------------------------------------------------------------------- fused RoPE


def _te_thd_rope(t, cu_seqlens, freqs, cp_size=1, cp_rank=0):
    """TE's fused THD RoPE contract (test-only stand-in: the kernel needs CUDA): row j of
    each sequence in ``cu_seqlens`` is rotated by ``freqs[j]`` (rotate-half, first
    ``freqs.size(-1)`` channels). No CP here."""
    assert cp_size == 1
    d = freqs.size(-1)
    out = t.clone()
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        f = freqs[: end - start, 0].float()  # [n, 1, d]
        x = t[start:end, :, :d].float()
        x1, x2 = x.chunk(2, -1)
        out[start:end, :, :d] = (x * f.cos() + torch.cat([-x2, x1], -1) * f.sin()).to(t.dtype)
    return out


def test_fused_rope_stays_on_for_tree_batches(monkeypatch):
    """apply_rope_fusion=True: the tree batch goes through Megatron's fused THD path (here
    TE's kernel contract in torch) with the per-token table and equals the unshared unfused
    stock model; nothing forces fusion off."""
    from megatron.core.models.common.embeddings import rope_utils

    calls = []

    def fused_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
        assert not interleaved  # megatron 0.19 passes config.rotary_interleaved
        calls.append(int(cu_seqlens[-1]))
        return _te_thd_rope(t, cu_seqlens, freqs, cp_size, cp_rank)

    def fused_sbhd(*args, **kwargs):
        raise AssertionError("tree batches are THD")

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", fused_thd)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_sbhd)
    cfg = tiny_config("qwen3")
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    randomize_(stock, seed=8)
    fused_cfg = tiny_config("qwen3", apply_rope_fusion=True)
    tree = build_gpt(fused_cfg, to_tree_spec(stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))))
    tree.load_state_dict(stock.state_dict(), strict=True)
    assert tree.config.apply_rope_fusion
    for pad in (1, 8):
        calls.clear()
        seqs = _forest()
        plan = plan_prefix_tree(seqs, min_prefix_len=1)
        psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad)
        with torch.no_grad():
            got = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                       attention_mask=None, packed_seq_params=psp)[0][: plan.num_tokens]
            ref = torch.cat([stock_forward(stock, s) for s in seqs])
        torch.testing.assert_close(plan.unpack(got), ref, rtol=1e-5, atol=1e-5)
        assert calls == [psp.num_rows] * (2 * cfg.num_layers)  # q and k of every layer, fused
