"""Mamba-2 layers of megatron-core 0.16.1 on prefix forests (CPU, fp32).

Oracle: megatron's STOCK ``MambaMixer`` (its training forward, with the mamba-ssm stand-ins of
``mamba_shims``: the Mamba-2 equations token by token) run on every sequence alone, and on the
unshared THD batch (``seq_idx``). Tree: ``TreeMambaMixer`` with the same weights on the packed
forest. Outputs at every original token, the gradient of the inputs and of every parameter of a
per-sample-weighted loss must match. Model level: a MambaModel with pattern ``M*M-``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from forests import small_nasty_forests  # noqa: E402
from mamba_shims import shim_mamba_for_cpu  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, SPTorchNorm, init_cpu_megatron, layer_spec_args, randomize_, stock_forward,
)

from ps_mcore import plan_prefix_tree  # noqa: E402

init_cpu_megatron(1)
shim_mamba_for_cpu()

from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.ssm import mamba_block  # noqa: E402
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

from ps_mcore.layer_specs import TreePackedSeqParams, to_tree_spec  # noqa: E402
from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer  # noqa: E402
from ps_mcore.layer_specs.conversion.recurrent import tree_recurrent_spec  # noqa: E402
from mamba_oracle import (  # noqa: E402
    SHAPES, assert_close_scaled, grads_of, mamba_config, mixer_pair, sharpen_mamba_, thd_params, tree_vs_stock,
)


FORESTS = small_nasty_forests()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def mixers(request):
    return mixer_pair(SHAPES[request.param])


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_tree_mixer_matches_each_sequence_alone(mixers, forest):
    _, stock, tree = mixers
    (got, ref), (dx, dx_ref), (grads, ref_grads) = tree_vs_stock(stock, tree, FORESTS[forest])
    assert_close_scaled(got, ref, "mixer output")
    assert_close_scaled(dx, dx_ref, "d hidden_states", rel=2e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) == 8  # in/out proj, conv w/b, dt_bias, A_log, D, norm
    for name, r in ref_grads.items():
        assert_close_scaled(grads[name], r, f"d {name}", rel=3e-5)


@pytest.mark.parametrize("forest", ["tree", "random"])
def test_tree_mixer_matches_stock_packed_thd(mixers, forest):
    """The second oracle: stock MambaMixer on the unshared THD batch (seq_idx resets)."""
    _, stock, tree = mixers
    (got, ref), (dx, dx_ref), (grads, ref_grads) = tree_vs_stock(stock, tree, FORESTS[forest], oracle="thd")
    assert_close_scaled(got, ref, "mixer output")
    assert_close_scaled(dx, dx_ref, "d hidden_states", rel=2e-5)
    for name, r in ref_grads.items():
        assert_close_scaled(grads[name], r, f"d {name}", rel=3e-5)


@pytest.mark.parametrize("forest", ["deep-chain-short-nodes", "duplicates-and-prefix"])
def test_tree_mixer_exact_in_fp64(forest):
    """fp64: the tree equals each sequence alone to rounding, so the fp32 tolerances above are
    summation order only. A_log, dt_bias and (per-channel) D pass through fp32 on both sides
    (the stock call casts them), so their gradients are rounded to fp32 there."""
    _, stock, tree = mixer_pair(SHAPES["g2-odd-headdim"], seed=3)
    stock, tree = stock.double(), tree.double()
    (got, ref), (dx, dx_ref), (grads, ref_grads) = tree_vs_stock(stock, tree, FORESTS[forest])
    assert_close_scaled(got, ref, "mixer output", rel=1e-12)
    assert_close_scaled(dx, dx_ref, "d hidden_states", rel=1e-12)
    for name, r in ref_grads.items():
        assert_close_scaled(grads[name], r, f"d {name}", rel=1e-6 if name in ("A_log", "dt_bias", "D") else 1e-11)


def test_ordinary_batches_run_the_stock_forward(mixers):
    _, stock, tree = mixers
    x = torch.randn(9, 2, stock.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(tree(x)[0], stock(x)[0], rtol=0, atol=0)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        thd = thd_params(cu, 5)
        torch.testing.assert_close(tree(x[:, :1], packed_seq_params=thd)[0],
                                   stock(x[:, :1], packed_seq_params=thd)[0], rtol=0, atol=0)


def test_refusals_name_mamba_and_the_option(mixers):
    cfg, _, tree = mixers
    plan = plan_prefix_tree(FORESTS["tree"], min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)
    x = torch.zeros(psp.num_local_rows, 1, cfg.hidden_size)
    cp_psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4, cp_size=2, cp_rank=0)
    with pytest.raises(NotImplementedError, match="Mamba.*context parallelism"):
        tree(x[: cp_psp.num_local_rows], packed_seq_params=cp_psp)
    with pytest.raises(NotImplementedError, match="Mamba.*inference"):
        tree(x, inference_context=object(), packed_seq_params=psp)
    tree.config.hidden_dropout = 0.1  # the layer drops the mixer's output on the packed rows
    try:
        with pytest.raises(ValueError, match="config.hidden_dropout to 0.*shared_dropout=True"):
            tree(x, packed_seq_params=psp)
        opted_in = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4, shared_dropout=True)
        assert tree(x, packed_seq_params=opted_in)[0].shape == x.shape
    finally:
        tree.config.hidden_dropout = 0.0
    cfg.tree_mamba_backend = "fla"  # not installed on the CPU test machine
    try:
        with pytest.raises(ImportError, match="tree_mamba_backend='fla'.*flash-linear-attention"):
            tree(x, packed_seq_params=psp)
        cfg.tree_mamba_backend = "cuda-magic"
        with pytest.raises(ValueError, match="tree_mamba_backend='cuda-magic'"):
            tree(x, packed_seq_params=psp)
    finally:
        del cfg.tree_mamba_backend


def test_spec_substitution_keeps_stock_parameters():
    spec = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                         out_proj=RowParallelLinear))
    converted = tree_recurrent_spec(spec)
    assert converted.module is TreeMambaMixer and converted.submodules is spec.submodules
    assert tree_recurrent_spec(converted) is converted

    class CustomMamba(MambaMixer):
        pass

    with pytest.raises(NotImplementedError, match="CustomMamba"):
        tree_recurrent_spec(ModuleSpec(module=CustomMamba))


# ----------------------------------------------------------------------------- model level


def _stack_spec(cfg, mixer_cls, attention_layer):
    """MambaStack spec with megatron's local layers (0.16 ships only a TE stack spec):
    ``M`` = norm + ``mixer_cls``, ``*`` = ``attention_layer``, ``-`` = norm + dense MLP."""
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    local = stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))
    norm = local.submodules.input_layernorm
    mixer = ModuleSpec(module=mixer_cls, submodules=MambaMixerSubmodules(
        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm, mixer=mixer, mamba_bda=local.submodules.self_attn_bda)),
        attention_layer=attention_layer,
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=local.submodules.mlp, mlp_bda=local.submodules.mlp_bda)),
    ))


@pytest.fixture(scope="module")
def models(monkeypatch_module):
    import importlib.util

    if importlib.util.find_spec("megatron.core.models.hybrid") is not None:
        pytest.skip("megatron-core 0.19+: MambaModel is a HybridModel (tests/test_hybrid_model.py)")
    from megatron.core.models.mamba.mamba_model import MambaModel

    monkeypatch_module.setattr(mamba_block, "TENorm", SPTorchNorm)  # the stack's final norm is TE's
    cfg = mamba_config(2, 4, 5, 6, num_layers=4)
    local = stock_specs.get_gpt_layer_local_spec(**layer_spec_args(cfg))
    attn_layer = dataclasses.replace(local, submodules=dataclasses.replace(  # attention only, as 0.16's stack
        local.submodules, mlp=IdentityOp, pre_mlp_layernorm=IdentityOp, mlp_bda=IdentityFuncOp))
    kw = dict(vocab_size=VOCAB, max_sequence_length=256, hybrid_override_pattern="M*M-",
              position_embedding_type="rope", rotary_base=1_000_000)
    stock = MambaModel(cfg, _stack_spec(cfg, MambaMixer, attn_layer), **kw)
    randomize_(stock, seed=7)
    for layer in (0, 2):
        sharpen_mamba_(stock.decoder.layers[layer].mixer)
    tree = MambaModel(cfg, _stack_spec(cfg, TreeMambaMixer, to_tree_spec(attn_layer)), **kw)
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock, tree


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("forest", ["deep-chain-short-nodes", "duplicates-and-prefix", "random"])
def test_hybrid_mamba_model_matches_each_sequence(models, forest):
    """MambaModel ``M*M-`` (Mamba, attention, Mamba, MLP; local layers, RoPE): logits at every
    original token and every parameter gradient of a per-sample-weighted loss."""
    stock, tree = models
    assert [type(layer.mixer) for layer in tree.decoder.layers[::2]] == [TreeMambaMixer] * 2
    assert list(stock.state_dict()) == list(tree.state_dict())
    seqs = FORESTS[forest]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    w = torch.cat([torch.full((len(s),), 0.3 + 0.4 * i) for i, s in enumerate(seqs)])
    probe = torch.randn(plan.num_input_tokens, VOCAB, generator=torch.Generator().manual_seed(1))

    ref = torch.cat([stock_forward(stock, s) for s in seqs])
    (w[:, None] * ref * probe).sum().backward()
    ref_grads = grads_of(stock)

    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)
    logits = tree(input_ids=psp.pad_rows(plan.input_ids)[None], position_ids=psp.position_ids[None],
                  attention_mask=None, packed_seq_params=psp)[0]
    got = plan.unpack(logits)
    (w[:, None] * got * probe).sum().backward()
    assert_close_scaled(got.detach(), ref.detach(), "logits")
    grads = grads_of(tree)
    assert grads.keys() == ref_grads.keys()
    for name, r in ref_grads.items():
        assert_close_scaled(grads[name], r, f"d {name}", rel=5e-5)
