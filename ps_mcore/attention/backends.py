"""The one table of tree-attention backends: name -> availability check, kernel, CP support.

Modelled on transformers' ``AttentionInterface``: every place that maps a backend name to
code (``tree_attention``, the context-parallel path, the layer-spec builders) reads
:data:`ATTENTION_BACKENDS`. Adding a backend is one :func:`register_backend` call with an
:class:`AttentionBackend` (give it a ``gather_kv_kernel`` and it also runs under context
parallelism, where local queries attend to all-gathered K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ps_mcore.attention.cascade import tree_varlen_attention
from ps_mcore.attention.cudnn import CUDNN_KERNEL, cudnn_refusal, cudnn_tree_attention, require_cudnn
from ps_mcore.attention.fa4 import FA4_KERNEL, require_fa4
from ps_mcore.attention.flex import flex_tree_attention
from ps_mcore.attention.gather_kv import MATH_KERNEL, VarlenKernel, flash_head_dim_refusal, flash_kernel_for, gather_kv_attention
from ps_mcore.attention.kernel_choice import PlanShape, plan_shape, prefers_cudnn
from ps_mcore.attention.layout import auto_layout, cascade_layout
from ps_mcore.attention.npu import NPU_KERNEL, require_torch_npu
from ps_mcore.attention.reference import reference_attention
from ps_mcore.attention.variants import FEATURES, PLAIN, AttentionVariant
from ps_mcore.planner import TreePlan

AUTO = "auto"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
ALL_FEATURES = frozenset(FEATURES)

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, TreePlan, float, AttentionVariant], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """One named way to compute tree attention.

    Attributes:
        name: what users pass as ``backend`` / ``tree_attention_backend``.
        attend: ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], plan, scale, variant) -> [T, Hq, D]``
            over the whole plan; None for a gather-KV backend (then it is
            ``gather_kv_attention`` with ``gather_kv_kernel``).
        gather_kv_kernel: ``device -> VarlenKernel`` for gather-KV backends (these, and only
            these, support context parallelism); None otherwise.
        cascade: a varlen kernel that returns its log-sum-exp can also run the cascade layout
            (no K/V copy); such a backend picks cascade or gather-KV per plan
            (:func:`ps_mcore.attention.cascade.tree_varlen_attention`).
        check: raises ``ValueError`` saying why the backend cannot run for ``q`` (explicit
            choices only; ``auto`` picks a backend that can).
        features: the variants (:data:`~ps_mcore.attention.variants.FEATURES`: ``window``,
            ``sinks``, ``softcap``) it computes exactly; None: those of its gather-KV kernel on
            the device.
        variant_check: raises ``ValueError`` when this install cannot run a variant its
            ``features`` list (cuDNN's probe).
    """

    name: str
    attend: AttendFn | None = None
    gather_kv_kernel: Callable[[torch.device], VarlenKernel] | None = None
    check: Callable[[torch.Tensor], None] | None = None
    cascade: bool = False
    features: frozenset | None = None
    variant_check: Callable[[torch.Tensor, AttentionVariant], None] | None = None

    @property
    def supports_cp(self) -> bool:
        return self.gather_kv_kernel is not None

    def _kernel(self, device: torch.device) -> VarlenKernel | None:
        return None if self.gather_kv_kernel is None else self.gather_kv_kernel(device)

    def supported_features(self, device: torch.device) -> frozenset:
        """The variant features this backend computes on ``device``."""
        if self.features is not None:
            return self.features
        kernel = self._kernel(device)
        return frozenset() if kernel is None else kernel.features

    def variant_refusal(self, q: torch.Tensor, variant: AttentionVariant) -> str | None:
        """Why this backend cannot compute ``variant`` for ``q`` (None: it can), naming the
        backends that can."""
        missing = [f for f in variant.features if f not in self.supported_features(q.device)]
        if not missing:
            return None
        kernel = self._kernel(q.device)
        why = dict(kernel.missing) if kernel is not None else {}
        parts = [FEATURES[f] + (f": {why[f]}" if f in why else "") for f in missing]
        able = [name for name, b in ATTENTION_BACKENDS.items() if set(variant.features) <= b.supported_features(q.device)]
        return (
            f"tree attention backend {self.name!r} does not implement {'; '.join(parts)}. "
            f"Backends that do on {q.device.type}: {', '.join(able) or 'none'}"
        )

    def __call__(self, q, k, v, plan: TreePlan, scale: float, variant: AttentionVariant = PLAIN) -> torch.Tensor:
        if self.attend is not None:
            return self.attend(q, k, v, plan, scale, variant)
        kernel = self.gather_kv_kernel(q.device)
        if self.cascade:
            return tree_varlen_attention(q, k, v, plan, scale, kernel, variant=variant)
        return gather_kv_attention(q, k, v, plan, scale, kernel, variant)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add (or replace) a backend in the table."""
    if backend.name == AUTO:
        raise ValueError(f"{AUTO!r} is reserved: it picks a registered backend per input")
    ATTENTION_BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """Every name ``backend`` accepts: ``auto`` then the table's, in registration order."""
    return (AUTO, *ATTENTION_BACKENDS)


def cp_backend_names() -> tuple[str, ...]:
    """The names that run under context parallelism (``auto`` then the gather-KV backends)."""
    return (AUTO, *(name for name, b in ATTENTION_BACKENDS.items() if b.supports_cp))


def check_backend_name(backend: str | None) -> None:
    """Raise ``ValueError`` for a name the table does not know (None means the default)."""
    if backend is not None and backend not in backend_names():
        raise ValueError(f"unknown tree attention backend {backend!r}; expected one of {backend_names()}")


# ----------------------------------------------------------------------------- built-ins


def _check_flex(q: torch.Tensor) -> None:
    if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "backend 'flex' runs forward only off CUDA (FlexAttention has no CPU backward); "
            "use 'chunked' for training on CPU"
        )


def _check_varlen(q: torch.Tensor) -> None:
    if flash_kernel_for(q.device) is None:
        raise ValueError(
            f"backend 'varlen' needs a CUDA device with a varlen flash kernel (torch's flash "
            f"attention or flash-attn); q is on {q.device}. Use 'chunked' or 'reference'."
        )
    if q.dtype not in _FLASH_DTYPES:
        raise ValueError(f"backend 'varlen' needs fp16 or bf16 inputs, got {q.dtype}")
    reason = flash_head_dim_refusal(q.size(-1))
    if reason is not None:
        raise ValueError(f"backend 'varlen' cannot run {reason}. Use 'chunked' or 'reference'.")


def _cudnn(q, k, v, plan, scale, variant):
    return cudnn_tree_attention(q, k, v, plan, scale, variant=variant)


def _check_cudnn_variant(q: torch.Tensor, variant: AttentionVariant) -> None:
    require_cudnn(q, window=variant.window is not None, sinks=variant.sinks is not None)


register_backend(AttentionBackend("reference", attend=reference_attention, features=ALL_FEATURES))
register_backend(AttentionBackend("chunked", gather_kv_kernel=lambda device: MATH_KERNEL, cascade=True))
register_backend(AttentionBackend("varlen", gather_kv_kernel=flash_kernel_for, check=_check_varlen, cascade=True))
register_backend(AttentionBackend("flex", attend=flex_tree_attention, check=_check_flex, features=ALL_FEATURES))
# cuDNN through Transformer Engine: gather-KV, or the chain self call on chain forests (cudnn.py);
# its gather-KV kernel also serves context parallelism.
register_backend(AttentionBackend("cudnn", attend=_cudnn, gather_kv_kernel=lambda device: CUDNN_KERNEL,
                                  check=require_cudnn, variant_check=_check_cudnn_variant))
register_backend(AttentionBackend(
    "npu", gather_kv_kernel=lambda device: NPU_KERNEL, check=lambda q: require_torch_npu()))
# FlashAttention-4 (flash-attn-4, CuTe DSL, SM90+): both layouts, like varlen; explicit only (fa4.py).
register_backend(AttentionBackend("fa4", gather_kv_kernel=lambda device: FA4_KERNEL, check=require_fa4, cascade=True))


# ----------------------------------------------------------------------------- resolution


def resolve_backend(backend: str, q: torch.Tensor, plan: TreePlan | None = None,
                    variant: AttentionVariant = PLAIN) -> str:
    """The concrete backend ``backend`` means for ``q`` and ``variant``; raises if it cannot
    run there (a variant it does not implement: the message names the backends that do).

    ``auto``: npu on an NPU device; on CUDA for fp16/bf16 with a flash kernel, varlen, or cudnn
    where TE's cuDNN attention can run and the kernel-choice rule prefers it for ``plan``'s
    shape (:mod:`ps_mcore.attention.kernel_choice`; without a plan, varlen; plain attention
    only: the rule was measured there); else flex on CUDA, else chunked. A variant the
    flash kernel lacks (softcap with torch's flash kernel) runs flex on CUDA; a head dim it
    lacks (not a multiple of 8, or over 256) runs chunked.
    """
    check_backend_name(backend)
    if backend == AUTO:
        name = _auto_backend(q, plan, variant)
        refusal = ATTENTION_BACKENDS[name].variant_refusal(q, variant)
        if refusal is not None:  # an NPU with a variant its kernel lacks
            raise ValueError(f"{refusal} (pass backend 'chunked' to run the exact pure-torch kernel there)")
        return name
    chosen = ATTENTION_BACKENDS[backend]
    if chosen.check is not None:
        chosen.check(q)
    refusal = chosen.variant_refusal(q, variant)
    if refusal is not None:
        raise ValueError(refusal)
    if chosen.variant_check is not None and not variant.plain:
        chosen.variant_check(q, variant)
    return backend


def _auto_backend(q: torch.Tensor, plan: TreePlan | None, variant: AttentionVariant) -> str:
    if q.device.type == "npu":
        return "npu"
    if q.is_cuda and q.dtype in _FLASH_DTYPES and flash_kernel_for(q.device) is not None:
        if flash_head_dim_refusal(q.size(-1)) is not None:
            return "chunked"  # the exact pure-torch kernel takes any head dim
        if ATTENTION_BACKENDS["varlen"].variant_refusal(q, variant) is not None:
            return "flex"
        return "cudnn" if plan is not None and variant.plain and _auto_prefers_cudnn(q, plan) else "varlen"
    return "flex" if q.is_cuda else "chunked"


def _auto_prefers_cudnn(q: torch.Tensor, plan: TreePlan) -> bool:
    if "cudnn" not in ATTENTION_BACKENDS or not isinstance(plan, TreePlan):
        return False
    # The shape rule first (host numbers, cached): the cuDNN probe only runs for plans it picks.
    if not prefers_cudnn(plan_shape(plan, q.size(1), q.size(2))):
        return False
    return cudnn_refusal(q) is None


def auto_choice(q: torch.Tensor, plan: TreePlan, variant: AttentionVariant = PLAIN) -> tuple[str, str]:
    """``(backend, layout)`` that ``tree_attention(..., backend="auto")`` runs for ``q``,
    ``plan`` and ``variant`` (layout "cascade" or "gather" for the varlen/cudnn kernels, else
    "-"; a window runs the cascade only without level calls)."""
    name = resolve_backend(AUTO, q, plan, variant)
    if name not in ("varlen", "cudnn", "chunked"):
        return name, "-"
    level_calls = name != "cudnn" and variant.window is None
    return name, auto_layout(plan, cascade_layout(plan, q.device), level_calls=level_calls)


def cp_kernel(backend: str, q: torch.Tensor, purpose: str = "under context parallelism",
              variant: AttentionVariant = PLAIN, shape: PlanShape | None = None) -> VarlenKernel:
    """The gather-KV kernel ``backend`` means for ``q`` where queries attend to K/V rows that
    are not their own (under CP, or against kept context K/V); ``auto`` never picks flex, and
    picks cuDNN over flash where the call's ``shape`` meets the kernel-choice work rule
    (:func:`~ps_mcore.attention.kernel_choice.prefers_cudnn`; without a shape, flash).
    Raises when it cannot compute ``variant``, naming the backends that can."""
    name = resolve_backend(backend, q, None, variant)
    if backend == AUTO and not ATTENTION_BACKENDS[name].supports_cp:
        name = "chunked"
    if (backend == AUTO and name == "varlen" and shape is not None and variant.plain
            and "cudnn" in ATTENTION_BACKENDS and prefers_cudnn(shape) and cudnn_refusal(q) is None):
        name = "cudnn"
    chosen = ATTENTION_BACKENDS[name]
    if not chosen.supports_cp:
        raise NotImplementedError(
            f"tree attention backend {name!r} cannot run {purpose}: queries against K/V rows "
            f"that are not their own need a gather-KV kernel; use one of {cp_backend_names()}"
        )
    refusal = chosen.variant_refusal(q, variant)
    if refusal is not None:
        raise ValueError(refusal)
    return chosen.gather_kv_kernel(q.device)


__all__ = [
    "ALL_FEATURES",
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "backend_names",
    "check_backend_name",
    "cp_backend_names",
    "auto_choice",
    "cp_kernel",
    "register_backend",
    "resolve_backend",
]
