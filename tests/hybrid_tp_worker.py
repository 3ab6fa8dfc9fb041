"""torchrun worker for tests/test_hybrid_tp.py, TP=2 on gloo, every small nasty forest, tree vs.
the stock module on each sequence alone: a Gated DeltaNet + attention GPTModel (``G*G``), and
a Mamba-2 mixer (2 groups, 4 heads, odd head dim: one group and two heads per rank); and the
GDN hybrid under a cross-micro-batch schedule vs the same model on the whole forest.

Usage: ``torchrun --standalone --nproc_per_node 2 hybrid_tp_worker.py``. Each rank checks its own
shards (heads, convolution channels, vocab) and prints one ``ok`` line per forest; a mismatch
raises, so the run exits non-zero.
"""

from __future__ import annotations

import numpy as np
import torch
from conftest import assert_grads_close, grads_of, run_schedule
from forests import small_nasty_forests
from gdn_shims import gdn_block_spec, gdn_config_overrides, sharpen_gdn_, shim_gdn_for_cpu
from megatron_shims import VOCAB, build_gpt, init_cpu_megatron, randomize_, tiny_config
from recurrent_oracle import tree_vs_each_sequence


def main() -> None:
    init_cpu_megatron(tp=2)
    shim_gdn_for_cpu()
    from megatron.core import parallel_state as ps

    from ps_mcore.layer_specs import to_tree_spec
    from ps_mcore.layer_specs.modules.gdn import TreeGatedDeltaNet

    rank = ps.get_tensor_model_parallel_rank()
    cfg = tiny_config("qwen2", num_layers=3, **gdn_config_overrides())
    spec = gdn_block_spec(cfg)
    stock = build_gpt(cfg, spec)
    randomize_(stock, seed=11)  # same seed on both ranks: replicated weights agree
    sharpen_gdn_(stock)
    tree = build_gpt(cfg, to_tree_spec(spec))
    tree.load_state_dict(stock.state_dict(), strict=True)
    mixer = tree.decoder.layers[0].self_attention
    assert isinstance(mixer, TreeGatedDeltaNet) and mixer.tp_size == 2
    # token ids spread over the whole vocabulary (one permutation keeps every forest's sharing),
    # so each rank's embedding shard gets gradient
    perm = np.random.default_rng(0).permutation(VOCAB)
    for name, seqs in sorted(small_nasty_forests().items()):
        seqs = [perm[np.asarray(s, dtype=np.int64)] for s in seqs]
        (got, ref), (grads, ref_grads) = tree_vs_each_sequence(stock, tree, seqs)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert_grads_close(grads, ref_grads, atol=3e-5, rtol=1e-4)
        print(f"rank {rank} ok {name} logits {tuple(got.shape)}", flush=True)
    schedule_across_micro_batches(tree, perm, rank)

    from mamba_shims import shim_mamba_for_cpu

    shim_mamba_for_cpu()
    from mamba_oracle import SHAPES, assert_close_scaled, mixer_pair, tree_vs_stock

    _, stock, tree = mixer_pair(SHAPES["g2-odd-headdim"], seed=5)
    assert tree.nheads_local_tp == 2 and tree.ngroups_local_tp == 1
    for name, seqs in sorted(small_nasty_forests().items()):
        (got, ref), (dx, dx_ref), (grads, ref_grads) = tree_vs_stock(stock, tree, seqs)
        assert_close_scaled(got, ref, "mixer output")
        assert_close_scaled(dx, dx_ref, "d hidden_states", rel=2e-5)
        for pname, r in ref_grads.items():
            assert_close_scaled(grads[pname], r, f"d {pname}", rel=3e-5)
        print(f"rank {rank} ok mamba {name} params {len(grads)}", flush=True)


def schedule_across_micro_batches(model, perm, rank: int) -> None:
    """The GDN hybrid under a cross-micro-batch schedule (each rank keeps its shards of the
    recurrent states and conv windows, log-probs over the vocab-parallel logits) equals the
    same model on the whole forest in one call: log-probs and every gradient shard."""
    from megatron.core import parallel_state as ps

    from ps_mcore.layer_specs.schedule import gpt_call
    from ps_mcore.minibatch import plan_minibatch

    rng = np.random.default_rng(3)
    prompt = list(rng.integers(0, VOCAB, 14))
    seqs = [perm[np.asarray(prompt + list(rng.integers(0, VOCAB, n)))] for n in (3, 7, 1, 5)]
    seqs.append(perm[np.asarray(prompt[:9] + list(rng.integers(0, VOCAB, 6)))])
    w = torch.from_numpy(np.repeat(np.linspace(0.3, 1.7, len(seqs)), [len(s) for s in seqs])).float()
    call = gpt_call(model, tp_group=ps.get_tensor_model_parallel_group())
    runs = []
    for budget in (1 << 20, 9):
        plan = plan_minibatch(seqs, budget, kv_row_cost=0.25, min_prefix_len=1)
        model.zero_grad(set_to_none=True)
        lp = run_schedule(plan, call, lambda out, tokens: (out["log_probs"] * w[tokens]).sum())
        runs.append((plan, lp, grads_of(model)))
    (one, ref, ref_grads), (plan, got, grads) = runs
    assert one.num_steps == 1 and plan.num_steps > 2
    assert any(plan.call_plan(c.index).exit_rows.numel() for c in plan.calls if c.kept)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads, ref_grads, atol=3e-5, rtol=1e-4)
    print(f"rank {rank} ok schedule steps {plan.num_steps}", flush=True)


if __name__ == "__main__":
    main()
