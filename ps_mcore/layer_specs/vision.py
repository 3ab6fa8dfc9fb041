"""A Megatron vision-language model (Megatron-Bridge's Qwen2.5-VL) on a prefix tree.

Megatron-Bridge's ``Qwen25VLModel`` is Hugging Face's vision tower in front of a megatron-core
``GPTModel`` with multimodal RoPE. Its own forward recomputes the mrope positions from the
token ids of each THD segment (``get_rope_index``); on a tree a segment is a node, not a
sample, so :func:`vision_language_tree_forward` runs the same pieces with the positions given:

* the token embedding of the packed rows, the vision tower on the images of the packed rows
  (in row order: a shared prompt's image once, :func:`ps_mcore.multimodal.packed_image_order`)
  and the model's own placeholder scatter of their features;
* the language model on the packed rows with ``position_ids [3, 1, T_pad]``: the temporal /
  height / width positions of every packed row, which depend only on the prefix
  (:func:`ps_mcore.multimodal.row_values` of each sample's positions), so GPTModel's rotary
  table has one row per packed row (tree layers use it as it is) and the tree packed params
  carry the mask.
"""

from __future__ import annotations

import torch

from ps_mcore.layer_specs.packed_params import TreePackedSeqParams

# what the tree forward uses of the model (Megatron-Bridge's Qwen25VLModel has them all)
_PARTS = ("language_model", "get_image_features", "get_placeholder_mask", "pre_process")


def vision_language_tree_refusal(model, packed_seq_params=None) -> str | None:
    """Why :func:`vision_language_tree_forward` cannot run this model (and batch, when its
    ``packed_seq_params`` are given) (None: it can)."""
    missing = [name for name in _PARTS if not hasattr(model, name)]
    if missing:
        return (f"{type(model).__name__} is not a Megatron-Bridge Qwen2.5-VL-style model (no "
                f"{', '.join(missing)}); tree path: Qwen2.5-VL")
    if getattr(model.config, "mrope_section", None) is None:
        return f"{type(model).__name__}'s language model has no multimodal RoPE (mrope_section)"
    if getattr(model.config, "sequence_parallel", False):
        return "vision-language inputs with sequence parallelism are not supported on a tree"
    if getattr(model.config, "context_parallel_size", 1) > 1:
        return "multimodal RoPE on a tree under context parallelism is not supported"
    if packed_seq_params is None:
        return None
    if not isinstance(packed_seq_params, TreePackedSeqParams):
        return "a tree forward needs TreePackedSeqParams (from_plan)"
    if packed_seq_params.cp_size > 1:
        return "multimodal RoPE on a tree under context parallelism is not supported"
    return None


def vision_language_tree_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    packed_seq_params: TreePackedSeqParams,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    attention_mask: None = None,
    **language_kwargs,
) -> torch.Tensor:
    """The model's output on the packed rows of a tree.

    Args:
        model: the unwrapped model (``Qwen25VLModel``: ``language_model``, the vision tower
            behind ``get_image_features``, ``get_placeholder_mask``).
        input_ids: ``[1, T_pad]`` packed rows (real token ids, image placeholders included).
        position_ids: ``[3, 1, T_pad]`` mrope positions of every packed row (padding rows: 0).
        packed_seq_params: the plan's :class:`TreePackedSeqParams`.
        pixel_values, image_grid_thw: the images of the packed rows, in row order.
        attention_mask: None (the plan is the mask).
        **language_kwargs: passed to the language model (``labels``, ``runtime_gather_output``).

    Returns:
        What the language model returns: logits ``[1, T_pad, V]`` (or ``[T_pad, 1, H]``
        hidden states on a stage without the output layer).
    """
    refusal = vision_language_tree_refusal(model, packed_seq_params)
    if refusal is not None:
        raise ValueError(refusal)
    if attention_mask is not None:
        raise ValueError("a tree forward takes no attention_mask (the plan describes the mask)")
    if position_ids.dim() != 3 or position_ids.size(0) != 3 or position_ids.size(-1) != packed_seq_params.num_rows:
        raise ValueError(
            f"position_ids must be [3, 1, T_pad={packed_seq_params.num_rows}] (mrope positions of every packed "
            f"row), got {tuple(position_ids.shape)}"
        )
    embeds = None
    if model.pre_process:
        embeds = model.language_model.embedding(input_ids=input_ids, position_ids=None)  # [T_pad, 1, H]
        if pixel_values is not None:
            embeds = embeds.transpose(0, 1)  # [1, T_pad, H]: the model's placeholder scatter
            features = torch.cat(model.get_image_features(pixel_values, image_grid_thw, return_dict=True).pooler_output)
            features = features.to(embeds.device, embeds.dtype)
            mask, _ = model.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=features)
            embeds = embeds.masked_scatter(mask, features).transpose(0, 1).contiguous()
    return model.language_model(
        input_ids=None, position_ids=position_ids, attention_mask=None, decoder_input=embeds,
        packed_seq_params=packed_seq_params, **language_kwargs,
    )
