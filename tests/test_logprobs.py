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
    """Per sequence: ``log_softmax(x / t)`` over its own unpacked rows; log-prob of the next
    token (0 after the last), entropy of every row."""
    rows = torch.split(plan.unpack(logits), [len(s) for s in seqs])
    lps, ents = [], []
    for x, s in zip(rows, seqs):
        logp = torch.log_softmax(x / temperature, dim=-1)
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


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("temperature", [0.3, 2.5])
@pytest.mark.parametrize("name, seqs", _cases(), ids=[c[0] for c in _cases()])
def test_temperature_matches_per_sequence_log_softmax(monkeypatch, name, seqs, temperature, dtype):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows per chunk
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    gen = torch.Generator().manual_seed(len(name))
    tol, grad_tol = TOLERANCES[dtype]
    logits = (3.0 * torch.randn(plan.num_tokens, VOCAB, generator=gen, dtype=dtype)).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    lp, ent = token_logprobs(logits, plan, temperature=temperature, compute_entropy=True)
    ref_lp, ref_ent = _reference(plan, ref_logits, seqs, temperature)
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


def test_temperature_changes_the_result():
    """The reference is sensitive to t (the comparison above could not pass with t ignored)."""
    seqs = nasty_forests(1)["tree"]
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    logits = 3.0 * torch.randn(plan.num_tokens, VOCAB, generator=torch.Generator().manual_seed(0))
    out = {t: token_logprobs(logits, plan, temperature=t, compute_entropy=True) for t in (0.3, 1.0, 2.5)}
    assert (out[0.3][1] < out[1.0][1]).all() and (out[1.0][1] < out[2.5][1]).all()  # entropy grows with t
    assert not torch.allclose(out[0.3][0], out[2.5][0])
