"""flash-linear-attention's varlen gated delta rule as the tree kernel (GPU only), vs. each
sequence alone through the fp64 token recurrence. Skips without CUDA or fla; run on the
device: ``python -m pytest -q tests/test_gpu_hybrid.py`` (with fla-core on the path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from forests import nasty_forests, random_forest
from ps_mcore import plan_prefix_tree
from ps_mcore.recurrent import gated_delta_rule_recurrent, l2norm, recurrent_tree, tree_gated_delta_rule

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention (fla-core)")

FORESTS = {**nasty_forests(), "random": random_forest(np.random.default_rng(0), max_len=200)}
FORESTS["long-shared"] = [list(range(150)) + [1] * n for n in (1, 70, 130)]  # > one 64-row chunk


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", sorted(FORESTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_tree_matches_each_sequence(name, dtype):
    plan = plan_prefix_tree(FORESTS[name], min_prefix_len=1).to("cuda")
    rows, h, dk, dv = plan.num_tokens + 3, 4, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(rows, h, d, device="cuda", generator=gen, requires_grad=True) for d in (dk, dk, dv)]
    leaves += [torch.randn(rows, h, device="cuda", generator=gen, requires_grad=True) for _ in range(2)]

    def args(cast):
        q, k, v, g, b = leaves
        return (cast(l2norm(q)), cast(l2norm(k)), cast(v), -F.softplus(g).float(), cast(torch.sigmoid(b)))

    out = tree_gated_delta_rule(*args(lambda t: t.to(dtype)), recurrent_tree(plan, rows), backend="fla")
    assert out.dtype == dtype and torch.isfinite(out).all()
    got = plan.unpack(out)
    per_seq = zip(*(plan.unpack(t[: plan.num_tokens]).split(list(plan.seq_lens)) for t in args(torch.Tensor.double)))
    ref = torch.cat([gated_delta_rule_recurrent(*parts)[0] for parts in per_seq])
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert rel(got, ref) < tol, f"output rel err {rel(got, ref)}"
    cot = torch.randn_like(ref)
    g_tree = torch.autograd.grad((got.double() * cot).sum(), leaves, retain_graph=True)
    g_ref = torch.autograd.grad((ref * cot).sum(), leaves)
    for lname, a, b in zip("q k v g beta".split(), g_tree, g_ref):
        assert rel(a[: plan.num_tokens], b[: plan.num_tokens]) < 2 * tol, f"d{lname} rel err"
