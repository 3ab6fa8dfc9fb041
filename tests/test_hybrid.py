"""Hybrid (Gated DeltaNet + attention) megatron-core 0.16 GPTModel on prefix forests (CPU, fp32),
and 0.16's MambaStack / MambaModel spec conversion (its attention layers run on CPU).

Oracle: the stock model (megatron's GatedDeltaNet and local attention, same weights) run on
every sequence alone (sbhd). Tree model: ``to_tree_spec`` of the same block spec, fed the
packed forest. Outputs at every original token and every parameter gradient of a
per-sample-weighted loss must match.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import assert_grads_close  # noqa: E402
from forests import small_nasty_forests  # noqa: E402
from gdn_shims import gdn_block_spec, gdn_config_overrides, sharpen_gdn_, shim_gdn_for_cpu  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, SPTorchNorm, build_gpt, init_cpu_megatron, local_hybrid_stack_spec, randomize_,
    stock_forward, tiny_config,
)
from recurrent_oracle import tree_vs_each_sequence  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.recurrent import gated_delta_rule_recurrent  # noqa: E402

init_cpu_megatron(1)
shim_gdn_for_cpu()

from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, to_tree_spec,
)
from ps_mcore.layer_specs.modules.gdn import TreeGatedDeltaNet  # noqa: E402
from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter  # noqa: E402
from ps_mcore.layer_specs.conversion.recurrent import tree_recurrent_spec  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
FORESTS = small_nasty_forests()


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config("qwen2", num_layers=3, **gdn_config_overrides())
    spec = gdn_block_spec(cfg)
    stock = build_gpt(cfg, spec)
    randomize_(stock, seed=11)
    sharpen_gdn_(stock)
    tree = build_gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return cfg, stock, tree


def test_spec_substitution_and_stock_keys(models):
    cfg, stock, tree = models
    kinds = [type(layer.self_attention) for layer in tree.decoder.layers]
    assert kinds == [TreeGatedDeltaNet, TreeSelfAttention, TreeGatedDeltaNet]
    assert list(stock.state_dict()) == list(tree.state_dict())
    assert tree_recurrent_spec(ModuleSpec(module=TreeGatedDeltaNet)).module is TreeGatedDeltaNet

    class CustomGDN(GatedDeltaNet):
        pass

    with pytest.raises(NotImplementedError, match="CustomGDN"):
        tree_recurrent_spec(ModuleSpec(module=CustomGDN))


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_hybrid_tree_matches_each_sequence(models, forest):
    """fp32, stock kernels (megatron's torch chunked gated delta rule) for the reference.
    Tolerances scale with each tensor's magnitude: ~40-step fp32 recurrences through a sharp
    random model differ by summation order only (the fp64 test below is exact to ~1e-12): the
    largest gradient error seen is 3.2e-5 of its tensor's largest entry (one element of an MLP
    weight on a deep chain; it depends on the CPU's vector width)."""
    _, stock, tree = models
    (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, FORESTS[forest])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert_grads_close(grads, ref_grads, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gdn_only_fp64(models):
    cfg, _, _ = models
    spec = gdn_block_spec(cfg, "GG")
    stock = build_gpt(cfg, spec)
    randomize_(stock, seed=5)
    tree = build_gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock.double(), tree.double()


def _stock_kernel_recurrent(q, k, v, g, beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False):
    """The gated delta rule token by token, in the stock module's [b, s, h, d] layout (keeps
    fp64, which megatron's torch kernel casts to fp32)."""
    outs = [gated_delta_rule_recurrent(q[i], k[i], v[i], g[i], beta[i])[0] for i in range(q.size(0))]
    return torch.stack(outs), None


@pytest.mark.parametrize("forest", ["deep-chain-short-nodes", "tree"])
def test_gdn_tree_exact_in_fp64(gdn_only_fp64, forest, monkeypatch):
    """Gated DeltaNet layers only, fp64: the tree equals each sequence alone to rounding
    (the gate is computed in fp32 by the stock module, so its gradients match to ~1e-7)."""
    from megatron.core.ssm import gated_delta_net as gdn

    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", _stock_kernel_recurrent)
    stock, tree = gdn_only_fp64
    (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, FORESTS[forest])
    torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-7 * float(ref.abs().max()))
    assert_grads_close(grads, ref_grads, atol=1e-6, rtol=1e-6)


def test_hybrid_on_standard_thd_batch_matches_each_sequence(models):
    """Ordinary PackedSeqParams (stock GatedDeltaNet in 0.16 refuses them): every sequence
    from zero state, convolution windows not crossing sequence boundaries."""
    _, stock, tree = models
    seqs = FORESTS["no-sharing"] + FORESTS["duplicates-and-prefix"]
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(s) for s in seqs])]), dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(map(len, seqs)), max_seqlen_kv=max(map(len, seqs)))
    ids = torch.cat([torch.as_tensor(s) for s in seqs])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        got = tree(ids[None], pos[None], None, packed_seq_params=psp)[0]
        ref = torch.cat([stock_forward(stock, s) for s in seqs])
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_hybrid_sbhd_runs_stock_forward(models):
    _, stock, tree = models
    seq = FORESTS["single-sequence"][0]
    with torch.no_grad():
        torch.testing.assert_close(stock_forward(tree, seq), stock_forward(stock, seq), **TOL)


def test_refusals(models):
    _, _, tree = models
    plan = plan_prefix_tree(FORESTS["tree"], min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4, cp_size=2, cp_rank=0)
    hidden = torch.zeros(psp.num_local_rows, 1, 64)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        tree.decoder.layers[0].self_attention(hidden, None, packed_seq_params=psp)
    gdn = tree.decoder.layers[0].self_attention
    assert isinstance(gdn, TreeGatedDeltaNet)
    gdn.config.hidden_dropout = 0.1  # the layer drops the mixer's output on the packed rows
    try:
        with pytest.raises(ValueError, match="config.hidden_dropout to 0.*shared_dropout=True"):
            gdn(hidden[: plan.num_tokens], None, packed_seq_params=TreePackedSeqParams.from_plan(plan))
    finally:
        gdn.config.hidden_dropout = 0.0


# ------------------------------------------------------------- megatron-core 0.16's MambaStack


def _mamba_stack_spec():
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

    return local_hybrid_stack_spec(MambaStack, MambaStackSubmodules)


def test_mamba_stack_spec_conversion():
    """0.16's MambaStackSubmodules (mamba / attention / mlp / moe layers) goes through the same
    per-kind builders as 0.19's hybrid stack."""
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules

    spec = _mamba_stack_spec()
    moe = stock_specs.get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")
    spec.submodules.moe_layer = moe
    tree = to_tree_spec(spec).submodules
    assert spec.submodules.moe_layer is moe and moe.module is not tree.moe_layer.module  # not modified
    attn = tree.attention_layer.submodules.self_attention
    assert attn.module is TreeSelfAttention and attn.submodules.core_attention.module is TreeCoreAttention
    assert tree.mlp_layer is spec.submodules.mlp_layer
    assert tree.mamba_layer is spec.submodules.mamba_layer  # IdentityOp: no Mamba layers
    assert issubclass(tree.moe_layer.module, moe.module)  # records its tree batch for the router
    assert tree.moe_layer.submodules.mlp.submodules.router is TreeTopKRouter

    unknown_mixer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(mixer=ModuleSpec(module=torch.nn.Identity)))
    spec.submodules.mamba_layer = unknown_mixer
    with pytest.raises(NotImplementedError, match="hybrid stack's mamba_layer.*MambaMixer"):
        to_tree_spec(spec)


def test_mamba_stack_mamba_mixer_becomes_the_tree_mixer():
    from mamba_shims import shim_mamba_for_cpu

    shim_mamba_for_cpu()  # megatron's mamba_mixer imports triton (a stub while it imports)
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    spec = _mamba_stack_spec()
    spec.submodules.mamba_layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(mixer=mixer))
    tree = to_tree_spec(spec).submodules.mamba_layer
    assert tree.module is MambaLayer and tree.submodules.mixer.module is TreeMambaMixer
    assert tree.submodules.mixer.submodules is mixer.submodules and mixer.module is MambaMixer


@pytest.mark.parametrize("forest", ["tree", "duplicates-and-prefix"])
def test_mamba_model_attention_layers_on_a_tree(forest, monkeypatch):
    """0.16's MambaModel (pattern ``*-*-``; its Mamba layers need triton) on a forest: tree vs each
    sequence alone, logits and every gradient. Test-only shim: MambaStack's final TENorm."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block

    monkeypatch.setattr(mamba_block, "TENorm", SPTorchNorm)
    spec = _mamba_stack_spec()

    def model(s):
        return MambaModel(tiny_config("qwen2", num_layers=4), s, vocab_size=VOCAB, max_sequence_length=512,
                          hybrid_override_pattern="*-*-", position_embedding_type="rope", rotary_base=1_000_000)

    stock = model(spec)
    randomize_(stock, seed=3)
    tree = model(to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    assert type(tree.decoder.layers[2].self_attention) is TreeSelfAttention
    (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, FORESTS[forest])
    torch.testing.assert_close(got, ref, **TOL)
    assert_grads_close(grads, ref_grads, atol=1e-5, rtol=1e-4)
