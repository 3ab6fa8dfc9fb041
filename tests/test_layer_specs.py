"""Tree layer specs on a real megatron-core GPTModel (CPU, gloo world 1, fp32).

Oracle: the stock local-spec model with the same weights, run on every sequence separately.
"""

from __future__ import annotations

import dataclasses
from functools import partial
import types

import numpy as np
import pytest
import torch
from torch.distributed.utils import _apply_to_tensors

pytest.importorskip("megatron.core")

from conftest import assert_grads_close, grads_of  # noqa: E402
from forests import branching_forest  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, build_gpt, causal_mask, init_cpu_megatron, layer_spec_args, randomize_,
    reference_logprobs, stock_forward, tiny_config, with_core_attention,
)

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

init_cpu_megatron(1)

from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import get_module  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, get_gpt_decoder_block_tree_spec,
    get_gpt_layer_local_tree_spec, get_gpt_layer_with_tree_attention_spec, megatron_dropout_refusal,
    to_tree_spec, tree_layer_spec, tree_layer_spec_from,
)

TOL = dict(rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- forests


def _random_forest(seed: int) -> list[list[int]]:
    """A tree rollout branching at two nested depths (asserted), with samples ending at branch
    points and a duplicate; one or two roots."""
    rng = np.random.default_rng(seed)
    return branching_forest(rng, roots=1 + seed % 2, depth=3, fanout=2, node_len=(1, 6), vocab=VOCAB)


def _nasty() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(123)
    a = rng.integers(0, VOCAB, 13)
    chain = rng.integers(0, VOCAB, 24)
    return {
        "single": [a],
        "duplicates": [a, a.copy(), a.copy()],
        "prefix_of_another": [a[:5], a, np.concatenate([a, rng.integers(0, VOCAB, 4)])],
        "single_tokens": [a[:1], a[:1].copy(), rng.integers(0, VOCAB, 1), a[:2]],
        "deep_chain": [chain[: 4 * (k + 1)] for k in range(6)],
        "no_sharing": [rng.integers(0, VOCAB, n) for n in (5, 9, 3)],
    }


FORESTS = {**_nasty(), **{f"random{s}": _random_forest(s) for s in range(4)}}


def _plan(seqs, **kw):
    return plan_prefix_tree(seqs, **{"min_prefix_len": 1, **kw})


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def models(request):
    """(config, stock local-spec model, tree-spec model) with identical random weights."""
    cfg = tiny_config(request.param)
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    randomize_(stock, seed=7)
    tree = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return cfg, stock, tree


def _tree_logits(model, plan, pad_to_multiple_of=1, **psp_kw):
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of, **psp_kw)
    logits = model(
        input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
        attention_mask=None, packed_seq_params=psp,
    )
    return logits[0]


def _stock_logits(model, seqs):
    return [stock_forward(model, s) for s in seqs]


def _weights(seqs, seed):
    """A different weight per sequence, so shared tokens must sum their samples' gradients."""
    w = torch.from_numpy(np.random.default_rng(seed).uniform(0.2, 2.0, len(seqs))).float()
    return w, torch.cat([w[i].repeat(len(s)) for i, s in enumerate(seqs)])


# ----------------------------------------------------------------------------- exactness


def test_state_dict_keys_identical_and_load_both_ways(models):
    cfg, stock, tree = models
    assert list(stock.state_dict()) == list(tree.state_dict())
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in tree.named_parameters()]
    fresh = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    fresh.load_state_dict(tree.state_dict(), strict=True)
    for (n, a), b in zip(stock.state_dict().items(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
    attn = tree.decoder.layers[0].self_attention
    assert type(attn) is TreeSelfAttention and type(attn.core_attention) is TreeCoreAttention


@pytest.mark.parametrize("forest", list(FORESTS))
def test_tree_forward_backward_matches_unshared(models, forest):
    """Logits at every original token, token log-probs and all parameter gradients of a
    per-sample-weighted token loss equal the stock model's per-sequence runs."""
    cfg, stock, tree = models
    seqs = FORESTS[forest]
    plan = _plan(seqs)
    if forest not in ("no_sharing", "single"):
        assert plan.num_tokens < plan.num_input_tokens  # the forest really shares
    _, w_tok = _weights(seqs, seed=len(forest))
    probe = torch.randn(plan.num_input_tokens, VOCAB, generator=torch.Generator().manual_seed(3))

    ref_logits = _stock_logits(stock, seqs)
    ref_lp = reference_logprobs(ref_logits, seqs)
    ((w_tok * ref_lp).sum() + 1e-2 * (torch.cat(ref_logits) * probe).sum()).backward()
    ref_grads = grads_of(stock)

    logits = _tree_logits(tree, plan)
    assert logits.shape == (plan.num_tokens, VOCAB)
    torch.testing.assert_close(plan.unpack(logits), torch.cat(ref_logits), **TOL)
    lp, ent = token_logprobs(logits, plan, compute_entropy=True)
    torch.testing.assert_close(lp, ref_lp, **TOL)
    ref_ent = torch.cat([torch.distributions.Categorical(logits=x).entropy() for x in ref_logits])
    torch.testing.assert_close(ent, ref_ent, **TOL)
    ((w_tok * lp).sum() + 1e-2 * (plan.unpack(logits) * probe).sum()).backward()
    assert_grads_close(grads_of(tree), ref_grads)


@pytest.mark.parametrize("forest", ["random0", "prefix_of_another", "deep_chain"])
def test_float64_model_at_float64_precision(forest):
    """A float64 GPTModel (softmax in fp64 too): logits, log-probs and every gradient of a
    per-sample-weighted loss equal the stock per-sequence runs to float64 precision; the tree
    kernels compute fp64 inputs in fp64."""
    cfg = tiny_config("qwen2", params_dtype=torch.float64, attention_softmax_in_fp32=False)
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))).double()
    randomize_(stock, seed=9)
    tree = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))).double()
    tree.load_state_dict(stock.state_dict(), strict=True)
    seqs = FORESTS[forest]
    plan = _plan(seqs)
    w_tok = _weights(seqs, seed=4)[1].double()
    ref_logits = _stock_logits(stock, seqs)
    ref_lp = reference_logprobs(ref_logits, seqs)
    (w_tok * ref_lp).sum().backward()
    logits = _tree_logits(tree, plan)
    lp, _ = token_logprobs(logits, plan)
    (w_tok * lp).sum().backward()
    assert logits.dtype == lp.dtype == torch.float64
    fp64 = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(plan.unpack(logits), torch.cat(ref_logits), **fp64)
    torch.testing.assert_close(lp, ref_lp, **fp64)
    ref_grads, grads = grads_of(stock), grads_of(tree)
    for name, r in ref_grads.items():
        torch.testing.assert_close(grads[name], r, rtol=1e-10, atol=1e-10 * float(r.abs().max()), msg=name)


def test_dissolved_short_prefixes_match(models):
    """With the default min_prefix_len short shared runs are duplicated, long ones shared."""
    _, stock, tree = models
    seqs = FORESTS["random1"] + FORESTS["prefix_of_another"]
    plan = plan_prefix_tree(seqs, min_prefix_len=8)
    with torch.no_grad():
        torch.testing.assert_close(
            plan.unpack(_tree_logits(tree, plan)), torch.cat(_stock_logits(stock, seqs)), **TOL
        )


def test_padding_rows_do_not_affect_real_rows(models):
    """pad_to_multiple_of (TP multiples): real rows and gradients equal the unpadded run."""
    _, _, tree = models
    plan = _plan(FORESTS["random2"])
    out = {}
    for pad in (1, 8):
        logits = _tree_logits(tree, plan, pad)
        assert logits.size(0) == -(-plan.num_tokens // pad) * pad
        lp, _ = token_logprobs(logits, plan)
        lp.sum().backward()
        out[pad] = (logits[: plan.num_tokens].detach(), grads_of(tree))
    assert plan.num_tokens % 8 != 0  # really padded
    torch.testing.assert_close(out[8][0], out[1][0], **TOL)
    assert_grads_close(out[8][1], out[1][1])


def test_packed_params_through_fsdp_input_cast(models):
    """FSDP's mixed-precision input cast rebuilds dataclass kwargs field by field: the packed
    params of a plan linked to its moved copy (as a GPU run's plan is) are rebuilt without
    walking into the link, keep the plan's memo and run as the originals do."""
    _, _, tree = models
    plan = _plan(FORESTS["random2"])
    plan.to("meta")  # plan.memo.moved -> the moved copy, whose memo.host -> plan
    reference = _tree_logits(tree, plan, 8).detach()
    psp = TreePackedSeqParams.from_plan(plan, 8)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, {"psp": psp})["psp"]
    assert isinstance(cast, TreePackedSeqParams) and cast is not psp and cast.plan.memo is plan.memo
    logits = tree(input_ids=cast.pad_rows(plan.input_ids)[None], position_ids=cast.position_ids[None],
                  attention_mask=None, packed_seq_params=cast)[0]
    torch.testing.assert_close(logits.detach(), reference, rtol=0, atol=0)


def test_unfused_rope_reads_host_bounds(models, monkeypatch):
    """Where Megatron's unfused THD RoPE runs on a tree batch (here: replaced by a wrapper, as a
    framework may replace it, so tree RoPE leaves it to Megatron), it reads its bounds with
    .tolist()/.item() (a device sync each on a GPU): it gets the same bounds on the host, and
    nothing else changes."""
    from megatron.core.models.common.embeddings import rope_utils

    _, _, tree = models
    assert not tree.config.apply_rope_fusion
    plan = _plan(FORESTS["random2"])
    reference = _tree_logits(tree, plan, 8).detach()
    seen = []
    thd = rope_utils._apply_rotary_pos_emb_thd

    def spy(t, cu_seqlens, *args, **kwargs):
        seen.append(cu_seqlens)
        return thd(t, cu_seqlens, *args, **kwargs)

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", spy)
    psp = TreePackedSeqParams.from_plan(plan, 8)
    logits = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                  attention_mask=None, packed_seq_params=psp)[0]
    host = psp.for_unfused_rope(logits.device)
    assert host is psp.for_unfused_rope(logits.device) and host.plan is psp.plan  # once per micro-batch
    assert psp.for_unfused_rope(types.SimpleNamespace(type="npu")) is psp  # MindSpeed's RoPE there
    assert psp.cu_seqlens_q_padded is None  # the caller's parameters are untouched
    assert len(seen) == 2 * tree.config.num_layers  # q and k in every layer
    for cu in seen:
        assert cu is host.cu_seqlens_q_padded and cu.device.type == "cpu"
        assert torch.equal(cu, psp.cu_seqlens_q.cpu())
    torch.testing.assert_close(logits.detach(), reference, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved,rotary_percent", [(False, 1.0), (True, 1.0), (False, 0.5)])
def test_packed_rope_is_megatrons_unfused_rope_bit_for_bit(monkeypatch, interleaved, rotary_percent):
    """Tree RoPE applied after the QKV projection with cos/sin computed once per micro-batch
    (the path an unfused-RoPE tree batch takes) gives exactly the logits and gradients of
    Megatron's own unfused THD RoPE on the same table, and matches the stock per-sequence runs;
    interleaved rotation and a partial rotary dim included."""
    from ps_mcore.layer_specs.modules import self_attention

    cfg = tiny_config("qwen2", rotary_interleaved=interleaved)
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)), rotary_percent=rotary_percent)
    randomize_(stock, seed=5)
    tree = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)), rotary_percent=rotary_percent)
    tree.load_state_dict(stock.state_dict(), strict=True)
    seqs = FORESTS["random3"]
    plan = _plan(seqs)
    w_tok = _weights(seqs, seed=6)[1]

    def run(packed: bool):
        monkeypatch.setattr(self_attention, "_unfused_rope_is_megatrons", lambda: packed)
        tree.zero_grad(set_to_none=True)
        psp = TreePackedSeqParams.from_plan(plan, 8)
        logits = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                      attention_mask=None, packed_seq_params=psp)[0]
        lp, _ = token_logprobs(logits, plan)
        (w_tok * lp).sum().backward()
        d_rot = int(cfg.kv_channels * rotary_percent)
        assert [(c.shape[-1], dtype) for _, dtype, _, c, _ in psp.rotary_cos_sin] == ([(d_rot, torch.float32)] if packed else [])
        return logits.detach(), grads_of(tree)

    packed_logits, packed_grads = run(True)
    megatron_logits, megatron_grads = run(False)
    torch.testing.assert_close(packed_logits, megatron_logits, rtol=0, atol=0)
    for name, g in megatron_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=0, atol=0, msg=name)
    ref_logits = _stock_logits(stock, seqs)
    torch.testing.assert_close(plan.unpack(packed_logits[: plan.num_tokens]), torch.cat(ref_logits), **TOL)


def test_tree_rope_not_applied_is_an_error(models, monkeypatch):
    """A megatron-core whose attention forward no longer goes through get_query_key_value_tensors
    would skip the tree RoPE prepared for it: an error, not a silently unrotated run."""
    from megatron.core.transformer.attention import Attention

    _, _, tree = models
    plan = _plan(FORESTS["random2"])
    monkeypatch.setattr(Attention, "forward", lambda self, hidden_states, *a, **k: (hidden_states, None))
    with pytest.raises(RuntimeError, match="never called get_query_key_value_tensors"):
        _tree_logits(tree, plan)


def test_softmax_scale_and_layer_scaling_as_megatron():
    """config.softmax_scale and apply_query_key_layer_scaling (which cancels out in the
    softmax) give the stock attention's numbers; 0.13-style constructor kwargs are accepted."""
    cfg = tiny_config("qwen2", softmax_scale=0.4, apply_query_key_layer_scaling=True)
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    randomize_(stock, seed=5)
    tree = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    tree.load_state_dict(stock.state_dict())
    seqs = FORESTS["random1"]
    plan = _plan(seqs)
    with torch.no_grad():
        ref = torch.cat(_stock_logits(stock, seqs))
        torch.testing.assert_close(plan.unpack(_tree_logits(tree, plan)), ref, **TOL)
        default = build_gpt(tiny_config("qwen2"), get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
        default.load_state_dict(stock.state_dict())
        assert (plan.unpack(_tree_logits(default, plan)) - ref).abs().max() > 1e-2  # scale matters
    core = TreeCoreAttention(config=cfg, layer_number=2, attn_mask_type=stock_specs.AttnMaskType.causal,
                             attention_type="self", cp_comm_type=None, softmax_scale=None,
                             model_comm_pgs=object())
    assert core.backend == "auto" and core.softmax_scale is None
    picked = dataclasses.replace(cfg)
    picked.tree_attention_backend = "reference"  # the config attribute picks the backend
    assert TreeCoreAttention(picked, 1).backend == "reference"
    assert TreeCoreAttention(picked, 1, backend="chunked").backend == "chunked"


# ----------------------------------------------------------------------------- unshared batches


def test_tree_model_on_sbhd_batches_matches_stock(models):
    _, stock, tree = models
    seqs = FORESTS["random0"]
    with torch.no_grad():
        for s in seqs:
            ids = torch.as_tensor(s, dtype=torch.long)[None]
            pos = torch.arange(len(s))[None]
            ref = stock_forward(stock, s)
            torch.testing.assert_close(tree(ids, pos, None)[0], ref, **TOL)  # causal, no mask
            torch.testing.assert_close(tree(ids, pos, causal_mask(len(s)))[0], ref, **TOL)
        # a batch of two equal-length sequences (b = 2)
        a, b = seqs[0], np.roll(seqs[0], 1)
        ids = torch.as_tensor(np.stack([a, b]), dtype=torch.long)
        got = tree(ids, torch.arange(len(a))[None].expand(2, -1), None)
        torch.testing.assert_close(got[1], stock_forward(stock, b), **TOL)
        # a right-padded batch with verl's [b, s] key-padding mask (True = token)
        short = seqs[1][: len(a) // 2]
        ids = torch.as_tensor(np.stack([a, np.pad(short, (0, len(a) - len(short)))]), dtype=torch.long)
        keep = torch.arange(len(a))[None] < torch.tensor([[len(a)], [len(short)]])
        got = tree(ids, torch.arange(len(a))[None].expand(2, -1), keep)
        torch.testing.assert_close(got[0], stock_forward(stock, a), **TOL)
        torch.testing.assert_close(got[1, : len(short)], stock_forward(stock, short), **TOL)


@pytest.mark.parametrize("pad_each", [1, 4])
def test_tree_model_on_standard_thd_batches_matches_stock(models, pad_each):
    """Ordinary PackedSeqParams (verl's THD layout; pad_each > 1: every sequence padded to a
    multiple, as verl does for TP) through the same model: per-sequence causal attention."""
    _, stock, tree = models
    seqs = FORESTS["no_sharing"] + FORESTS["duplicates"]
    lens = [len(s) for s in seqs]
    padded = [-(-n // pad_each) * pad_each for n in lens]
    ids = torch.cat([
        torch.cat([torch.as_tensor(s, dtype=torch.long), torch.zeros(p - n, dtype=torch.long)])
        for s, n, p in zip(seqs, lens, padded)
    ])
    pos = torch.cat([torch.arange(p) for p in padded])
    cu = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32)
    cu_real = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_real if pad_each > 1 else cu,
        cu_seqlens_kv=cu_real if pad_each > 1 else cu, max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        cu_seqlens_q_padded=cu if pad_each > 1 else None,
        cu_seqlens_kv_padded=cu if pad_each > 1 else None,
    )
    with torch.no_grad():
        logits = tree(ids[None], pos[None], None, packed_seq_params=psp)[0]
        starts = cu[:-1].tolist()
        got = torch.cat([logits[s : s + n] for s, n in zip(starts, lens)])
        torch.testing.assert_close(got, torch.cat(_stock_logits(stock, seqs)), **TOL)


def _te_like_pair(**overrides):
    """(stock, tree) models whose stock core attention is the CPU stand-in of TE's (THD and sbhd,
    TE's checkpoint keys): the tree model keeps it for the batches that are not trees."""
    from te_cpu_shims import TEDotProductAttentionCPU

    cfg = tiny_config("qwen3", **overrides)
    spec = with_core_attention(stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)), TEDotProductAttentionCPU)
    stock = build_gpt(cfg, spec)
    randomize_(stock, seed=8)
    tree = build_gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock, tree


def test_batches_that_are_not_trees_run_the_stock_core_attention(monkeypatch):
    """An ordinary THD batch and an sbhd batch run the replaced core attention, built as
    megatron-core builds it: logits and every gradient equal the stock model's bit for bit. It
    adds no parameter or checkpoint key and follows train / eval and dtype moves; a tree batch
    never reaches it. Megatron's local core attention (no THD) and learnable sinks (the
    parameter is ours) keep ps-mcore's kernels."""
    from te_cpu_shims import TEDotProductAttentionCPU

    stock, tree = _te_like_pair()
    cores = [layer.self_attention.core_attention for layer in tree.decoder.layers]
    assert all(type(c.stock_core_attention) is TEDotProductAttentionCPU for c in cores)
    assert list(tree.state_dict()) == list(stock.state_dict())
    assert sum(p.numel() for p in tree.parameters()) == sum(p.numel() for p in stock.parameters())
    seqs = FORESTS["no_sharing"] + FORESTS["duplicates"]
    lens = [len(s) for s in seqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))
    ids = torch.as_tensor(np.concatenate(seqs), dtype=torch.long)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    n = min(lens)
    rows = torch.as_tensor(np.stack([s[:n] for s in seqs]), dtype=torch.long)
    batches = [dict(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp),
               dict(input_ids=rows, position_ids=torch.arange(n)[None].expand(len(seqs), n),
                    attention_mask=causal_mask(n))]
    for batch in batches:
        out = {}
        for name, model in (("stock", stock), ("tree", tree)):
            model.zero_grad(set_to_none=True)
            logits = model(**batch)
            (logits * torch.linspace(-1, 1, logits.size(-1))).sum().backward()
            out[name] = logits.detach(), grads_of(model)
        (logits, grads), (ref, ref_grads) = out["tree"], out["stock"]
        assert torch.equal(logits, ref) and grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    calls = []
    monkeypatch.setattr(TEDotProductAttentionCPU, "forward", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        _tree_logits(tree, _plan(FORESTS["random0"]))
    assert calls == []
    tree.eval()
    assert not any(c.stock_core_attention.training for c in cores)
    tree.train()
    assert all(c.stock_core_attention.training for c in cores)
    probe = torch.zeros(1)
    cores[0].stock_core_attention.register_buffer("probe", probe)
    tree.double()
    assert cores[0].stock_core_attention.probe.dtype == torch.float64
    _, sinks = _te_like_pair(softmax_type="learnable")
    assert all(layer.self_attention.core_attention.stock_core_attention is None for layer in sinks.decoder.layers)
    local = build_gpt(tiny_config("qwen3"), get_gpt_layer_local_tree_spec(**layer_spec_args(tiny_config("qwen3"))))
    assert all(layer.self_attention.core_attention.stock_core_attention is None for layer in local.decoder.layers)


def test_thd_batch_memo_follows_the_bounds_tensor():
    """An ordinary THD batch's segment plan is derived once per params object (every layer
    reads the same one) and derived again when its bounds tensor is replaced: the memo holds
    the tensor it was derived from, so no later tensor (not even one at a recycled ``id``) is
    mistaken for it."""
    from ps_mcore.layer_specs.packed_params import plan_for_thd

    psp = PackedSeqParams(qkv_format="thd", max_seqlen_q=8, max_seqlen_kv=8)
    for bounds in ([0, 3, 7], [0, 5, 8], [0, 1, 2, 8], [0, 3, 7]):
        psp.cu_seqlens_q = psp.cu_seqlens_kv = None  # the old tensor is freed first
        psp.cu_seqlens_q = psp.cu_seqlens_kv = torch.tensor(bounds, dtype=torch.int32)
        plan = plan_for_thd(psp, 8, torch.device("cpu"))
        lengths = [b - a for a, b in zip(bounds, bounds[1:] + [8]) if b > a]
        assert list(plan.seq_lens) == lengths
        assert plan_for_thd(psp, 8, torch.device("cpu")) is plan  # once per micro-batch


# ----------------------------------------------------------------------------- spec conversion


def _attn(layer_spec):
    return layer_spec.submodules.self_attention


def test_to_tree_spec_on_local_block_spec():
    cfg = tiny_config("qwen3", num_layers=3)
    block = stock_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    before = [(_attn(s).module, _attn(s).submodules.core_attention) for s in block.layer_specs]
    tree = to_tree_spec(block, tree_attention_backend="chunked")
    assert isinstance(tree, TransformerBlockSubmodules) and len(tree.layer_specs) == 3
    assert tree.layer_norm is block.layer_norm
    for old, new in zip(block.layer_specs, tree.layer_specs):
        assert _attn(new).module is TreeSelfAttention
        core = _attn(new).submodules.core_attention
        assert core.module is TreeCoreAttention and core.params == {"backend": "chunked"}
        for field in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
            assert getattr(_attn(new).submodules, field) is getattr(_attn(old).submodules, field)
        for field in ("input_layernorm", "pre_mlp_layernorm", "mlp", "self_attn_bda", "mlp_bda"):
            assert getattr(new.submodules, field) is getattr(old.submodules, field)
        assert new.submodules.sharded_state_dict_keys_map == old.submodules.sharded_state_dict_keys_map
        assert _attn(new).params == _attn(old).params
    # the input is untouched and layers that shared one spec still share one
    assert [(_attn(s).module, _attn(s).submodules.core_attention) for s in block.layer_specs] == before
    assert len({id(s) for s in tree.layer_specs}) == len({id(s) for s in block.layer_specs})
    # the builder gives the same and the model builds with stock keys
    built = get_gpt_decoder_block_tree_spec(cfg, False, normalization="RMSNorm")
    assert [_attn(s).module for s in built.layer_specs] == [TreeSelfAttention] * 3
    stock_keys = build_gpt(cfg, block).state_dict().keys()
    assert list(build_gpt(cfg, built).state_dict().keys()) == list(stock_keys)
    assert to_tree_spec(tree).layer_specs[0].submodules.self_attention.module is TreeSelfAttention


def test_to_tree_spec_moe_pattern_untouched_except_attention_and_router():
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter

    from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter

    cfg = tiny_config("qwen2", num_layers=4, num_moe_experts=4, moe_layer_freq=[1, 0, 1, 0],
                      moe_router_topk=2)
    block = stock_specs.get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    tree = get_gpt_decoder_block_tree_spec(cfg, False, normalization="RMSNorm")
    assert len(tree.layer_specs) == 4
    for old, new in zip(block.layer_specs, to_tree_spec(block).layer_specs):
        old_mlp, new_mlp = old.submodules.mlp, new.submodules.mlp
        old_sub = old_mlp.keywords.get("submodules") if isinstance(old_mlp, partial) else old_mlp.submodules
        new_sub = new_mlp.keywords.get("submodules") if isinstance(new_mlp, partial) else new_mlp.submodules
        if isinstance(old_sub, MoESubmodules):  # only the router swapped (specs are partials in 0.17+)
            assert new_sub.router is TreeTopKRouter
            assert dataclasses.replace(new_sub, router=TopKRouter) == old_sub
        else:
            assert new_mlp is old_mlp
        assert new.submodules.pre_mlp_layernorm is old.submodules.pre_mlp_layernorm
        assert _attn(new).module is TreeSelfAttention
        assert _attn(new).submodules.core_attention.module is TreeCoreAttention
    # behaviour, not spec internals: the built layers alternate MoE and dense MLPs as stock does
    stock_mlps = [type(l.mlp) for l in build_gpt(cfg, block).decoder.layers]
    assert stock_mlps[0] is not stock_mlps[1]  # the pattern really mixes MoE and dense
    assert [type(l.mlp) for l in build_gpt(cfg, tree).decoder.layers] == stock_mlps


def test_te_specs():
    if stock_specs.HAVE_TE:
        spec = get_gpt_layer_with_tree_attention_spec(qk_layernorm=True)
        stock = stock_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
        assert _attn(spec).module is TreeSelfAttention
        assert _attn(spec).submodules.linear_qkv is _attn(stock).submodules.linear_qkv
        assert _attn(to_tree_spec(stock)).submodules.core_attention.module is TreeCoreAttention
    else:
        with pytest.raises(ImportError, match="transformer-engine"):
            get_gpt_layer_with_tree_attention_spec()
        with pytest.raises(ImportError, match="transformer-engine"):
            get_gpt_decoder_block_tree_spec(tiny_config(), True)
        pytest.skip("transformer-engine not installed: TE spec conversion not exercised")


def test_to_tree_spec_refusals():
    cfg = tiny_config()
    local = stock_specs.get_gpt_layer_local_spec()
    mla = stock_specs.get_gpt_layer_local_spec(multi_latent_attention=True)
    custom_mla = type("MyMLA", (get_module(mla.submodules.self_attention),), {})
    with pytest.raises(NotImplementedError, match="MyMLA"):
        to_tree_spec(dataclasses.replace(mla, submodules=dataclasses.replace(
            mla.submodules, self_attention=dataclasses.replace(mla.submodules.self_attention, module=custom_mla))))
    with pytest.raises(ValueError, match="backend"):
        to_tree_spec(local, tree_attention_backend="bogus")
    with pytest.raises(TypeError, match="layer ModuleSpec"):
        to_tree_spec(cfg)
    custom = type("MySelfAttention", (SelfAttention,), {})
    other = dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, self_attention=dataclasses.replace(_attn(local), module=custom)))
    with pytest.raises(NotImplementedError, match="MySelfAttention"):
        to_tree_spec(other)


def _fake_provider(**fields):
    """A dataclass provider shaped like Megatron-Bridge's GPTModelProvider (no Bridge here)."""
    def base_spec(config, vp_stage=None):
        base_spec.calls.append(vp_stage)
        return stock_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    base_spec.calls = []

    @dataclasses.dataclass
    class Provider:
        transformer_layer_spec: object = base_spec
        attention_backend: object = None
        apply_rope_fusion: bool = False
        tree_attention_backend: str | None = None

    return Provider(**fields), base_spec


def test_tree_layer_spec_for_megatron_bridge():
    provider, base = _fake_provider(tree_attention_backend="reference")
    provider.transformer_layer_spec = tree_layer_spec
    spec = provider.transformer_layer_spec(provider, vp_stage=1)
    assert base.calls == [1]
    assert _attn(spec).module is TreeSelfAttention
    assert _attn(spec).submodules.core_attention.params == {"backend": "reference"}
    # an instance-level spec is kept by tree_layer_spec_from
    custom = stock_specs.get_gpt_layer_local_spec(qk_layernorm=True)
    spec = tree_layer_spec_from(custom)(provider)
    assert _attn(spec).module is TreeSelfAttention and base.calls == [1]
    assert _attn(spec).submodules.q_layernorm is _attn(custom).submodules.q_layernorm
    local = types.SimpleNamespace(name="local")
    with pytest.raises(ValueError, match="attention_backend='local'"):
        tree_layer_spec(_fake_provider(attention_backend=local)[0])
    fused = tree_layer_spec(_fake_provider(apply_rope_fusion=True)[0])  # RoPE fusion stays on
    assert _attn(fused).module is TreeSelfAttention


# ----------------------------------------------------------------------------- dropout


def _tree_run(model, plan, seqs, weights, **psp_kw):
    """Logits [T, V], token log-probs [N] and the gradients of a per-sample weighted loss."""
    psp = TreePackedSeqParams.from_plan(plan, **psp_kw)
    logits = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
    logprobs, _ = token_logprobs(logits, plan)
    (weights * logprobs).sum().backward()
    return logits.detach(), logprobs.detach(), grads_of(model)


def _dropout_model(kind="qwen2", **dropouts):
    """A tree-spec model with megatron-core's dropout defaults (hidden 0.1) unless given, and
    the stock local-spec model with the same weights."""
    cfg = tiny_config(kind, **{"hidden_dropout": 0.1, **dropouts})
    stock = build_gpt(cfg, stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg)))
    randomize_(stock, seed=3)
    tree = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock, tree.train()


def test_megatron_default_hidden_dropout_is_refused_naming_the_key():
    """megatron-core's hidden_dropout default (0.1) drops the embeddings and every layer's
    attention and MLP outputs on the packed rows: refused in training, with the key and the
    opt-in; the whole-model check names each site, attention dropout apart."""
    _, tree = _dropout_model()
    assert tree.config.hidden_dropout == 0.1
    plan = _plan(FORESTS["random1"])
    psp = TreePackedSeqParams.from_plan(plan)
    with pytest.raises(ValueError, match="config.hidden_dropout to 0.*shared_dropout=True"):
        tree(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
             attention_mask=None, packed_seq_params=psp)
    msg = megatron_dropout_refusal(tree)
    for part in ("embedding.embedding_dropout (p=0.1, config key config.hidden_dropout)",
                 "decoder.layers.*.hidden_dropout (p=0.1, config key config.hidden_dropout)"):
        assert part in msg, msg
    assert "attention dropout" not in msg
    assert megatron_dropout_refusal(tree, shared_dropout=True) is None
    assert megatron_dropout_refusal(tree.eval()) is None

    _, both = _dropout_model(attention_dropout=0.2)
    msg = megatron_dropout_refusal(both, shared_dropout=True, key_prefix="override_transformer_config.")
    assert msg.startswith("attention dropout is not supported") and "hidden_dropout" not in msg
    assert "core_attention.dropout_p (p=0.2, config key override_transformer_config.attention_dropout)" in msg


def test_dropout_in_eval_mode_is_exact():
    """eval(): no dropout runs, the tree equals the stock model on every sequence."""
    stock, tree = _dropout_model(attention_dropout=0.1)
    seqs = FORESTS["random2"]
    plan = _plan(seqs)
    stock.eval(), tree.eval()
    with torch.no_grad():
        logits = _tree_logits(tree, plan)
        ref = torch.cat(_stock_logits(stock, seqs))
    torch.testing.assert_close(plan.unpack(logits), ref, **TOL)


def test_shared_dropout_opt_in_is_seeded_and_exact_without_sharing():
    """shared_dropout=True runs hidden dropout on the packed rows: reproducible under a seed,
    different from eval, and on a plan without sharing (rows = the batch concatenated) the
    same masks and numbers as megatron's own THD run of that batch."""
    _, tree = _dropout_model()
    seqs = FORESTS["random3"]
    plan = _plan(seqs)
    weights = _weights(seqs, 1)[1]

    def run(seed):
        torch.manual_seed(seed)
        return _tree_run(tree, plan, seqs, weights, shared_dropout=True)

    (a, lp_a, g_a), (b, lp_b, g_b), (c, _, _) = run(0), run(0), run(1)
    assert torch.equal(a, b) and torch.equal(lp_a, lp_b) and all(torch.equal(g_a[n], g_b[n]) for n in g_a)
    assert not torch.equal(a, c)
    with torch.no_grad():
        assert not torch.allclose(a, _tree_logits(tree.eval(), plan))
    tree.train()

    unshared = _plan(FORESTS["no_sharing"])
    assert unshared.is_trivial
    torch.manual_seed(5)
    got = _tree_logits(tree, unshared, shared_dropout=True)
    cu = torch.tensor([0, *np.cumsum(unshared.seq_lens)], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(unshared.seq_lens), max_seqlen_kv=max(unshared.seq_lens))
    positions = torch.cat([torch.arange(n) for n in unshared.seq_lens])[None]
    torch.manual_seed(5)
    want = tree(input_ids=unshared.input_ids[None], position_ids=positions, attention_mask=None,
                packed_seq_params=thd)[0]
    torch.testing.assert_close(got, want, **TOL)


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_tree_model_matches_eager_without_recompiling_per_plan():
    """torch.compile(GPTModel) with tree specs (megatron-core has no compile option of its
    own): core attention and the tree RoPE preparation run between the compiled graphs,
    outputs and gradients equal the eager model's, and plans of other lengths and sequence
    counts reuse the graphs. (aot_eager: Dynamo and AOTAutograd as inductor sees them,
    without CPU codegen.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    cfg = tiny_config("qwen2", num_layers=1)
    model = build_gpt(cfg, get_gpt_layer_local_tree_spec(**layer_spec_args(cfg)))
    randomize_(model, seed=7)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    graphs = []
    names = ("random2", "prefix_of_another", "deep_chain")
    assert len({len(FORESTS[n]) for n in names}) == 3  # other sequence counts, other lengths
    for name in names:
        seqs = FORESTS[name]
        plan = _plan(seqs)
        weights = _weights(seqs, 2)[1]
        logits, logprobs, grads = _tree_run(compiled, plan, seqs, weights)
        ref_logits, ref_logprobs, ref_grads = _tree_run(model, plan, seqs, weights)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-6, atol=1e-6)
        assert_grads_close({n.removeprefix("_orig_mod."): g for n, g in grads.items()}, ref_grads)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs  # no recompile for new plans


def test_plain_call_skips_tree_arguments_and_clears_the_tree_batch(models, monkeypatch):
    """A call without a tree batch goes straight to Megatron's forward (no signature binding in
    every layer) and leaves no tree batch behind for the MoE router of the layer; a tree batch
    by keyword, or any call with positional arguments, still binds and checks."""
    from ps_mcore.layer_specs.modules import self_attention
    from ps_mcore.layer_specs.modules.tree_context import current_tree_batch

    cfg, _, tree = models
    plan = _plan(FORESTS["random3"])
    attn = tree.decoder.layers[0].self_attention
    hidden = torch.randn(plan.num_tokens, 1, cfg.hidden_size)
    psp = TreePackedSeqParams.from_plan(plan)
    bound = []
    tree_arguments = self_attention.TreeSelfAttention._tree_arguments
    monkeypatch.setattr(self_attention.TreeSelfAttention, "_tree_arguments",
                        lambda self, args, kwargs: (bound.append(1), tree_arguments(self, args, kwargs))[1])
    with torch.no_grad():
        attn(hidden, attention_mask=None, packed_seq_params=psp)
        assert current_tree_batch() is psp and bound == [1]
        plain, _ = attn(hidden, attention_mask=None, packed_seq_params=None)  # as TransformerLayer calls it
        assert current_tree_batch() is None and bound == [1]
        again, _ = attn(hidden, None, None)  # positional: bound and checked
        assert bound == [1, 1]
    torch.testing.assert_close(plain, again, rtol=0, atol=0)


# ----------------------------------------------------------------------------- refusals


def test_refusals(models):
    cfg, _, tree = models
    plan = _plan(FORESTS["random3"])
    spec = get_gpt_layer_local_tree_spec(**layer_spec_args(cfg))
    with pytest.raises(ValueError, match="backend"):
        TreeCoreAttention(cfg, 1, backend="bogus")
    with pytest.raises(NotImplementedError, match="self attention only"):
        TreeCoreAttention(cfg, 1, attention_type="cross")
    with pytest.raises(NotImplementedError, match="right window"):  # (4, 0) windows run
        TreeCoreAttention(dataclasses.replace(cfg, window_size=(4, 2)), 1)
    with pytest.raises(TypeError, match="TreePlan"):
        TreePackedSeqParams.from_plan(FORESTS["single"])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        TreePackedSeqParams.from_plan(plan, 0)

    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)
    ids = plan.input_ids[None]
    if psp.num_padding:  # unpadded input with padded params
        with pytest.raises(ValueError, match="pad_rows"):
            tree(ids, plan.position_ids[None], None, packed_seq_params=psp)
    core = TreeCoreAttention(cfg, 1)
    q = torch.zeros(plan.num_tokens, 4, 16)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        core(q, q, q, None, attention_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="qkv_format"):
        core(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    def thd(cu, cu_kv=None):
        cu = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                               cu_seqlens_kv=cu if cu_kv is None else torch.tensor(cu_kv, dtype=torch.int32))
    t = plan.num_tokens
    with pytest.raises(ValueError, match="non-decreasing"):
        core(q, q, q, None, packed_seq_params=thd([0, 5, 3, t]))
    with pytest.raises(ValueError, match="only"):
        core(q, q, q, None, packed_seq_params=thd([0, t + 1]))
    with pytest.raises(NotImplementedError, match="cu_seqlens_kv"):
        core(q, q, q, None, packed_seq_params=thd([0, 2, t], [0, 3, t]))
    with pytest.raises(ValueError, match="pad_rows expects"):
        psp.pad_rows(plan.input_ids[:-1])
    core_drop = TreeCoreAttention(cfg, 1, attention_dropout=0.1)
    with pytest.raises(ValueError, match="dropout"):
        core_drop(q, q, q, None, packed_seq_params=TreePackedSeqParams.from_plan(plan))
    core_drop.eval()  # evaluation ignores dropout
    assert core_drop(q, q, q, None, packed_seq_params=TreePackedSeqParams.from_plan(plan)).shape == (
        plan.num_tokens, 64)

    attn = tree.decoder.layers[0].self_attention
    hidden = torch.zeros(plan.num_tokens, 1, cfg.hidden_size)
    with pytest.raises(NotImplementedError, match="KV caches"):
        attn(hidden, None, inference_context=object())
    saved = attn.core_attention
    attn.core_attention = DotProductAttention(cfg, 1, saved.attn_mask_type, "self")
    try:  # what Megatron-Bridge's attention_backend='local' would do: refused, not ignored
        with pytest.raises(TypeError, match="silently ignore"):
            attn(hidden, None, packed_seq_params=TreePackedSeqParams.from_plan(plan))
    finally:
        attn.core_attention = saved
