"""Cross-micro-batch schedules on Hugging Face models.

A :class:`~ps_mcore.minibatch.MiniBatchPlan` cuts a mini-batch's prefix forest into calls and
steps under a token budget; :class:`~ps_mcore.schedule.ScheduleRunner` runs them with exact
gradients (a prefix's forward once, its per-layer K/V kept for the calls that continue it,
their dK/dV accumulated into it, its backward once after its last continuation). Here the
Hugging Face side:

* :func:`hf_call`: one call through :func:`~ps_mcore.fsdp_bridge.forward_tree` (the
  ``"prefix_tree"`` attention reads the kept context K/V by each attention module's
  ``layer_idx``), log-probs / entropy of the call's tokens, or a value head's values.
* :func:`hf_schedule_refusal`: what does not hold exactly under a schedule.
* :func:`hf_kv_row_cost`: the budget tokens one kept K/V row costs for the model's shape.

Activation checkpointing (``gradient_checkpointing_enable`` or torch's checkpoint wrapper)
composes: a checkpointed layer recomputes inside the call's backward, K/V are recorded once.
"""

from __future__ import annotations

import torch

from ps_mcore.fsdp_bridge.dropout import hf_dropout_refusal
from ps_mcore.fsdp_bridge.forward import forward_tree
from ps_mcore.fsdp_bridge.hf_attention import attention_configs
from ps_mcore.fsdp_bridge.unwrap import unwrap_model
from ps_mcore.minibatch import ContextPlan, kept_kv_row_cost
from ps_mcore.schedule import RunCall, call_outputs


def hf_schedule_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` (an HF model or a FSDP / DDP / PEFT wrapper of one) cannot run a
    cross-micro-batch schedule exactly, or None when it can.

    Active dropout is refused, shared or not: a K/V-kept prefix runs its forward again at its
    release, which would draw other masks than the ones its readers saw."""
    if hf_dropout_refusal(model) is not None:
        return ("active dropout (a K/V-kept prefix runs its forward again at its release, which "
                "would draw other dropout masks)")
    return None


def hf_call(
    model: torch.nn.Module,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    value_head: bool = False,
    backend: str = "auto",
) -> RunCall:
    """``run_call`` for :class:`~ps_mcore.schedule.ScheduleRunner` on a Hugging Face model.

    Args:
        model: a causal LM (or a token-classification head with ``value_head``), possibly
            FSDP / DDP / PEFT wrapped: the wrapper's forward runs, so its hooks do.
        temperature, compute_entropy: as :func:`ps_mcore.logprobs.token_logprobs`.
        value_head: the model's head gives one value per row (``[1, R, 1]`` logits): return
            ``{"values": [n]}`` instead of log-probs.
        backend: the tree attention backend.

    Returns:
        ``run_call(plan) -> {"log_probs": [n], "entropy": [n]}`` (entropy when asked) or
        ``{"values": [n]}``, in the call's token order.
    """

    def run_call(plan: ContextPlan) -> dict[str, torch.Tensor]:
        out = forward_tree(model, plan, return_logits=True, backend=backend)
        return call_outputs(out.logits, plan, value_head, temperature, compute_entropy)

    return run_call


def _checkpoints_layers(inner: torch.nn.Module) -> bool:
    # transformers 5.x renamed is_gradient_checkpointing (the old name warns).
    name = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(inner, name, False))


def hf_kv_row_cost(model: torch.nn.Module, training: bool, dtype_bytes: int = 2) -> float:
    """:func:`~ps_mcore.minibatch.kept_kv_row_cost` of an HF decoder's config (full
    recompute when the model checkpoints its layers)."""
    config = attention_configs(model)[-1]
    heads = config.num_attention_heads
    hidden = config.hidden_size
    return kept_kv_row_cost(
        layers=config.num_hidden_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        ffn=getattr(config, "intermediate_size", None) or 4 * hidden,
        vocab=int(getattr(config, "vocab_size", 0) or 0),
        training=training,
        full_recompute=_checkpoints_layers(unwrap_model(model)),
        dtype_bytes=dtype_bytes,
    )
