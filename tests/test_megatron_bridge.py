"""Real Megatron-Bridge 0.6.2 on megatron-core 0.19 (CPU, gloo world 1, fp32).

For each family (Qwen2, Qwen3 with qk-norm and a decoupled head dim, Qwen3-MoE, the hybrid
Nemotron-H: Mamba-2, attention, MLP, and GPT-OSS: sliding-window and full layers, learnable
sinks, MoE with biases, which Bridge maps to megatron-core's ``window_size`` /
``window_attn_skip_freq`` / ``softmax_type``): the test writes a tiny HF checkpoint (config +
safetensors), ``AutoBridge.from_hf_pretrained`` makes the provider, the provider builds the
stock model (its own TE spec) and, with :func:`~ps_mcore.layer_specs.tree_provider_spec`, the
tree model; Bridge loads the checkpoint into both strictly (every parameter written; exporting
gives back exactly the checkpoint). Checked: the stock model equals the Hugging Face model per
sequence (logits), and the tree model on branching forests and nasty shapes equals the stock
model on the unshared batch (THD, one forward, as verl's stock path runs it: logits, and every
gradient of a per-sample-weighted log-prob loss, MoE router losses included).

Test-only shims (TE needs a GPU; see tests/te_cpu_shims.py): ``transformer_engine`` imports as
a stub for Bridge, the TE modules megatron-core's specs name are CPU modules with TE's
parameter names; megatron's Mamba and MoE kernels run as torch stand-ins (tests/mamba_shims.py,
megatron_shims.enable_cpu_moe). tests/test_gpu_bridge.py repeats the load and the comparison
with real TE on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bridge_helpers import require_bridge

require_bridge()

from bridge_helpers import FAMILIES, bridge_and_provider, build, cpu_bridge, load_strictly, write_hf_checkpoint  # noqa: E402,F401
from forests import small_nasty_forests  # noqa: E402

from ps_mcore import plan_prefix_tree, token_logprobs  # noqa: E402
from ps_mcore.layer_specs import TreeCoreAttention, TreePackedSeqParams, provider_spec_field, tree_provider_spec  # noqa: E402

FORESTS = small_nasty_forests()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, HF model, stock chunks, tree chunks), both models loaded from the same checkpoint."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf, tensors = write_hf_checkpoint(name, path, seed=FAMILIES.index(name))
    bridge, provider = bridge_and_provider(path)
    stock = build(provider)
    load_strictly(bridge, stock, tensors)
    field = provider_spec_field(provider)
    setattr(provider, field, tree_provider_spec(provider))
    tree = build(provider)
    load_strictly(bridge, tree, tensors)
    return name, hf, stock[0], tree[0]


def _stock_logits(model, seq) -> torch.Tensor:
    ids = torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]
    return model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None], attention_mask=None)[0]


def test_tree_model_has_tree_mixers_and_the_stock_keys(family):
    name, _, stock, tree = family
    assert list(tree.state_dict()) == list(stock.state_dict())
    kinds = {type(m).__name__ for m in tree.modules()}
    assert any(isinstance(m, TreeCoreAttention) for m in tree.modules())
    assert "TEDotProductAttentionCPU" in {type(m).__name__ for m in stock.modules()}
    if name == "nemotron_h":
        assert "TreeMambaMixer" in kinds
    if name == "qwen3_moe":
        assert "TreeTopKRouter" in kinds


def test_stock_provider_model_equals_hugging_face(family):
    """The loaded checkpoint means the same model on both sides (an independent reference)."""
    _, hf, stock, _ = family
    assert_stock_equals_hugging_face(hf, stock, (1, 5, 13))


def assert_stock_equals_hugging_face(hf, stock, lengths, rtol: float = 1e-5, atol: float = 2e-5) -> None:
    """Logits of random sequences of ``lengths`` tokens: the stock Megatron model = the HF one."""
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for length in lengths:
            seq = rng.integers(0, 128, length)
            ref = hf(input_ids=torch.as_tensor(seq)[None], use_cache=False).logits[0]
            torch.testing.assert_close(_stock_logits(stock, seq), ref, rtol=rtol, atol=atol)


def _weights(seqs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(len(seqs))
    return [torch.rand(len(s) - 1, generator=gen) + 0.5 for s in seqs]


def _stock_thd_logits(model, seqs) -> torch.Tensor:
    """The stock model on the unshared batch: every sequence packed one after another (THD,
    causal per sequence; ``total_tokens`` makes megatron 0.19 fill the ``seq_idx`` its Mamba
    mixer restarts its state by). ``[N, V]``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=int(lens.max()), max_seqlen_kv=int(lens.max()),
                          total_tokens=int(lens.sum()))
    ids = torch.as_tensor(np.concatenate([np.asarray(s) for s in seqs]), dtype=torch.long)[None]
    return model(input_ids=ids, position_ids=None, attention_mask=None, packed_seq_params=psp)[0]


def _stock_loss(model, seqs, weights):
    """Logits ``[N, V]`` and the weighted log-prob loss of the unshared batch in one forward
    (MoE router statistics over the whole batch, as in verl's stock step)."""
    logits = _stock_thd_logits(model, seqs)
    logp = torch.log_softmax(logits.float(), -1)
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    total = sum((logp[a: b - 1].gather(-1, torch.as_tensor(s[1:])[:, None])[:, 0] * w).sum()
                for a, b, s, w in zip(offsets[:-1], offsets[1:], seqs, weights))
    return logits, total


def _tree_loss(model, seqs, weights):
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan)
    logits = model(input_ids=plan.input_ids[None], position_ids=psp.position_ids[None], attention_mask=None,
                   packed_seq_params=psp)[0][: plan.num_tokens]
    logp, _ = token_logprobs(logits, plan)  # [N], row t: log p(token t+1)
    offsets = np.cumsum([0] + [len(s) for s in seqs])
    total = sum((logp[a: b - 1] * w).sum() for a, b, w in zip(offsets[:-1], offsets[1:], weights))
    return plan, logits, total


@pytest.mark.parametrize("forest", list(FORESTS))
def test_tree_run_equals_stock_provider_model(family, forest):
    _, _, stock, tree = family
    assert_tree_equals_stock(stock, tree, [list(s) for s in FORESTS[forest]])


def assert_tree_equals_stock(stock, tree, seqs) -> None:
    """The tree model on the forest of ``seqs`` equals the stock model on the unshared batch:
    logits, and every gradient of a per-sample-weighted log-prob loss (fp32). Logits within
    1e-5 of their largest magnitude (at least 2e-5): reordered fp32 sums differ by up to 2.6e-6
    of it (Gemma 3's logits reach 9)."""
    weights = _weights(seqs)
    for m in (stock, tree):
        m.zero_grad(set_to_none=True)
    plan, logits, tree_total = _tree_loss(tree, seqs, weights)
    ref, stock_total = _stock_loss(stock, seqs, weights)
    torch.testing.assert_close(plan.unpack(logits), ref, rtol=1e-5, atol=max(2e-5, 1e-5 * float(ref.abs().max())))
    if all(len(s) == 1 for s in seqs):
        return  # nothing to predict
    tree_total.backward()
    stock_total.backward()
    stock_grads = dict(stock.named_parameters())
    for pname, p in tree.named_parameters():
        g_ref = stock_grads[pname].grad
        if g_ref is None:
            assert p.grad is None or not p.grad.any(), pname
            continue
        scale = float(g_ref.abs().max()) or 1.0
        torch.testing.assert_close(p.grad, g_ref, rtol=1e-4, atol=2e-5 * scale, msg=lambda m: f"{pname}: {m}")
