"""Recurrent kernels across the calls of a cross-micro-batch schedule (pure torch, CPU, fp64):
each call runs its rows on a ``CallRecurrentTree`` starting from the states and conv windows
earlier calls kept, keeps those of its exits, and the schedule runner carries the gradients
back. Reference: the same layer (conv, then the gated delta rule or Mamba-2's SSD) on the whole
forest in one ``RecurrentTree`` (itself checked against each sequence alone in
test_recurrent.py): per-token outputs and the gradients of every input and of the conv weight,
on forests that branch at several depths, nasty shapes and budgets from tiny to whole.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_schedule
from forests import branching_forest, nasty_forests, random_forest
from ps_mcore.minibatch import ContextPlan, plan_minibatch
from ps_mcore.recurrent import (
    recurrent_tree, tree_causal_conv1d, tree_conv_windows, tree_gated_delta_rule, tree_simple_gla,
)

W = 4  # conv width
FORESTS = {
    **{k: v for k, v in nasty_forests().items() if sum(map(len, v)) >= 12},
    **{f"random{s}": random_forest(np.random.default_rng(s), max_seqs=10, max_len=30) for s in range(3)},
    **{f"branching{s}": branching_forest(np.random.default_rng(s), depth=4, fanout=2, node_len=(1, 6))
       for s in range(2)},
}


class Layer:
    """A conv + recurrence layer over per-row inputs (leaves, one value per packed row), drawn
    in fp64 on the host for ``seed`` and held in ``dtype`` on ``device``; ``backend``: the
    recurrent kernels' (torch, fla). ``dims``: heads, key and value head dims (the conv has
    heads * key dim channels: its output becomes the keys)."""

    def __init__(self, t: int, kernel: str, seed: int = 0, dtype=torch.float64, device="cpu", backend="torch",
                 dims=(2, 3, 4)):
        gen = torch.Generator().manual_seed(seed)
        self.dims = H, K, V = dims
        D = H * K

        def leaf(value):
            return value.to(device=device, dtype=dtype).requires_grad_()

        def randn(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        self.x, self.q, self.v = leaf(randn(t, D)), leaf(randn(t, H, K)), leaf(randn(t, H, V))
        self.g = leaf(-torch.rand(t, H, generator=gen, dtype=torch.float64))
        self.beta = leaf(torch.rand(t, H, generator=gen, dtype=torch.float64))
        self.weight = leaf(randn(D, W) * 0.7)
        self.kernel, self.backend = kernel, backend

    def leaves(self):
        return [self.x, self.q, self.v, self.g, self.weight] + ([self.beta] if self.kernel == "gdn" else [])

    def __call__(self, rows: torch.Tensor, plan, entries=(None, None)):
        """``[R, H, V]`` outputs of ``rows``, and (exit states, exit windows) of the call."""
        tree = recurrent_tree(plan, rows.numel())
        H, K, _ = self.dims
        x = self.x[rows]
        k = torch.nn.functional.normalize(tree_causal_conv1d(x, self.weight, None, tree, entries[1]).view(-1, H, K),
                                          dim=-1)
        args = (self.q[rows], k, self.v[rows], self.g[rows])
        kw = dict(backend=self.backend, entry_states=entries[0], with_states=True)
        if self.kernel == "gdn":
            out = tree_gated_delta_rule(*args, self.beta[rows], tree, **kw)
        else:
            out = tree_simple_gla(*args, tree, scale=0.5, **kw)
        windows = tree_conv_windows(x, tree, W, entries[1]) if tree.num_exits else None
        return out[0], out[1], windows


def whole(layer: Layer, tree, w: torch.Tensor):
    """Per-token outputs ``[N]`` of the whole forest in one tree, and the leaves' gradients of
    ``sum(w * outputs)``."""
    out, _, _ = layer(torch.arange(tree.num_tokens, device=w.device), tree)
    per_token = out.sum((1, 2)).index_select(0, tree.unpack_index)
    for leaf in layer.leaves():
        leaf.grad = None
    (per_token * w).sum().backward()
    return per_token.detach(), [leaf.grad.clone() for leaf in layer.leaves()]


def scheduled(layer: Layer, plan, w: torch.Tensor, key=7):
    """:func:`whole` through the schedule of ``plan``, call by call."""
    device = w.device

    def run_call(call_plan):
        call_plan = call_plan.to(device)
        if not isinstance(call_plan, ContextPlan):  # the whole forest in one call
            out, _, _ = layer(torch.arange(call_plan.num_tokens, device=device), call_plan)
            return {"o": out.sum((1, 2)).index_select(0, call_plan.unpack_index)}
        runtime = call_plan.runtime
        rows = torch.from_numpy(plan.calls[call_plan.call].rows).to(device)
        out, states, windows = layer(rows, call_plan, runtime.context_recurrent(key) or (None, None))
        out = runtime.own_recurrent(key, out, states, windows)
        return {"o": out.sum((1, 2)).index_select(0, call_plan.unpack_index)}

    for leaf in layer.leaves():
        leaf.grad = None
    got = run_schedule(plan, run_call, lambda out, tokens: (out["o"] * w[tokens]).sum(), w.dtype)
    return got, [leaf.grad.clone() for leaf in layer.leaves()]


@pytest.mark.parametrize("kernel", ["gdn", "ssd"])
@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_schedule_equals_the_whole_forest(forest, kernel):
    seqs = FORESTS[forest]
    tree = plan_minibatch(seqs, 1 << 20, min_prefix_len=1).tree
    t = tree.num_tokens
    w = torch.from_numpy(np.random.default_rng(1).uniform(0.2, 2.0, tree.num_input_tokens))
    layer = Layer(t, kernel)
    ref = whole(layer, tree, w)
    continued = 0
    for budget, rho in sorted({(4, 0.05), (max(4, t // 4), 1.0), (max(4, t // 2), 0.3), (t, 0.3)}):
        try:
            plan = plan_minibatch(seqs, budget, kv_row_cost=rho, min_prefix_len=1)
        except ValueError:  # BudgetTooSmall: a path too long for this budget
            continue
        continued += sum(plan.call_plan(c.index).exit_rows.numel() for c in plan.calls if c.kept)
        got = scheduled(layer, plan, w)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
        for name, a, b in zip(("x", "q", "v", "g", "weight", "beta"), got[1], ref[1]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")
    assert continued > 0  # some state did cross calls
