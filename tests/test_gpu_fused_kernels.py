"""verl's Triton fused log-prob / entropy kernel (``linear_cross_entropy``) on prefix-tree rows,
on a GPU (skipped without CUDA, Triton, transformers or verl).

A tiny random Qwen2 (bf16) runs verl's fused forward (``forward_with_triton_backend``) two
ways: stock, one sequence at a time (the unshared batch); tree, the decoder once over the
packed forest and the kernel on the plan's distinct (row, next-token) pairs
(``ps_mcore.integrations.verl_common.fused``). Both are measured against an fp32 reference (the
same weights in fp32, plain ``log_softmax``): the tree's largest log-prob and entropy error no
larger than stock's (factor 1.5 plus a floor of bf16 noise: a token's value is one number whose
rounding differs between the two runs), and each row of every gradient of a per-sample
weighted loss within twice stock's own error on that row plus 5% of the tensor's largest value
(a row's largest error, not a norm over the tensor: one wrong row fails). One table per run:
the largest errors, gradients as the largest row error relative to its tensor's largest value.

    python -m pytest -q -s tests/test_gpu_fused_kernels.py       # on the GPU machine, verl carried
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
pytest.importorskip("verl.utils.kernel.linear_cross_entropy")

from conftest import assert_rows_close, row_errors  # noqa: E402
from verl.models.transformers import dense_common  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.fsdp_bridge import TreeCall, enable_tree_attention  # noqa: E402
from ps_mcore.integrations.verl_common.fused import FUSED_ROWS_KWARG, triton_fused_kernel, tree_fused_forward  # noqa: E402
from ps_mcore.logprobs import labelled_rows  # noqa: E402
from ps_mcore.workloads import make_workload  # noqa: E402

VOCAB = 1024  # the kernel splits the vocab in multiples of 128; hidden size a multiple of 128
DEVICE = torch.device("cuda")
TEMPERATURE = 0.8
ROWS = []


def _model():
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        initializer_range=0.05, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    model.train()
    return model


def _outputs(lp, ent, seqs, weights):
    """Per-sample weighted loss over log-probs and entropy of every predicting token."""
    mask = torch.cat([torch.arange(len(s), device=DEVICE) < len(s) - 1 for s in seqs])
    lp = torch.where(mask, lp.float(), 0.0)
    loss = (weights[0] * lp).sum() + (weights[1] * torch.where(mask, ent.float(), 0.0)).sum()
    return lp.detach(), ent.float().detach(), mask, loss


def _reference(model, seqs):
    """fp32, plain HF forward one sequence at a time, ``log_softmax(logits / t)``."""
    lps, ents = [], []
    for s in seqs:
        ids = torch.as_tensor(s, device=DEVICE)[None]
        logits = model(input_ids=ids, position_ids=torch.arange(len(s), device=DEVICE)[None]).logits[0]
        logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
        nxt = torch.roll(ids[0], -1)
        lps.append(logp.gather(1, nxt[:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def _stock(model, seqs):
    """verl's Triton fused forward on the unshared batch, one sequence at a time. Its kernel
    (``linear_cross_entropy``) flattens ``[1, L, D]`` hidden states to ``[L, D]`` and returns
    ``[L]`` log-probs / entropy (no batch dim), read as such."""
    lps, ents = [], []
    for s in seqs:
        ids = torch.as_tensor(s, device=DEVICE)[None]
        out = dense_common.forward_with_triton_backend(
            model, input_ids=ids, position_ids=torch.arange(len(s), device=DEVICE)[None],
            temperature=TEMPERATURE, return_dict=True, shift_labels=torch.roll(ids, -1, dims=-1),
        )
        lps.append(out.log_probs.reshape(len(s)))
        ents.append(out.entropy.reshape(len(s)))
    return torch.cat(lps), torch.cat(ents)


def _tree(model, seqs):
    plan = plan_prefix_tree(seqs, min_prefix_len=1).to(DEVICE)
    rows = labelled_rows(plan)
    forward = tree_fused_forward(dense_common.forward_with_triton_backend, triton_fused_kernel)
    enable_tree_attention(model)
    out = forward(
        model, input_ids=plan.input_ids[None], position_ids=plan.position_ids[None], attention_mask=None,
        tree_call=TreeCall(plan), temperature=TEMPERATURE, return_dict=True, **{FUSED_ROWS_KWARG: rows},
    )
    return rows.per_token(out.log_probs[0], out.entropy[0])


def _run(model, fn, seqs, weights):
    model.zero_grad(set_to_none=True)
    lp, ent, mask, loss = _outputs(*fn(model, seqs), seqs, weights)
    loss.backward()
    return lp, ent, mask, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def _errors(run, ref):
    lp, ent, mask, grads = run
    rlp, rent, _, rgrads = ref
    grad = max(float(row_errors(grads[n], r).max()) / max(float(r.abs().max()), 1e-12) for n, r in rgrads.items())
    return float((lp - rlp)[mask].abs().max()), float((ent - rent)[mask].abs().max()), grad


def _workloads():
    rng = np.random.default_rng(0)
    p = rng.integers(0, VOCAB, 40).tolist()
    nasty = {
        "branching-tree": [p + a + b for a in (rng.integers(0, VOCAB, 9).tolist(), [5]) for b in ([7, 8], [9], [])],
        "duplicates+prefix": [p, p, p[:13], p + [3]],
    }
    std = {n: [s.tolist() for s in make_workload(n, seed=1, scale=1 / 16, vocab=VOCAB).sequences]
           for n in ("grpo-math", "agent-tree", "step-wise")}
    return {**nasty, **std}


@pytest.mark.parametrize("name, seqs", list(_workloads().items()), ids=list(_workloads()))
def test_tree_fused_error_no_larger_than_stock(name, seqs):
    model = _model().to(torch.bfloat16)
    ref_model = copy.deepcopy(model).float()
    n = sum(len(s) for s in seqs)
    weights = torch.randn(2, n, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    ref = _run(ref_model, _reference, seqs, weights)
    stock_run, tree_run = _run(model, _stock, seqs, weights), _run(model, _tree, seqs, weights)
    stock, tree = _errors(stock_run, ref), _errors(tree_run, ref)
    ROWS.append((name, n, *stock, *tree))
    print(f"\n{'workload':>18} {'N':>5} | stock: {'lp':>8} {'ent':>8} {'grad':>8} | tree: {'lp':>8} {'ent':>8} {'grad':>8}")
    for r in ROWS:
        print(f"{r[0]:>18} {r[1]:>5} |        {r[2]:8.2e} {r[3]:8.2e} {r[4]:8.2e} |       {r[5]:8.2e} {r[6]:8.2e} {r[7]:8.2e}")
    for s_err, t_err in zip(stock[:2], tree[:2]):
        assert t_err <= 1.5 * s_err + 2e-2, (name, stock, tree)
    g_ref, g_stock, g_tree = ref[3], stock_run[3], tree_run[3]
    assert g_tree.keys() == g_stock.keys() == g_ref.keys()
    for pname, g in g_ref.items():
        assert_rows_close(g_tree[pname], g, 5e-2, f"{name} d {pname}", baseline=g_stock[pname])
