"""Worker of tests/test_recurrent_bare.py: the tree recurrent mixers in a fresh interpreter that
has neither flash-linear-attention nor mamba-ssm and none of the test shims (gdn_shims,
mamba_shims, fla_shims) applied, on the pure-torch kernels.

``python recurrent_bare_worker.py gdn|mamba`` builds the tree mixer, runs a forest that branches
at several depths (forward and backward of a per-sample-weighted loss) and compares every
original token's output, the input gradient and every parameter gradient with each sequence
run alone through a reference written here from the layer's equations (from the mixer's own
projections, norms and parameters; none of ps_mcore's kernels). Prints ``ok`` or
``skip: <why>``; a mismatch raises.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from megatron_shims import init_cpu_megatron, randomize_, tiny_config

from ps_mcore import plan_prefix_tree

# Branches at depths 3, 6 and 9, a sequence that is a prefix of another, a duplicate, one token.
FOREST = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 12],
    [1, 2, 3, 4, 5, 6, 13, 14],
    [1, 2, 3, 15, 16, 17, 18],
    [1, 2, 3, 15, 16, 17, 18],
    [1, 2, 3, 4, 5],
    [19],
]


def branch_depths(plan) -> set[int]:
    """Token depths at which the forest branches: the first depth of every node whose parent
    (or, for a root, the forest) has two or more children."""
    parents = plan.node_parent.tolist()
    first_rows = plan.cu_seqlens_q[:-1].tolist()
    depths = plan.position_ids.tolist()
    children = Counter(parents)
    return {depths[first_rows[v]] for v, p in enumerate(parents) if children[p] > 1}


def causal_conv(x, weight, bias):
    """``[L, C]`` depthwise causal convolution from zero history (weight ``[C, 1, W]``)."""
    w = weight.size(-1)
    return F.conv1d(x.t()[None], weight, bias, padding=w - 1, groups=x.size(1))[0, :, : x.size(0)].t()


def gdn_alone(m, x):
    """Megatron's GatedDeltaNet on one sequence ``[L, hidden]`` (TP=1), token by token."""
    qkvzba = m.in_proj(x[:, None])[0][:, 0]
    qkv, gate, beta, alpha = torch.split(qkvzba, [2 * m.qk_dim + m.v_dim, m.v_dim, m.num_value_heads,
                                                 m.num_value_heads], -1)
    qkv = m.act_fn(causal_conv(qkv, m.conv1d.weight, m.conv1d.bias))
    q, k, v = torch.split(qkv, [m.qk_dim, m.qk_dim, m.v_dim], -1)
    length, group = x.size(0), m.num_value_heads // m.num_key_heads
    q, k = (t.reshape(length, m.num_key_heads, -1) for t in (q, k))
    q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))  # fla's l2norm
    q, k = (t.repeat_interleave(group, 1) for t in (q, k))
    v = v.reshape(length, m.num_value_heads, -1)
    g = -m.A_log.exp() * F.softplus(alpha + m.dt_bias)
    beta = beta.sigmoid()
    state = x.new_zeros(m.num_value_heads, k.size(-1), v.size(-1))
    outs = []
    for t in range(length):  # S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q / sqrt(K)
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t] * k.size(-1) ** -0.5, state))
    o = torch.stack(outs).reshape(-1, v.size(-1))
    y = m.out_norm(o) * m.act_fn(gate.reshape(-1, v.size(-1)))
    return m.out_proj(y.reshape(length, 1, -1))[0][:, 0]


def mamba_alone(m, x):
    """Megatron's MambaMixer (``_ssm_training``) on one sequence ``[L, hidden]`` (TP=1)."""
    from mamba_shims import mamba_ssd_reference, rms_norm_gated_reference  # equations, not shims

    zxbcdt = m.in_proj(x[:, None])[0][:, 0]
    inner, bc = m.d_inner, m.ngroups * m.d_state
    z, xbc, dt = torch.split(zxbcdt, [inner, inner + 2 * bc, m.nheads], -1)
    xbc = F.silu(causal_conv(xbc, m.cp.get_conv1d_weight(), m.cp.get_conv1d_bias()))
    xs, b, c = torch.split(xbc, [inner, bc, bc], -1)
    length = x.size(0)
    y = mamba_ssd_reference(
        xs.reshape(length, m.nheads, m.headdim), F.softplus(dt + m.dt_bias), -m.A_log.exp(),
        b.reshape(length, m.ngroups, m.d_state), c.reshape(length, m.ngroups, m.d_state),
        m.D.reshape(m.nheads, m.headdim) if m.D_has_hdim else m.D,
    ).reshape(length, inner)
    y = rms_norm_gated_reference(y, m.norm.weight, z=z, eps=m.norm.eps, group_size=inner // m.ngroups,
                                 norm_before_gate=False)
    return m.out_proj(y[:, None])[0][:, 0]


def build_gdn():
    from gdn_shims import gdn_config_overrides  # tiny dimensions only
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net
    from megatron.core.transformer.spec_utils import build_module

    from ps_mcore.layer_specs.modules.gdn import TreeGatedDeltaNet, get_gdn_layer_local_tree_spec

    assert not gated_delta_net.HAVE_FLA
    cfg = tiny_config("qwen2", **gdn_config_overrides())
    cfg.tree_gdn_backend = "torch"
    layer = get_gdn_layer_local_tree_spec(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"),
                                          conv_bias=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    mixers = [build_module(layer.submodules.self_attention, config=cfg, layer_number=1, pg_collection=pgs)
              for _ in range(2)]  # the tree's and the reference's
    assert type(mixers[0]) is TreeGatedDeltaNet
    randomize_(mixers[0], seed=1)
    with torch.no_grad():  # decays away from 1, a conv reaching across nodes: the tree matters
        mixers[0].A_log.copy_(torch.linspace(-1.0, 0.5, mixers[0].A_log.numel()))
        mixers[0].conv1d.weight.mul_(4.0)

    def run(x, psp):
        return mixers[0](x, None, packed_seq_params=psp)

    return mixers, run, gdn_alone


def build_mamba():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import mamba_mixer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ps_mcore.layer_specs.modules.mamba import TorchGatedRMSNorm, TreeMambaMixer

    assert not mamba_mixer.HAVE_MAMBA_SSM
    cfg = tiny_config("qwen2", mamba_num_groups=2, mamba_num_heads=4, mamba_head_dim=5, mamba_state_dim=6)
    cfg.tree_mamba_backend = "torch"
    sub = mamba_mixer.MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    mixers = [TreeMambaMixer(cfg, sub, d_model=cfg.hidden_size, d_conv=4, D_has_hdim=True, pg_collection=pgs)
              for _ in range(2)]  # the tree's and the reference's
    assert isinstance(mixers[0].norm, TorchGatedRMSNorm)
    randomize_(mixers[0], seed=2)
    with torch.no_grad():  # slow decays (state crosses nodes), a conv reaching across nodes
        mixers[0].A_log.copy_(torch.linspace(-3.0, 0.0, mixers[0].A_log.numel()))
        mixers[0].dt_bias.copy_(torch.linspace(-1.5, 0.5, mixers[0].dt_bias.numel()))
        mixers[0].cp.get_conv1d_weight().mul_(4.0)

    def run(x, psp):
        return mixers[0](x, packed_seq_params=psp)

    return mixers, run, mamba_alone


def compare(mixers, run, alone) -> None:
    """``run`` (the tree mixer ``mixers[0]`` on a forest) against ``alone`` (each sequence by
    the equations, from ``mixers[1]`` holding the same weights)."""
    from ps_mcore.layer_specs import TreePackedSeqParams

    mixer, reference = mixers
    plan = plan_prefix_tree(FOREST, min_prefix_len=1)
    assert len(branch_depths(plan)) >= 3, branch_depths(plan)
    psp = TreePackedSeqParams.from_plan(plan, pad_to_multiple_of=4)
    gen = torch.Generator().manual_seed(0)
    hidden = mixer.config.hidden_size
    x = torch.randn(psp.num_local_rows, 1, hidden, generator=gen, requires_grad=True)
    w = torch.cat([torch.full((len(s),), 0.3 + 0.4 * i) for i, s in enumerate(FOREST)])[:, None]
    probe = torch.randn(plan.num_input_tokens, hidden, generator=gen)

    reference.load_state_dict(mixer.state_dict())
    per_seq = plan.unpack(x[: plan.num_tokens, 0]).split(list(plan.seq_lens))
    ref = torch.cat([alone(reference, part) for part in per_seq])
    dx_ref, *ref_grads = torch.autograd.grad((w * ref * probe).sum(), [x, *reference.parameters()])

    out, bias = run(x, psp)
    assert bias is None and out.shape == x.shape
    got = plan.unpack(out[: plan.num_tokens, 0])
    dx, *grads = torch.autograd.grad((w * got * probe).sum(), [x, *mixer.parameters()])
    for name, a, b in [("outputs", got, ref), ("input gradient", dx, dx_ref)] + [
            (n, g, r) for (n, _), g, r in zip(mixer.named_parameters(), grads, ref_grads)]:
        scale = float(b.abs().max())
        assert scale > 0, f"{name}: zero reference, nothing would be tested"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=name)


def main(kind: str) -> str:
    for package in ("fla", "mamba_ssm"):
        if importlib.util.find_spec(package) is not None:
            return f"skip: {package} is installed (this test is about its absence)"
    init_cpu_megatron()
    if kind == "mamba":
        for package, why in (("triton", "megatron-core's Mamba mixer module imports triton"),
                             ("einops", "megatron-core's Mamba mixer needs einops")):
            if importlib.util.find_spec(package) is None:
                return f"skip: {why}, which is not installed"
    compare(*(build_gdn() if kind == "gdn" else build_mamba()))
    for shimmed in ("fla", "mamba_ssm"):  # nothing stood in for the packages
        assert shimmed not in sys.modules, shimmed
    return "ok"


if __name__ == "__main__":
    print(main(sys.argv[1]))
