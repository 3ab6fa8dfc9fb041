"""``ps_mcore.multimodal``: keying image placeholders by content, the plan's real tokens, the
image occurrences of the packed rows and per-row values (the verl path end to end:
tests/test_verl_vlm.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_mcore import plan_prefix_tree
from ps_mcore.multimodal import IMAGE_KEY_BASE, image_key, keyed_sequence, packed_image_order, row_values, with_tokens

IMG = 9


def _seqs():
    text = [1, 2, 3]
    return [np.array(text + [IMG] * 4 + [5, 6]), np.array(text + [IMG] * 4 + [5, 7]),  # image A twice
            np.array(text + [IMG] * 4 + [5, 6])]  # image B, same tokens


def test_keys_share_equal_images_only_and_tokens_come_back():
    seqs = _seqs()
    keyed = [keyed_sequence(s, IMG, [4], [k]) for s, k in zip(seqs, (0, 0, 1))]
    plan = with_tokens(plan_prefix_tree(keyed, min_prefix_len=1), seqs)
    # A's two samples share text + image + [5]; B shares only the text
    assert plan.num_tokens == 3 + (4 + 1 + 2) + (4 + 2)
    assert int(plan.input_ids.max()) < IMAGE_KEY_BASE
    unpacked = plan.input_ids[plan.unpack_index]
    assert torch.equal(unpacked, torch.from_numpy(np.concatenate(seqs)))
    nxt = torch.from_numpy(np.concatenate([np.append(s[1:], 0) for s in seqs]))
    assert torch.equal(plan.next_token_ids, nxt)
    order = packed_image_order(plan, seqs, IMG, [[4], [4], [4]])
    assert order == [(0, 0), (2, 0)]  # one occurrence per distinct image, in row order
    # values fixed by the prefix (positions, two rows of them) come back token by token
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].repeat(2, 1) * torch.tensor([[1], [3]])
    assert torch.equal(row_values(plan, pos)[:, plan.unpack_index], pos)


def test_placeholder_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="holds 4 image placeholder tokens"):
        keyed_sequence(_seqs()[0], IMG, [3], [0])


def test_image_key_names_content_and_grid():
    a = torch.randn(16, 12)
    assert image_key(a, (1, 4, 4)) == image_key(a.clone(), (1, 4, 4))
    assert image_key(a, (1, 4, 4)) != image_key(a, (1, 2, 8))
    assert image_key(a, (1, 4, 4)) != image_key(a + 1e-6, (1, 4, 4))
