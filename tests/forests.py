"""Batches with prefix structure for the exactness tests: named nasty shapes, seeded random
forest generators and a hypothesis strategy. Small vocabularies make sharing happen by itself.

A forest *branches* where two sequences with a common prefix continue with different tokens;
a recurrent layer hands its state over there, and only a forest that branches inside a branch
tests that the handed-over state is itself the right one. :func:`assert_branches` checks that
from the token sequences alone (a trie built here, not the planner under test); the branching
generators and named tree shapes assert it on what they return."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def _rand(rng, n, vocab=50):
    return [int(x) for x in rng.integers(0, vocab, n)]


def nested_branch_depths(seqs) -> list[int]:
    """Token depths of the branch points along the root-to-leaf path that passes the most of
    them (depth = length of the shared prefix, >= 1: distinct first tokens are separate roots,
    which share no state). ``[5, 9]``: a branch at depth 5 whose subtree branches again at 9."""
    trie: dict = {}
    for s in seqs:
        node = trie
        for t in np.asarray(s).tolist():
            node = node.setdefault(int(t), {})
    best: list[int] = []
    stack = [(child, 1, []) for child in trie.values()]
    while stack:
        node, depth, path = stack.pop()
        if len(node) > 1:
            path = path + [depth]
        if len(path) > len(best):
            best = path
        stack.extend((child, depth + 1, path) for child in node.values())
    return best


def assert_branches(seqs, levels: int = 2):
    """``seqs`` branch at ``levels`` or more depths, each branch inside the previous one's subtree
    (so a recurrent child starts from a state that was itself handed over). Returns ``seqs``."""
    depths = nested_branch_depths(seqs)
    assert len(depths) >= levels, (
        f"forest branches at nested depths {depths}, wanted {levels} levels: {[len(s) for s in seqs]} tokens")
    return seqs


def branching_forest(rng: np.random.Generator, roots: int = 2, depth: int = 3, fanout: int = 3,
                     node_len: tuple[int, int] = (2, 9), vocab: int = 50) -> list[list[int]]:
    """A tree rollout: each root's first node forks into 2..``fanout`` children, the first of
    them again, down ``depth`` levels (branches at ``depth - 1`` nested depths, asserted); other
    nodes fork into 1..``fanout``. Sibling nodes start with different tokens. Some samples end at
    a branch point (a prefix of others), and one repeats another (a duplicate)."""
    seqs: list[list[int]] = []

    def grow(prefix, level, forced):
        if level == depth:
            seqs.append(prefix)
            return
        n = int(rng.integers(2 if forced else 1, fanout + 1))
        firsts = rng.choice(vocab, size=n, replace=False)
        for i, first in enumerate(firsts):
            rest = _rand(rng, int(rng.integers(*node_len)) - 1, vocab)
            grow(prefix + [int(first)] + rest, level + 1, forced and i == 0)
        if rng.random() < 0.3:
            seqs.append(prefix)  # a sample ending at a branch point

    for first in rng.choice(vocab, size=roots, replace=False):
        grow([int(first)] + _rand(rng, int(rng.integers(*node_len)) - 1, vocab), 1, True)
    seqs.append(list(seqs[int(rng.integers(len(seqs)))]))
    order = rng.permutation(len(seqs))
    return assert_branches([seqs[i] for i in order], levels=depth - 1)


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
        "tree": assert_branches([p + a + b for a in ([51] + _rand(rng, 5), [52] + _rand(rng, 5))
                                 for b in ([53] + _rand(rng, 3), [9])]),
    }


def small_nasty_forests() -> dict[str, list[list[int]]]:
    """Short nasty shapes for model-level tests (every reference sequence runs a stock layer):
    one sequence, a deep chain of 1-4-token nodes (shorter than a conv window of 4), single
    tokens, duplicates and a prefix of another, a tree, no sharing, a small random tree. The
    last two of those branch inside a branch (asserted)."""
    rng = np.random.default_rng(0)
    p, chain = _rand(rng, 7), _rand(rng, 12)
    return {
        "single-sequence": [p],
        "deep-chain-short-nodes": [chain[:n] for n in (2, 4, 5, 9, 12)],
        "single-tokens": [[7], [7], [3], [7, 1, 2]],
        "duplicates-and-prefix": [p, list(p), p[:3], p + [1, 2]],
        # branches at depth 7, then at 8 and 9 (one-token nodes, shorter than a conv window)
        "tree": assert_branches([p + a + b for a in ([1, 2], [3]) for b in ([4, 5, 6], [8])] + [p + [1, 2]]),
        "no-sharing": [[1, 2, 3], [4, 5], [6]],
        "random": branching_forest(np.random.default_rng(3), roots=1, depth=3, fanout=2, node_len=(2, 5)),
    }


def random_forest(rng: np.random.Generator, max_seqs: int = 8, max_len: int = 24) -> list[list[int]]:
    """Sequences grown from each other: extensions, prefixes, duplicates and fresh roots (any
    shape, branching or not: :func:`branching_forest` for one that surely branches)."""
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
    and branches shorter than a window. The seeds the tests use branch inside a branch
    (asserted)."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, 3 * window + 2).tolist()]
    while len(seqs) < num_seqs - 1:
        base = seqs[rng.integers(len(seqs))]
        cut = int(rng.integers(1, len(base) + 1))
        seqs.append(base[:cut] + rng.integers(0, vocab, int(rng.integers(1, 2 * window + 2))).tolist())
    seqs.append(seqs[0][: int(rng.integers(1, len(seqs[0])))])
    return assert_branches(seqs)


@st.composite
def forests(draw, max_seqs: int = 8, max_len: int = 24):
    """Half random shapes (:func:`random_forest`), half trees that branch inside a branch
    (:func:`branching_forest`: at most 8 sequences of fewer than ``max_len`` tokens)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        return random_forest(rng, max_seqs, max_len)
    return branching_forest(rng, roots=1, depth=3, fanout=2, node_len=(1, max(2, max_len // 3)))
