"""Mini-batch plans (ps_mcore.minibatch) and their schedule (ps_mcore.schedule), core only:
the planner's invariants on random forests under budgets that cut at node edges and inside
nodes, and exactness of the schedule on a small pure-torch decoder (learned absolute
positions, GQA) against the unshared batch: log-probs and every gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forests import branching_forest, nasty_forests, random_forest
from ps_mcore.attention import tree_attention
from ps_mcore.attention.context import context_attention
from ps_mcore.logprobs import token_logprobs
from ps_mcore.minibatch import (
    CALL_OVERHEAD_FRACTION, ContextPlan, kept_kv_row_cost, plan_cost, plan_minibatch, schedule_tree, split_cost,
)
from ps_mcore.planner import plan_prefix_tree, plan_unshared
from ps_mcore.schedule import ScheduleRunner


def offshoot_forest(rng, num_seqs=6, root_len=17, branch_len=(1, 12), vocab=50):
    """A root sequence, then sequences branching off earlier ones at random depths: ranges cut
    by a small budget start inside one subtree and run on past its end into the next."""
    seqs = [[int(x) for x in rng.integers(0, vocab, root_len)]]
    while len(seqs) < num_seqs:
        base = seqs[int(rng.integers(len(seqs)))]
        cut = int(rng.integers(1, len(base) + 1))
        seqs.append(base[:cut] + [int(x) for x in rng.integers(0, vocab, int(rng.integers(*branch_len)))])
    return seqs


FOREST_CASES = [
    ("offshoot", lambda rng: offshoot_forest(rng)),
    ("branching", lambda rng: branching_forest(rng)),
    ("random", lambda rng: random_forest(rng, max_seqs=10, max_len=30)),
    ("long-prefix", lambda rng: [[1] * 40 + [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 8)))]
                                 for _ in range(6)]),
    *[(name, (lambda seqs: lambda rng: seqs)(seqs)) for name, seqs in nasty_forests(1).items()],
]


def check_plan(plan) -> None:
    """Every row computed by exactly one call; a call's context holds all ancestors of its
    rows that it does not compute; kept calls are released after their last reader; every
    sample's loss in exactly one step, after all its rows ran; the budget holds."""
    tree = plan.tree
    t = tree.num_tokens
    owner = np.full(t, -1)
    for c in plan.calls:
        assert (owner[c.rows] == -1).all()
        owner[c.rows] = c.index
    assert (owner >= 0).all()
    step_of_call = {c.index: c.step for c in plan.calls}
    order = [i for s in plan.steps for i in s.calls]
    assert order == list(range(len(plan.calls)))  # calls run in creation order
    samples = [s for step in plan.steps for s in step.samples]
    assert sorted(samples) == list(range(tree.num_sequences))
    released = {}
    for step in plan.steps:
        for c in step.releases:
            assert plan.calls[c].kept and c not in released
            released[c] = step.index
        assert step.charge <= plan.max_tokens + 1e-9
    assert set(released) == {c.index for c in plan.calls if c.kept}
    subtree_end = tree.subtree_end.numpy()
    for c in plan.calls:
        for k in c.context:
            assert plan.calls[k].kept and k < c.index
            assert released[k] >= c.step  # still alive when c runs
            if c.kept:  # its release runs it again or back-propagates into k: k is its ancestor,
                # released after it (same step: descendants first)
                assert subtree_end[plan.calls[k].rows[0]] > c.rows[0]
                assert released[k] >= released[c.index]
        cp = plan.call_plan(c.index)
        if isinstance(cp, ContextPlan):
            assert cp.kv_index.max() < cp.num_context_rows + c.num_rows
        else:  # the one call of a forest that fits: the tree itself
            assert plan.num_steps == 1 and cp is plan.tree
        # every reader of a kept call runs no later than its release step
    unpack = tree.unpack_index.numpy()
    lens = np.asarray(tree.seq_lens)
    last = unpack[np.cumsum(lens) - 1]
    for step in plan.steps:
        for s in step.samples:
            assert step_of_call[owner[last[s]]] == step.index


@pytest.mark.parametrize("name,make", FOREST_CASES, ids=[c[0] for c in FOREST_CASES])
@pytest.mark.parametrize("budget", [6, 9, 16, 1000])
def test_plan_invariants(name, make, budget):
    seqs = make(np.random.default_rng(7))
    tree = plan_prefix_tree(seqs, min_prefix_len=1)
    for training in (True, False):
        plan = schedule_tree(tree, budget, kv_row_cost=0.1, training=training)
        check_plan(plan)
        if tree.num_tokens <= budget:
            assert plan.num_steps == 1 and len(plan.calls) == 1 and not plan.calls[0].kept


def test_plan_shapes_the_agent_example():
    """24-token history with 16 branches of 4 under a budget of 32: the history is kept (its
    graph: nothing recomputed), every row is computed once, and every step after the first
    computes the 8 rows the kept history leaves."""
    rng = np.random.default_rng(0)
    history = [int(x) for x in rng.integers(1000, 2000, 24)]
    seqs = [history + [3000 + 10 * b + i for i in range(4)] for b in range(16)]
    plan = plan_minibatch(seqs, 32, kv_row_cost=0.25)
    assert plan.computed_tokens == 24 + 64 and plan.recomputed_tokens == 0
    assert plan.num_steps == 8
    kept = [c for c in plan.calls if c.kept]
    assert len(kept) == 1 and kept[0].num_rows == 24 and not kept[0].recompute
    assert all(s.charge == 32 for s in plan.steps)


def test_prefix_longer_than_the_budget_is_a_chain_of_kv_kept_calls():
    rng = np.random.default_rng(1)
    prompt = [int(x) for x in rng.integers(0, 1000, 100)]
    seqs = [prompt + [2000 + 10 * g + i for i in range(5)] for g in range(6)]
    plan = plan_minibatch(seqs, 32, kv_row_cost=0.25)
    check_plan(plan)
    kept = [c for c in plan.calls if c.kept]
    assert len(kept) >= 3  # the prompt in pieces, each the context of the next
    assert all(c.recompute for c in kept[:-1])
    assert all(kept[i].index in kept[i + 1].context for i in range(len(kept) - 1))
    assert plan.recomputed_tokens >= 60
    releases = [c for s in plan.steps for c in s.releases]
    assert releases == sorted(releases, reverse=True)  # descendants first


def test_budget_too_small_names_the_option():
    seqs = [[1] * 50 + [2, 3], [1] * 50 + [4, 5]]
    with pytest.raises(ValueError, match="max_tokens=10 cannot hold the context"):
        plan_minibatch(seqs, 10, kv_row_cost=0.5)
    with pytest.raises(ValueError, match="kv_row_cost"):
        plan_minibatch(seqs, 10, kv_row_cost=0)
    with pytest.raises(ValueError, match="max_tokens"):
        plan_minibatch(seqs, 0)


def test_min_steps_splits_at_sample_ends():
    rng = np.random.default_rng(2)
    seqs = branching_forest(rng, roots=3)
    tree = plan_prefix_tree(seqs, min_prefix_len=1)
    base = schedule_tree(tree, 40)
    more = schedule_tree(tree, 40, min_steps=base.num_steps + 3)
    assert more.num_steps == base.num_steps + 3
    check_plan(more)
    with pytest.raises(ValueError, match="cannot make"):
        schedule_tree(plan_prefix_tree([[1, 2, 3]]), 40, min_steps=2)


@pytest.mark.parametrize("header, cheaper", [(4, "pieces"), (40, "schedule")])
def test_pieces_against_the_schedule(header, cheaper):
    """Four groups behind one header, two budgets large: as two pieces of two groups each
    (the second repeats the header) or as a schedule (the header a kept call: one more model
    call). The pieces cost less while the header is shorter than a call's fixed cost."""
    rng = np.random.default_rng(0)
    head = rng.integers(1, 50, header).tolist()
    groups = []
    for _ in range(4):
        prompt = head + rng.integers(1, 50, 30).tolist()
        groups.append([prompt + rng.integers(1, 50, 40).tolist() for _ in range(3)])
    seqs = [s for g in groups for s in g]
    tree = plan_prefix_tree(seqs, min_prefix_len=2)
    budget = int(tree.num_tokens * 0.6)
    assert 4 < CALL_OVERHEAD_FRACTION * budget < 40  # the two headers bracket a call's fixed cost
    plan = schedule_tree(tree, budget, kv_row_cost=0.1)
    assert plan.num_steps == 2 and len(plan.calls) == 3  # the header kept, two closed calls
    pieces = [plan_prefix_tree(groups[0] + groups[1], min_prefix_len=2).num_tokens,
              plan_prefix_tree(groups[2] + groups[3], min_prefix_len=2).num_tokens]
    assert sum(pieces) == tree.num_tokens + header
    assert plan_cost(plan) == 3 * (tree.num_tokens + CALL_OVERHEAD_FRACTION * budget * 3)
    pieces_cost = split_cost(pieces, 2, budget)
    assert (pieces_cost < plan_cost(plan)) == (cheaper == "pieces")
    assert split_cost(pieces, 2, budget, training=False) == pieces_cost / 3


def test_kept_kv_row_cost_estimate():
    shape = dict(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, ffn=18944, vocab=152064)
    train = kept_kv_row_cost(**shape)
    assert 0.005 < train < 0.1
    assert 0 < kept_kv_row_cost(**shape, training=False) < 0.1
    assert train < kept_kv_row_cost(**shape, full_recompute=True) <= 1.0


# ----------------------------------------------------------------------------- exactness


class ToyDecoder(torch.nn.Module):
    """Embeddings + learned absolute positions, pre-norm attention (GQA) and MLP blocks, an
    untied LM head. ``attend(q, k, v, layer)`` is the attention, so one model runs both the
    unshared reference and a schedule's calls."""

    def __init__(self, vocab=128, hidden=24, heads=4, kv_heads=2, layers=2, max_pos=256):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_pos, hidden)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict(dict(
                norm1=torch.nn.LayerNorm(hidden),
                qkv=torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.dim),
                out=torch.nn.Linear(heads * self.dim, hidden),
                norm2=torch.nn.LayerNorm(hidden),
                mlp=torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                        torch.nn.Linear(2 * hidden, hidden)),
            )))
        self.head = torch.nn.Linear(hidden, vocab)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))

    def forward(self, input_ids, position_ids, attend):
        h = self.embed(input_ids) + self.pos(position_ids)
        d = self.dim
        for i, b in enumerate(self.blocks):
            qkv = b["qkv"](b["norm1"](h))
            q = qkv[:, : self.heads * d].view(-1, self.heads, d)
            k = qkv[:, self.heads * d: (self.heads + self.kv_heads) * d].view(-1, self.kv_heads, d)
            v = qkv[:, (self.heads + self.kv_heads) * d:].view(-1, self.kv_heads, d)
            h = h + b["out"](attend(q, k, v, i).reshape(h.size(0), -1))
            h = h + b["mlp"](b["norm2"](h))
        return self.head(h)


def _weights(seqs, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.2, 2.0, len(seqs))
    return torch.tensor(np.repeat(w, [len(s) for s in seqs]), dtype=torch.float64)


def unshared_reference(model, seqs, weights):
    plan = plan_unshared(seqs)
    model.zero_grad(set_to_none=True)
    logits = model(plan.input_ids, plan.position_ids,
                   lambda q, k, v, i: tree_attention(q, k, v, plan, backend="reference"))
    lp, ent = token_logprobs(logits.double(), plan, compute_entropy=True)
    ((lp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_schedule(model, plan, weights, training=True, backend="chunked"):
    """The schedule on ``model``'s device with ``backend``'s kernel; results on the CPU."""
    device = next(model.parameters()).device

    def run_call(cp):
        cp = cp.to(device)
        if isinstance(cp, ContextPlan):
            attend = lambda q, k, v, i: context_attention(q, k, v, cp, i, backend=backend)  # noqa: E731
        else:  # a forest that fits: one call on the tree itself
            attend = lambda q, k, v, i: tree_attention(q, k, v, cp, backend=backend)  # noqa: E731
        logits = model(cp.input_ids, cp.position_ids, attend)
        lp, ent = token_logprobs(logits.double(), cp, compute_entropy=True)
        return {"log_probs": lp, "entropy": ent}

    model.zero_grad(set_to_none=True)
    runner = ScheduleRunner(plan, run_call, training=training)
    n = plan.tree.num_input_tokens
    lp_all = torch.zeros(n, dtype=torch.float64)
    ent_all = torch.zeros(n, dtype=torch.float64)
    for j, step in enumerate(plan.steps):
        with torch.set_grad_enabled(training):
            out = runner.forward(j)
        tokens = torch.from_numpy(plan.sample_tokens(step.samples))
        lp_all[tokens], ent_all[tokens] = out["log_probs"].detach().cpu(), out["entropy"].detach().cpu()
        if training:
            w = weights[tokens].to(device)
            ((out["log_probs"] * w).sum() + 0.1 * (out["entropy"] * w).sum()).backward()
        runner.release(j)
    runner.finish()
    assert runner.done and not runner.kept
    grads = {n: p.grad.detach().cpu().double() for n, p in model.named_parameters()} if training else None
    return lp_all, ent_all, grads


def assert_same(got, ref):
    """The attention kernels compute in fp32 (the rest in fp64): fp32 tolerances."""
    lp, ent, grads = got
    torch.testing.assert_close(lp, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref[1], rtol=1e-5, atol=1e-5)
    if grads is not None:
        for name, g in ref[2].items():
            rel = ((grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert rel < 1e-5, (name, rel)


@pytest.fixture(scope="module")
def toy():
    return ToyDecoder().double()


@pytest.mark.parametrize("name,make", FOREST_CASES, ids=[c[0] for c in FOREST_CASES])
@pytest.mark.parametrize("budget,rho", [(6, 0.1), (16, 0.2), (60, 1.0)])
def test_schedule_equals_unshared(toy, name, make, budget, rho):
    seqs = make(np.random.default_rng(3))
    weights = _weights(seqs)
    ref = unshared_reference(toy, seqs, weights)
    plan = plan_minibatch(seqs, budget, kv_row_cost=rho, min_prefix_len=1)
    assert_same(run_schedule(toy, plan, weights), ref)
    fwd = plan_minibatch(seqs, budget, kv_row_cost=rho, min_prefix_len=1, training=False)
    assert_same(run_schedule(toy, fwd, weights, training=False), (ref[0], ref[1], None))


def test_schedule_cuts_inside_nodes_and_keeps_kv_only(toy):
    """A long shared prompt under a small budget: calls cut inside its node, K/V-kept calls
    recomputed at their release; still exact."""
    rng = np.random.default_rng(4)
    prompt = [int(x) for x in rng.integers(0, 64, 45)]
    seqs = [prompt + [int(x) for x in rng.integers(0, 64, int(rng.integers(2, 9)))] for _ in range(5)]
    seqs.append(prompt[:30])  # a sample ending inside the prompt
    weights = _weights(seqs, 1)
    plan = plan_minibatch(seqs, 14, kv_row_cost=0.2, min_prefix_len=1)
    assert plan.recomputed_tokens > 0
    assert any(c.kept and c.rows[-1] + 1 < 45 for c in plan.calls)  # cut inside the prompt node
    assert_same(run_schedule(toy, plan, weights), unshared_reference(toy, seqs, weights))
