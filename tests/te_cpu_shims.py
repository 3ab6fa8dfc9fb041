"""Test-only: Megatron-Bridge (which imports Transformer Engine at import) and its TE layer specs
on a machine without a GPU.

Why a shim and not TE itself: transformer-engine 2.20.2's core library links the NVIDIA driver
(``libcuda.so.1``: ``import transformer_engine`` fails without it) and its torch extension
ships as source that needs nvcc; its kernels need a GPU anyway. So:

* :func:`install_te_import_stub` makes ``import transformer_engine[.anything]`` succeed with
  placeholder classes (instantiating one raises), AFTER every megatron-core module that probes
  for TE has been imported: megatron-core keeps seeing no TE (``HAVE_TE = False``, its
  documented no-TE mode), only Megatron-Bridge's own imports see the stub.
* The modules megatron-core's TE specs name are mapped to CPU modules with TE's parameter
  names and checkpoint keys (so Bridge's HF<->Megatron mappings, written for the TE spec, load
  every weight): :class:`TELayerNormColumnParallelLinearCPU` (fused norm + megatron's
  ColumnParallelLinear; ``layer_norm_weight`` / ``layer_norm_bias``), :class:`TENormCPU`
  (zero-centred gamma, sequence-parallel marks), :class:`TEDotProductAttentionCPU` (causal sbhd
  and THD attention with TE's ``_extra_state``), megatron's Column/RowParallelLinear for TE's
  (same names). :func:`use_cpu_te_specs` installs the mapping where models are built: the GPT
  TE spec provider megatron-core uses, and Bridge's default hybrid stack spec.

Never used by the library.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import types
import unittest.mock
from pathlib import Path

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- import stub


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")


class _Placeholder(metaclass=_PlaceholderMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: Transformer Engine is a CPU test stub here")


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name, (_Placeholder,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-test-stub"
        return module

    def exec_module(self, module):
        pass


_TE_IMPORT = re.compile(r"^\s*(import|from) transformer_engine", re.M)


def install_te_import_stub() -> None:
    """Import every megatron-core module that probes for TE (they settle on no TE), then let
    ``transformer_engine`` import as a stub. Idempotent; raises if a real TE is importable."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("a real transformer_engine is installed: these CPU shims are not needed")
    import megatron.core

    root = Path(megatron.core.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if _TE_IMPORT.search(path.read_text(errors="ignore")):
            name = ".".join(("megatron", "core", *path.relative_to(root).with_suffix("").parts))
            try:
                importlib.import_module(name.removesuffix(".__init__"))
            except Exception:  # modules needing other optional packages: never built here
                pass
    sys.meta_path.insert(0, _StubFinder())


# ----------------------------------------------------------------------------- CPU modules


def _norm(x, weight, bias, eps, rms: bool, zero_centered: bool):
    gamma = weight + 1 if zero_centered else weight
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp64 runs stay fp64 (an exact oracle)
    xf = x.to(dtype)
    if rms:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], eps=eps)
    y = y * gamma.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(x.dtype)


class _CPUNorm(torch.nn.Module):
    """TE's ``RMSNorm`` / ``LayerNorm`` (``weight``, ``bias``; zero-centred gamma)."""

    def __init__(self, config, hidden_size: int, eps: float):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x, residual=None):
        assert residual is None, "fused residual norms are not shimmed"
        return _norm(x, self.weight, self.bias, self.eps, self.rms, self.zero_centered)


class TENormCPU:
    """``TENorm``'s contract on CPU (``config.normalization`` picks RMSNorm or LayerNorm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        return _CPUNorm(config, hidden_size, eps)


def _column_parallel_linear():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


class TELayerNormColumnParallelLinearCPU(_column_parallel_linear()):
    """``TELayerNormColumnParallelLinear`` on CPU: the norm (``layer_norm_weight``, and
    ``layer_norm_bias`` for LayerNorm, replicated) fused in front of megatron's
    ColumnParallelLinear (``weight``, ``bias``: TE's names)."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias,
                 skip_bias_add, is_expert, skip_weight_param_allocation=False,
                 tp_comm_buffer_name=None, tp_group=None, stride=1, name=None):
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add,
                         is_expert=is_expert, tp_group=tp_group)
        self.norm_eps = config.layernorm_epsilon
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = (
            None if self.rms else torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype)))
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = config.sequence_parallel

    def forward(self, x, weight=None, runtime_gather_output=None):
        x = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.norm_eps, self.rms, self.zero_centered)
        return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)


def _causal_attention(q, k, v, scale, window=None, sinks=None):
    """q ``[s, hq, d]``, k/v ``[s, hk, d]`` -> ``[s, hq, dv]`` causal (GQA grouped); TE's
    ``window_size=(left, 0)`` lets query i see keys ``i - left .. i``; ``sinks`` ``[hq]``: TE's
    learnable / off-by-one softmax, ``exp(sink)`` added to every row's denominator."""
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp64 runs stay fp64 (an exact oracle)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k.to(dtype)) * scale
    mask = torch.ones(q.size(0), k.size(0), dtype=torch.bool, device=q.device).triu(1)
    if window is not None and window[0] >= 0:
        mask |= torch.ones_like(mask).tril(-window[0] - 1)
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.to(dtype)[:, None, None].expand(-1, q.size(0), 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v.to(dtype)).to(q.dtype)


class TEDotProductAttentionCPU(torch.nn.Module):
    """TE's ``DotProductAttention`` contract on CPU: causal attention on sbhd batches or THD
    packed sequences (``cu_seqlens_q_padded`` segments, each causal), with the layer's sliding
    window and sink softmax as megatron's ``TEDotProductAttention`` configures TE, TE's
    checkpoint state (an empty uint8 ``_extra_state``, the learnable ``softmax_offset``). No
    context parallelism, no arbitrary masks."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, num_splits=None,
                 cp_comm_type="p2p", pg_collection=None, **kwargs):
        super().__init__()
        if config.context_parallel_size > 1:
            raise NotImplementedError("the CPU TE attention shim has no context parallelism")
        from megatron.core.transformer.utils import is_layer_window_attention

        self.config = config
        self.softmax_scale = softmax_scale
        self.fp8_state = torch.empty(0, dtype=torch.uint8)
        # as TEDotProductAttention hands them to TE: this layer's window and TE's sink logits
        # (learnable: a float32 zeros parameter of [heads per TP rank]; off-by-one: zeros)
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window_size = config.window_size if windowed else None
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads))
        else:
            self.softmax_offset = torch.zeros(heads) if config.softmax_type == "off-by-one" else None

    def get_extra_state(self):
        return self.fp8_state

    def set_extra_state(self, state):
        if state is not None:
            self.fp8_state = state

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        scale = self.softmax_scale or query.size(-1) ** -0.5
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            q, k, v = (t.reshape(t.size(0), t.size(-2), t.size(-1)) for t in (query, key, value))
            bounds = packed_seq_params.cu_seqlens_q_padded
            if bounds is None:
                bounds = packed_seq_params.cu_seqlens_q
            bounds = bounds.tolist()
            out = torch.zeros(q.size(0), q.size(1), v.size(-1), dtype=q.dtype, device=q.device)
            pieces = [_causal_attention(q[a:b], k[a:b], v[a:b], scale, self.window_size, self.softmax_offset)
                      for a, b in zip(bounds, bounds[1:])]
            out = torch.cat(pieces) if bounds[-1] == q.size(0) else torch.cat(
                pieces + [out[bounds[-1]:]])
            return out.reshape(out.size(0), -1)
        s, b = query.shape[:2]
        outs = [_causal_attention(query[:, i], key[:, i], value[:, i], scale, self.window_size, self.softmax_offset)
                for i in range(b)]
        return torch.stack(outs, 1).reshape(s, b, -1)


# ----------------------------------------------------------------------------- specs


def _te_classes() -> dict:
    """megatron-core's TE module names (MagicMocks / refusing classes without TE) -> CPU modules."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    pairs = {
        "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinearCPU,
        "TEColumnParallelLinear": ColumnParallelLinear,
        "TERowParallelLinear": RowParallelLinear,
        "TENorm": TENormCPU,
        "TEDotProductAttention": TEDotProductAttentionCPU,
    }
    return {id(getattr(te_ext, name)): cpu for name, cpu in pairs.items() if getattr(te_ext, name, None) is not None}


def _unshimmed(mock) -> type:
    """A TE module no test here builds (TELinear of DSA / MLA layers): a class that refuses to
    be built, in place of megatron's MagicMock (which Bridge's spec deep copies cannot copy)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{mock!r}: Transformer Engine module without a CPU shim")

    return type("UnshimmedTEModule", (torch.nn.Module,), {"__init__": __init__})


def cpu_te_spec(spec, _mapping: dict | None = None, _seen: dict | None = None):
    """``spec`` (a ModuleSpec, submodules dataclass, partial or class) with every TE module
    megatron-core names replaced by its CPU module; shared sub-specs stay shared."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    mapping = _te_classes() if _mapping is None else _mapping
    seen = {} if _seen is None else _seen
    if id(spec) in mapping:
        return mapping[id(spec)]
    if id(spec) in seen:
        return seen[id(spec)]
    if isinstance(spec, ModuleSpec):
        out = dataclasses.replace(
            spec, module=cpu_te_spec(spec.module, mapping, seen),
            submodules=cpu_te_spec(spec.submodules, mapping, seen))
    elif isinstance(spec, functools.partial):
        out = functools.partial(cpu_te_spec(spec.func, mapping, seen), *spec.args,
                                **{k: cpu_te_spec(v, mapping, seen) for k, v in spec.keywords.items()})
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        out = dataclasses.replace(spec, **{f.name: cpu_te_spec(getattr(spec, f.name), mapping, seen)
                                           for f in dataclasses.fields(spec) if f.init})
    elif isinstance(spec, list):
        out = [cpu_te_spec(s, mapping, seen) for s in spec]
    elif isinstance(spec, unittest.mock.NonCallableMock):
        out = _unshimmed(spec)
    else:
        out = spec
    seen[id(spec)] = out
    return out


def _cpu_te_spec_provider():
    from megatron.core.models.backends import LocalSpecProvider

    class TESpecProviderCPU(LocalSpecProvider):
        """megatron-core's ``TESpecProvider`` with the CPU modules above (TE's parameter names)."""

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinearCPU

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
            return TENormCPU

        def core_attention(self):
            return TEDotProductAttentionCPU

    return TESpecProviderCPU


def use_cpu_te_specs(monkeypatch) -> None:
    """Where models are built: megatron-core's GPT TE spec builder (its ``TESpecProvider``, None
    without TE), the final norms TE would give a GPT block (``LayerNormImpl``) and ``HybridStack``
    (``TENorm`` unconditionally), and Megatron-Bridge's default hybrid stack spec get the CPU
    modules."""
    from megatron.bridge.models.hybrid import hybrid_provider
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron.core.models.hybrid import hybrid_block

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _cpu_te_spec_provider())
    from megatron.core.transformer import transformer_block

    monkeypatch.setattr(hybrid_block, "TENorm", TENormCPU)  # HybridStack's final norm
    monkeypatch.setattr(transformer_block, "LayerNormImpl", TENormCPU)  # a GPT block's final norm under TE
    stock = hybrid_provider.get_default_hybrid_stack_spec
    monkeypatch.setattr(hybrid_provider, "get_default_hybrid_stack_spec",
                        lambda config: cpu_te_spec(stock(config)))
    # Bridge picks a weight's TP layout by its module's class name: the CPU attention's sink
    # logits (GPT-OSS) split by head as TEDotProductAttention's
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("TEDotProductAttentionCPU", "column")


# ----------------------------------------------------------------------------- Gemma 3 (Bridge)


class Gemma3TEDotProductAttentionCPU(TEDotProductAttentionCPU):
    """Megatron-Bridge's ``Gemma3TEDotProductAttention`` on the CPU: the same per-layer config
    rewrite (its ``__init__``: local layers the window ``(window_size - 1, 0)``, global layers
    none), then TE's contract as :class:`TEDotProductAttentionCPU`."""

    def __init__(self, config, layer_number, *args, **kwargs):
        from megatron.bridge.models.gemma.gemma3_provider import _is_local_attn_layer

        config = copy.deepcopy(config)
        local = _is_local_attn_layer(layer_number, config.interleaved_attn_pattern)
        config.window_size = (config.window_size - 1, 0) if local else None
        super().__init__(config, layer_number, *args, **kwargs)


def _row_parallel_linear_layer_norm():
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class TERowParallelLinearLayerNormCPU(RowParallelLinear):
        """Bridge's ``TERowParallelLinearLayerNorm`` (Gemma's post-attention / post-MLP norm
        inside the row-parallel projection): megatron's RowParallelLinear, then TE's norm as
        ``post_layernorm`` (same parameter names)."""

        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = TENormCPU(config, output_size)  # as Bridge builds it: TENorm's default eps

        def forward(self, x):
            output, bias = super().forward(x)
            assert bias is None
            return self.post_layernorm(output), bias

    return TERowParallelLinearLayerNormCPU


def use_cpu_gemma3_spec(monkeypatch) -> None:
    """Megatron-Bridge's ``gemma3_layer_spec`` (the Gemma 3 provider's default spec) with its TE
    modules (its own Gemma 3 core attention and post-norm row-parallel linear included) replaced
    by the CPU modules, for providers made after this call."""
    from megatron.bridge.models.common import te_layers
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.gemma import gemma3_provider

    row_norm = _row_parallel_linear_layer_norm()
    AutoMapping.register_module_type(row_norm.__name__, "row")
    stock = gemma3_provider.gemma3_layer_spec

    def gemma3_cpu_layer_spec(config):
        mapping = {**_te_classes(), id(gemma3_provider.Gemma3TEDotProductAttention): Gemma3TEDotProductAttentionCPU,
                   id(te_layers.TERowParallelLinearLayerNorm): row_norm}
        return cpu_te_spec(stock(config), mapping)

    monkeypatch.setattr(gemma3_provider, "gemma3_layer_spec", gemma3_cpu_layer_spec)
