"""megatron-core 0.19+ ``HybridModel`` with a local (non-TE) hybrid stack spec on CPU:
``to_tree_spec`` converts the attention layers and the Gated DeltaNet layers (tree vs each
sequence alone through the stock model: logits and every parameter gradient), puts
``TreeMambaMixer`` into the Mamba layers, leaves MLP layers stock, and a tree batch that reaches
a layer kind without tree support (DSA, MLA) raises naming it.

Test-only shims: ``HybridStack`` builds its final norm with ``TENorm`` unconditionally (TE needs
CUDA); it is pointed at a torch RMSNorm here. The stock ``GatedDeltaNet`` runs megatron's
pure-torch kernels (tests/gdn_shims.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel needs megatron-core 0.19+")

from conftest import assert_grads_close  # noqa: E402
from gdn_shims import gdn_config_overrides, shim_gdn_for_cpu  # noqa: E402
from megatron_shims import (  # noqa: E402
    VOCAB, SPTorchNorm, causal_mask, init_cpu_megatron, local_hybrid_stack_spec, randomize_, tiny_config,
)
from forests import small_nasty_forests  # noqa: E402
from recurrent_oracle import tree_vs_each_sequence  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402

init_cpu_megatron(1)
shim_gdn_for_cpu()

from megatron.core.models.hybrid import hybrid_block  # noqa: E402
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402
from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_layer import (  # noqa: E402
    TransformerLayer, TransformerLayerSubmodules,
)

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, to_tree_spec,
)
from ps_mcore.layer_specs.modules.gdn import TreeGatedDeltaNet  # noqa: E402
from ps_mcore.layer_specs.modules.moe_router import TreeTopKRouter  # noqa: E402
from ps_mcore.layer_specs.conversion.spec_class import spec_class  # noqa: E402

PATTERN = "*-*-"


_STOCK_TENORM = hybrid_block.TENorm


@pytest.fixture(autouse=True)
def _torch_final_norm(monkeypatch):
    monkeypatch.setattr(hybrid_block, "TENorm", SPTorchNorm)


def _local_hybrid_spec(config=None, mamba=False) -> ModuleSpec:
    return local_hybrid_stack_spec(HybridStack, HybridStackSubmodules, config, mamba=mamba)


def _model(spec, pattern=PATTERN, config=None):
    cfg = config or tiny_config("qwen2", num_layers=len(pattern))
    return HybridModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=512,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope",
                       rotary_base=1_000_000)


def test_hybrid_model_tree_matches_stock():
    spec = _local_hybrid_spec()
    tree_spec = to_tree_spec(spec)
    sub = tree_spec.submodules
    assert sub.attention_layer.submodules.self_attention.module is TreeSelfAttention
    assert sub.attention_layer.submodules.self_attention.submodules.core_attention.module is TreeCoreAttention
    assert sub.mlp_layer is spec.submodules.mlp_layer
    stock = _model(spec)
    randomize_(stock, seed=11)
    tree = _model(tree_spec)
    assert list(tree.state_dict()) == list(stock.state_dict())
    tree.load_state_dict(stock.state_dict(), strict=True)
    kinds = [type(layer).__name__ for layer in tree.decoder.layers]
    assert kinds == ["TransformerLayer", "MLPLayer"] * 2

    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 10)
    seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, n)]) for n in (4, 7, 1)] + [prompt[:6]]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    assert plan.num_tokens < plan.num_input_tokens
    psp = TreePackedSeqParams.from_plan(plan)
    with torch.no_grad():
        got = tree(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                   attention_mask=None, packed_seq_params=psp)[0]
        ref = []
        for s in seqs:
            ids = torch.as_tensor(s, dtype=torch.long)[None]
            ref.append(stock(input_ids=ids, position_ids=torch.arange(len(s))[None],
                             attention_mask=causal_mask(len(s)))[0])
    torch.testing.assert_close(plan.unpack(got), torch.cat(ref), rtol=1e-5, atol=1e-5)


GDN_PATTERN = "G*G-"  # GDN, attention (with its MLP), GDN, MLP: test_hybrid.py's depth
GDN_FORESTS = small_nasty_forests()


@pytest.fixture(scope="module")
def gdn_models():
    cfg = tiny_config("qwen2", num_layers=len(GDN_PATTERN), **gdn_config_overrides())
    spec = _local_hybrid_spec(cfg)
    hybrid_block.TENorm = SPTorchNorm  # module scope: the autouse fixture runs per test
    try:
        stock = _model(spec, GDN_PATTERN, cfg)
        randomize_(stock, seed=11)
        with torch.no_grad():  # decays away from 1 and short convs that reach across nodes
            for layer, kind in zip(stock.decoder.layers, GDN_PATTERN):
                if kind == "G":
                    layer.self_attention.A_log.copy_(torch.linspace(-1.0, 0.5, layer.self_attention.A_log.numel()))
                    layer.self_attention.conv1d.weight.mul_(4.0)
        tree_spec = to_tree_spec(spec)
        tree = _model(tree_spec, GDN_PATTERN, cfg)
    finally:
        hybrid_block.TENorm = _STOCK_TENORM
    tree.load_state_dict(stock.state_dict(), strict=True)
    return spec, tree_spec, stock, tree


def test_gdn_layers_get_the_tree_mixer(gdn_models):
    spec, tree_spec, stock, tree = gdn_models
    gdn = tree_spec.submodules.gdn_layer
    assert gdn.module is TransformerLayer and gdn.submodules.self_attention.module is TreeGatedDeltaNet
    assert spec.submodules.gdn_layer.submodules.self_attention.module is GatedDeltaNet  # not modified
    assert tree_spec.submodules.mlp_layer is spec.submodules.mlp_layer
    mixers = {"G": TreeGatedDeltaNet, "*": TreeSelfAttention}
    for layer, kind in zip(tree.decoder.layers, GDN_PATTERN, strict=True):
        if kind == "-":
            assert type(layer) is MLPLayer
        else:
            assert type(layer) is TransformerLayer and type(layer.self_attention) is mixers[kind]
    assert list(tree.state_dict()) == list(stock.state_dict())


@pytest.mark.parametrize("forest", sorted(GDN_FORESTS))
def test_gdn_hybrid_model_tree_matches_each_sequence(gdn_models, forest):
    """fp32; the stock GatedDeltaNet runs megatron's torch chunked kernel on each sequence alone
    (summation order only). Gradients get 2e-4 of their scale: on the branching forests of a
    7-token prompt this sharpened model is ill-conditioned in fp32, the stock model's own
    gradients moving by 4e-4 to 8e-4 of their scale when its weights move by 1e-7 (measured;
    the per-head A_log / dt_bias worst, as their gradients sum cancelling terms over every
    token). A child started from the wrong state is off by far more."""
    _, _, stock, tree = gdn_models
    (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, GDN_FORESTS[forest])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(ref, -1), rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, atol=2e-4, rtol=1e-4)


MAMBA_PATTERN = "M*M-"  # Mamba, attention (with its MLP), Mamba, MLP


@pytest.fixture(scope="module")
def mamba_models():
    from mamba_shims import shim_mamba_for_cpu

    shim_mamba_for_cpu()  # megatron's Mamba kernels (mamba-ssm, Triton) as torch stand-ins
    cfg = tiny_config("qwen2", num_layers=len(MAMBA_PATTERN), mamba_num_groups=2, mamba_num_heads=4,
                      mamba_head_dim=5, mamba_state_dim=6)
    spec = _local_hybrid_spec(mamba=True)
    hybrid_block.TENorm = SPTorchNorm
    try:
        stock = _model(spec, MAMBA_PATTERN, cfg)
        randomize_(stock, seed=5)
        with torch.no_grad():  # slow decays and convs reaching across nodes
            for layer, kind in zip(stock.decoder.layers, MAMBA_PATTERN):
                if kind == "M":
                    layer.mixer.cp.get_A_log().copy_(torch.linspace(-3.0, 0.0, layer.mixer.cp.get_A_log().numel()))
                    layer.mixer.cp.get_conv1d_weight().mul_(4.0)
        tree = _model(to_tree_spec(spec), MAMBA_PATTERN, cfg)
    finally:
        hybrid_block.TENorm = _STOCK_TENORM
    tree.load_state_dict(stock.state_dict(), strict=True)
    return stock, tree


@pytest.mark.parametrize("forest", ["deep-chain-short-nodes", "duplicates-and-prefix", "tree", "random"])
def test_mamba_hybrid_model_tree_matches_each_sequence(mamba_models, forest):
    """0.19 HybridModel ``M*M-`` with the stock MambaMixer swapped by to_tree_spec: logits,
    log-probs and every gradient, tree vs each sequence alone through the stock model (fp32)."""
    from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

    stock, tree = mamba_models
    assert [type(layer.mixer) for layer in tree.decoder.layers[::2]] == [TreeMambaMixer] * 2
    (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, GDN_FORESTS[forest])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    torch.testing.assert_close(torch.log_softmax(got, -1), torch.log_softmax(ref, -1), rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, atol=5e-5, rtol=1e-4)


def test_stock_hybrid_stack_spec_converts_gdn_and_mamba_mixers():
    """megatron's own (TE) hybrid_stack_spec: every mixer kind with a tree version gets it."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.ssm.mamba_layer import MambaLayer

    from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

    tree = to_tree_spec(hybrid_stack_spec).submodules
    stock = hybrid_stack_spec.submodules
    assert tree.mamba_layer.module is MambaLayer
    assert tree.mamba_layer.submodules.mixer.module is TreeMambaMixer
    assert tree.mamba_layer.submodules.mixer.submodules is stock.mamba_layer.submodules.mixer.submodules
    assert tree.mamba_layer.submodules.mamba_bda is stock.mamba_layer.submodules.mamba_bda
    assert tree.gdn_layer.submodules.self_attention.module is TreeGatedDeltaNet
    assert tree.attention_layer.submodules.self_attention.module is TreeSelfAttention
    assert tree.mlp_layer is stock.mlp_layer and tree.mtp_block_spec is stock.mtp_block_spec
    for field in ("dsa_layer", "mla_layer"):  # kept, but refusing tree batches
        kept, refusing = getattr(stock, field).module, getattr(tree, field).module
        assert refusing is not kept and issubclass(refusing, kept)
    assert issubclass(tree.moe_layer.module, stock.moe_layer.module)  # records its batch
    moe = tree.moe_layer.submodules.mlp  # a functools.partial in 0.19's TE hybrid stack spec
    assert moe.keywords["submodules"].router is TreeTopKRouter


MOE_PATTERN = "*E*E"  # attention, MoE, attention, MoE (0.19's hybrid MoE layers)


@pytest.mark.parametrize("forest", ["tree", "duplicates-and-prefix", "deep-chain-short-nodes"])
def test_moe_hybrid_model_tree_equals_unshared_thd(forest):
    """0.19 HybridModel with MoE layers (MoETransformerLayer, local experts): the tree equals the
    unshared THD batch through the same model in log-probs, every gradient, the aux / z losses
    and the tokens counted per expert (each shared row counted once per sample holding it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer
    from megatron_shims import enable_cpu_moe
    from moe_cases import MOE_CASES, assert_same, moe_config, run_tree, run_unshared, sample_coefs

    enable_cpu_moe()
    cfg = moe_config(num_layers=len(MOE_PATTERN), **MOE_CASES["aux+z/allgather"])
    moe_mlp = get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm").submodules
    assert spec_class(moe_mlp.mlp) is MoELayer
    spec = _local_hybrid_spec()
    spec.submodules.moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=moe_mlp.pre_mlp_layernorm, mlp=moe_mlp.mlp, mlp_bda=moe_mlp.mlp_bda))
    hybrid_block.TENorm = SPTorchNorm
    try:
        model = _model(to_tree_spec(spec), MOE_PATTERN, cfg)
    finally:
        hybrid_block.TENorm = _STOCK_TENORM
    randomize_(model, seed=2)
    model.train()
    routers = [m for m in model.modules() if isinstance(m, TreeTopKRouter)]
    assert len(routers) == 2
    seqs = small_nasty_forests()[forest]
    coef = sample_coefs(seqs, seed=3)
    tree, _ = run_tree(model, seqs, coef)
    ref = run_unshared(model, seqs, coef)
    assert {"load_balancing_loss", "z_loss"} <= set(ref["losses"])  # the comparison compares something
    assert_same(tree, ref)


class _MixerLayer(torch.nn.Module):
    """Stands for a DSA / MLA layer: mixes tokens, has weights."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        return hidden_states.cumsum(0) * self.weight


@pytest.mark.parametrize("field", ["dsa_layer", "mla_layer"])
def test_tree_batch_reaching_a_layer_without_tree_support_raises(field):
    spec = HybridStackSubmodules(**{field: ModuleSpec(module=_MixerLayer)})
    tree = to_tree_spec(spec)
    layer = tree.__dict__[field].module()
    assert isinstance(layer, _MixerLayer) and list(layer.state_dict()) == ["weight"]
    x = torch.randn(5, 1, 4)
    torch.testing.assert_close(layer(x), x.cumsum(0))  # stock batches: the layer unchanged
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4]], min_prefix_len=1)
    with pytest.raises(NotImplementedError, match=f"_MixerLayer.*{field}"):
        layer(x[:4], packed_seq_params=TreePackedSeqParams.from_plan(plan))


@pytest.mark.parametrize("field", ["gdn_layer", "mamba_layer"])
def test_recurrent_layer_without_a_known_mixer_is_refused_at_conversion(field):
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules

    mixer = ModuleSpec(module=_MixerLayer)
    layer = {
        "gdn_layer": ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(self_attention=mixer)),
        "mamba_layer": ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(mixer=mixer)),
    }[field]
    with pytest.raises(NotImplementedError, match=f"hybrid stack's {field}"):
        to_tree_spec(HybridStackSubmodules(**{field: layer}))


def test_a_stack_or_layer_that_drops_packed_seq_params_is_refused():
    class NoPackedParamsLayer(TransformerLayer):
        def forward(self, hidden_states, attention_mask=None):
            return super().forward(hidden_states, attention_mask)

    class NoPackedParamsStack(HybridStack):
        def forward(self, hidden_states, attention_mask):
            return super().forward(hidden_states, attention_mask)

    gdn = _local_hybrid_spec(tiny_config("qwen2", **gdn_config_overrides())).submodules.gdn_layer
    with pytest.raises(NotImplementedError, match="gdn_layer.*NoPackedParamsLayer"):
        to_tree_spec(HybridStackSubmodules(gdn_layer=dataclasses.replace(gdn, module=NoPackedParamsLayer)))
    with pytest.raises(NotImplementedError, match="hybrid stack.*NoPackedParamsStack"):
        to_tree_spec(ModuleSpec(module=NoPackedParamsStack, submodules=HybridStackSubmodules(gdn_layer=gdn)))


def test_hybrid_stack_spec_without_attention_is_left_alone():
    spec = HybridStackSubmodules(mlp_layer=_local_hybrid_spec().submodules.mlp_layer)
    tree = to_tree_spec(spec)
    assert tree.mlp_layer is spec.mlp_layer and tree.attention_layer is spec.attention_layer
