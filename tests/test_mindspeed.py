"""MindSpeed wiring (ps_mcore.mindspeed) on CPU.

No NPU, MindSpeed or Megatron-LM's ``megatron.training`` exist here (the megatron-core wheel
has no ``megatron.training``). Everything that does not exist is a **stand-in**, named as such:

* ``MindSpeedLikeStandIn*`` classes replace megatron's classes the way MindSpeed's
  ``Patch.apply_patch`` does (every loaded module attribute of that name that *is* the
  original object is rebound, see :func:`mindspeed_like_patch`);
* ``stand_in_megatron_training`` provides ``get_args`` / ``core_transformer_config_from_args``
  / ``get_model`` for verl's real ``gpt_model_provider`` and engine build;
* ``stand_in_mindspeed_state`` provides MindSpeed's global-state setters for verl's real
  ``preprocess_for_mindspeed``.

Real parts: megatron-core 0.16.1 GPTModel and spec builders, verl 0.8.0's
``gpt_model_provider``, ``MindSpeedMegatronEngineWithLMHead._build_megatron_module`` and
``preprocess_for_mindspeed``. Oracle: the stock-spec model with the same weights, run on every
sequence separately.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from argparse import Namespace

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl")

from forests import nasty_forests  # noqa: E402
from megatron_shims import VOCAB, init_cpu_megatron, randomize_, stock_forward, tiny_config  # noqa: E402

init_cpu_megatron(1)

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs as stock_specs  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import import_module  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.layer_specs import TreeCoreAttention, TreePackedSeqParams, TreeSelfAttention, to_tree_spec  # noqa: E402
from ps_mcore.layer_specs.packed_params import segment_plan  # noqa: E402
from ps_mcore.integrations.verl080 import mindspeed as ms_patch  # noqa: E402
from ps_mcore.mindspeed import spec as ms_spec  # noqa: E402
from ps_mcore.mindspeed import state as ms_state  # noqa: E402
from ps_mcore.integrations.patching import Patcher  # noqa: E402
from ps_mcore.integrations.verl_common.config import ENGINE_ATTR, PrefixGrouperConfig, PrefixSharingSetting  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
FORESTS = nasty_forests(3)


# ----------------------------------------------------------------------------- stand-ins


class MindSpeedLikeStandInColumnParallelLinear(ColumnParallelLinear):
    """Stand-in for MindSpeed's replacement of megatron's column-parallel linear."""


class MindSpeedLikeStandInRowParallelLinear(RowParallelLinear):
    """Stand-in for MindSpeed's replacement of megatron's row-parallel linear."""


class MindSpeedLikeStandInDotProductAttention(DotProductAttention):
    """Stand-in for MindSpeed's flash-attention DotProductAttention."""


class MindSpeedLikeStandInPTNorm(WrappedTorchNorm):
    """Stand-in for MindSpeed's ``PTNorm`` (it replaces ``LNImpl`` / ``WrappedTorchNorm``)."""


class MindSpeedLikeStandInTransformerLayer(TransformerLayer):
    """Stand-in for MindSpeed-LLM's ``TransformerLayer`` replacement."""


STAND_INS = {
    "ColumnParallelLinear": (ColumnParallelLinear, MindSpeedLikeStandInColumnParallelLinear),
    "RowParallelLinear": (RowParallelLinear, MindSpeedLikeStandInRowParallelLinear),
    "DotProductAttention": (DotProductAttention, MindSpeedLikeStandInDotProductAttention),
    "LNImpl": (WrappedTorchNorm, MindSpeedLikeStandInPTNorm),
    "WrappedTorchNorm": (WrappedTorchNorm, MindSpeedLikeStandInPTNorm),
    "TransformerLayer": (TransformerLayer, MindSpeedLikeStandInTransformerLayer),
}


def mindspeed_like_patch(monkeypatch, name: str, original, replacement) -> int:
    """Stand-in for MindSpeed's ``Patch.apply_patch``: rebind ``name`` in every loaded module
    where it is ``original`` (monkeypatch undoes it). Returns how many modules were patched.

    The class's own module is skipped: its methods call ``super(ClassName, self)``, which a
    subclass stand-in bound to that name would break (MindSpeed's replacements are separate
    classes, so MindSpeed rebinds that module too)."""
    count = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if getattr(module, "__name__", None) == original.__module__:
            continue
        if isinstance(namespace, dict) and namespace.get(name) is original:
            monkeypatch.setattr(module, name, replacement)
            count += 1
    return count


def provider_args(**overrides) -> Namespace:
    """The Megatron-LM args verl 0.8.0's ``gpt_model_provider`` reads (local layers: no TE
    here), with Megatron-LM's default ``apply_rope_fusion=True``."""
    args = dict(
        transformer_impl="local", spec=None, num_experts=None, moe_grouped_gemm=False,
        qk_layernorm=True, padded_vocab_size=VOCAB, max_position_embeddings=512,
        fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_percent=1.0,
        rotary_seq_len_interpolation_factor=None, apply_rope_fusion=True,
    )
    return Namespace(**{**args, **overrides})


@pytest.fixture
def stand_in_megatron_training(monkeypatch):
    """Stand-in ``megatron.training`` modules around one args namespace; returns the args."""
    args = provider_args()

    def core_transformer_config_from_args(a):
        return tiny_config("qwen3", apply_rope_fusion=a.apply_rope_fusion)

    def get_model(provider, model_type, wrap_with_ddp=True):
        return [provider(pre_process=True, post_process=True)]

    modules = {
        "megatron.training": dict(get_args=lambda: args),
        "megatron.training.arguments": dict(core_transformer_config_from_args=core_transformer_config_from_args),
        "megatron.training.training": dict(get_model=get_model),
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name, "stand-in (megatron.training is not in the megatron-core wheel)")
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return args


@pytest.fixture
def stand_in_mindspeed_state(monkeypatch):
    """Stand-in MindSpeed modules holding the globals verl's ``preprocess_for_mindspeed`` sets."""
    store = {}
    modules = {
        "mindspeed": {},
        ms_state.BATCH_UTILS: dict(set_actual_seq_len=lambda v: store.__setitem__("actual_seq_len", v)),
        ms_state.UTILS: dict(set_position_ids=lambda v: store.__setitem__("position_ids", v)),
        ms_state.ARGS_UTILS: dict(_MINDSPEED_ARGS=Namespace(reset_attention_mask=False)),
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name, "stand-in for a MindSpeed module (MindSpeed is not installed)")
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return store


# ----------------------------------------------------------------------------- helpers


def _attn(layer_spec):
    return layer_spec.submodules.self_attention


def _plan(seqs):
    return plan_prefix_tree([np.asarray(s) for s in seqs], min_prefix_len=1)


def _tree_logits(model, plan) -> torch.Tensor:
    """``[N, V]``: logits of every original token through one tree forward."""
    psp = TreePackedSeqParams.from_plan(plan)
    out = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None],
                attention_mask=None, packed_seq_params=psp)
    return plan.unpack(out[0])


def assert_tree_equals_stock(tree_model, stock_model, names=("tree", "prefix-of-another", "single-tokens", "grpo")):
    tree_model.load_state_dict(stock_model.state_dict(), strict=True)
    for name in names:
        seqs = FORESTS[name]
        ref = torch.cat([stock_forward(stock_model, s) for s in seqs])
        torch.testing.assert_close(_tree_logits(tree_model, _plan(seqs)), ref, **TOL, msg=name)


def _modules_of(model, cls) -> int:
    return sum(type(m) is cls for m in model.modules())


# ----------------------------------------------------------------------------- spec


def test_lazy_spec_follows_mindspeed_like_replacements(monkeypatch):
    """Spec conversion on a spec shaped like MindSpeed's: the stock local spec built after the
    classes were replaced keeps every replaced class except attention's."""
    args = provider_args(apply_rope_fusion=False)
    eager = ms_spec.tree_spec_from_args(args)  # built before MindSpeed's patches
    lazy = ms_spec.LazyTreeLayerSpec(lambda: args)
    assert lazy.resolve() == eager and lazy.module is STAND_INS["TransformerLayer"][0]  # read early
    for name, (original, stand_in) in STAND_INS.items():
        assert mindspeed_like_patch(monkeypatch, name, original, stand_in) > 0, name

    stock = stock_specs.get_gpt_layer_local_spec(None, False, qk_layernorm=True)  # MindSpeed-shaped
    tree = lazy.resolve()
    assert stock.module is MindSpeedLikeStandInTransformerLayer and tree.module is stock.module
    assert _attn(stock).submodules.linear_qkv is MindSpeedLikeStandInColumnParallelLinear
    assert _attn(stock).submodules.core_attention is MindSpeedLikeStandInDotProductAttention
    for field in ("input_layernorm", "pre_mlp_layernorm", "mlp", "self_attn_bda", "mlp_bda",
                  "sharded_state_dict_keys_map"):
        assert getattr(tree.submodules, field) == getattr(stock.submodules, field), field
    assert tree.submodules.mlp.submodules.linear_fc2 is MindSpeedLikeStandInRowParallelLinear
    for field in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(_attn(tree).submodules, field) is getattr(_attn(stock).submodules, field), field
    assert _attn(tree).params == _attn(stock).params
    assert _attn(tree).module is TreeSelfAttention
    assert _attn(tree).submodules.core_attention.module is TreeCoreAttention
    assert tree == to_tree_spec(stock)
    # what laziness avoids: a spec built before the patches keeps megatron's own classes (the
    # names in this module were rebound too, as MindSpeed rebinds every module's)
    assert _attn(eager).submodules.linear_qkv is STAND_INS["ColumnParallelLinear"][0]
    assert eager.module is STAND_INS["TransformerLayer"][0]

    # a GPTModel built from the lazy spec has the replaced layers and computes the tree exactly
    cfg = tiny_config("qwen3")
    model_kwargs = dict(vocab_size=VOCAB, max_sequence_length=512, position_embedding_type="rope",
                        share_embeddings_and_output_weights=False)
    stock_model = GPTModel(cfg, stock, **model_kwargs)
    randomize_(stock_model, seed=3)
    tree_model = GPTModel(cfg, lazy, **model_kwargs)
    assert _modules_of(tree_model, MindSpeedLikeStandInTransformerLayer) == cfg.num_layers
    # qkv and fc1 per layer, plus the output layer (GPTModel binds the name too)
    assert _modules_of(tree_model, MindSpeedLikeStandInColumnParallelLinear) == 2 * cfg.num_layers + 1
    assert _modules_of(tree_model, MindSpeedLikeStandInDotProductAttention) == 0
    assert _modules_of(tree_model, TreeCoreAttention) == cfg.num_layers
    assert_tree_equals_stock(tree_model, stock_model)


def test_spec_entry_through_verl_gpt_model_provider(stand_in_megatron_training):
    """``mcore_kwargs.spec=[ps_mcore.mindspeed.spec, get_tree_spec]`` through verl's real
    provider: megatron's import_module hands our object to GPTModel unchanged, and the model
    it builds computes every nasty forest exactly as the stock model per sequence."""
    from verl.workers.engine.mindspeed.utils import gpt_model_provider

    args = stand_in_megatron_training
    assert import_module(list(ms_spec.SPEC_ENTRY)) is ms_spec.get_tree_spec
    args.apply_rope_fusion = False
    stock_model = gpt_model_provider()
    randomize_(stock_model, seed=5)
    args.spec = ["ps_mcore.mindspeed.spec", "get_tree_spec"]  # what hydra hands over
    tree_model = gpt_model_provider()
    assert _modules_of(tree_model, TreeCoreAttention) == tree_model.config.num_layers
    assert list(tree_model.state_dict()) == list(stock_model.state_dict())
    assert_tree_equals_stock(tree_model, stock_model, names=tuple(FORESTS))

    args.tree_attention_backend = "reference"
    assert _attn(ms_spec.get_tree_spec.resolve()).submodules.core_attention.params == {"backend": "reference"}
    # Megatron-LM's default apply_rope_fusion=True is refused with the config line to set (the
    # provider cannot get that far on CPU: TransformerConfig wants TE for fused RoPE)
    with pytest.raises(ValueError, match="mcore_kwargs.apply_rope_fusion=False"):
        ms_spec.tree_spec_from_args(provider_args(apply_rope_fusion=True))


def test_tree_base_spec_and_spec_rewriting(stand_in_megatron_training, monkeypatch):
    args = stand_in_megatron_training
    args.apply_rope_fusion = False
    user = types.ModuleType("user_spec_stand_in", "stand-in for a user's --spec module")
    user.layer_spec = stock_specs.get_gpt_layer_local_spec(None, False, qk_layernorm=True, normalization="RMSNorm")
    user.block_spec = stock_specs.get_gpt_decoder_block_spec(tiny_config("qwen3"), False, normalization="RMSNorm")
    monkeypatch.setitem(sys.modules, "user_spec_stand_in", user)

    args.tree_base_spec = ["user_spec_stand_in", "layer_spec"]
    assert ms_spec.get_tree_spec.resolve() == to_tree_spec(user.layer_spec)
    args.tree_base_spec = ["user_spec_stand_in", "block_spec"]  # a block spec: GPTModel's block form
    block = ms_spec.get_tree_spec.resolve()
    assert block.submodules == to_tree_spec(user.block_spec)
    from megatron.core.transformer.transformer_block import TransformerBlock

    assert block.module is TransformerBlock
    for bad, match in ((["user_spec_stand_in"], "pair"), (list(ms_spec.SPEC_ENTRY), "itself"),
                       (["no_such_module_stand_in", "x"], "could not import"),
                       (["user_spec_stand_in", "missing"], "has no 'missing'")):
        args.tree_base_spec = bad
        with pytest.raises(ValueError, match=match):
            ms_spec.get_tree_spec.resolve()
    args.tree_base_spec = None
    args.reset_attention_mask = True
    with pytest.raises(ValueError, match="reset_attention_mask=False"):
        ms_spec.get_tree_spec.resolve()
    args.reset_attention_mask = False

    # rewriting the lazy spec (dataclasses.replace, to_tree_spec, assignment) gives concrete specs
    lazy = ms_spec.LazyTreeLayerSpec(lambda: args)
    fixed = dataclasses.replace(lazy, params={"x": 1})
    assert fixed.params == {"x": 1} and fixed.submodules == lazy.submodules
    assert to_tree_spec(lazy) == lazy.resolve()
    lazy.params = {"y": 2}
    args.qk_layernorm = False  # no longer read: the assignment fixed every field
    assert lazy.params == {"y": 2} and _attn(lazy).submodules.q_layernorm is not stock_specs.IdentityOp
    with pytest.raises(TypeError, match="unknown"):
        ms_spec.LazyTreeLayerSpec(bogus=1)


# ----------------------------------------------------------------------------- build patch


def _engine_shell(setting):
    """An instance of verl's MindSpeedMegatronEngineWithLMHead without its heavy __init__:
    the attributes its ``_build_megatron_module`` reads (stand-in bridge records the load)."""
    from verl.workers.config import MindSpeedEngineConfig
    from verl.workers.engine.mindspeed.transformer_impl import MindSpeedMegatronEngineWithLMHead

    engine = object.__new__(MindSpeedMegatronEngineWithLMHead)
    engine.engine_config = MindSpeedEngineConfig(forward_only=True, dtype="bfloat16")
    if setting is not None:
        object.__setattr__(engine.engine_config, ENGINE_ATTR, setting)
    engine.model_config = types.SimpleNamespace(architectures=["Qwen3ForCausalLM"], local_path="/stand-in")
    engine.vanilla_bridge = True
    engine.loaded = []
    engine.bridge = types.SimpleNamespace(load_weights=lambda module, path: engine.loaded.append(path))
    engine.enable_routing_replay = False
    engine._qat_enabled = False
    return engine


ON = PrefixSharingSetting(True, PrefixGrouperConfig())


@pytest.fixture
def build_patch():
    assert not ms_patch.installed()
    patcher = Patcher()
    assert ms_patch.install_mindspeed_build_patch(patcher) is True
    yield
    patcher.restore()
    assert not ms_patch.installed()


def test_build_patch_installs_and_restores_exactly():
    from verl.workers.engine.mindspeed.transformer_impl import MindSpeedMegatronEngineWithLMHead as cls

    before = dict(vars(cls))
    assert ms_patch.engine_available()
    first = Patcher()
    assert ms_patch.install_mindspeed_build_patch(first) is True and ms_patch.installed()
    patched = vars(cls)["_build_megatron_module"]
    assert patched is not before["_build_megatron_module"]
    assert ms_patch.install_mindspeed_build_patch(first) is False and vars(cls)["_build_megatron_module"] is patched
    patcher = Patcher()  # a second patcher sees it installed and adds nothing
    assert ms_patch.install_mindspeed_build_patch(patcher) is False and len(patcher) == 0
    first.restore()
    assert dict(vars(cls)) == before and not ms_patch.installed()
    first.restore()  # no-op
    assert ms_patch.install_mindspeed_build_patch(patcher) is True and ms_patch.installed()
    patcher.restore()
    assert dict(vars(cls)) == before and not ms_patch.installed()


def test_build_patch_builds_tree_model_and_restores_args(stand_in_megatron_training, build_patch, monkeypatch):
    args = stand_in_megatron_training
    before = dict(vars(args))
    engine = _engine_shell(ON)
    (model,) = engine._build_megatron_module()
    assert _modules_of(model, TreeCoreAttention) == model.config.num_layers
    assert model.config.apply_rope_fusion is False and engine.loaded == ["/stand-in"]
    assert vars(args) == before  # spec, tree_base_spec, apply_rope_fusion as they were

    # a user spec is converted, not replaced
    user = types.ModuleType("user_spec_stand_in", "stand-in for a user's --spec module")
    user.layer_spec = stock_specs.get_gpt_layer_local_spec(None, False, qk_layernorm=False)
    monkeypatch.setitem(sys.modules, "user_spec_stand_in", user)
    args.spec = ["user_spec_stand_in", "layer_spec"]
    (model,) = _engine_shell(ON)._build_megatron_module()
    assert _modules_of(model, TreeCoreAttention) == model.config.num_layers
    assert not any("q_layernorm" in n for n, _ in model.named_parameters())  # the user's spec
    assert args.spec == ["user_spec_stand_in", "layer_spec"] and "tree_base_spec" not in vars(args)
    args.spec = None

    # stock model: prefix sharing off for the engine, switched off, or reset-attention-mask
    args.apply_rope_fusion = False  # the stock provider would otherwise build a fused-RoPE config
    (model,) = _engine_shell(None)._build_megatron_module()
    assert _modules_of(model, TreeCoreAttention) == 0
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "0")
    (model,) = _engine_shell(ON)._build_megatron_module()
    assert _modules_of(model, TreeCoreAttention) == 0
    monkeypatch.setenv("ENABLE_PREFIX_SHARING", "1")
    args.reset_attention_mask = True
    with pytest.warns(UserWarning, match="reset-attention-mask"):
        (model,) = _engine_shell(ON)._build_megatron_module()
    assert _modules_of(model, TreeCoreAttention) == 0


# ----------------------------------------------------------------------------- global state


def test_tree_sequence_state_matches_verl_preprocess(stand_in_mindspeed_state, monkeypatch):
    """Our state for a tree micro-batch has the layout verl's real preprocess_for_mindspeed
    gives a stock one; for a plan without sharing the positions are the same."""
    import verl.models.mcore.util as util

    store = stand_in_mindspeed_state
    seqs = FORESTS["no-sharing"]
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    monkeypatch.setattr(util, "is_npu_available", True)
    util.preprocess_for_mindspeed(torch.zeros(1, dtype=torch.long), cu, lens, len(seqs))
    verl_cu, verl_pos = store["actual_seq_len"], store["position_ids"]

    plan = segment_plan([len(s) for s in seqs])  # no sharing, sequences in order
    assert ms_state.set_tree_sequence_state(TreePackedSeqParams.from_plan(plan)) is True
    got_cu, got_pos = store["actual_seq_len"], store["position_ids"]
    assert got_pos.dtype == verl_pos.dtype == torch.int32 and got_pos.shape == verl_pos.shape
    assert torch.equal(got_pos, verl_pos)
    assert got_cu.dtype == verl_cu.dtype and got_cu.tolist() == [0, int(cu[-1])]  # leading 0, as verl

    plan = _plan(FORESTS["tree"])
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)
    ms_state.set_tree_sequence_state(psp)
    t, t_pad = plan.num_tokens, psp.num_rows
    assert store["actual_seq_len"].tolist() == ([0, t, t_pad] if t_pad > t else [0, t])
    assert store["position_ids"].shape == (t_pad, 1)
    assert store["position_ids"][:t, 0].tolist() == plan.position_ids.tolist()
    assert store["position_ids"][t:].abs().sum() == 0
    with pytest.raises(ValueError, match="from_plan"):
        ms_state.set_tree_sequence_state(types.SimpleNamespace(plan=None, position_ids=None))


def test_unsupported_under_mindspeed(stand_in_mindspeed_state, monkeypatch):
    store = stand_in_mindspeed_state
    psp = TreePackedSeqParams.from_plan(_plan(FORESTS["grpo"]))
    assert ms_state.mindspeed_refusal() is None
    sys.modules[ms_state.ARGS_UTILS]._MINDSPEED_ARGS.reset_attention_mask = True
    assert "reset_attention_mask=False" in ms_state.mindspeed_refusal()
    with pytest.raises(NotImplementedError, match="reset-attention-mask"):
        ms_state.set_tree_sequence_state(psp)
    assert store == {}  # nothing set
    sys.modules[ms_state.ARGS_UTILS]._MINDSPEED_ARGS.reset_attention_mask = False
    megatron_args = types.ModuleType(ms_state.MEGATRON_GLOBAL_VARS, "stand-in for megatron.training.global_vars")
    megatron_args._GLOBAL_ARGS = Namespace(reset_attention_mask=True)  # mindspeed_megatron's args
    monkeypatch.setitem(sys.modules, ms_state.MEGATRON_GLOBAL_VARS, megatron_args)
    assert ms_state.mindspeed_refusal() == ms_state.RESET_ATTENTION_MASK_REFUSAL
    megatron_args._GLOBAL_ARGS.reset_attention_mask = False
    assert ms_state.mindspeed_refusal() is None
    monkeypatch.setattr(ms_state, "_context_parallel_size", lambda: 2)
    assert ms_state.mindspeed_refusal() == ms_state.CONTEXT_PARALLEL_REFUSAL


def test_no_mindspeed_loaded_is_a_no_op():
    assert "mindspeed" not in sys.modules
    psp = TreePackedSeqParams.from_plan(_plan(FORESTS["tree"]))
    assert ms_state.set_tree_sequence_state(psp) is False
    assert ms_state.mindspeed_refusal() is None and not ms_state.reset_attention_mask_active()
    assert "torch_npu" not in sys.modules and "mindspeed" not in sys.modules


# ----------------------------------------------------------------------------- documented config


def _documented_overrides() -> list[str]:
    """The CLI lines of the first code block in docs/mindspeed.md's "MindSpeed wiring"."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "mindspeed.md").read_text()
    section = doc[doc.index("## MindSpeed wiring"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_documented_config_reaches_the_engine():
    from verl.utils.config import omega_conf_to_dataclass
    from verl_helpers import BASE_OVERRIDES, compose, verl_config_dir

    from ps_mcore.integrations.verl_common.config import install_config_patches, reset_actor_setting, resolve_setting

    overrides = _documented_overrides()
    assert "model_engine=mindspeed" in overrides
    patcher = Patcher()
    install_config_patches(patcher)  # the patchset's config patch (prefix_grouper keys)
    try:
        cfg = compose(verl_config_dir(), "ppo_trainer", BASE_OVERRIDES + overrides)
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    finally:
        patcher.restore()
        reset_actor_setting()
    kwargs = actor.mindspeed.mcore_kwargs
    assert actor.mindspeed.strategy == "mindspeed_megatron"
    assert import_module(kwargs["spec"]) is ms_spec.get_tree_spec
    assert kwargs["reset_attention_mask"] is False and kwargs["apply_rope_fusion"] is False
    assert resolve_setting(actor.mindspeed) is not None  # prefix sharing on for this engine
    assert list(cfg.actor_rollout_ref.ref.mindspeed.mcore_kwargs.spec) == list(ms_spec.SPEC_ENTRY)
