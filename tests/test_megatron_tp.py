"""TP=2 (torchrun, gloo, CPU): the tree-spec GPTModel's logits, vocab-parallel token
log-probs and full gradients equal the same model at TP=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import assert_grads_close, grads_of  # noqa: E402
from forests import assert_branches  # noqa: E402
from megatron_shims import VOCAB, init_cpu_megatron, randomize_  # noqa: E402
from megatron_tp_worker import KINDS, tree_model, tree_step  # noqa: E402

from ps_mcore import plan_prefix_tree  # noqa: E402

WORKER = Path(__file__).with_name("megatron_tp_worker.py")


def _forest(seed: int):
    """A prompt whose continuations branch at two nested depths (asserted), the prompt itself, a
    prefix of it and an unrelated sequence: 25 packed rows (odd, so TP=2 pads)."""
    rng = np.random.default_rng(seed)
    prompt, turn = rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 3)
    seqs = [np.concatenate([prompt, turn, rng.integers(0, VOCAB, n)]) for n in (4, 2)]
    seqs += [np.concatenate([prompt, rng.integers(0, VOCAB, 2)]), prompt, prompt[:3], rng.integers(0, VOCAB, 5)]
    return plan_prefix_tree(seqs, min_prefix_len=1), assert_branches(seqs)


def test_tp2_equals_tp1(tmp_path):
    init_cpu_megatron(tp=1)
    payload, expected = {}, {}
    for i, kind in enumerate(KINDS):
        plan, seqs = _forest(i)
        assert plan.num_tokens % 2 == 1 and plan.num_tokens < plan.num_input_tokens  # pads, shares
        w = np.random.default_rng(i).uniform(0.2, 2.0, len(seqs))
        w_tok = torch.from_numpy(np.repeat(w, [len(s) for s in seqs])).float()
        probe = torch.randn(plan.num_input_tokens, VOCAB, generator=torch.Generator().manual_seed(i))
        model = tree_model(kind)
        randomize_(model, seed=11 + i)
        out = tree_step(model, plan, w_tok, probe)
        out["grads"] = grads_of(model)
        expected[kind] = out
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        payload[kind] = {"state": state, "plan": plan, "w_tok": w_tok, "probe": probe}
    torch.save(payload, tmp_path / "payload.pt")

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(tmp_path / "payload.pt"), str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(tmp_path / "out.pt", weights_only=False)

    for kind in KINDS:
        ref, tp2 = expected[kind], got[kind]
        torch.testing.assert_close(tp2["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp2["logprobs"], ref["logprobs"], rtol=1e-5, atol=1e-5)
        assert_grads_close(tp2["grads"], ref["grads"])
