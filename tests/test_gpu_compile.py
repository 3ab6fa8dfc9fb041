"""On CUDA: float64 stays float64 through the CUDA-side helpers (the Triton merge and dK/dV
scatter-add sum in fp32 and are skipped for fp64), and torch.compile (inductor) around tree
attention and a Hugging Face model equals eager without recompiling per plan. Skips without
CUDA; run on the device: ``python -m pytest -q tests/test_gpu_compile.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from attention_oracle import compare_with_unshared, random_qkv
from forests import nasty_forests, random_forest

from ps_mcore import plan_prefix_tree, tree_attention
from ps_mcore.attention import layout

pytestmark = pytest.mark.gpu

FORESTS = ("tree", "grpo", "deep-chain")


@pytest.mark.parametrize("layout_levels", ["cascade", "gather"])
def test_float64_chunked_on_cuda_at_float64_precision(monkeypatch, layout_levels):
    """The cascade's merges and gather-KV's shared-row sums run in fp64 on CUDA too."""
    monkeypatch.setattr(layout, "cascade_pays", lambda plan, lay: layout_levels == "cascade")
    for name in FORESTS:
        plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1)
        out, ref, got, want = compare_with_unshared(plan, "chunked", 4, 2, 16, torch.float64, "cuda")
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_compiled_tree_attention_on_cuda(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()

    def block(q, k, v, plan):
        return tree_attention(torch.tanh(q), k * 2, v, plan, backend=backend).float().square().sum()

    compiled = torch.compile(block, dynamic=True)
    graphs = []
    for name in FORESTS:
        plan = plan_prefix_tree(nasty_forests()[name], min_prefix_len=1).to("cuda")
        q, k, v = random_qkv(plan, 8, 2, 64, torch.bfloat16, "cuda")
        got = torch.autograd.grad(compiled(q, k, v, plan), (q, k, v))
        want = torch.autograd.grad(block(q, k, v, plan), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        graphs.append(counters["stats"]["unique_graphs"])
    assert len({len(nasty_forests()[name]) for name in FORESTS}) == 3  # other sequence counts
    assert graphs[1:] == [graphs[0]] * 2, graphs


def test_compiled_hf_model_on_cuda_matches_eager():
    """torch.compile(model) (inductor, dynamic=True) + forward_tree on a bf16 Qwen2 with the
    varlen kernel: log-probs as the eager tree run's, no recompile for new plans, the config
    as the user set it."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from ps_mcore.fsdp_bridge import forward_tree

    torch._dynamo.reset()
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, dynamic=True)
    import numpy as np

    graphs, counts = [], set()
    for seed in (0, 1, 4):  # 7, 4 and 6 sequences
        seqs = random_forest(np.random.default_rng(seed), max_seqs=8, max_len=200)
        counts.add(len(seqs))
        plan = plan_prefix_tree(seqs, min_prefix_len=1)
        got = forward_tree(compiled, plan, compute_logprobs=True).logprobs
        want = forward_tree(eager, plan, compute_logprobs=True).logprobs
        got.sum().backward()
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
        graphs.append(counters["stats"]["unique_graphs"])
    assert len(counts) == 3  # a new sequence count must not recompile either
    assert graphs[1:] == [graphs[0]] * 2, graphs
