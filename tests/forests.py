"""Batches with prefix structure for the exactness tests: named nasty shapes, a seeded random
forest generator and a hypothesis strategy. Small vocabularies make sharing happen by itself."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def _rand(rng, n, vocab=50):
    return [int(x) for x in rng.integers(0, vocab, n)]


def nasty_forests(seed: int = 0) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    p = _rand(rng, 12)
    chain = _rand(rng, 40)
    return {
        "single-sequence": [_rand(rng, 17)],
        "identical-duplicates": [p + [1, 2, 3]] * 3,
        "prefix-of-another": [p, p + _rand(rng, 9), p[:5]],
        "single-tokens": [[7], [7], [3], p, [7]],
        "deep-chain": [chain[: 4 * (i + 1)] for i in range(10)],
        "no-sharing": [[100 + i] + _rand(rng, 5 + i) for i in range(4)],
        "grpo": [p + _rand(rng, int(rng.integers(1, 9))) for _ in range(5)],
        "tree": [p + a + b for a in (_rand(rng, 6), _rand(rng, 6)) for b in (_rand(rng, 4), [9])],
    }


def small_nasty_forests() -> dict[str, list[list[int]]]:
    """Short nasty shapes for model-level tests (every reference sequence runs a stock layer):
    one sequence, a deep chain of 1-4-token nodes (shorter than a conv window of 4), single
    tokens, duplicates and a prefix of another, a tree, no sharing, a small random forest."""
    rng = np.random.default_rng(0)
    p, chain = _rand(rng, 7), _rand(rng, 12)
    return {
        "single-sequence": [p],
        "deep-chain-short-nodes": [chain[:n] for n in (2, 4, 5, 9, 12)],
        "single-tokens": [[7], [7], [3], [7, 1, 2]],
        "duplicates-and-prefix": [p, list(p), p[:3], p + [1, 2]],
        "tree": [p + a + b for a in ([1, 2], [3]) for b in ([4, 5, 6], [])],
        "no-sharing": [[1, 2, 3], [4, 5], [6]],
        "random": random_forest(np.random.default_rng(3), max_seqs=5, max_len=12),
    }


def random_forest(rng: np.random.Generator, max_seqs: int = 8, max_len: int = 24) -> list[list[int]]:
    """Sequences grown from each other: extensions, prefixes, duplicates and fresh roots."""
    seqs: list[list[int]] = []
    for _ in range(int(rng.integers(1, max_seqs + 1))):
        op = rng.integers(0, 4) if seqs else 0
        base = seqs[int(rng.integers(0, len(seqs)))] if seqs else []
        if op == 0:  # fresh root with a tiny vocabulary (accidental shared runs)
            new = _rand(rng, int(rng.integers(1, max_len)), vocab=3)
        elif op == 1:  # branch off a random point of an existing sequence
            cut = int(rng.integers(0, len(base) + 1))
            new = base[:cut] + _rand(rng, int(rng.integers(1, 8)))
        elif op == 2:  # a prefix of an existing sequence
            new = base[: int(rng.integers(1, len(base) + 1))]
        else:  # an identical duplicate
            new = list(base)
        seqs.append(new[:max_len] or [0])
    return seqs


def window_forest(seed: int, window: int, num_seqs: int = 6, vocab: int = 50) -> list[list[int]]:
    """A root of about three windows, then sequences branching off earlier ones at random
    depths (inside the first window, across later ones) and running on for up to two windows,
    plus a prefix of another: contexts several windows long, windows that cross branch points
    and branches shorter than a window."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, 3 * window + 2).tolist()]
    while len(seqs) < num_seqs - 1:
        base = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(1, len(base) + 1))
        seqs.append(base[:cut] + rng.integers(0, vocab, int(rng.integers(1, 2 * window + 2))).tolist())
    seqs.append(seqs[0][: int(rng.integers(1, len(seqs[0])))])
    return seqs


@st.composite
def forests(draw, max_seqs: int = 8, max_len: int = 24):
    seed = draw(st.integers(0, 2**32 - 1))
    return random_forest(np.random.default_rng(seed), max_seqs, max_len)
