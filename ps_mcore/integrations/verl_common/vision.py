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

Under Ulysses SP the tree follows verl's VLM layout: every SP rank gets all packed rows
(padded to a multiple of SP) and all images of the packed rows, so each rank runs the vision
tower once per distinct image and the placeholder scatter on all rows; the text model then
takes this rank's contiguous chunk of the embeddings and positions
(:func:`route_sp_input_slicing`, the slice verl's ``patch_vlm_for_ulysses_input_slicing``
makes), and the decoder runs as on a text model under SP
(:mod:`ps_mcore.fsdp_bridge.sequence_parallel`). The vision tower's gradient on each rank comes
from its own chunk's rows; summed over the SP ranks it is the whole gradient, as in verl.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, NamedTuple

import torch

from ps_mcore.fsdp_bridge import unwrap_model
from ps_mcore.fsdp_bridge.sequence_parallel import SequenceParallelPlan
from ps_mcore.integrations.verl_common.batch import ImageTokens, sample_images, sequences, sharing_sequences
from ps_mcore.multimodal import packed_image_order, row_values

class VLMClasses(NamedTuple):
    """Where a vision-language family's classes live in transformers (names of classes)."""

    module: str
    attention: str  # the text attention class
    text_model: str


# model_type -> its classes
VLM_CLASSES = {
    "qwen2_vl": VLMClasses("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLAttention", "Qwen2VLTextModel"),
    "qwen2_5_vl": VLMClasses("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLAttention",
                             "Qwen2_5_VLTextModel"),
}
_KNOWN_INPUTS = {"pixel_values", "image_grid_thw"}
_HF_FORWARD: dict[type, Callable] = {}  # Hugging Face's own attention forward, per class
_TREE_ROUTED = "_ps_mcore_tree_routed"
_SP_SLICED = "_ps_mcore_sp_sliced"
# set while verl's Ulysses VLM input-slicing wrapper runs the text model: it slices only when unset
_VERL_SLICE_FLAG = "_needs_initial_slice"


def _config(module):
    return unwrap_model(module).config


def image_tokens_of(module) -> ImageTokens | None:
    """The image placeholder layout of a supported vision-language model (None otherwise)."""
    config = _config(module)
    if getattr(config, "model_type", None) not in VLM_CLASSES:
        return None
    return ImageTokens(int(config.image_token_id), int(config.vision_config.spatial_merge_size))


def engine_image_tokens(engine) -> ImageTokens | None:
    module = getattr(engine, "module", None)
    return None if module is None else image_tokens_of(module)


def is_vision_batch(batch) -> bool:
    return "multi_modal_inputs" in batch.keys() or batch["position_ids"].dim() == 3


def _vlm_class(model_type: str, which: str = "attention") -> type | None:
    """The model type's class ``which`` (a :class:`VLMClasses` field), if its module is imported."""
    classes = VLM_CLASSES[model_type]
    module = sys.modules.get(classes.module)
    return None if module is None else getattr(module, getattr(classes, which), None)


def record_hf_attention_forwards() -> None:
    """Remember Hugging Face's own forward of every supported VLM attention class that is
    imported and not yet patched (verl replaces it when it builds a VLM)."""
    import importlib

    for model_type, (module_name, name, _) in VLM_CLASSES.items():
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
    if model_type not in VLM_CLASSES:
        return f"vision-language inputs on {model_type or type(config).__name__} (tree path: Qwen2-VL, Qwen2.5-VL)"
    # values(), not the shape: verl's micro-batch selection keeps values and offsets of a
    # nested [B, 4, j] tensor but not its shape metadata
    position_ids = batch["position_ids"]
    if position_ids.dim() != 3 or position_ids.values().dim() != 2 or position_ids.values().size(0) != 4:
        return "vision-language inputs without verl's 4-row (text + 3-D mrope) position ids"
    reason = multi_modal_inputs_refusal(batch)
    if reason is not None:
        return reason
    cls = _vlm_class(model_type)
    if cls is None:
        return f"{VLM_CLASSES[model_type].attention} is not importable"
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
    cls = _vlm_class(_config(module).model_type)
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


@contextlib.contextmanager
def _verl_slicing_off(text_model):
    previous = text_model.__dict__.get(_VERL_SLICE_FLAG)
    setattr(text_model, _VERL_SLICE_FLAG, False)
    try:
        yield
    finally:
        if previous is None:
            delattr(text_model, _VERL_SLICE_FLAG)
        else:
            setattr(text_model, _VERL_SLICE_FLAG, previous)


def route_sp_input_slicing(module, patcher) -> None:
    """Make the model's text model take this Ulysses rank's rows in a tree call under SP: the
    model embeds all ``T_pad`` packed rows (images scattered in place), the text model keeps
    rows ``[rank * c, (rank + 1) * c)`` of ``inputs_embeds [1, T_pad, H]`` and of the positions
    ``[..., T_pad]``. A call whose rows verl's own slicing wrapper (installed around the class
    when verl builds a VLM for Ulysses) already cut runs as it is; verl's wrapper never slices a
    tree call a second time. Recorded in ``patcher`` (undone with the patchset)."""
    cls = _vlm_class(_config(module).model_type, "text_model")
    if getattr(cls.forward, _SP_SLICED, False):
        return

    def make(current):
        def forward(self, *args, **kwargs):
            sp_plan = getattr(kwargs.get("tree_call"), "plan", None)
            if not isinstance(sp_plan, SequenceParallelPlan):
                return current(self, *args, **kwargs)
            embeds = kwargs.get("inputs_embeds")
            if embeds is not None and embeds.size(1) != sp_plan.rows_per_rank:
                kwargs["inputs_embeds"] = sp_plan.local(embeds, dim=1)
                kwargs["position_ids"] = sp_plan.local(kwargs["position_ids"], dim=-1)
            with _verl_slicing_off(self):
                return current(self, *args, **kwargs)

        setattr(forward, _SP_SLICED, True)
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


def tree_vision_inputs(batch, plan, images: ImageTokens, device, sp_plan: SequenceParallelPlan | None = None) -> dict:
    """Model inputs of the packed rows beyond the token ids: ``position_ids [4, 1, T]`` (each
    packed row's text + mrope positions; ``[4, 1, T_pad]`` under SP, every rank all rows) and
    :func:`packed_images`."""
    positions = row_values(plan, batch["position_ids"].values().cpu())  # [4, N] -> [4, T]
    if sp_plan is not None:
        positions = sp_plan.padded(positions, dim=-1)
    inputs = {"position_ids": positions[:, None, :].to(device)}
    inputs.update(packed_images(batch, plan, images, device))
    return inputs
