"""``forward_tree``: one Hugging Face causal LM forward over a packed prefix forest."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ps_mcore.fsdp_bridge.dropout import hf_dropout_refusal
from ps_mcore.fsdp_bridge.hf_attention import TreeCall
from ps_mcore.fsdp_bridge.scope import tree_attention_scope
from ps_mcore.fsdp_bridge.unwrap import unwrap_model
from ps_mcore.logprobs import token_logprobs
from ps_mcore.minibatch import ContextPlan
from ps_mcore.planner import TreePlan

# Inputs forward_tree builds itself from the plan; passing them too would contradict it.
_RESERVED_KWARGS = (
    "input_ids", "inputs_embeds", "position_ids", "attention_mask", "tree_call", "tree_plan",
    "tree_backend", "cache", "past_key_values", "labels",
)


@dataclass
class TreeForwardOutput:
    """Packed (``T`` rows, plan order) and per-original-token (``N`` rows) results.

    Attributes:
        logits: ``[T, V]`` model head output, or None when not requested.
        hidden_states: ``[T, H]`` last hidden state (after the final norm), or None.
        logprobs: ``[N]`` log p(next token), 0 at each sequence's last token, or None.
        entropy: ``[N]`` predictive entropy per original token, or None.
    """

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _check_args(plan: Any, model_kwargs: dict, temperature: float) -> None:
    if not isinstance(plan, (TreePlan, ContextPlan)):
        raise TypeError(f"plan must be a TreePlan or a ContextPlan, got {type(plan).__name__}")
    clash = [k for k in _RESERVED_KWARGS if k in model_kwargs]
    if clash:
        raise ValueError(f"forward_tree builds {clash} from the plan; do not pass them")
    if model_kwargs.get("use_cache"):
        raise ValueError("forward_tree runs without a KV cache; use_cache must be False")
    if model_kwargs.get("return_dict") is False:
        raise ValueError("forward_tree reads the model's output by name; do not pass return_dict=False")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def _check_vocab(inner, plan: TreePlan) -> None:
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    vocab = getattr(config, "vocab_size", None)
    top = int(plan.input_ids.max())
    if vocab is not None and top >= vocab:
        raise ValueError(f"plan holds token id {top} but the model's vocab_size is {vocab}")


def _model_device(inner) -> torch.device:
    embeddings = inner.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if weight is not None:
        return weight.device
    return next(inner.parameters()).device


def _accepts(module: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters


def forward_tree(
    model: torch.nn.Module,
    plan: TreePlan,
    *,
    return_logits: bool = True,
    return_hidden_states: bool = False,
    compute_logprobs: bool = False,
    compute_entropy: bool = False,
    temperature: float = 1.0,
    backend: str = "auto",
    shared_dropout: bool = False,
    **model_kwargs: Any,
) -> TreeForwardOutput:
    """Run a causal HF model once over ``plan``'s packed forest.

    The model (or a FSDP / DDP / PEFT / compiled wrapper of it: the wrapper's forward is
    called, so its hooks run) gets ``input_ids = plan.input_ids[None]``, ``position_ids =
    plan.position_ids[None]`` (tree depths, so RoPE needs no patch) and ``tree_call`` (a
    :class:`TreeCall` of the plan and backend, which FSDP's input casting leaves alone). Its
    decoder runs ``"prefix_tree"`` attention for this call only: afterwards (also after an
    exception) ``config._attn_implementation`` reads what it read before, and checkpointed
    layers still recompute with the tree kernels in backward (:mod:`.scope`). Under
    ``torch.compile`` the tree attention runs outside the compiled graphs (plan checks and
    host-side layouts) and the packed length is marked dynamic, so plans of new lengths
    reuse the compiled layers.

    Args:
        model: a causal LM (``*ForCausalLM``), a head model (token classification / value
            head: ``logits`` are its head output) or a bare decoder (hidden states only).
        plan: the micro-batch's plan (moved to the model's device, cached), or one call of a
            cross-micro-batch schedule (:class:`~ps_mcore.minibatch.ContextPlan` with its
            runtime: ``run_call`` of :class:`~ps_mcore.schedule.ScheduleRunner`).
        return_logits: keep the packed logits in the output.
        return_hidden_states: capture the decoder's last hidden state. Without logits or
            log-probs the LM head is skipped where the model supports ``logits_to_keep``.
        compute_logprobs, compute_entropy: per-token results through :func:`token_logprobs`
            (each branch row normalised once).
        temperature: logits are divided by it for log-probs/entropy.
        backend: :func:`ps_mcore.tree_attention` backend.
        shared_dropout: run active dropout (training mode) on the packed rows, one mask per
            shared row common to the samples holding it (each sample's own mask
            distribution is unchanged). False: such a model is refused with a message naming
            its dropouts and their config keys. Attention dropout is refused either way.
        **model_kwargs: passed on to the model (not ``input_ids``/``attention_mask``/...).

    Returns:
        :class:`TreeForwardOutput`.
    """
    _check_args(plan, model_kwargs, temperature)
    inner = unwrap_model(model)
    _check_vocab(inner, plan)
    refusal = hf_dropout_refusal(model, shared_dropout)
    if refusal is not None:
        raise ValueError(refusal)
    plan = plan.to(_model_device(inner))

    need_logits = return_logits or compute_logprobs or compute_entropy
    kwargs = dict(model_kwargs, use_cache=False, tree_call=TreeCall(plan, backend))
    if not need_logits and _accepts(inner, "logits_to_keep"):
        kwargs["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=plan.device)

    captured: list[torch.Tensor] = []
    decoder = inner.base_model
    hook = None
    if return_hidden_states and decoder is not inner:
        hook = decoder.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    input_ids, position_ids = plan.input_ids[None], plan.position_ids[None]
    for rows in (input_ids, position_ids):  # T varies per plan: compiled layers stay dynamic in it
        torch._dynamo.maybe_mark_dynamic(rows, 1)
    try:
        with tree_attention_scope(model):
            out = model(input_ids=input_ids, position_ids=position_ids, **kwargs)
    finally:
        if hook is not None:
            hook.remove()

    logits = getattr(out, "logits", None)
    if decoder is inner:  # a bare decoder: its output is the hidden state
        captured.append(out[0])
    if need_logits and logits is None:
        raise ValueError(f"{type(inner).__name__} returns no logits; ask for hidden states only")
    result = TreeForwardOutput(
        logits=logits[0] if return_logits else None,
        hidden_states=captured[-1][0] if return_hidden_states else None,
    )
    if compute_logprobs or compute_entropy:
        result.logprobs, result.entropy = token_logprobs(
            logits[0], plan, temperature=temperature, compute_entropy=compute_entropy
        )
    return result
