"""Multi-token prediction (MTP) on a prefix tree at the model level, against stock MTP on the
unshared batch, on megatron-core 0.16 (verl 0.8.0) and 0.19 (verl 0.9.1).

Stock and tree as tests/mtp_cases.py builds and runs them (the loss verl trains with: its own
on megatron-core 0.16, megatron's ``process_mtp_loss`` on 0.19); under tensor parallelism (TP=2,
with and without sequence parallelism) both run in a torchrun world
(tests/mtp_parallel_worker.py).
Each sample has its own loss mask and per-token weights (duplicates differ), so a shared row
must count once per sample and once per distinct continuation. Checked: the per-sample
weighted main loss, every gradient (MTP layers, decoder, embedding, output layer where the
MTP loss trains it) and megatron's MTP tracker (logged losses; acceptance counts on 0.19).
The same through verl's Megatron engine: tests/test_verl_megatron.py.
"""

from __future__ import annotations


from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

from forests import branching_forest, small_nasty_forests  # noqa: E402
from megatron_shims import enable_cpu_recompute, init_cpu_megatron, randomize_, run_torchrun  # noqa: E402
from mtp_cases import build_models, labelled, run_stock, run_tree, samples, step  # noqa: E402
import verl_batches  # noqa: E402, F401  (verl 0.9.1 on a CPU-only machine: its CPU platform)

init_cpu_megatron(1)
enable_cpu_recompute()

from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from ps_mcore.integrations.verl_common.mtp import megatron_mtp_loss  # noqa: E402


def _check(seqs, depths=2, detach=False, tied=False, seed=1, **config):
    missing = [k for k in config if k not in TransformerConfig.__dataclass_fields__]
    if missing:
        pytest.skip(f"this megatron-core has no {missing}")
    masks, weights = samples(seqs, seed)
    if not megatron_mtp_loss():
        # verl's own loss (megatron-core 0.16) divides by the depth's token count unclamped
        # (0/0 in stock too): keep the depths that score something
        while depths and not all(labelled(seqs, masks, k) for k in range(1, depths + 1)):
            depths -= 1
        if not depths:
            pytest.skip("no MTP depth scores a token of this forest")
    stock, tree, _ = build_models(depths, detach, tied, **config)
    randomize_(stock, seed=11)
    tree.load_state_dict(stock.state_dict())
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    loss_s, grads_s, logged_s = step(stock, lambda: run_stock(stock, seqs, masks, weights))
    loss_t, grads_t, logged_t = step(tree, lambda: run_tree(tree, seqs, masks, weights, detach))
    torch.testing.assert_close(loss_t, loss_s, rtol=1e-5, atol=1e-5)
    assert grads_s.keys() == grads_t.keys()
    for name in grads_s:
        scale = float(grads_s[name].abs().max()) + 1e-6
        torch.testing.assert_close(grads_t[name], grads_s[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert logged_s.keys() == logged_t.keys() and logged_s
    for key in logged_s:
        torch.testing.assert_close(logged_t[key], logged_s[key], rtol=1e-5, atol=1e-6, msg=key)
    return grads_t


@pytest.mark.parametrize("name", list(small_nasty_forests()))
def test_tree_mtp_matches_stock_on_nasty_forests(name):
    """Two MTP layers on one sequence, a deep chain, single tokens, duplicates and a prefix of
    another, a branching tree, no sharing, a random tree."""
    _check(small_nasty_forests()[name])


def _branching():
    return branching_forest(np.random.default_rng(4), roots=2, depth=3, fanout=3, node_len=(2, 5))


@pytest.mark.parametrize("options", [
    dict(depths=1),
    dict(depths=3),
    dict(detach=True),  # verl's detach_encoder
    dict(tied=True),  # the output layer is the embedding
    dict(calculate_per_token_loss=True),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(mtp_detach_heads=True),  # megatron-core 0.19
    dict(mtp_use_repeated_layer=True),  # megatron-core 0.19: one layer at every depth
    dict(mtp_loss_scaling_factor=0.7),
    dict(use_mup=True, mup_base_hidden_size=32),  # megatron-core 0.19: MuP scales the MTP logits too
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_tree_mtp_matches_stock_on_a_branching_forest(options):
    grads = _check(_branching(), **options)
    mtp = [g for n, g in grads.items() if n.startswith("mtp.")]
    assert mtp and all(float(g.abs().max()) > 0 for g in mtp)  # the MTP loss reached every MTP layer


def _tp_cases() -> list[dict]:
    """A branching forest (2 layers) and the nasty tree (3 layers, tied embeddings, verl's
    ``detach_encoder``), with their masks, weights and full TP=1 weights."""
    cases = []
    for seqs, options in ((_branching(), dict(depths=2, detach=False, tied=False)),
                          (small_nasty_forests()["tree"], dict(depths=3, detach=True, tied=True))):
        masks, weights = samples(seqs, seed=2)
        assert all(labelled(seqs, masks, k) for k in range(1, options["depths"] + 1))  # every depth scores
        stock, _, _ = build_models(**options)
        randomize_(stock, seed=11)
        state = {n: p.detach().clone() for n, p in stock.named_parameters()}
        cases.append(dict(seqs=seqs, masks=masks, weights=weights, state=state, config={}, **options))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "tp2sp"])
def test_tree_mtp_matches_stock_under_tensor_parallelism(layout, tmp_path):
    """TP=2 (with and without sequence parallelism) in a torchrun world: the tree's loss, every
    gradient (reduced as megatron's DDP does, TP shards gathered) and the MTP tracker equal stock
    MTP's at the same TP on the unshared batch; stock at TP=2 equals stock at TP=1."""
    cases = _tp_cases()
    torch.save(cases, tmp_path / "payload.pt")
    run_torchrun(Path(__file__).with_name("mtp_parallel_worker.py"), 2, layout, tmp_path / "payload.pt",
                 tmp_path / "out.pt")
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    assert len(results) == len(cases)
    for case, result in zip(cases, results):
        single_rank, _, _ = build_models(case["depths"], case["detach"], case["tied"])
        with torch.no_grad():
            for name, p in single_rank.named_parameters():
                p.copy_(case["state"][name])
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        batch = (case["seqs"], case["masks"], case["weights"])
        single = step(single_rank, lambda model=single_rank, batch=batch: run_stock(model, *batch))
        for name, (loss, grads, logged) in (("tree", result["tree"]), ("stock TP=1", single)):
            ref_loss, ref_grads, ref_logged = result["stock"]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=name)
            assert grads.keys() == ref_grads.keys()
            for key, g in ref_grads.items():
                scale = float(g.abs().max()) + 1e-6
                torch.testing.assert_close(grads[key], g, rtol=1e-5, atol=1e-5 * scale, msg=f"{name} {key}")
            assert logged.keys() == ref_logged.keys() and logged
            for key in logged:
                torch.testing.assert_close(logged[key], ref_logged[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        mtp = [g for n, g in result["tree"][1].items() if n.startswith("mtp.")]
        assert mtp and all(float(g.abs().max()) > 0 for g in mtp)  # the MTP loss reached every MTP layer
