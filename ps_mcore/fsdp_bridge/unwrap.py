"""Find the Hugging Face model inside FSDP / DDP / PEFT / compile / checkpoint wrappers."""

from __future__ import annotations

import torch

# Attributes under which common wrappers keep the module they wrap: FSDP1
# (``_fsdp_wrapped_module``), activation-checkpoint wrappers, ``torch.compile``
# (``_orig_mod``), DDP and FSDP1 (``module``). FSDP2 needs none: it keeps the model's class.
_WRAPPED_ATTRS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module")
_MAX_DEPTH = 16


def _inner(module: torch.nn.Module) -> torch.nn.Module | None:
    get_base = getattr(module, "get_base_model", None)  # PEFT's PeftModel
    if callable(get_base):
        base = get_base()
        if isinstance(base, torch.nn.Module) and base is not module:
            return base
    for name in _WRAPPED_ATTRS:
        inner = getattr(module, name, None)
        if isinstance(inner, torch.nn.Module) and inner is not module:
            return inner
    return None


def unwrap_model(model: torch.nn.Module):
    """The ``transformers.PreTrainedModel`` that ``model`` is or wraps.

    Raises:
        ValueError: no PreTrainedModel is found within a few wrapper levels.
    """
    from transformers import PreTrainedModel

    current = model
    for _ in range(_MAX_DEPTH):
        if isinstance(current, PreTrainedModel):
            return current
        inner = _inner(current)
        if inner is None:
            break
        current = inner
    raise ValueError(
        f"could not find a transformers PreTrainedModel inside {type(model).__name__} "
        "(looked through FSDP, DDP, PEFT, torch.compile and checkpoint wrappers)"
    )
