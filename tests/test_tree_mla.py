"""Multi-latent attention (MLA) on prefix trees: a real megatron-core MLA GPTModel (CPU, fp32).

Oracle: the same model run on every sequence separately (sbhd, plain causal attention, stock
MLA RoPE code path), per-sample weighted loss; gradients summed over the sequences.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from forests import nasty_forests, random_forest  # noqa: E402
from megatron_shims import build_gpt, enable_cpu_mla, init_cpu_megatron, randomize_  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.attention import tree_attention  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

init_cpu_megatron(1)
enable_cpu_mla()

from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from ps_mcore.layer_specs import TreePackedSeqParams, get_gpt_layer_local_tree_spec, megatron_dropout_refusal  # noqa: E402
from ps_mcore.layer_specs.modules.mla import TreeMLASelfAttention, mla_refusal  # noqa: E402
from megatron.core.transformer import multi_latent_attention as mla_module  # noqa: E402


def mla_config(**overrides):
    base = dict(
        num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=64,
        multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12,
        qk_pos_emb_head_dim=6, v_head_dim=10, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=1e-6,
        use_cpu_initialization=True, params_dtype=torch.float32, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    return MLATransformerConfig(**{**base, **overrides})


def build_mla(cfg, seed=0):
    spec = get_gpt_layer_local_tree_spec(multi_latent_attention=True, qk_layernorm=cfg.qk_layernorm,
                                         normalization="RMSNorm")
    model = build_gpt(cfg, spec)
    randomize_(model, seed, std=0.2)
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def per_sequence(model, seqs, coef):
    model.zero_grad(set_to_none=True)
    lps, off = [], 0
    for s in seqs:
        ids = torch.as_tensor(np.asarray(s), dtype=torch.long)[None]
        logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None],
                       attention_mask=None)[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        lp = torch.cat([lp, lp.new_zeros(1)])  # the last token predicts nothing
        (lp * coef[off:off + len(s)]).sum().backward()
        lps.append(lp.detach())
        off += len(s)
    return torch.cat(lps), _grads(model)


def tree(model, seqs, coef, pad_to=1):
    model.zero_grad(set_to_none=True)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad_to)
    logits = model(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
    lp, _ = token_logprobs(logits, plan)
    (lp * coef).sum().backward()
    return lp.detach(), _grads(model), plan


def assert_equal_runs(seqs, cfg, pad_to=1):
    model = build_mla(cfg)
    assert all(isinstance(layer.self_attention, TreeMLASelfAttention) for layer in model.decoder.layers)
    n = sum(len(s) for s in seqs)
    coef = torch.as_tensor(np.random.default_rng(len(seqs)).normal(size=n), dtype=torch.float32)
    ref_lp, ref_g = per_sequence(model, seqs, coef)
    lp, g, plan = tree(model, seqs, coef, pad_to)
    mask = plan.next_token_mask
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=0, atol=1e-5)
    assert g.keys() == ref_g.keys()
    for name, r in ref_g.items():
        scale = float(r.abs().max())
        assert scale > 0, name
        err = float((g[name] - r).abs().max()) / scale
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("variant", ["q_lora", "no_q_lora", "v_wider", "yarn"])
def test_mla_tree_equals_per_sequence(variant):
    overrides = {
        "q_lora": {},
        # without a Q down-projection a Q norm needs a fused norm+linear (TE) in 0.19: no norms
        "no_q_lora": dict(q_lora_rank=None, qk_layernorm=False),
        "v_wider": dict(v_head_dim=24, qk_head_dim=8, qk_pos_emb_head_dim=4),
        "yarn": dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8,
                     mscale=1.0, mscale_all_dim=1.0),
    }[variant]
    if variant == "v_wider" and "_prepare_mla_core_attention_value" in vars(mla_module):
        pytest.skip("megatron-core 0.19 crops V to the QK head dim on THD batches when "
                    "v_head_dim is wider (F.pad with a negative width): the stock MLA fails the same way")
    cfg = mla_config(**overrides)
    for seed in (0, 1):
        assert_equal_runs(random_forest(np.random.default_rng(seed), max_seqs=6, max_len=20), cfg,
                          pad_to=4 if seed else 1)


@pytest.mark.parametrize("name", sorted(nasty_forests(0)))
def test_mla_nasty_shapes(name):
    assert_equal_runs(nasty_forests(0)[name], mla_config())


def test_mla_tree_rope_matters():
    """Positions really reach the decoupled RoPE part: with plain packed positions (0..T-1,
    what the stock THD path would use for the packed rows) the tree run differs."""
    import ps_mcore.layer_specs.modules.mla as mla

    cfg = mla_config()
    seqs = nasty_forests(0)["tree"]
    model = build_mla(cfg)
    coef = torch.ones(sum(len(s) for s in seqs))
    ref, _ = per_sequence(model, seqs, coef)
    real = mla.tree_rotary_table
    try:
        mla.tree_rotary_table = lambda table, psp: table[: psp.num_rows]
        lp, _, plan = tree(model, seqs, coef)
    finally:
        mla.tree_rotary_table = real
    assert (lp - ref)[plan.next_token_mask].abs().max() > 1e-3


def test_mla_hidden_dropout_refused_unless_shared():
    """hidden_dropout drops each MLA layer's output on the packed rows: refused in training
    naming the key, run with shared_dropout=True, exact in eval."""
    model = build_mla(mla_config(hidden_dropout=0.1)).train()
    seqs = nasty_forests(0)["tree"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    coef = torch.ones(sum(len(s) for s in seqs))
    with pytest.raises(ValueError, match="config.hidden_dropout to 0"):
        tree(model, seqs, coef)
    assert "decoder.layers.*.hidden_dropout" in megatron_dropout_refusal(model)
    for shared_dropout in (True, False):
        psp = TreePackedSeqParams.from_plan(plan, shared_dropout=shared_dropout)
        model.train(shared_dropout)  # opted in (training), or eval
        with torch.no_grad():
            out = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                        attention_mask=None, packed_seq_params=psp)
        assert torch.isfinite(out).all()
    ref, _ = per_sequence(model, seqs, coef)  # eval: the tree is exact
    lp, _, _ = tree(model, seqs, coef)
    torch.testing.assert_close(lp[plan.next_token_mask], ref[plan.next_token_mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("option, value, word", [
    ("apply_rope_fusion", True, "apply_rope_fusion"),
    ("cache_mla_latents", True, "cache_mla_latents"),
    ("experimental_attention_variant", "dsa", "dsa"),
])
def test_mla_unsupported_refused(option, value, word):
    cfg = mla_config()
    setattr(cfg, option, value)  # set after validation: the config check may need TE for some
    assert word in mla_refusal(cfg)
    with pytest.raises(NotImplementedError, match=word):
        TreeMLASelfAttention(cfg, submodules=None, layer_number=1)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize("dims", [(12, 8), (8, 12), (10, 10)])
def test_tree_attention_value_head_dim(backend, dims):
    """v head dim != q/k head dim: each sequence's rows equal plain causal attention."""
    d, dv = dims
    seqs = nasty_forests(2)["tree"] + nasty_forests(2)["prefix-of-another"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(plan.num_tokens, 4, d, generator=g, requires_grad=True)
    k = torch.randn(plan.num_tokens, 2, d, generator=g, requires_grad=True)
    v = torch.randn(plan.num_tokens, 2, dv, generator=g, requires_grad=True)
    out = tree_attention(q, k, v, plan, backend, softmax_scale=0.3)
    assert out.shape == (plan.num_tokens, 4, dv)
    probe = torch.randn(plan.num_input_tokens, 4, dv, generator=g)
    (plan.unpack(out) * probe).sum().backward()
    off = 0
    ref_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for s in seqs:
        rows = plan.unpack_index[off:off + len(s)]
        qs, ks, vs = (t.detach()[rows].transpose(0, 1).requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0),
                                           is_causal=True, scale=0.3)
        torch.testing.assert_close(out.detach()[rows], o.detach().transpose(0, 1), rtol=1e-5, atol=1e-5)
        (o.transpose(0, 1) * probe[off:off + len(s)]).sum().backward()
        for acc, t in zip(ref_grads, (qs, ks, vs)):
            acc.index_add_(0, rows, t.grad.transpose(0, 1))
        off += len(s)
    for got, ref in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
