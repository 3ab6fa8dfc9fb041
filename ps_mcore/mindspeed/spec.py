"""The ``--spec`` entry point: a tree layer spec built lazily, after MindSpeed's patches.

Usage (verl 0.8.0, ``mindspeed_megatron`` backend)::

    actor_rollout_ref.actor.mindspeed.mcore_kwargs.spec=[ps_mcore.mindspeed.spec,get_tree_spec]

Calling convention. verl's ``gpt_model_provider`` (like Megatron-LM's ``gpt_builders`` and
MindSpeed-LLM's trainers) does ``transformer_layer_spec = import_module(args.spec)``, and
megatron-core's ``import_module((module, name))`` returns ``vars(module)[name]`` **without
calling it**; the object goes straight to ``GPTModel(transformer_layer_spec=...)``, whose
``TransformerBlock`` accepts only a ``ModuleSpec`` or ``TransformerBlockSubmodules``. So
``get_tree_spec`` is a :class:`LazyTreeLayerSpec`: a layer ``ModuleSpec`` whose ``module`` /
``params`` / ``submodules`` are built from the stock builder on every read.

Why lazy. MindSpeed replaces megatron's TE / local classes (``TEColumnParallelLinear``,
``TEDotProductAttention``, ``LNImpl``, ...) by rebinding every loaded module's attribute that
is the original object, and verl re-applies its patches (``repatch``) for every engine, with
that engine's config. A spec built at import time would keep whatever classes were bound
then. Building at read time (inside ``GPTModel.__init__``, after ``repatch``) always sees the
classes MindSpeed bound for this model; a build costs ~20 us, so nothing is cached.

What it builds: exactly the stock spec verl's ``gpt_model_provider`` builds when
``args.spec`` is unset (``get_gpt_layer_with_transformer_engine_spec`` or
``get_gpt_layer_local_spec`` with ``args.num_experts, args.moe_grouped_gemm,
qk_layernorm=args.qk_layernorm``), or the spec named by ``args.tree_base_spec`` (a
``[module, name]`` pair, e.g. a MindSpeed-LLM model spec), then :func:`to_tree_spec` with
``args.tree_attention_backend`` (default: each layer picks ``auto``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec

from ps_mcore.layer_specs import to_tree_spec
from ps_mcore.mindspeed.state import RESET_ATTENTION_MASK_REFUSAL

SPEC_ENTRY = ("ps_mcore.mindspeed.spec", "get_tree_spec")
BASE_SPEC_ARG = "tree_base_spec"
BACKEND_ARG = "tree_attention_backend"
_FIELDS = tuple(f.name for f in dataclasses.fields(ModuleSpec))


def megatron_args() -> Any:
    """Megatron-LM's global args (``megatron.training.get_args()``, imported lazily)."""
    from megatron.training import get_args

    return get_args()


def _base_spec(args: Any) -> Any:
    """The stock spec verl 0.8.0's ``gpt_model_provider`` builds (or ``args.tree_base_spec``).

    Builders are looked up at call time, so MindSpeed's / MindSpeed-LLM's replacements of
    them (e.g. ``get_gpt_layer_local_spec_wrapper``) and of the classes they use apply."""
    from megatron.core.models.gpt import gpt_layer_specs

    base = getattr(args, BASE_SPEC_ARG, None)
    if base:
        return _import_base_spec(base)
    if getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine":
        builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    else:
        builder = gpt_layer_specs.get_gpt_layer_local_spec
    return builder(args.num_experts, args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm)


def _import_base_spec(pair) -> Any:
    from megatron.core.transformer.spec_utils import import_module

    pair = tuple(pair)
    if len(pair) != 2 or not all(isinstance(p, str) for p in pair):
        raise ValueError(f"{BASE_SPEC_ARG} must be a [module, name] pair, got {list(pair)!r}")
    if pair == SPEC_ENTRY:
        raise ValueError(f"{BASE_SPEC_ARG} names the tree spec itself; name the stock spec to convert")
    try:
        spec = import_module(pair)
    except KeyError:
        raise ValueError(f"{BASE_SPEC_ARG}={list(pair)!r}: module {pair[0]!r} has no {pair[1]!r}") from None
    if spec is None:  # import_module logs the ImportError and returns None
        raise ValueError(f"{BASE_SPEC_ARG}={list(pair)!r}: could not import module {pair[0]!r}")
    return spec


def check_args(args: Any) -> None:
    """Refuse Megatron/MindSpeed args under which a tree model cannot run tree batches."""
    if getattr(args, "reset_attention_mask", False):
        raise ValueError(f"tree specs cannot run here: {RESET_ATTENTION_MASK_REFUSAL}")
    if getattr(args, "apply_rope_fusion", False):
        raise ValueError(
            "tree specs need apply_rope_fusion=False (Megatron-LM's default is True): fused RoPE "
            "cannot take per-token tree positions. Set "
            "actor_rollout_ref.actor.mindspeed.mcore_kwargs.apply_rope_fusion=False"
        )


def tree_spec_from_args(args: Any) -> ModuleSpec:
    """The tree spec for Megatron-LM ``args`` (see the module docstring): a layer
    ``ModuleSpec``, or a ``TransformerBlock`` spec when ``tree_base_spec`` names a block spec."""
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    check_args(args)
    spec = to_tree_spec(_base_spec(args), getattr(args, BACKEND_ARG, None))
    if isinstance(spec, TransformerBlockSubmodules):  # GPTModel takes it as a block ModuleSpec
        return ModuleSpec(module=TransformerBlock, submodules=spec)
    return spec


class LazyTreeLayerSpec(ModuleSpec):
    """A layer ``ModuleSpec`` built from ``args()`` on every read of its fields.

    Args:
        args: returns the Megatron args namespace to build from (default
            :func:`megatron_args`), read at build time.

    Every ``ModuleSpec`` field (``module``, ``params``, ``submodules``, ``metainfo``) reads
    :meth:`resolve`. ``dataclasses.replace`` or assigning a field makes the spec concrete
    (fixed fields), so ``to_tree_spec`` and other spec rewriting keep working on it. Calling
    it builds a module, as for any ``ModuleSpec``.
    """

    def __init__(self, args: Callable[[], Any] | None = None, **fields):
        # Not the dataclass __init__: replace() passes every field, a lazy spec passes none.
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise TypeError(f"LazyTreeLayerSpec got unknown ModuleSpec field(s) {unknown}")
        self.__dict__["_args"] = args or megatron_args
        self.__dict__["_fixed"] = dict(fields)

    def resolve(self) -> ModuleSpec:
        """The concrete tree layer spec for the current args and the classes bound now."""
        if self._fixed:
            return ModuleSpec(**self._fixed)
        return tree_spec_from_args(self._args())

    def _read(self, name: str):
        if name in self._fixed:
            return self._fixed[name]
        return getattr(self.resolve(), name)

    def _write(self, name: str, value) -> None:
        if not self._fixed:
            resolved = self.resolve()
            self._fixed.update({f: getattr(resolved, f) for f in _FIELDS})
        self._fixed[name] = value

    def __eq__(self, other) -> bool:
        # Compare content with any ModuleSpec (the dataclass __eq__ needs the same class).
        if not isinstance(other, ModuleSpec):
            return NotImplemented
        theirs = other.resolve() if isinstance(other, LazyTreeLayerSpec) else other
        return self.resolve() == theirs

    __hash__ = None  # mutable, as ModuleSpec

    def __repr__(self) -> str:
        if self._fixed:
            return f"LazyTreeLayerSpec(fixed: {self.resolve()!r})"
        return f"LazyTreeLayerSpec(lazy, args from {getattr(self._args, '__qualname__', self._args)})"


def _field_property(name: str) -> property:
    return property(lambda self: self._read(name), lambda self, value: self._write(name, value))


for _name in _FIELDS:
    setattr(LazyTreeLayerSpec, _name, _field_property(_name))


# The --spec entry point: [ps_mcore.mindspeed.spec, get_tree_spec].
get_tree_spec = LazyTreeLayerSpec()
