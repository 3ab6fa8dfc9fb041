"""The unshared computation every tree-attention path is checked against."""

from __future__ import annotations

import torch

from ps_mcore import TreePlan, tree_attention


def unshared_attention(q, k, v, plan: TreePlan, scale=None) -> torch.Tensor:
    """Per-sequence causal attention on the *unpacked* rows, float64. Returns ``[N, Hq, D]``.

    Differentiable w.r.t. the packed q/k/v: unpacking is a gather, so shared rows receive the
    sum of their samples' gradients, which is what the tree path must reproduce."""
    qu, ku, vu = (plan.unpack(x).double() for x in (q, k, v))
    group = q.size(1) // k.size(1)
    bounds = plan.cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        qs = qu[a:b].transpose(0, 1)
        ks = ku[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vs = vu[a:b].repeat_interleave(group, 1).transpose(0, 1)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale
            ).transpose(0, 1)
        )
    return torch.cat(outs)


def random_qkv(plan: TreePlan, hq: int, hkv: int, d: int, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape_q, shape_kv = (plan.num_tokens, hq, d), (plan.num_tokens, hkv, d)
    return tuple(
        torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
        for s in (shape_q, shape_kv, shape_kv)
    )


def compare_with_unshared(plan, backend, hq, hkv, d, dtype, device="cpu", seed=0, grads=True):
    """Outputs and q/k/v gradients of ``backend`` and of the unshared float64 computation, for
    a loss that weights every sample differently (shared rows must sum correctly)."""
    q, k, v = random_qkv(plan, hq, hkv, d, dtype, device, seed)
    n = plan.num_input_tokens
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    weight = torch.randn(n, hq, d, generator=g, dtype=torch.float64).to(device)
    out = plan.unpack(tree_attention(q, k, v, plan, backend=backend))
    ref = unshared_attention(q, k, v, plan)
    if not grads:
        return out.detach(), ref.detach(), None, None
    got = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    return out.detach(), ref.detach(), got, want
