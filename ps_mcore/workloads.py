"""The standard benchmark workloads, as seeded generators.

Every benchmark, the demo and many tests use these names; each is one micro-batch:

==================  ===========================================================================
grpo-long-prompt    1 prompt of 4096 tokens, G = 8 responses of ~1024
grpo-wide           1 prompt of 2048, G = 16 responses of ~512
grpo-math           4 prompts of 256, G = 8 responses of ~768 each
agent-tree          a prompt of 1024, 3 turns, each turn branching in 2 (response ~256 + tool
                    output ~128): 8 root-to-leaf samples
step-wise           one 8-step trajectory, steps of ~512 tokens (observation ~128 + action
                    ~384); sample k = steps 1..k, each sample a prefix of the next
no-sharing          8 unrelated sequences of ~1024
==================  ===========================================================================

Lengths marked ~ vary +-25% around the stated mean (prompts are exact); ``scale`` shrinks
every length (the CPU demo runs them at 1/16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("grpo-long-prompt", "grpo-wide", "grpo-math", "agent-tree", "step-wise", "no-sharing")
# Workloads several micro-batch token budgets large (16k-32k at full scale): what the
# cross-micro-batch schedule (ps_mcore.minibatch) is for; one micro-batch cannot hold them.
BUDGET_WORKLOADS = ("agent-long",)
ALL_WORKLOADS = WORKLOADS + BUDGET_WORKLOADS
# A whole training mini-batch of sharing units that each fit a micro-batch (8 GRPO groups of
# 8, N ~196k, T ~82k at full scale): packed into micro-batches under a token budget (32k) as
# training runs it, first-fit by each group's deduplicated tokens.
MINIBATCH_WORKLOADS = ("grpo-minibatch",)


@dataclass(frozen=True)
class Workload:
    """One micro-batch: sequences in batch order with their prompt lengths and group labels."""

    name: str
    sequences: list[np.ndarray]
    prompt_lens: list[int]
    group_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.sequences))


class _Gen:
    def __init__(self, seed: int, scale: float, vocab: int):
        self.rng = np.random.default_rng(seed)
        self.scale = scale
        self.vocab = vocab

    def length(self, mean: int, jitter: bool = True) -> int:
        m = mean * self.scale
        n = self.rng.uniform(0.75 * m, 1.25 * m) if jitter else m
        return max(1, int(round(n)))

    def tokens(self, mean: int, jitter: bool = True) -> np.ndarray:
        return self.rng.integers(0, self.vocab, self.length(mean, jitter), dtype=np.int64)


def _grpo(g: _Gen, name, prompts, prompt_len, group, response_len) -> Workload:
    seqs, plens, gids = [], [], []
    for p in range(prompts):
        prompt = g.tokens(prompt_len, jitter=False)
        for _ in range(group):
            seqs.append(np.concatenate([prompt, g.tokens(response_len)]))
            plens.append(len(prompt))
            gids.append(p)
    return Workload(name, seqs, plens, gids)


def _agent_tree(g: _Gen) -> Workload:
    prompt = g.tokens(1024, jitter=False)
    paths = [prompt]
    for _turn in range(3):  # every turn branches in two: response + tool output
        paths = [np.concatenate([p, g.tokens(256), g.tokens(128)]) for p in paths for _ in range(2)]
    return Workload("agent-tree", paths, [len(prompt)] * len(paths), [0] * len(paths))


def _step_wise(g: _Gen) -> Workload:
    # A step is an observation (a quarter) then an action; sample k = steps 1..k, and its
    # prompt is everything before its last action.
    seqs, plens, context = [], [], np.zeros(0, dtype=np.int64)
    for _step in range(8):
        obs, act = g.tokens(128), g.tokens(384)
        plens.append(len(context) + len(obs))
        context = np.concatenate([context, obs, act])
        seqs.append(context)
    return Workload("step-wise", seqs, plens, [0] * len(seqs))


def _agent_long(g: _Gen) -> Workload:
    # A long agent history, then two turns branching in four (~4096, then ~2048 tokens each):
    # 16 samples, T ~ 74k and N ~ 491k tokens at full scale.
    history = g.tokens(24576, jitter=False)
    paths = [history]
    for mean in (4096, 2048):
        paths = [np.concatenate([p, g.tokens(mean)]) for p in paths for _ in range(4)]
    return Workload("agent-long", paths, [len(history)] * len(paths), [0] * len(paths))


def _no_sharing(g: _Gen) -> Workload:
    seqs = [g.tokens(1024) for _ in range(8)]
    return Workload("no-sharing", seqs, [max(1, len(s) // 4) for s in seqs], list(range(8)))


def make_workload(name: str, seed: int = 0, scale: float = 1.0, vocab: int = 32000) -> Workload:
    """Build the named standard workload (see :data:`WORKLOADS`, :data:`BUDGET_WORKLOADS` and
    :data:`MINIBATCH_WORKLOADS`)."""
    g = _Gen(seed, scale, vocab)
    if name == "grpo-long-prompt":
        return _grpo(g, name, prompts=1, prompt_len=4096, group=8, response_len=1024)
    if name == "grpo-wide":
        return _grpo(g, name, prompts=1, prompt_len=2048, group=16, response_len=512)
    if name == "grpo-math":
        return _grpo(g, name, prompts=4, prompt_len=256, group=8, response_len=768)
    if name == "agent-tree":
        return _agent_tree(g)
    if name == "step-wise":
        return _step_wise(g)
    if name == "no-sharing":
        return _no_sharing(g)
    if name == "agent-long":
        return _agent_long(g)
    if name == "grpo-minibatch":
        return _grpo(g, name, prompts=8, prompt_len=2048, group=8, response_len=1024)
    raise ValueError(f"unknown workload {name!r}; expected one of {ALL_WORKLOADS + MINIBATCH_WORKLOADS}")
