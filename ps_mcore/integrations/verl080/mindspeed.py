"""verl 0.8.0's ``mindspeed_megatron`` engine building its model with tree specs (moved here
from ``ps_mcore.mindspeed.patch``: ``ps_mcore.mindspeed`` keeps the NPU spec and state only).

``MindSpeedMegatronEngineWithLMHead._build_megatron_module`` builds the model through
``gpt_model_provider``, which takes ``args.spec`` (Megatron-LM's global args) when set, so the
Megatron-engine build patch (mbridge / Megatron-Bridge specs) never applies to it. The patch
here sets, for the duration of that build only, ``args.spec`` to the lazy tree spec
(:mod:`ps_mcore.mindspeed.spec`; a spec the user set moves to ``args.tree_base_spec`` and is
converted) and ``args.apply_rope_fusion = False`` (the provider builds the model config from
the args), when prefix sharing is on for the engine and ``ENABLE_PREFIX_SHARING`` is not 0.
It refuses (stock model, one warning) dynamic CP / QAT as the Megatron engine glue does,
context parallelism (MindSpeed's CP algorithms patch attention and slice batches through its
global state; the Megatron engine shares under CP), and MindSpeed's reset-attention-mask feature (on in verl's mindspeed yaml).

Nothing of MindSpeed itself is patched: MindSpeed's ``repatch`` (run by verl for every
engine) removes and re-applies its patches by object identity, so a patch on one of its
targets would be overwritten or restored wrongly. verl's class is what we patch. The
forward needs no patch here: the engine inherits the Megatron engine's ``forward_step`` and
forward function, which the ``verl080_mcore0161_ms0160`` patchset already wraps (see
:mod:`ps_mcore.mindspeed.state` for the MindSpeed hooks that forward must call).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Iterator

from ps_mcore.integrations.env import module_importable
from ps_mcore.integrations.patching import Patcher, info_once
from ps_mcore.integrations.verl_common.megatron import ROPE_FUSION_REFUSAL, tree_build, tree_build_refusal
from ps_mcore.mindspeed.state import CONTEXT_PARALLEL_REFUSAL, RESET_ATTENTION_MASK_REFUSAL

ENGINE_MODULE = "verl.workers.engine.mindspeed.transformer_impl"
ENGINE_CLASS = "MindSpeedMegatronEngineWithLMHead"
_MARK = "__ps_mcore_mindspeed__"
_MISSING = object()


def engine_available() -> bool:
    """Whether verl's MindSpeed engine module imports (it does without MindSpeed)."""
    return module_importable(ENGINE_MODULE)


@contextlib.contextmanager
def tree_spec_args(args: Any) -> Iterator[None]:
    """Within the block: ``args.spec`` is the tree spec entry, the previous spec (if any) is
    ``args.tree_base_spec``, ``args.apply_rope_fusion`` is False. Restored exactly after."""
    from ps_mcore.mindspeed.spec import BASE_SPEC_ARG, SPEC_ENTRY  # after MindSpeed's repatch (see verl_common.megatron)

    names = ("spec", BASE_SPEC_ARG, "apply_rope_fusion")
    saved = {name: vars(args).get(name, _MISSING) for name in names}
    user_spec = getattr(args, "spec", None)
    if user_spec and tuple(user_spec) != SPEC_ENTRY:
        setattr(args, BASE_SPEC_ARG, list(user_spec))
    args.spec = list(SPEC_ENTRY)
    args.apply_rope_fusion = False
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                vars(args).pop(name, None)
            else:
                setattr(args, name, value)


def build_refusal(engine: Any, args: Any) -> str | None:
    """Why this engine's model must be built with stock specs (None: tree specs)."""
    refusal = tree_build_refusal(engine)
    if refusal is not None:
        return f"{refusal} is not supported by tree attention"
    if getattr(engine.engine_config, "context_parallel_size", 1) > 1:
        return CONTEXT_PARALLEL_REFUSAL  # the Megatron engine shares under CP; MindSpeed's CP does not
    if getattr(args, "reset_attention_mask", False):
        return RESET_ATTENTION_MASK_REFUSAL
    return None


def _mindspeed_refusal(engine) -> str | None:
    from ps_mcore.mindspeed.spec import megatron_args  # after MindSpeed's repatch (see verl_common.megatron)

    return build_refusal(engine, megatron_args())


def _mindspeed_tree_build(engine, original: Callable):
    from ps_mcore.mindspeed.spec import megatron_args  # after MindSpeed's repatch (see verl_common.megatron)

    info_once("rope-fusion", ROPE_FUSION_REFUSAL)
    with tree_spec_args(megatron_args()):
        return original(engine)


def mindspeed_build_module(original: Callable) -> Callable:
    """``MindSpeedMegatronEngineWithLMHead._build_megatron_module`` with tree specs."""
    build = tree_build(
        original,
        "mindspeed-build",
        _mindspeed_refusal,
        _mindspeed_tree_build,
        "gpt_model_provider built the model without the tree spec; prefix sharing falls "
        "back to verl's stock forward for this model",
    )
    setattr(build, _MARK, True)
    return build


def install_mindspeed_build_patch(patcher: Patcher) -> bool:
    """Install the build patch through ``patcher`` (the patchset's); restoring ``patcher``
    removes it. Returns False when it is already installed (by any patcher)."""
    cls = getattr(importlib.import_module(ENGINE_MODULE), ENGINE_CLASS)
    if getattr(cls.__dict__.get("_build_megatron_module"), _MARK, False):
        return False
    patcher.wrap(cls, "_build_megatron_module", mindspeed_build_module)
    return True


def installed() -> bool:
    """Whether the build patch is in place (by any patcher)."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is None:
        return False
    cls = getattr(module, ENGINE_CLASS)
    return bool(getattr(cls.__dict__.get("_build_megatron_module"), _MARK, False))
