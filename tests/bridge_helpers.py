"""Megatron-Bridge test helpers: tiny Hugging Face checkpoints written by the test (config +
safetensors, random weights large enough for sharp attention), Bridge providers set up for the
CPU (fp32, fusions off), models built through ``provide_distributed_model`` and HF weights
loaded strictly (every Megatron parameter written, and Bridge's export gives back exactly the
checkpoint's tensors).

A CPU test module starts with :func:`require_bridge` and imports the :func:`cpu_bridge`
fixture (the shims for that module only); a worker process calls :func:`prepare_cpu_bridge`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import pytest
import torch
from flip_free_routing import HF_ROUTING_NAMES, route_by_token_

VOCAB = 128


def require_bridge() -> None:
    """Skip the calling test module unless Megatron-Bridge is installed (found without importing
    it: it imports transformer_engine); then a gloo world of 1 for megatron."""
    import importlib.util

    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("Megatron-Bridge is not installed", allow_module_level=True)
    from megatron_shims import init_cpu_megatron

    init_cpu_megatron(1)


# Megatron records a model's attention backend in these variables when it builds the model and
# asserts them at the next build (flash for verl's and Gemma's Bridge providers, auto elsewhere);
# Transformer Engine reads them whenever its attention runs.
ATTENTION_BACKEND_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def clear_attention_backend_env() -> None:
    """Cleared between builds of different setups in one process."""
    for var in ATTENTION_BACKEND_ENV:
        os.environ.pop(var, None)


@contextlib.contextmanager
def own_attention_backend_env():
    """The attention-backend variables unset for the block (its models build and run with their
    own backend) and put back as they were after it."""
    with pytest.MonkeyPatch.context() as patch:
        for var in ATTENTION_BACKEND_ENV:
            patch.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module", autouse=True)
def cpu_bridge():
    """The CPU shims for the importing test module only (other modules see megatron as is)."""
    with pytest.MonkeyPatch.context() as patch:
        prepare_cpu_bridge(patch)
        yield
    clear_attention_backend_env()


def prepare_cpu_bridge(monkeypatch=None) -> None:
    """The TE import stub (for the process), megatron's Mamba and MoE kernels as torch
    stand-ins (as the Mamba and MoE tests shim them), and, scoped by ``monkeypatch`` (default: the
    rest of the process), the CPU TE specs and ``Module.cuda`` a no-op without a GPU (Bridge
    moves a model it did not initialise on the CPU to the GPU)."""
    from mamba_shims import shim_mamba_for_cpu
    from megatron_shims import allow_local_expert_bias_backward, enable_cpu_moe
    from te_cpu_shims import install_te_import_stub, use_cpu_te_specs

    monkeypatch = monkeypatch or pytest.MonkeyPatch()
    install_te_import_stub()
    use_cpu_te_specs(monkeypatch)
    shim_mamba_for_cpu()
    enable_cpu_moe()
    allow_local_expert_bias_backward()  # GPT-OSS's expert biases in megatron's local experts
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)


def hf_config(family: str, layers: int | None = None):
    """The tiny HF config of a model family Megatron-Bridge 0.6.2 converts (``layers``
    transformer layers; default 2, Nemotron-H's 4 are its pattern; GPT-OSS eager, so the HF
    reference applies its sliding window and sinks itself)."""
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    if layers is not None and family != "nemotron_h":
        common["num_hidden_layers"] = layers
    if family == "qwen2":  # GQA 4/2, qkv bias
        return transformers.Qwen2Config(**{"num_hidden_layers": 2, **common}, hidden_size=64, intermediate_size=96,
                                        num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3":  # GQA 6/2, head dim 10 (decoupled), qk-norm
        return transformers.Qwen3Config(**{"num_hidden_layers": 2, **common}, hidden_size=48, intermediate_size=80,
                                        num_attention_heads=6, num_key_value_heads=2, head_dim=10)
    if family == "qwen3_moe":  # 4 experts, top-2, every layer MoE
        return transformers.Qwen3MoeConfig(
            hidden_size=48, intermediate_size=80, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
            num_attention_heads=6, num_key_value_heads=2, head_dim=10, **{"num_hidden_layers": 2, **common})
    if family == "nemotron_h":  # hybrid: Mamba-2, attention (no RoPE), Mamba-2, squared-ReLU MLP
        # chunk_size >= every test sequence: transformers' CPU path for Mamba-2 (torch_forward)
        # drifts across chunks (measured 3e-3 at 2 chunks of 8) while one chunk is the exact
        # recurrence; time_step_min ~ 0: that path clamps dt below by it, the kernels do not
        return transformers.NemotronHConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, hybrid_override_pattern="M*M-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
            mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=64, use_mamba_kernels=False,
            time_step_min=1e-9, time_step_floor=1e-10, **common)
    if family == "gpt_oss":  # sliding window 3 / full layers alternating, per-head sinks, MoE 4 experts top-2
        return transformers.GptOssConfig(
            **{"num_hidden_layers": 2, **common}, hidden_size=64, intermediate_size=24, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
            attn_implementation="eager", experts_implementation="eager")
    if family == "gemma3":  # 5 local (window GEMMA3_WINDOW) : 1 global, two RoPE bases, query_pre_attn_scalar != head dim
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": layers or 6, "tie_word_embeddings": True}, hidden_size=64,
            intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=GEMMA3_WINDOW, attn_implementation="eager",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if family == "qwen2_5_vl":  # GQA 4/2 text with mrope 2/3/3, a 2-block vision tower (windows, then full)
        text = dict(vocab_size=VOCAB + 32, hidden_size=64, intermediate_size=96, num_hidden_layers=layers or 2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    bos_token_id=VLM_TOKENS["bos_token_id"], eos_token_id=VLM_TOKENS["eos_token_id"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, patch_size=2,
                      temporal_patch_size=1, spatial_merge_size=2, in_channels=3, window_size=8,
                      fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                             **VLM_TOKENS)
    raise ValueError(f"unknown family {family!r}")


# the tiny Qwen2.5-VL's special tokens (tests/vlm_samples.py; above the text ids, inside its vocabulary)
VLM_TOKENS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153,
                  bos_token_id=154, eos_token_id=155)

GEMMA3_WINDOW = 4  # the tiny Gemma 3's sliding window (tokens)

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "nemotron_h", "gpt_oss")


def _sharpen_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough for sharp attention (``megatron_shims.randomize_``), Mamba's A / dt /
    D around their usual values."""
    from megatron_shims import randomize_

    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".sinks"):  # GPT-OSS sink logits of both signs, some dominating
                p.copy_(torch.linspace(-3.0, 3.0, p.numel()))


def write_hf_checkpoint(family: str, path: Path, seed: int = 0, layers: int | None = None,
                        dtype: torch.dtype = torch.float32, flip_free_routing: bool = False):
    """Write ``config.json`` + ``model.safetensors`` of a random tiny ``family`` model to
    ``path`` in ``dtype``; returns the HF model (eval, fp32, the checkpoint's values) and the
    checkpoint's tensors by name. ``flip_free_routing``: an MoE family's routers pick their
    top-k by token id with wide margins (tests/flip_free_routing.py), for bf16 runs compared
    per token; no change to a dense family."""
    import transformers
    from safetensors.torch import save_file

    config = hf_config(family, layers)
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "nemotron_h": "NemotronHForCausalLM", "gpt_oss": "GptOssForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[family]
    model = getattr(transformers, arch)(config).float().eval()
    _sharpen_(model, seed)
    if flip_free_routing and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        if family not in HF_ROUTING_NAMES:
            raise ValueError(f"flip_free_routing: no routing parameter names for {family!r}")
        route_by_token_(model, HF_ROUTING_NAMES[family], seed)
    # the HF model holds the checkpoint's values, in fp32: its parameters rounded to dtype, its
    # buffers untouched (casting the model to dtype and back would round RoPE's fp32
    # ``inv_freq`` too: with bf16, log-prob errors of 0.2 at position ~500 against an exact
    # fp32 model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    if family == "nemotron_h":
        # Nemotron-H checkpoints name the trunk backbone.*; transformers 5.9 renames it to model.*
        # on load, and its save_pretrained writes backbone.embedding.weight, a key
        # Megatron-Bridge 0.6.2 does not map (it reads backbone.embeddings.weight)
        config.architectures = [arch]
        config.save_pretrained(path)
        tensors = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v.detach().to(dtype).contiguous()
                   for k, v in model.state_dict().items()}
        save_file(tensors, str(Path(path) / "model.safetensors"))
    else:
        copy.deepcopy(model).to(dtype).save_pretrained(path)
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    return model, tensors


CPU_PROVIDER = dict(
    params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False, fp16=False,
    use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
    masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
    persist_layer_norm=False, cross_entropy_loss_fusion=False, moe_permute_fusion=False,
    moe_grouped_gemm=False, moe_router_fusion=False, moe_token_dispatcher_type="alltoall",
    moe_shared_expert_overlap=False, first_last_layers_bf16=False,
)


def cpu_overrides(provider, **extra) -> dict:
    """The provider fields that make its model run on the CPU in fp32 (only those it has)."""
    return {k: v for k, v in {**CPU_PROVIDER, **extra}.items() if hasattr(provider, k)}


def bridge_and_provider(path: Path, **overrides):
    """``AutoBridge.from_hf_pretrained(path)`` and its provider set up for the CPU, finalized."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(path))
    provider = bridge.to_megatron_provider(load_weights=False)
    for key, value in cpu_overrides(provider, **overrides).items():
        setattr(provider, key, value)
    provider.finalize()
    return bridge, provider


def build(provider) -> list:
    """The provider's model chunks, built on the CPU (no DDP, no fp16 wrapper)."""
    clear_attention_backend_env()  # families differ in attention backend
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                              mixed_precision_wrapper=None)


def load_strictly(bridge, chunks: list, tensors: dict) -> None:
    """Bridge's HF load into ``chunks``, checked both ways: every parameter was written (all are
    NaN before), and exporting the model gives back exactly the checkpoint's tensors (same names,
    same values)."""
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.fill_(float("nan"))
    bridge.load_hf_weights(chunks)
    unloaded = [n for c in chunks for n, p in c.named_parameters() if torch.isnan(p).any()]
    assert not unloaded, f"parameters Megatron-Bridge did not load: {unloaded}"
    exported = dict(bridge.export_hf_weights(chunks, cpu=True, show_progress=False))
    assert sorted(exported) == sorted(tensors), (sorted(set(exported) ^ set(tensors)))
    for name, value in tensors.items():
        assert torch.equal(exported[name].float(), value.float()), name


# ----------------------------------------------------------------------------- verl's engine

# What the CPU needs beyond verl's own provider overrides (verl's Bridge path passes
# engine_config.override_transformer_config to the provider; dtypes come from engine_config.dtype)
ENGINE_CPU_OVERRIDES = {k: v for k, v in CPU_PROVIDER.items() if not isinstance(v, torch.dtype)}


class ModelConfig(dict):
    """verl's ``HFModelConfig`` surface the Megatron engine's build reads (a real one loads a
    tokenizer the tiny checkpoints do not have)."""

    __getattr__ = dict.__getitem__


def bridge_engine(cls, path: Path, setting=None, value: bool = False, **engine_config):
    """An instance of verl's Megatron engine class ``cls`` built by verl's own
    ``_build_tf_config`` (``AutoBridge.from_hf_pretrained(path)``, verl's provider overrides)
    and ``_build_megatron_module`` (the provider builds the model, Bridge loads the HF weights),
    without its optimizer or checkpoint manager (``forward_only``: no DDP wrapper; gradients land
    in ``param.grad``). ``setting``: the prefix-sharing setting on the engine config."""
    from types import SimpleNamespace

    import transformers
    from verl.workers.config import McoreEngineConfig

    from ps_mcore.integrations.verl_common.config import ENGINE_ATTR

    options = dict(forward_only=True, use_remove_padding=True, sequence_parallel=False,
                   override_transformer_config=dict(ENGINE_CPU_OVERRIDES))
    options.update(engine_config)
    config = McoreEngineConfig(**options)
    object.__setattr__(config, "dtype", "float32")  # verl validates bf16/fp16 only: fp32 is the CPU oracle
    if setting is not None:
        object.__setattr__(config, ENGINE_ATTR, setting)
    engine = object.__new__(cls)
    engine.engine_config = config
    hf_config = transformers.AutoConfig.from_pretrained(str(path))
    engine.model_config = ModelConfig(
        model_type="value_model" if value else "language_model", local_path=str(path), hf_config=hf_config,
        trust_remote_code=False, share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        mtp=SimpleNamespace(enable=False, enable_train=False), lora={},
        tokenizer=SimpleNamespace(pad_token_id=0), architectures=hf_config.architectures,
    )
    engine.optimizer_config = {}
    engine.enable_routing_replay = False
    engine._qat_enabled = False
    engine.mini_layer_topk_idx_list = []
    engine._build_tf_config()
    clear_attention_backend_env()
    engine.module = engine._build_megatron_module()
    return engine
