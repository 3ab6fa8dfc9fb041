"""Images inside the token sequences of a prefix tree (Qwen2-VL-style vision-language models).

A vision-language prompt holds each image as a run of identical placeholder tokens, one per
merged patch. Two samples with different images under the same text carry the same token ids,
so sharing must be decided on *keys*: every placeholder of an image becomes a key that names the
image's content (:data:`IMAGE_KEY_BASE` + the image's index in a batch-wide table of distinct
images). The tree is planned on the keys; :func:`with_tokens` puts the real token ids back.

On such a plan every image occurrence covers whole, contiguous packed rows (its placeholders
all carry one key, so a node boundary never falls inside it), a shared prompt's image is one
occurrence, and :func:`packed_image_order` lists the occurrences in row order: the vision tower
runs on exactly those, and the model scatters their features into the placeholders of the
packed rows as it does for an ordinary packed batch. Per-token values that depend only on the
prefix (3-D mrope positions) go to the packed rows with :func:`row_values`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from ps_mcore.planner import TreePlan

IMAGE_KEY_BASE = 1 << 40  # above every vocabulary


def image_key(pixels: torch.Tensor, grid: tuple[int, ...]) -> bytes:
    """A digest naming one image's content (its patches and grid)."""
    data = pixels.detach().cpu().contiguous()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str((tuple(grid), tuple(data.shape), str(data.dtype))).encode())
    digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.digest()


def keyed_sequence(seq: np.ndarray, image_token_id: int, tokens_per_image: list[int], keys: list[int]) -> np.ndarray:
    """``seq`` with the placeholders of its i-th image replaced by ``IMAGE_KEY_BASE + keys[i]``
    (placeholders in order; image i owns the next ``tokens_per_image[i]``)."""
    positions = np.flatnonzero(seq == image_token_id)
    if positions.size != sum(tokens_per_image):
        raise ValueError(
            f"a sequence holds {positions.size} image placeholder tokens (id {image_token_id}) for images "
            f"of {sum(tokens_per_image)} merged patches"
        )
    out = np.asarray(seq, dtype=np.int64).copy()
    out[positions] = IMAGE_KEY_BASE + np.repeat(np.asarray(keys, dtype=np.int64), tokens_per_image)
    return out


def with_tokens(plan: TreePlan, sequences: list[np.ndarray]) -> TreePlan:
    """``plan`` (made from keyed sequences) with ``input_ids`` / ``next_token_ids`` taken from
    the real ``sequences`` (same lengths, batch order)."""
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if sequences else np.zeros(0, np.int64)
    unpack = plan.host.unpack_index.cpu().numpy()
    if flat.size != unpack.size:
        raise ValueError(f"{flat.size} tokens for a plan of N={unpack.size}")
    input_ids = np.empty(plan.num_tokens, dtype=np.int64)
    input_ids[unpack] = flat
    mask = plan.host.next_token_mask.cpu().numpy()
    next_ids = np.where(mask, np.concatenate([flat[1:], [0]]), 0)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init and not f.name.startswith("_")}
    fields.update(input_ids=torch.from_numpy(input_ids), next_token_ids=torch.from_numpy(next_ids))
    return TreePlan(**{k: v.to(plan.device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def packed_image_order(
    plan: TreePlan, sequences: list[np.ndarray], image_token_id: int, tokens_per_image: list[list[int]]
) -> list[tuple[int, int]]:
    """The image occurrences of the packed rows, in row order: ``(sample, image index)`` of the
    first sample holding each. Raises ``ValueError`` if an image's rows are not one whole run."""
    unpack = plan.host.unpack_index.cpu().numpy()
    offset, first_rows = 0, {}
    for s, seq in enumerate(sequences):
        positions = np.flatnonzero(np.asarray(seq) == image_token_id) + offset
        start = 0
        for j, count in enumerate(tokens_per_image[s]):
            rows = unpack[positions[start: start + count]]
            start += count
            if rows.size and not np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
                raise ValueError(f"image {j} of sample {s} does not cover one contiguous run of packed rows")
            if rows.size:
                first_rows.setdefault(int(rows[0]), (s, j))
        offset += len(seq)
    return [first_rows[r] for r in sorted(first_rows)]


def row_values(plan: TreePlan, values: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` per original token -> ``[..., T]`` per packed row (each row takes one of its
    tokens' values: they agree for values fixed by the prefix, e.g. positions)."""
    unpack = plan.host.unpack_index.cpu()
    token_of_row = torch.empty(plan.num_tokens, dtype=torch.long)
    token_of_row[unpack] = torch.arange(unpack.numel())
    return values.index_select(-1, token_of_row.to(values.device))
