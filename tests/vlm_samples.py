"""Tiny vision-language samples shared by the FSDP and Megatron VLM tests: Qwen2-VL-style
images (random patches of 3 channels x 1 frame x 2 x 2 pixels, merged 2 x 2 into one image
token) and prompts holding their placeholders."""

from __future__ import annotations

import numpy as np
import torch

IMAGE, VIDEO, VISION_START, VISION_END = 150, 151, 152, 153
PATCH_DIM = 3 * 1 * 2 * 2  # channels x temporal patch x patch^2
MERGE = 2


def random_image(rng, grid=(1, 4, 4)):
    """``(patches [t*h*w, PATCH_DIM], grid)``."""
    t, h, w = grid
    return torch.from_numpy(rng.normal(size=(t * h * w, PATCH_DIM)).astype(np.float32)), grid


def image_prompt(rng, image, text_below: int = 140, head=(3, 6), tail=(2, 5)) -> list[int]:
    """Text, then (with an image) vision start, its placeholders, vision end, then text; text ids
    in ``[1, text_below)``, ``head`` / ``tail`` lengths drawn from these half-open ranges."""
    first = rng.integers(1, text_below, int(rng.integers(*head))).tolist()
    last = rng.integers(1, text_below, int(rng.integers(*tail))).tolist()
    if image is None:
        return first + last
    t, h, w = image[1]
    return first + [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END] + last
