"""The unshared computation every tree-attention path is checked against."""

from __future__ import annotations

import torch

from ps_mcore import TreePlan, tree_attention


def _one_sequence(qs, ks, vs, scale, window, sinks, softcap):
    """Causal attention of one sequence, float64, written out: q/k/v ``[H, L, D]``."""
    scale = qs.size(-1) ** -0.5 if scale is None else scale
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(qs.size(1))[:, None]
    j = torch.arange(qs.size(1))[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window  # the last `window` positions, itself included
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.size(1), 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : ks.size(1)]
    return torch.matmul(p, vs)


def unshared_attention(q, k, v, plan: TreePlan, scale=None, window=None, sinks=None, softcap=None) -> torch.Tensor:
    """Per-sequence causal attention on the *unpacked* rows, float64. Returns ``[N, Hq, D]``.

    Differentiable w.r.t. the packed q/k/v (and ``sinks``): unpacking is a gather, so shared
    rows receive the sum of their samples' gradients, which is what the tree path must
    reproduce. Plain attention runs through SDPA; a window / sinks / softcap through the
    formula written out here."""
    qu, ku, vu = (plan.unpack(x).double() for x in (q, k, v))
    group = q.size(1) // k.size(1)
    bounds = plan.cu_seqlens.tolist()
    plain = window is None and sinks is None and softcap is None
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        qs = qu[a:b].transpose(0, 1)
        ks = ku[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vs = vu[a:b].repeat_interleave(group, 1).transpose(0, 1)
        if plain:
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            o = _one_sequence(qs, ks, vs, scale, window, sinks, softcap)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def random_qkv(plan: TreePlan, hq: int, hkv: int, d: int, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape_q, shape_kv = (plan.num_tokens, hq, d), (plan.num_tokens, hkv, d)
    return tuple(
        torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
        for s in (shape_q, shape_kv, shape_kv)
    )


def random_sinks(hq: int, device="cpu", seed=0, dtype=torch.float32):
    """Per-head sink logits of both signs and a few magnitudes (some dominate a row)."""
    g = torch.Generator(device="cpu").manual_seed(seed + 7)
    return (torch.randn(hq, generator=g) * 2.0).to(device=device, dtype=dtype).requires_grad_()


def compare_with_unshared(plan, backend, hq, hkv, d, dtype, device="cpu", seed=0, grads=True, **variant):
    """Outputs and q/k/v gradients of ``backend`` and of the unshared float64 computation, for
    a loss that weights every sample differently (shared rows must sum correctly).

    ``variant``: ``window=``, ``softcap=``, ``sinks=True`` (random per-head sink logits: their
    gradient is compared too, as a fourth entry)."""
    q, k, v = random_qkv(plan, hq, hkv, d, dtype, device, seed)
    sinks_dtype = torch.promote_types(dtype, torch.float32)  # float32 logits, float64 for float64
    sinks = random_sinks(hq, device, seed, sinks_dtype) if variant.pop("sinks", False) else None
    n = plan.num_input_tokens
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    weight = torch.randn(n, hq, d, generator=g, dtype=torch.float64).to(device)
    out = plan.unpack(tree_attention(q, k, v, plan, backend=backend, sinks=sinks, **variant))
    ref = unshared_attention(q.cpu(), k.cpu(), v.cpu(), plan.to("cpu"), sinks=None if sinks is None else sinks.cpu(),
                             **variant).to(device)
    if not grads:
        return out.detach(), ref.detach(), None, None
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    got = torch.autograd.grad((out.double() * weight).sum(), leaves)
    want = torch.autograd.grad((ref * weight).sum(), leaves)
    return out.detach(), ref.detach(), got, want
