"""``ps_mcore.multi_token``: the rows of each MTP depth on a prefix tree, checked token by token
against what stock MTP computes on the unshared batch (depth k at position i reads token i+k,
the previous depth at position i, and predicts token i+k+1), on the nasty and random forests.
The end-to-end check against megatron's MTP block is tests/test_verl_megatron.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forests import nasty_forests, random_forest

from ps_mcore import plan_prefix_tree
from ps_mcore.multi_token import depth_plans, rolled_mask


def _cases():
    cases = list(nasty_forests(2).items())
    rng = np.random.default_rng(5)
    cases += [(f"random{i}", random_forest(rng, max_seqs=10, max_len=20)) for i in range(4)]
    return cases


@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_depth_rows_follow_each_samples_path(name, seqs):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    unpack = plan.unpack_index.tolist()
    depths = depth_plans(plan, 3)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    previous = None
    for depth in depths:
        k = depth.depth
        rows_of_tokens = set()
        for s, seq in enumerate(seqs):
            for i in range(len(seq)):
                n = offsets[s] + i
                if i + k >= len(seq):
                    assert not bool(depth.tokens.next_token_mask[n])
                    continue
                q = int(depth.tokens.unpack_index[n])
                rows_of_tokens.add(q)
                assert int(depth.rows[q]) == unpack[n + k]  # named after the row of token i+k
                assert int(depth.plan.position_ids[q]) == i  # RoPE position at depth k
                src = int(depth.source[q])
                assert (src if k == 1 else int(previous.rows[src])) == unpack[n + k - 1]
                labelled = i + k + 1 < len(seq)
                assert bool(depth.tokens.next_token_mask[n]) == labelled
                if labelled:
                    assert int(depth.tokens.next_token_ids[n]) == seq[i + k + 1]
        # one row per distinct packed row at position >= k: nothing merged, nothing copied
        assert rows_of_tokens == set(range(depth.num_rows))
        assert depth.num_rows == len({unpack[offsets[s] + i] for s, seq in enumerate(seqs)
                                      for i in range(k, len(seq))})
        previous = depth
    assert len(depths) == min(3, max(len(s) for s in seqs) - 1)


def test_a_shared_row_branches_at_depth_k_only_where_the_next_k_tokens_differ():
    """Two samples share 6 tokens then differ: at depth 1 their rows up to position 4 are
    shared (token i+1 agrees), at depth 2 up to position 3."""
    p = [5, 6, 7, 8, 9, 10]
    plan = plan_prefix_tree([p + [1, 2], p + [3, 4]], min_prefix_len=1)
    d1, d2 = depth_plans(plan, 2)
    rows = lambda d, s: d.tokens.unpack_index[8 * s: 8 * s + 8].tolist()  # noqa: E731
    assert rows(d1, 0)[:5] == rows(d1, 1)[:5] and rows(d1, 0)[5] != rows(d1, 1)[5]
    assert rows(d2, 0)[:4] == rows(d2, 1)[:4] and rows(d2, 0)[4] != rows(d2, 1)[4]


def test_rolled_mask_matches_megatron_roll_per_sequence():
    mask = torch.tensor([1.0, 2, 3, 4, 5, 6, 7])
    out = rolled_mask(mask, (3, 4), 2)
    assert out.tolist() == [3, 0, 0, 6, 7, 0, 0]
