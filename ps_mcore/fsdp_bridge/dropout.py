"""Active dropout of a Hugging Face model (and its PEFT adapters) on a prefix tree.

Attention dropout is refused by the ``"prefix_tree"`` attention itself (the tree kernels
have none). Every other dropout runs on the packed rows, where a shared row's mask would be
common to the samples holding it: :func:`hf_dropout_refusal` names them all
(:mod:`ps_mcore.dropout`).
"""

from __future__ import annotations

import torch

from ps_mcore.dropout import active_dropouts, config_dropout_keys, key_by_value, shared_dropout_refusal
from ps_mcore.fsdp_bridge.hf_attention import attention_configs

PEFT_KEY = "lora_dropout (the PEFT adapter's LoraConfig)"
# Heads that build ``self.dropout = nn.Dropout(config.classifier_dropout or ... or 0.1)``.
_CLASSIFIER_HEADS = ("ForTokenClassification", "ForSequenceClassification")


def _is_attention_dropout(name: str, holder: torch.nn.Module) -> bool:
    """The rate an HF attention module hands its attention function (``dropout=``)."""
    leaf = name.rpartition(".")[2]
    return type(holder).__name__.endswith("Attention") and leaf in ("attention_dropout", "dropout", "attn_dropout")


def hf_dropout_refusal(
    model: torch.nn.Module, shared_dropout: bool = False, opt_in: str = "forward_tree(..., shared_dropout=True)"
) -> str | None:
    """Why ``model`` (an HF model or a FSDP / DDP / PEFT / compiled wrapper of one) cannot run
    a prefix tree as it is: its active dropouts, each with the config key that sets it
    (attention dropout always; the others unless ``shared_dropout``); None when nothing is
    refused (eval mode, every rate 0)."""
    keys = config_dropout_keys(*attention_configs(model))

    def key_for(name: str, holder: torch.nn.Module, p: float) -> str | None:
        if "lora_dropout" in name.split("."):
            return PEFT_KEY
        if name.endswith(".dropout") or name == "dropout":
            if type(holder).__name__.endswith(_CLASSIFIER_HEADS):
                return "classifier_dropout"
        return key_by_value(keys, name, p)

    sites = active_dropouts(model, key_for, _is_attention_dropout)
    return shared_dropout_refusal(sites, opt_in, shared_dropout)
