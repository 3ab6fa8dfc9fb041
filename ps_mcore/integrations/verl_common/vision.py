"""Vision-language micro-batches (Qwen2-VL / Qwen2.5-VL) on a prefix tree, FSDP engine.

verl's stock forward packs every sample's tokens, 4-row positions (text position, then the
temporal / height / width mrope rows) and images, and the model runs the vision tower on every
sample's images and scatters the features into the image placeholders. On the tree:

* the plan is made on sequences whose image placeholders are keyed by image content
  (:func:`~ps_mcore.integrations.verl_common.batch.sharing_sequences`), so a prompt's image is
  shared exactly where the image is the same; the real token ids go back into the plan
  (:func:`ps_mcore.multimodal.with_tokens`);
* the model gets the packed rows, the 4-row positions of each packed row (mrope positions ride
  in the plan like 1-D positions) and the images of the packed rows in row order
  (:func:`ps_mcore.multimodal.packed_image_order`): the vision tower runs once per image
  occurrence in the packed rows (a shared prompt's image once), and the model's own
  placeholder scatter puts the features in place;
* the text decoder runs tree attention (``"prefix_tree"`` on the text config). verl patches the
  Qwen2-VL attention classes with its own flash-attention forward; for a tree call the class's
  Hugging Face forward (recorded when the patchset is installed) runs instead, which
  dispatches to the tree attention.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from ps_mcore.fsdp_bridge import unwrap_model
from ps_mcore.integrations.verl_common.batch import ImageTokens, sample_images, sequences, sharing_sequences
from ps_mcore.multimodal import packed_image_order, row_values

# model_type -> (transformers module, text attention class)
VLM_ATTENTION = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLAttention"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLAttention"),
}
_KNOWN_INPUTS = {"pixel_values", "image_grid_thw"}
_HF_FORWARD: dict[type, Callable] = {}  # Hugging Face's own attention forward, per class
_TREE_ROUTED = "_ps_mcore_tree_routed"


def _config(module):
    return unwrap_model(module).config


def image_tokens_of(module) -> ImageTokens | None:
    """The image placeholder layout of a supported vision-language model (None otherwise)."""
    config = _config(module)
    if getattr(config, "model_type", None) not in VLM_ATTENTION:
        return None
    return ImageTokens(int(config.image_token_id), int(config.vision_config.spatial_merge_size))


def engine_image_tokens(engine) -> ImageTokens | None:
    module = getattr(engine, "module", None)
    return None if module is None else image_tokens_of(module)


def is_vision_batch(batch) -> bool:
    return "multi_modal_inputs" in batch.keys() or batch["position_ids"].dim() == 3


def _attention_class(model_type: str) -> type | None:
    module_name, name = VLM_ATTENTION[model_type]
    module = sys.modules.get(module_name)
    return None if module is None else getattr(module, name, None)


def record_hf_attention_forwards() -> None:
    """Remember Hugging Face's own forward of every supported VLM attention class that is
    imported and not yet patched (verl replaces it when it builds a VLM)."""
    import importlib

    for model_type, (module_name, name) in VLM_ATTENTION.items():
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
        forward = cls.forward
        if cls not in _HF_FORWARD and getattr(forward, "__module__", "") == module_name:
            _HF_FORWARD[cls] = forward


def _routing_refusal(cls: type) -> str | None:
    forward = cls.forward
    if getattr(forward, _TREE_ROUTED, False) or getattr(forward, "__module__", "") == cls.__module__:
        return None
    if cls not in _HF_FORWARD:
        return (
            f"{cls.__name__}.forward was replaced before prefix sharing was installed (import "
            "prefix_sharing before the model is built)"
        )
    return None


def vlm_refusal(engine, batch) -> str | None:
    """Why this vision-language micro-batch must take verl's stock forward (None: the tree
    path runs it)."""
    config = _config(engine.module)
    model_type = getattr(config, "model_type", None)
    if model_type not in VLM_ATTENTION:
        return f"vision-language inputs on {model_type or type(config).__name__} (tree path: Qwen2-VL, Qwen2.5-VL)"
    if getattr(engine, "use_ulysses_sp", False):
        return "vision-language inputs with Ulysses sequence parallelism are not supported on a tree"
    # values(), not the shape: verl's micro-batch selection keeps values and offsets of a
    # nested [B, 4, j] tensor but not its shape metadata
    position_ids = batch["position_ids"]
    if position_ids.dim() != 3 or position_ids.values().dim() != 2 or position_ids.values().size(0) != 4:
        return "vision-language inputs without verl's 4-row (text + 3-D mrope) position ids"
    reason = multi_modal_inputs_refusal(batch)
    if reason is not None:
        return reason
    cls = _attention_class(model_type)
    if cls is None:
        return f"{VLM_ATTENTION[model_type][1]} is not importable"
    reason = _routing_refusal(cls)
    if reason is not None:
        return reason
    return images_refusal(batch, image_tokens_of(engine.module))


def multi_modal_inputs_refusal(batch) -> str | None:
    """Why the batch's multi-modal inputs cannot be shared (None: images only)."""
    for inputs in batch["multi_modal_inputs"] if "multi_modal_inputs" in batch.keys() else []:
        unknown = set(getattr(inputs, "data", inputs) or {}) - _KNOWN_INPUTS
        if unknown:
            return f"multi-modal inputs {sorted(unknown)} (videos) are not supported on a tree"
    return None


def images_refusal(batch, images: ImageTokens) -> str | None:
    """Why the batch's image placeholders do not match its images (None: they do)."""
    try:
        sharing_sequences(batch, images)
    except ValueError as err:
        return str(err)
    return None


def route_tree_attention(module, patcher) -> None:
    """Make tree calls of the model's VLM attention class reach the attention interface: when
    verl replaced the class's forward, a call carrying ``tree_call`` runs Hugging Face's own
    forward instead (recorded in ``patcher``, undone with the patchset)."""
    cls = _attention_class(_config(module).model_type)
    forward = cls.forward
    if getattr(forward, _TREE_ROUTED, False) or getattr(forward, "__module__", "") == cls.__module__:
        return
    hf_forward = _HF_FORWARD[cls]

    def make(current):
        def forward(self, *args, **kwargs):
            if kwargs.get("tree_call") is not None:
                return hf_forward(self, *args, **kwargs)
            return current(self, *args, **kwargs)

        setattr(forward, _TREE_ROUTED, True)
        return forward

    patcher.wrap(cls, "forward", make)


def packed_images(batch, plan, images: ImageTokens, device) -> dict:
    """The images of the packed rows in row order (``pixel_values``, ``image_grid_thw``;
    empty when the micro-batch has no image)."""
    per_sample = sample_images(batch)
    counts = [[images.tokens(grid) for _, grid in sample] for sample in per_sample]
    order = packed_image_order(plan, sequences(batch), images.image_token_id, counts)
    if not order:
        return {}
    return {
        "pixel_values": torch.cat([per_sample[s][j][0] for s, j in order]).to(device),
        "image_grid_thw": torch.tensor([per_sample[s][j][1] for s, j in order], device=device),
    }


def tree_vision_inputs(batch, plan, images: ImageTokens, device) -> dict:
    """Model inputs of the packed rows beyond the token ids: ``position_ids [4, 1, T]`` (each
    packed row's text + mrope positions) and :func:`packed_images`."""
    positions = batch["position_ids"].values()  # [4, N]
    inputs = {"position_ids": row_values(plan, positions.cpu())[:, None, :].to(device)}
    inputs.update(packed_images(batch, plan, images, device))
    return inputs
