"""Active dropout of a Megatron model on a prefix tree.

megatron-core's ``TransformerConfig.hidden_dropout`` defaults to 0.1: in training it drops
the embeddings (``embedding_dropout``) and every layer's output of attention and of the MLP /
MoE / MLA / Mamba mixer in the bias-dropout-add, all on the packed rows, where a shared row's
mask would be common to the samples holding it (:mod:`ps_mcore.dropout`). RL configs set it
to 0 (verl's mbridge and Megatron-Bridge builds of Qwen / Llama do). Attention dropout
(``attention_dropout``) is refused by :class:`TreeCoreAttention` itself.

* :func:`megatron_dropout_refusal`: every active dropout of a whole model, by name (the verl
  glue's per micro-batch fallback, or a user's check before training).
* :func:`tree_batch_dropout_refusal`: the check each tree layer makes on a tree batch (it sees
  its config, not the model): ``hidden_dropout`` in training, unless the batch's
  :class:`TreePackedSeqParams` opted in to shared masks (``shared_dropout=True``).
"""

from __future__ import annotations

import torch

from ps_mcore.dropout import DropoutSite, active_dropouts, key_by_value, shared_dropout_refusal
from ps_mcore.layer_specs.modules.core_attention import TreeCoreAttention

OPT_IN = "TreePackedSeqParams.from_plan(..., shared_dropout=True)"
# Dropout sites named after something other than the config key that sets them.
_SITE_KEYS = {"embedding_dropout": "hidden_dropout", "dropout_p": "attention_dropout"}
_CONFIG_KEYS = ("hidden_dropout", "attention_dropout")


def _is_attention_dropout(name: str, holder: torch.nn.Module) -> bool:
    return isinstance(holder, TreeCoreAttention) or name.rpartition(".")[2] in ("attention_dropout", "dropout_p")


def megatron_dropout_refusal(
    model: torch.nn.Module, shared_dropout: bool = False, opt_in: str = OPT_IN, key_prefix: str = "config."
) -> str | None:
    """Why ``model`` (a GPTModel / HybridModel chunk, or a DDP / Float16Module wrapper) cannot
    run a prefix tree as it is: its active dropouts with their config keys (written
    ``key_prefix + key``, e.g. verl's ``override_transformer_config.``); attention dropout
    always, the others unless ``shared_dropout``. None when nothing is refused."""
    config = getattr(model, "config", None)
    keys = {k: float(getattr(config, k)) for k in _CONFIG_KEYS if getattr(config, k, 0.0)}

    def key_for(name: str, holder: torch.nn.Module, p: float) -> str | None:
        leaf = name.rpartition(".")[2]
        key = _SITE_KEYS.get(leaf) or key_by_value(keys, name, p)
        return None if key is None else key_prefix + key

    return shared_dropout_refusal(active_dropouts(model, key_for, _is_attention_dropout), opt_in, shared_dropout)


def tree_batch_dropout_refusal(module: torch.nn.Module, packed_seq_params) -> str | None:
    """The refusal of a tree layer (``module``, training or not) on a tree batch: its
    config's ``hidden_dropout`` in training, unless ``packed_seq_params.shared_dropout``."""
    p = float(getattr(module.config, "hidden_dropout", 0.0) or 0.0)
    if not module.training or p == 0.0:
        return None
    site = DropoutSite(
        "hidden_dropout (the embedding dropout and every layer's bias-dropout-add after "
        "attention and MLP/MoE)", p, "config.hidden_dropout",
    )
    return shared_dropout_refusal([site], OPT_IN, bool(getattr(packed_seq_params, "shared_dropout", False)))
