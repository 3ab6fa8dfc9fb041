"""megatron-core 0.19+ ``HybridModel`` with a local (non-TE) hybrid stack spec on CPU:
``to_tree_spec`` converts the attention layers, MLP layers stay stock, and a tree batch that
reaches a layer kind without tree support (Mamba, GDN, DSA, MLA) raises naming it.

Test-only shim: ``HybridStack`` builds its final norm with ``TENorm`` unconditionally (TE needs
CUDA); it is pointed at a torch RMSNorm here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core.models.hybrid", reason="HybridModel needs megatron-core 0.19+")

from megatron_shims import (  # noqa: E402
    VOCAB, SPTorchNorm, causal_mask, init_cpu_megatron, randomize_, tiny_config,
)

from ps_mcore import plan_prefix_tree  # noqa: E402

init_cpu_megatron(1)

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.hybrid import hybrid_block  # noqa: E402
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules  # noqa: E402

from ps_mcore.layer_specs import (  # noqa: E402
    TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, to_tree_spec,
)

PATTERN = "*-*-"


@pytest.fixture(autouse=True)
def _torch_final_norm(monkeypatch):
    monkeypatch.setattr(hybrid_block, "TENorm", SPTorchNorm)


def _local_hybrid_spec() -> ModuleSpec:
    gpt = get_gpt_layer_local_spec(normalization="RMSNorm")
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.submodules.pre_mlp_layernorm, mlp=gpt.submodules.mlp,
        mlp_bda=gpt.submodules.mlp_bda))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=gpt, mlp_layer=mlp))


def _model(spec):
    cfg = tiny_config("qwen2", num_layers=len(PATTERN))
    return HybridModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=512,
                       hybrid_layer_pattern=PATTERN, position_embedding_type="rope",
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


class _MixerLayer(torch.nn.Module):
    """Stands for a Mamba / GDN layer (their kernels need CUDA): mixes tokens, has weights."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        return hidden_states.cumsum(0) * self.weight


@pytest.mark.parametrize("field", ["mamba_layer", "gdn_layer", "dsa_layer"])
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


def test_hybrid_stack_spec_without_attention_is_left_alone():
    spec = HybridStackSubmodules(mlp_layer=_local_hybrid_spec().submodules.mlp_layer)
    tree = to_tree_spec(spec)
    assert tree.mlp_layer is spec.mlp_layer and tree.attention_layer is spec.attention_layer
