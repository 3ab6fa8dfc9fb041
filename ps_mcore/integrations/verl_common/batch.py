"""Reading one verl worker batch (a TensorDict): sequences, prompt lengths, groups,
and planning it. Shared by the Megatron and FSDP glue and the micro-batcher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig
from ps_mcore.multimodal import image_key, keyed_sequence
from ps_mcore.planner import TreePlan, plan_prefix_tree, tree_pairs

# verl's ``calculate_workload``: ``24576 * L + L**2`` for a sequence of L tokens (a 7B model's
# linear FLOPs per token in units of its attention FLOPs per query-key pair, halved).
VERL_TOKEN_WORKLOAD = 24576


@dataclass(frozen=True)
class ImageTokens:
    """How a vision-language model lays images into its token sequences (Qwen2-VL style).

    Attributes:
        image_token_id: the placeholder token of image patches.
        merge_size: the spatial merge: an image of grid ``(t, h, w)`` patches has
            ``t * h * w // merge_size**2`` placeholders.
    """

    image_token_id: int
    merge_size: int

    def tokens(self, grid) -> int:
        t, h, w = (int(x) for x in grid)
        return t * h * w // self.merge_size**2


def sequences(data) -> list[np.ndarray]:
    """The unpadded token sequences (CPU int64 arrays), batch order.

    ``input_ids`` is a jagged nested tensor in verl's no-padding layout, or a padded
    ``[B, S]`` tensor with ``attention_mask``.
    """
    ids = data["input_ids"]
    if ids.is_nested:
        values = ids.values().detach().cpu().numpy()
        offsets = ids.offsets().cpu().numpy()
        return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    mask = data["attention_mask"].bool().cpu()
    rows = ids.detach().cpu()
    return [rows[i][mask[i]].numpy() for i in range(rows.size(0))]


def sample_images(data) -> list[list[tuple[torch.Tensor, tuple[int, int, int]]]]:
    """Per sample, its images in order: ``(patches [t*h*w, dim], (t, h, w))``, from verl's
    ``multi_modal_inputs`` (``pixel_values`` and ``image_grid_thw`` per sample)."""
    if "multi_modal_inputs" not in data.keys():
        return [[] for _ in range(len(data["input_ids"]))]
    out = []
    for inputs in data["multi_modal_inputs"]:
        inputs = getattr(inputs, "data", inputs) or {}
        grids = inputs.get("image_grid_thw")
        if grids is None:
            out.append([])
            continue
        sizes = [int(torch.as_tensor(g).prod()) for g in grids]
        patches = torch.split(inputs["pixel_values"], sizes)
        out.append([(p, tuple(int(x) for x in g)) for p, g in zip(patches, grids)])
    return out


def sharing_sequences(data, images: ImageTokens | None = None) -> list[np.ndarray]:
    """The sequences the tree is planned on: the tokens, with every image placeholder run
    replaced by a key naming the image's content when ``images`` is given and the batch holds
    images (so different images under one prompt are not shared; equal ones are)."""
    seqs = sequences(data)
    if images is None or "multi_modal_inputs" not in data.keys():
        return seqs
    table: dict[bytes, int] = {}
    keyed = []
    for seq, sample in zip(seqs, sample_images(data)):
        keys = [table.setdefault(image_key(pixels, grid), len(table)) for pixels, grid in sample]
        counts = [images.tokens(grid) for _, grid in sample]
        keyed.append(keyed_sequence(seq, images.image_token_id, counts, keys))
    return keyed


def sequence_lengths(data) -> np.ndarray:
    ids = data["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().cpu().numpy()
    return data["attention_mask"].sum(-1).cpu().numpy()


def prompt_lengths(data) -> np.ndarray | None:
    """Prompt length per sample (verl's rule, as in ``no_padding_2_padding``), or None."""
    keys = data.keys()
    if "prompts" not in keys:
        return None
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().cpu().numpy()
    if "attention_mask" not in keys:
        return None
    mask = data["attention_mask"]
    return mask[:, : prompts.shape[1]].sum(-1).cpu().numpy()


def group_ids(data) -> list[Any] | None:
    """Per-sample ``uid`` labels when the batch carries them."""
    if "uid" not in data.keys():
        return None
    return list(data["uid"])


def plan_batch(data, config: PrefixGrouperConfig, images: ImageTokens | None = None) -> TreePlan:
    """The micro-batch's :class:`TreePlan` under ``config`` (CPU), planned on
    :func:`sharing_sequences` (image placeholders keyed by content when ``images`` is given;
    :func:`ps_mcore.multimodal.with_tokens` then gives it the real token ids)."""
    prompts = prompt_lengths(data)
    if config.mode == "prompt_only" and prompts is None:
        raise ValueError(
            "prefix_grouper.mode=prompt_only needs the batch's 'prompts' to know prompt "
            "lengths; use mode=arbitrary_prefix for batches without them"
        )
    return plan_sequences(sharing_sequences(data, images), config, prompts, group_ids(data))


def plan_sequences(
    seqs: list[np.ndarray],
    config: PrefixGrouperConfig,
    prompts: np.ndarray | None,
    groups: list[Any] | None,
) -> TreePlan:
    """Plan pre-read sequences. ``prompt_only`` shares whole prompts within a ``uid`` group;
    ``arbitrary_prefix`` shares any common prefix, across groups."""
    if config.mode != "prompt_only":
        prompts, groups = None, None
    return plan_prefix_tree(
        seqs,
        mode=config.mode,
        min_prefix_len=config.min_prefix_len,
        min_group_size=config.min_group_size,
        prompt_lens=prompts,
        group_ids=groups,
    )


def tree_workload(tokens: int, pairs: float) -> int:
    """verl's workload (``calculate_workload``'s units) of ``tokens`` rows attending ``pairs``
    causal query-key pairs. A sequence of L rows attends ``L * (L + 1) / 2`` pairs, so verl's
    ``L**2`` is ``2 * pairs - L``: with nothing shared this is the sum of ``calculate_workload``
    over the sequences."""
    return int(VERL_TOKEN_WORKLOAD * tokens + round(2 * pairs) - tokens)


def plan_workload(plan: TreePlan) -> int:
    """:func:`tree_workload` of what ``plan`` computes: its T rows and the pairs its nodes
    attend (:func:`ps_mcore.planner.tree_pairs`)."""
    host = plan.host
    return tree_workload(plan.num_tokens, tree_pairs(host.cu_seqlens_q.numpy(), host.cu_seqlens_kv.numpy()))


def saved_fraction(plan: TreePlan) -> float:
    """1 - T/N: the fraction of token rows the plan does not compute."""
    return 1.0 - plan.num_tokens / max(plan.num_input_tokens, 1)


def nested_like(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Jagged nested tensor with ``like``'s offsets holding ``values`` ``[N, ...]``."""
    return torch.nested.nested_tensor_from_jagged(values, offsets=like.offsets().to(values.device))


def batch_flag(batch, key: str, default: bool = False) -> bool:
    """A boolean non-tensor entry of a verl micro-batch (``default`` when absent)."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(batch, key=key, default=default))


def batch_temperature(temp) -> float | torch.Tensor:
    """A micro-batch's ``temperature`` entry as the tree path reads it, with verl's floor
    (non-positive -> 1e-8): one float (unset: 1.0; or every sample alike), else the host
    ``[B]`` float32 per-sample tensor."""
    if temp is None:
        return 1.0
    if not isinstance(temp, torch.Tensor):
        t = float(temp)
        return t if t > 0 else 1e-8
    values = (temp.values() if temp.is_nested else temp).detach().reshape(-1).to("cpu", torch.float32)
    values = torch.where(values > 0, values, torch.full_like(values, 1e-8))
    if values.numel() == 0 or bool(torch.all(values == values[0])):
        return float(values[0]) if values.numel() else 1.0
    return values
