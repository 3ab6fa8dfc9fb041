"""Model parallelism for tree batches (CPU, gloo).

* In-process: the CP chunk layout is Megatron's (batch slicing and THD RoPE slicing), every
  CP rank's local tree attention against the global K/V equals the single-rank attention at its
  rows (outputs, and gradients summed over ranks), plan fingerprints, CP parameter refusals.
* torchrun, one subprocess per layout: CP=2, PP=2 (megatron's 1F1B schedule, several
  micro-batches of different lengths) and CP=2 x TP=2 with sequence parallelism give logits,
  log-probs, entropies and every parameter gradient equal to the single-rank run on randomized
  forests (incl. a one-token forest, which leaves a CP rank with padding only). TP=2 alone is
  tests/test_megatron_tp.py. SP runs on CPU with a test-only norm (megatron's torch norm
  refuses SP; TE / apex norms do not exist here).
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from forests import branching_forest, nasty_forests, random_forest  # noqa: E402
from megatron_parallel_worker import KINDS, LAYOUTS, VARIANT_KINDS, build_model, tree_step, world_size  # noqa: E402
from megatron_shims import VOCAB, init_cpu_megatron, randomize_, run_torchrun, tiny_config  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402
from ps_mcore.attention import tree_attention  # noqa: E402
from ps_mcore.attention.gather_kv import MATH_KERNEL, gather_kv_attention  # noqa: E402
from ps_mcore.attention.variants import attention_variant  # noqa: E402
from ps_mcore.layer_specs import (  # noqa: E402
    TreePackedSeqParams,
    assert_same_plan,
    cp_chunk_rows,
    plan_fingerprint,
)

WORKER = Path(__file__).with_name("megatron_parallel_worker.py")
# 4 processes on CI's 2 cores: one config (qwen3: GQA with one kv head per TP rank, qk-norm).
LAYOUT_KINDS = {"cp2tp2sp": ("qwen3",), "cp2": KINDS + VARIANT_KINDS}
init_cpu_megatron(1)


def _layout_forests(seed: int) -> list[list]:
    """A tree branching at two nested depths (asserted), a random forest, a prefix of another,
    one token."""
    rng = np.random.default_rng(seed)
    nasty = nasty_forests(seed)
    tree = branching_forest(rng, roots=1, depth=3, fanout=2, node_len=(2, 7))
    return [tree, random_forest(rng, 6, 20), nasty["prefix-of-another"], [[7]]]


def _cases(seed: int) -> list[dict]:
    cases = []
    for i, seqs in enumerate(_layout_forests(seed)):
        plan = plan_prefix_tree(seqs, min_prefix_len=1)
        w = np.random.default_rng(seed + i).uniform(0.2, 2.0, len(seqs))
        w_tok = torch.from_numpy(np.repeat(w, [len(s) for s in seqs])).float()
        gen = torch.Generator().manual_seed(seed + i)
        probe = torch.randn(plan.num_input_tokens, VOCAB, generator=gen)
        cases.append({"plan": plan, "w_tok": w_tok, "probe": probe})
    return cases


@pytest.fixture(scope="module")
def reference():
    """Payload for the workers and the single-rank results of every kind."""
    init_cpu_megatron(1)
    payload, expected = {}, {}
    for i, kind in enumerate(KINDS + VARIANT_KINDS):
        cases = _cases(100 * i)
        assert any(c["plan"].num_tokens < c["plan"].num_input_tokens for c in cases)  # shares
        model = build_model(kind, "single")
        randomize_(model, seed=21 + i)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        outs = [tree_step(model, case, "single") for case in cases]
        expected[kind] = {"cases": outs, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
        payload[kind] = {"state": state, "cases": cases}
    return payload, expected


def _run_layout(layout: str, payload: dict, tmp_path: Path, device: str) -> dict:
    torch.save(payload, tmp_path / "payload.pt")
    run_torchrun(WORKER, world_size(layout), layout, tmp_path / "payload.pt", tmp_path / "out.pt", device)
    return torch.load(tmp_path / "out.pt", weights_only=False)


def _assert_refusals(layout: str, refusals: dict) -> None:
    expected = {}
    if LAYOUTS[layout]["cp"] > 1:
        expected.update(flex=("NotImplementedError", "context parallelism"),
                        sbhd=("NotImplementedError", "sbhd"),
                        thd=("ValueError", "multiple of 2*cp=4"),
                        no_cp_params=("ValueError", "built for cp=1"),
                        wrong_rank=("ValueError", "CP rank"))
    if LAYOUTS[layout]["pp"] > 1:
        expected["pp_plan_mismatch"] = ("RuntimeError", "ranks of the group hold different plans")
    assert refusals.keys() == expected.keys()
    for case, (kind, words) in expected.items():
        assert refusals[case].startswith(kind + ":") and words in refusals[case], (case, refusals[case])


def _check_layout(layout: str, reference, tmp_path: Path, device: str, kinds=KINDS) -> None:
    payload, expected = reference
    got = _run_layout(layout, {kind: payload[kind] for kind in kinds}, tmp_path, device)
    assert got.keys() == set(kinds)
    for kind in kinds:
        ref, par = expected[kind], got[kind]
        assert len(par["cases"]) == len(ref["cases"])
        for i, (r, p) in enumerate(zip(ref["cases"], par["cases"])):
            for key in ("logits", "logprobs", "entropy"):
                torch.testing.assert_close(p[key], r[key], rtol=1e-5, atol=1e-5, msg=f"{kind} case {i} {key}")
        assert par["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            scale = float(g.abs().max())
            assert scale > 0, name
            torch.testing.assert_close(par["grads"][name], g, rtol=1e-4, atol=1e-5 * scale,
                                       msg=f"{kind} {name}")
        _assert_refusals(layout, par.get("refusals", {}))


# The worker also has "tp2sp" (TP=2 with SP, no CP); left out here: cp2tp2sp runs SP too (~15 s).
@pytest.mark.parametrize("layout", ["cp2", "pp2", "cp2tp2sp"])
def test_layout_equals_single_rank(layout, reference, tmp_path):
    _check_layout(layout, reference, tmp_path, "cpu", LAYOUT_KINDS.get(layout, KINDS))


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=pytest.mark.gpu(world_size(layout)))
                                    for layout in ("cp2", "tp2sp", "pp2", "cp2tp2sp")])
def test_layout_equals_single_rank_nccl(layout, reference, tmp_path):
    """The same on GPUs (NCCL, fp32, chunked kernel; one GPU per rank) against the CPU
    single-rank run."""
    _check_layout(layout, reference, tmp_path, "cuda")


# ----------------------------------------------------------------------------- CP layout


def _fake_group(size: int, rank: int):
    return types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_chunks_are_megatrons(cp, monkeypatch):
    # megatron 0.18+ asks torch.distributed for the fake group's size and rank
    for name, attr in (("get_world_size", "size"), ("get_rank", "rank")):
        real = getattr(torch.distributed, name)
        monkeypatch.setattr(torch.distributed, name, lambda group=None, _real=real, _attr=attr: (
            getattr(group, _attr)() if isinstance(group, types.SimpleNamespace) else _real(group)))
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.utils import get_batch_on_this_cp_rank

    rows = 12 * cp
    for rank in range(cp):
        ours = cp_chunk_rows(rows, cp, rank)
        tokens = {"tokens": torch.arange(rows)[None]}
        if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:  # 0.18+
            batch = get_batch_on_this_cp_rank(tokens, is_hybrid_cp=False, cp_group=_fake_group(cp, rank))
        else:
            batch = get_batch_on_this_cp_rank(tokens, _fake_group(cp, rank))
        assert ours.tolist() == batch["tokens"][0].tolist()
        freqs = torch.arange(rows, dtype=torch.float32)[:, None, None, None]
        local = _get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(rows // cp), freqs, 0)
        assert local.flatten().long().tolist() == ours.tolist()  # THD RoPE takes the same rows
    with pytest.raises(ValueError, match="2\\*cp"):
        cp_chunk_rows(rows + 1, 2, 0)


def _cp_forests():
    rng = np.random.default_rng(5)
    forests = dict(nasty_forests(3))
    forests.update({f"random{i}": random_forest(rng) for i in range(6)})
    return forests


@pytest.mark.parametrize("variant", ["plain", "window+sinks"])
@pytest.mark.parametrize("name", sorted(_cp_forests()))
def test_local_attention_per_cp_rank_equals_full(name, variant):
    """Each CP rank's local queries against the rank-major gathered K/V (fp32 math, segments
    cut at chunk borders): the single-rank output at its rows; gradients summed over ranks (the
    all-gather's reduce-scatter) equal the single-rank ones. With a sliding window (counted
    along each sample's path: a segment's context is its whole root path, uncut) and per-head
    sinks (whose gradients each rank computes for its rows) too."""
    plan = plan_prefix_tree(_cp_forests()[name], min_prefix_len=1)
    gen = torch.Generator().manual_seed(len(name))
    hq, hkv, d = 4, 2, 6
    sinks = torch.linspace(-2.0, 2.0, hq, requires_grad=True)
    kw = dict(window=3, sinks=sinks) if variant != "plain" else {}
    for cp, tp in ((2, 1), (3, 1), (2, 2)):
        psp0 = TreePackedSeqParams.from_plan(plan, 2 * cp * tp, cp_size=cp, cp_rank=0)
        t_pad = psp0.num_rows
        q, k, v = (torch.randn(t_pad, h, d, generator=gen, requires_grad=True)
                   for h in (hq, hkv, hkv))
        leaves = (q, k, v, sinks) if kw else (q, k, v)
        g = torch.randn(t_pad, hq, d, generator=gen)
        t = plan.num_tokens
        full = tree_attention(q[:t], k[:t], v[:t], plan, "chunked", **kw)
        ref_grads = torch.autograd.grad((full * g[:t]).sum(), leaves)
        seen, tokens, loss = [], [], 0
        for rank in range(cp):
            lay = TreePackedSeqParams.from_plan(plan, 2 * cp * tp, cp_size=cp, cp_rank=rank).cp_layout
            rows = lay.local_rows
            real = rows[lay.query_rows]
            # K/V as the all-gather lays them out: rank-major
            kg, vg = k[lay.gathered_rows], v[lay.gathered_rows]
            out = gather_kv_attention(q[real], kg, vg, lay, d**-0.5, MATH_KERNEL, attention_variant(q, **kw))
            torch.testing.assert_close(out, full[real], rtol=1e-5, atol=1e-6)
            loss = loss + (out * g[real]).sum()
            seen.append(rows)
            tokens.append(lay.token_index)
            assert torch.equal(rows[lay.token_rows], plan.unpack_index[lay.token_index])
            assert torch.equal(lay.gathered_rows[lay.plan_order], torch.arange(t_pad))
        assert sorted(torch.cat(seen).tolist()) == list(range(t_pad))
        assert sorted(torch.cat(tokens).tolist()) == list(range(plan.num_input_tokens))
        for got, want in zip(torch.autograd.grad(loss, leaves), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cp", [2, 3])
def test_ordinary_thd_cp_layout_equals_full(cp):
    """An ordinary THD batch under CP (verl's stock layout: every sequence padded to 2*cp and
    chunked on its own): each rank's local rows against the gathered K/V equal per-sequence
    causal attention at its rows; gradients summed over ranks equal the full ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ps_mcore.layer_specs.packed_params import segment_plan, thd_cp_layout

    lengths = [2 * cp * n for n in (1, 3, 2, 5)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    rows = int(cu[-1])
    gen = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(rows, h, 6, generator=gen, requires_grad=True) for h in (4, 2, 2))
    g = torch.randn(rows, 4, 6, generator=gen)
    full = tree_attention(q, k, v, segment_plan(lengths), "chunked")
    ref = torch.autograd.grad((full * g).sum(), (q, k, v))
    loss, seen = 0, []
    for rank in range(cp):
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                              max_seqlen_kv=max(lengths), cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)
        lay = thd_cp_layout(psp, cp, rank, torch.device("cpu"))
        assert thd_cp_layout(psp, cp, rank, torch.device("cpu")) is lay  # cached
        local = lay.local_rows
        out = gather_kv_attention(q[local], k[lay.gathered_rows], v[lay.gathered_rows], lay, 6**-0.5, MATH_KERNEL)
        torch.testing.assert_close(out, full[local], rtol=1e-5, atol=1e-6)
        loss = loss + (out * g[local]).sum()
        seen.append(local)
    assert sorted(torch.cat(seen).tolist()) == list(range(rows))
    for got, want in zip(torch.autograd.grad(loss, (q, k, v)), ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cp_packed_params():
    plan = plan_prefix_tree([[1, 2, 3, 4, 5], [1, 2, 3, 9]], min_prefix_len=1)  # T = 6
    psp = TreePackedSeqParams.from_plan(plan, 8, cp_size=2, cp_rank=1)
    assert (psp.num_rows, psp.num_local_rows, psp.cp_size) == (8, 4, 2)
    assert psp.cu_seqlens_q.tolist() == [0, 8] and psp.max_seqlen_q == 8  # one THD sequence
    assert psp.cp_shard(plan.input_ids).tolist() == plan.input_ids[[2, 3, 4, 5]].tolist()
    assert psp.cp_shard(psp.position_ids).tolist() == plan.position_ids[[2, 3, 4, 5]].tolist()
    rank0 = TreePackedSeqParams.from_plan(plan, 8, cp_size=2, cp_rank=0)
    assert rank0.cp_shard(plan.input_ids, value=-1).tolist() == plan.input_ids[[0, 1]].tolist() + [-1, -1]
    assert rank0.cp_layout.query_rows.tolist() == [0, 1]  # rows 6, 7 are padding
    assert TreePackedSeqParams.from_plan(plan, 4).cp_layout is None
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        TreePackedSeqParams.from_plan(plan, 2, cp_size=2)
    with pytest.raises(ValueError, match="cp_rank"):
        TreePackedSeqParams.from_plan(plan, 4, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_size"):
        TreePackedSeqParams.from_plan(plan, 4, cp_size=0)
    with pytest.raises(ValueError, match="cp_shard expects"):
        psp.cp_shard(plan.input_ids[:-1])


# ----------------------------------------------------------------------------- PP plan check


def test_plan_fingerprint():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7]]
    a, b = plan_prefix_tree(seqs, min_prefix_len=1), plan_prefix_tree(seqs, min_prefix_len=1)
    assert plan_fingerprint(a) == plan_fingerprint(b) and 0 <= plan_fingerprint(a) < 2**63
    others = [
        plan_prefix_tree([[1, 2, 3, 4], [1, 2, 3, 5, 8], [7]], min_prefix_len=1),  # one token
        plan_prefix_tree(seqs, min_prefix_len=10),  # other planner options: no sharing
        plan_prefix_tree(seqs[::-1], min_prefix_len=1),  # other batch order
    ]
    assert len({plan_fingerprint(p) for p in [a] + others}) == 4
    assert assert_same_plan(a) == plan_fingerprint(a)  # world of 1: nothing to disagree with
    assert assert_same_plan([a, others[0]]) != assert_same_plan([others[0], a])
    with pytest.raises(TypeError, match="TreePlan"):
        plan_fingerprint(seqs)
    with pytest.raises(TypeError, match="TreePlan"):
        assert_same_plan([])


def test_no_cp_model_refuses_cp_params():
    init_cpu_megatron(1)
    from ps_mcore.layer_specs import TreeCoreAttention

    cfg = tiny_config("qwen2")
    plan = plan_prefix_tree([[1, 2, 3], [1, 2, 4, 5]], min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, 4, cp_size=2, cp_rank=0)
    q = torch.zeros(psp.num_local_rows, 4, 16)
    with pytest.raises(ValueError, match="runs context parallelism cp=1 but .* built for cp=2"):
        TreeCoreAttention(cfg, 1)(q, q, q, None, packed_seq_params=psp)
