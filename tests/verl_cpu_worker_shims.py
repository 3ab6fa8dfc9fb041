"""Test-only shims that let verl 0.8.0's real ``ActorRolloutRefWorker`` (both engines, with
their real ``__init__``, model build, optimizer and ``update_actor``) run on a CPU in an
fp32 gloo world of one. ``benchmarks/verl_actor.py --tiny`` installs them; nothing here is
library code.

What each shim stands in for (all hardware or fp32 gaps, none changes the math):

* ``EngineRegistry``: verl registers its engines for ``cuda``/``npu`` only; the same classes
  are registered for ``cpu``.
* ``torch.cpu`` memory statistics verl logs (``memory_reserved`` ...) return 0; pinning host
  memory (FSDP2's CPU offload policy, which verl gives every forward-only engine) is a no-op.
* Megatron: ``torch.cuda.current_device`` -> "cpu" and the RNG tracker (``megatron_shims``);
  mbridge's ``get_model`` calls ``module.cuda()`` (a no-op here); mbridge hard-codes the TE
  layer spec, redirected to megatron's local layers converted by ``to_tree_spec`` (the only
  THD attention that runs on CPU: with plain packed params it is per-sequence causal
  attention, so the stock run is still verl's stock forward); mbridge's Qwen2 weight-name
  table learns the local spec's two norm names (TE fuses them into the linear layers); the
  no-pipelining schedule allocates a CUDA counter (``cpu_forward_backward_func``); megatron's
  optimizer, grad-norm and multi-tensor helpers allocate ``device="cuda"`` tensors
  (redirected to the CPU); verl's ``McoreEngineConfig`` accepts only bf16/fp16 and its
  optimizer config forces ``bf16`` (fp32 allowed here: exactness is checked in fp32).
* Megatron's full recompute (``--recompute``) saves and restores the CUDA RNG state around the
  rerun layer (``megatron_shims.enable_cpu_recompute``: none on the CPU, and no dropout).
* Megatron's fused LM head (``use_fused_kernels``): verl's Triton ``linear_cross_entropy``
  (CUDA) is ``megatron_shims.cpu_linear_cross_entropy``, verl's torch kernel; a process that
  called it says how often on stderr when it exits.
* Activation recompute (``--recompute``), not a shim but its witness: a process that reran
  decoder layers inside a backward pass (Megatron's full recompute: its ``TransformerLayer``;
  HF's gradient checkpointing: each layer's attention module) says how often on stderr when it
  exits.
* Megatron MoE (``megatron_shims.enable_cpu_moe``): the alltoall dispatcher's side CUDA
  stream and host copies; mbridge asks for grouped-GEMM experts (TE's or the ``grouped_gemm``
  CUDA kernels), here megatron's ``SequentialMLP`` (the same experts, one GEMM each).
"""

from __future__ import annotations

import atexit
import functools
import sys

import torch

_CUDA_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


class _CpuTorch:
    """``torch`` as a megatron module sees it: factories asked for ``device="cuda"`` build on
    the CPU."""

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in _CUDA_FACTORIES:
            return fn

        def call(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return fn(*args, device=device, **kwargs)

        return call


def _register_engines_for_cpu() -> None:
    from verl.workers.engine.base import EngineRegistry

    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (registers the engines)
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401

    for backends in EngineRegistry._engines.values():
        for devices in backends.values():
            if "cuda" in devices:
                devices.setdefault("cpu", devices["cuda"])


def _cpu_memory_stats() -> None:
    for name in ("memory_reserved", "memory_allocated", "max_memory_allocated", "max_memory_reserved"):
        setattr(torch.cpu, name, lambda *args, **kwargs: 0)
    torch.cpu.empty_cache = lambda *args, **kwargs: None
    torch.cpu.reset_peak_memory_stats = lambda *args, **kwargs: None
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # FSDP2's ref offload policy pins


def _megatron_fp32() -> None:
    from verl.workers.config.engine import McoreEngineConfig

    import verl.utils.megatron.optimizer as verl_optimizer

    post_init = McoreEngineConfig.__post_init__

    def accept_fp32(self):
        dtype = self.dtype
        object.__setattr__(self, "dtype", "bfloat16" if dtype == "float32" else dtype)
        post_init(self)
        object.__setattr__(self, "dtype", dtype)

    McoreEngineConfig.__post_init__ = accept_fp32
    optim_config = verl_optimizer.init_megatron_optim_config

    def fp32_optim_config(*args, **kwargs):
        config = optim_config(*args, **kwargs)
        config.bf16 = False  # fp32 params: megatron's FP32Optimizer
        return config

    verl_optimizer.init_megatron_optim_config = fp32_optim_config


def _megatron_on_cpu() -> None:
    from mbridge.core import llm_bridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer
    from verl.models.mcore import model_forward_fused
    from verl.workers.engine.megatron import transformer_impl

    from megatron_shims import cpu_linear_cross_entropy, enable_cpu_moe, enable_cpu_recompute, init_cpu_megatron
    from ps_mcore.layer_specs import to_tree_spec
    from verl_batches import cpu_forward_backward_func

    init_cpu_megatron()
    enable_cpu_moe()
    enable_cpu_recompute()
    rows = []  # one entry per call: the rows the kernel saw
    model_forward_fused.linear_cross_entropy = functools.partial(cpu_linear_cross_entropy, rows_seen=rows)
    atexit.register(lambda: rows and print(f"CPU fused LM-head kernel: {len(rows)} calls, {sum(rows)} rows",
                                           file=sys.stderr))
    torch.nn.Module.cuda = lambda self, device=None: self
    stock_block_spec = llm_bridge.get_gpt_decoder_block_spec

    def local_layers(config, use_transformer_engine, **kwargs):
        return to_tree_spec(stock_block_spec(config, False, **kwargs))

    llm_bridge.get_gpt_decoder_block_spec = local_layers
    Qwen2Bridge._OTHER_MAPPING = {
        **getattr(Qwen2Bridge, "_OTHER_MAPPING", {}),
        "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    }
    Qwen2Bridge._MLP_MAPPING = {
        **Qwen2Bridge._MLP_MAPPING,
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
    }
    transformer_impl.get_forward_backward_func = cpu_forward_backward_func
    for module in (optimizer, clip_grads, mcore_utils):
        module.torch = _CpuTorch()


def _count_recomputed_layers() -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    recomputed = {"megatron": 0, "fsdp": 0}

    def hf_attention(module) -> bool:
        # one per HF decoder layer: a checkpointed layer reruns its forward, not its __call__
        kind = type(module)
        return kind.__module__.startswith("transformers.models.") and kind.__name__.endswith("Attention")

    def count(module, args):
        # -1 outside autograd's engine: a layer run by a backward pass is a recompute
        if torch._C._current_graph_task_id() != -1:
            if isinstance(module, TransformerLayer):
                recomputed["megatron"] += 1
            elif hf_attention(module):
                recomputed["fsdp"] += 1

    torch.nn.modules.module.register_module_forward_pre_hook(count)
    atexit.register(lambda: print("CPU layer forwards recomputed in backward: "
                                  f"{recomputed['megatron']} megatron, {recomputed['fsdp']} fsdp", file=sys.stderr))


def install_cpu_worker_shims() -> None:
    """Everything above (idempotent enough for one process: call once)."""
    _count_recomputed_layers()
    _register_engines_for_cpu()
    _cpu_memory_stats()
    _megatron_fp32()
    _megatron_on_cpu()


# Megatron's FP32Optimizer clips with a CUDA-typed assert (``param.grad.type()``): the tiny
# run sets ``optim.clip_grad=0`` (grad norms are still computed and compared).
TINY_MEGATRON_OVERRIDES = {"optim.clip_grad": 0.0, "megatron.dtype": "float32",
                           "megatron.use_distributed_optimizer": False}
MEGATRON_CPU_TRANSFORMER_CONFIG = dict(
    use_cpu_initialization=True, gradient_accumulation_fusion=False, apply_rope_fusion=False,
    bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
    persist_layer_norm=False,
    moe_grouped_gemm=False,  # grouped GEMM experts need TE or the grouped_gemm CUDA kernels: SequentialMLP
)
