"""``ps_mcore.logprobs.token_logprobs`` on the CPU, directly (no model): with temperatures
other than 1 (0.3 sharpens, 2.5 flattens) its log-probs, entropy and their gradients equal
the per-sequence ``log_softmax(logits / t)`` computed on the unpacked [N, V] logits, over the
nasty forests and random ones (branch-point rows read several labels), with the chunked
normaliser forced to split rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forests import nasty_forests, random_forest

from ps_mcore import logprobs, plan_prefix_tree
from ps_mcore.logprobs import token_logprobs

VOCAB = 113  # odd, so chunks of rows never line up with anything; above every id the forests use (< 104)


def _reference(plan, logits, seqs, temperature):
    """Per sequence: ``log_softmax(x / t)`` over its own unpacked rows (``t`` the sequence's
    own temperature when ``temperature`` is a list); log-prob of the next token (0 after the
    last), entropy of every row."""
    rows = torch.split(plan.unpack(logits), [len(s) for s in seqs])
    temps = temperature if isinstance(temperature, list) else [temperature] * len(seqs)
    lps, ents = [], []
    for x, s, t in zip(rows, seqs, temps):
        logp = torch.log_softmax(x / t, dim=-1)
        nxt = torch.tensor(s[1:] + [0])
        lp = logp.gather(1, nxt[:, None])[:, 0]
        lps.append(torch.where(torch.arange(len(s)) < len(s) - 1, lp, torch.zeros_like(lp)))
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def _cases():
    cases = list(nasty_forests(1).items())
    rng = np.random.default_rng(11)
    cases += [(f"random{i}", random_forest(rng, max_seqs=10, max_len=30)) for i in range(4)]
    return cases


# float64: the same math to rounding; float32 (what verl hands over): fp32 reduction order
TOLERANCES = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-5)}


def _check_against_reference(plan, seqs, temperature, dtype, seed, ref_temperature=None):
    """token_logprobs vs :func:`_reference`: outputs and the gradient of a per-sample weighted
    loss on both log-probs and entropy."""
    gen = torch.Generator().manual_seed(seed)
    tol, grad_tol = TOLERANCES[dtype]
    logits = (3.0 * torch.randn(plan.num_tokens, VOCAB, generator=gen, dtype=dtype)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    lp, ent = token_logprobs(logits, plan, temperature=temperature, compute_entropy=True)
    ref_lp, ref_ent = _reference(plan, ref_logits, seqs, temperature if ref_temperature is None else ref_temperature)
    assert lp.dtype == ent.dtype == dtype
    torch.testing.assert_close(lp, ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ref_ent, rtol=tol, atol=tol)
    # a per-sample weighted loss on both outputs: gradients into the shared packed rows
    n = plan.num_input_tokens
    w_lp = torch.randn(n, generator=gen, dtype=dtype)
    w_ent = torch.randn(n, generator=gen, dtype=dtype)
    ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
    ((w_lp * ref_lp).sum() + (w_ent * ref_ent).sum()).backward()
    # shared rows sum their gradients in another order: absolute floor relative to the largest
    scale = float(ref_logits.grad.abs().max())
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=grad_tol, atol=grad_tol * scale)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("temperature", [0.3, 2.5])
@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_temperature_matches_per_sequence_log_softmax(monkeypatch, name, seqs, temperature, dtype):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows per chunk
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    _check_against_reference(plan, seqs, temperature, dtype, seed=len(name))


def _sample_temperatures(num_seqs, rng):
    """Per-sample temperatures from a pool of three, so shared rows meet repeats and changes."""
    return [float(t) for t in rng.choice([0.4, 1.0, 1.7], size=num_seqs)]


@pytest.mark.parametrize("per", ["sample", "token"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_per_sample_temperature_matches_per_sequence_log_softmax(monkeypatch, name, seqs, dtype, per):
    """A shared row is normalised once per distinct temperature among its samples; each token
    reads its own sample's. Chunks of 2 rows, so a row's pairs meet chunk boundaries."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * VOCAB)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    given = torch.tensor(_sample_temperatures(len(seqs), np.random.default_rng(len(name))))  # float32, as verl's
    temps = given.tolist()
    if per == "token":
        given = torch.repeat_interleave(given, torch.tensor([len(s) for s in seqs]))
    _check_against_reference(plan, seqs, given, dtype, seed=len(name) + 1, ref_temperature=temps)


def test_per_sample_temperature_scores_a_shared_row_once_per_distinct_temperature():
    """GRPO prompt of 12 under 5 responses at temperatures (0.5, 0.5, 1.0, 1.0, 1.0): the
    prompt's rows are scored twice, every other row once; one temperature for all samples
    is the plain one-float path."""
    seqs = nasty_forests(1)["grpo"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    shared = int((plan.multiplicity > 1).sum())
    scored = logprobs.scored_rows(plan, torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0]))
    assert scored.num_pairs == plan.num_tokens + shared and shared >= 12
    assert scored.rows is not None and torch.equal(torch.unique(scored.rows), torch.arange(plan.num_tokens))
    same = logprobs.scored_rows(plan, torch.full((len(seqs),), 0.7))
    assert same.rows is None and same.temperature == pytest.approx(0.7) and same.num_pairs == plan.num_tokens


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, float("nan"), 1.0])])
def test_per_sample_temperature_must_be_positive_and_finite(bad):
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4], [5]], min_prefix_len=1)
    with pytest.raises(ValueError, match="temperature must be a finite positive number"):
        token_logprobs(torch.randn(plan.num_tokens, 8), plan, temperature=bad)


def test_per_sample_temperature_of_the_wrong_length_names_the_shapes():
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4], [5]], min_prefix_len=1)
    with pytest.raises(ValueError, match=r"\[B=3\] per sample or \[N=7\] per token, got \(4,\)"):
        token_logprobs(torch.randn(plan.num_tokens, 8), plan, temperature=torch.ones(4))


def test_temperature_changes_the_result():
    """The reference is sensitive to t (the comparison above could not pass with t ignored)."""
    seqs = nasty_forests(1)["tree"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    logits = 3.0 * torch.randn(plan.num_tokens, VOCAB, generator=torch.Generator().manual_seed(0))
    out = {t: token_logprobs(logits, plan, temperature=t, compute_entropy=True) for t in (0.3, 1.0, 2.5)}
    assert (out[0.3][1] < out[1.0][1]).all() and (out[1.0][1] < out[2.5][1]).all()  # entropy grows with t
    assert not torch.allclose(out[0.3][0], out[2.5][0])


@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_labelled_rows_scored_one_label_per_row_equal_token_logprobs(name, seqs):
    """What a kernel scoring one label per row (verl's fused linear + log-prob kernels) sees:
    the distinct (row, next token) pairs of the plan, each scored with a plain per-row
    ``log_softmax``; each token's pair gives its log-prob and entropy, equal to
    ``token_logprobs``, gradients included."""
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    rows = logprobs.labelled_rows(plan)
    # independent count: one pair per distinct (row, label) of a token that predicts something,
    # plus one for each row read only by sequence-last tokens
    pairs, read = set(), set()
    for s_idx, s in enumerate(seqs):
        start = sum(len(x) for x in seqs[:s_idx])
        for j in range(len(s)):
            r = int(plan.unpack_index[start + j])
            if j + 1 < len(s):
                pairs.add((r, s[j + 1]))
                read.add(r)
    only_last = set(range(plan.num_tokens)) - read
    assert rows.num_pairs == len(pairs) + len(only_last)
    assert set(zip(rows.rows.tolist(), rows.labels.tolist())) >= pairs
    # row_offsets: row r's pairs (what an SP rank holding rows [a, b) scores)
    offsets = rows.row_offsets.tolist()
    assert len(offsets) == plan.num_tokens + 1 and offsets[0] == 0 and offsets[-1] == rows.num_pairs
    for r in range(plan.num_tokens):
        assert rows.rows[offsets[r]:offsets[r + 1]].tolist() == [r] * (offsets[r + 1] - offsets[r])
    gen = torch.Generator().manual_seed(len(name))
    logits = (3.0 * torch.randn(plan.num_tokens, VOCAB, generator=gen, dtype=torch.float64)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(logits[rows.rows] / 0.7, dim=-1)
    lp, ent = rows.per_token(logp.gather(1, rows.labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1))
    ref_lp, ref_ent = token_logprobs(ref_logits, plan, temperature=0.7, compute_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    w = torch.randn(2, plan.num_input_tokens, generator=gen, dtype=torch.float64)
    ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
    ((w[0] * ref_lp).sum() + (w[1] * ref_ent).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-10)


def _statistics_reference(plan, logits, seqs, temps, ids, k):
    """Per sequence, on its own unpacked rows ``x / t``: ``sum_v p^2``, the log-probs at
    ``ids`` (``[N, K]``, batch order) and the ``k`` largest log-probs' ids."""
    rows = torch.split(plan.unpack(logits), [len(s) for s in seqs])
    logp = torch.cat([torch.log_softmax(x / t, dim=-1) for x, t in zip(rows, temps)])
    return (logp.exp() ** 2).sum(-1), logp.gather(1, ids), logp.topk(k, dim=-1).indices


@pytest.mark.parametrize("temperature", ["one", "per-sample"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_row_statistics_match_per_sequence_softmax(monkeypatch, name, seqs, dtype, temperature):
    """``token_statistics``' sum of squared probabilities, log-probs at given ids (each token
    its own ids, so tokens of a shared row read different ones) and top-k ids equal the
    per-sequence softmax, with one temperature or per-sample ones (a shared row normalised once
    per distinct temperature); gradients of a per-sample weighted loss on every output too.
    Chunks of 2 rows, so a row's pairs meet chunk boundaries."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * VOCAB)
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    rng = np.random.default_rng(len(name))
    given = torch.tensor(_sample_temperatures(len(seqs), rng)) if temperature == "per-sample" else 0.7  # float32, as verl's
    temps = given.tolist() if temperature == "per-sample" else [0.7] * len(seqs)
    gen = torch.Generator().manual_seed(len(name) + 3)
    tol, grad_tol = TOLERANCES[dtype]
    n, k = plan.num_input_tokens, 4
    ids = torch.randint(0, VOCAB, (n, k), generator=gen)
    logits = (3.0 * torch.randn(plan.num_tokens, VOCAB, generator=gen, dtype=dtype)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    stats = logprobs.token_statistics(
        logits, plan, given, compute_entropy=True, compute_sum_pi_squared=True, label_ids=ids, topk=k
    )
    ref_sq, ref_at_ids, ref_topk = _statistics_reference(plan, ref_logits, seqs, temps, ids, k)
    ref_lp, ref_ent = _reference(plan, ref_logits, seqs, temps)
    assert stats.sum_pi_squared.dtype == stats.label_logprobs.dtype == dtype
    torch.testing.assert_close(stats.sum_pi_squared, ref_sq, rtol=tol, atol=tol)
    torch.testing.assert_close(stats.label_logprobs, ref_at_ids, rtol=tol, atol=tol)
    assert torch.equal(stats.topk_ids, ref_topk)
    torch.testing.assert_close(stats.logprobs, ref_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(stats.entropy, ref_ent, rtol=tol, atol=tol)
    w = [torch.randn(n, generator=gen, dtype=dtype) for _ in range(3)] + [torch.randn(n, k, generator=gen, dtype=dtype)]

    def loss(lp, ent, sq, at_ids):
        return (w[0] * lp).sum() + (w[1] * ent).sum() + (w[2] * sq).sum() + (w[3] * at_ids).sum()

    loss(stats.logprobs, stats.entropy, stats.sum_pi_squared, stats.label_logprobs).backward()
    loss(ref_lp, ref_ent, ref_sq, ref_at_ids).backward()
    scale = float(ref_logits.grad.abs().max())
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=grad_tol, atol=grad_tol * scale)


def test_sum_pi_squared_gradient_alone_matches():
    """Only ``sum_pi_squared`` carries a gradient (the other outputs' gradients are None)."""
    seqs = nasty_forests(1)["tree"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    logits = torch.randn(plan.num_tokens, VOCAB, dtype=torch.float64, requires_grad=True)
    ref_logits = logits.detach().clone().requires_grad_()
    sq = logprobs.token_statistics(logits, plan, 1.3, compute_sum_pi_squared=True).sum_pi_squared
    ref = torch.softmax(plan.unpack(ref_logits) / 1.3, -1).pow(2).sum(-1)
    w = torch.randn(plan.num_input_tokens, dtype=torch.float64)
    (w * sq).sum().backward()
    (w * ref).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)


def test_statistics_refuse_ids_outside_the_vocab_and_a_topk_past_it():
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4], [5]], min_prefix_len=1)
    logits = torch.randn(plan.num_tokens, 8)
    with pytest.raises(ValueError, match=r"label_ids must be token ids in \[0, 8\)"):
        logprobs.token_statistics(logits, plan, label_ids=torch.full((7, 2), 8))
    with pytest.raises(ValueError, match=r"label_ids must be \[N=7, K\] per token"):
        logprobs.token_statistics(logits, plan, label_ids=torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="topk=9 is larger than the vocab"):
        logprobs.token_statistics(logits, plan, topk=9)
