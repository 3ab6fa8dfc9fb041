"""The stock-vs-tree oracle of the Mamba mixer tests (tests/test_mamba.py, the TP=2 worker
tests/hybrid_tp_worker.py): a stock ``MambaMixer`` and a ``TreeMambaMixer`` with the same weights,
and their outputs and gradients on a forest. No import-time side effects: the caller sets up
Megatron's parallel state and ``mamba_shims.shim_mamba_for_cpu()`` first."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from conftest import grads_of
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_shims import randomize_, tiny_config

from ps_mcore import plan_prefix_tree
from ps_mcore.layer_specs import TreePackedSeqParams
from ps_mcore.layer_specs.modules.mamba import TreeMambaMixer

# (ngroups, heads, headdim, d_state, D_has_hdim): groups > 1 with an odd head dim, and D per channel
SHAPES = {"g1": (1, 2, 8, 4, False), "g2-odd-headdim": (2, 4, 5, 6, True)}


def mamba_config(groups, heads, headdim, state, **extra):
    return tiny_config("qwen2", mamba_num_groups=groups, mamba_num_heads=heads, mamba_head_dim=headdim,
                       mamba_state_dim=state, **extra)


def sharpen_mamba_(mixer):
    """Slow decays (state crosses many nodes) and a conv that reaches across node boundaries."""
    with torch.no_grad():
        mixer.A_log.copy_(torch.linspace(-3.0, 0.0, mixer.A_log.numel()))
        mixer.dt_bias.copy_(torch.linspace(-1.5, 0.5, mixer.dt_bias.numel()))
        mixer.cp.get_conv1d_weight().mul_(4.0)  # conv1d.weight (0.16) / conv1d_weight (0.19)


def thd_params(cu: torch.Tensor, max_len: int) -> PackedSeqParams:
    """Standard THD params; megatron-core 0.19's Mamba reads the sequence of each row from
    ``seq_idx`` (0.16 derives it from ``cu_seqlens``), so it is filled where the field exists."""
    extra = {}
    if "seq_idx" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        extra["seq_idx"] = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff().long()).int()[None]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len, **extra)


def mixer_pair(shape, seed=0):
    groups, heads, headdim, state, d_hdim = shape
    cfg = mamba_config(groups, heads, headdim, state)
    sub = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    kw = dict(d_model=cfg.hidden_size, d_conv=4, D_has_hdim=d_hdim, pg_collection=pgs)
    stock = MambaMixer(cfg, sub, **kw)
    randomize_(stock, seed=seed)
    sharpen_mamba_(stock)
    tree = TreeMambaMixer(cfg, sub, **kw)
    tree.load_state_dict(stock.state_dict(), strict=True)
    return cfg, stock, tree


def assert_close_scaled(got, ref, what, rel=1e-5):
    scale = float(ref.abs().max())
    assert scale > 0, f"{what}: zero reference, the test would not test it"
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * scale, msg=what)


def tree_vs_stock(stock, tree, seqs, oracle="alone", pad_to_multiple_of=4):
    """Mixer outputs at every original token and the gradients (input rows, parameters) of a
    per-sample-weighted loss, tree vs the stock oracle (``alone``: each sequence sbhd;
    ``thd``: the unshared batch packed with ``seq_idx``)."""
    plan = plan_prefix_tree(seqs, min_prefix_len=1)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=pad_to_multiple_of)
    hidden = stock.config.hidden_size
    gen = torch.Generator().manual_seed(len(seqs))
    dtype = next(stock.parameters()).dtype
    x = torch.randn(psp.num_local_rows, 1, hidden, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.cat([torch.full((len(s),), 0.3 + 0.4 * i, dtype=dtype) for i, s in enumerate(seqs)])
    probe = torch.randn(plan.num_input_tokens, hidden, generator=gen, dtype=dtype)

    per_seq = plan.unpack(x[: plan.num_tokens, 0])  # [N, h]: each sample's rows (differentiable)
    if oracle == "alone":
        ref = torch.cat([stock(part[:, None])[0][:, 0] for part in per_seq.split(list(plan.seq_lens))])
    else:
        cu = torch.tensor(np.concatenate([[0], np.cumsum(plan.seq_lens)]), dtype=torch.int32)
        thd = thd_params(cu, max(plan.seq_lens))
        ref = stock(per_seq[:, None], packed_seq_params=thd)[0][:, 0]
    (dx_ref,) = torch.autograd.grad((w[:, None] * ref * probe).sum(), x, retain_graph=True)
    (w[:, None] * ref * probe).sum().backward()
    ref_grads = grads_of(stock)

    out, bias = tree(x, packed_seq_params=psp)
    assert out.shape == x.shape and bias is None
    got = plan.unpack(out[: plan.num_tokens, 0])
    loss = (w[:, None] * got * probe).sum()
    (dx,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    assert not dx[plan.num_tokens:].any(), "padding rows must not reach real rows"
    return (got.detach(), ref.detach()), (dx, dx_ref), (grads_of(tree), ref_grads)
