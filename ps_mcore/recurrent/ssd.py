"""Mamba-2's SSD (a linear attention with a scalar per-head decay) over a prefix forest.

Per head, with state ``S`` of shape ``[K, V]``::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T;  o_t = scale * S_t^T q_t

(flash-linear-attention calls it "simple GLA"). Mamba-2's state-space recurrence per head ``h``
(state ``[P = headdim, N = d_state]``: ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T``,
``y_t = S_t C_t + D_h x_t``) is this form with ``q = C``, ``k = B`` (its group expanded to the
heads), ``v = dt * x``, ``g = dt * A`` and ``scale = 1``: :func:`tree_mamba_chunk_scan`.

Kernels: flash-linear-attention's ``chunk_simple_gla`` (varlen, ``initial_state`` /
``output_final_state``) on GPUs, a pure-torch chunked form elsewhere (CPU tests), checked
against the token-by-token recurrence. The forest runs level by level through
:func:`~ps_mcore.recurrent.scan.tree_scan`, each node from its parent's final state.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ps_mcore.recurrent.scan import (
    BACKENDS, compute_dtype, fla_op, resolve_backend, tree_scan, varlen_call,
)
from ps_mcore.recurrent.tree import RecurrentTree

SSD_BACKENDS = BACKENDS
_WHAT = "Mamba SSD (simple GLA)"


def simple_gla_recurrent(q, k, v, g, scale=1.0, initial_state=None):
    """Token-by-token recurrence of one sequence (the reference for the chunked forms).

    Args:
        q, k: ``[L, H, K]``; v: ``[L, H, V]``; g (log decay, <= 0): ``[L, H]``.
        scale: query scale; initial_state: ``[H, K, V]`` or None (zeros).

    Returns:
        out ``[L, H, V]`` (dtype of q), final state ``[H, K, V]`` (fp32, fp64 for fp64 inputs).
    """
    dtype = q.dtype
    ct = compute_dtype(q)
    q, k, v, g = (t.to(ct) for t in (q, k, v, g))
    h, dk, dv = k.size(1), k.size(2), v.size(2)
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.to(ct)
    outs = []
    for t in range(q.size(0)):
        s = s * g[t].exp()[:, None, None] + k[t][:, :, None] * v[t][:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, s))
    out = torch.stack(outs) if outs else v.new_zeros(0, h, dv)
    return out.to(dtype), s


def chunk_simple_gla_torch(q, k, v, g, scale=1.0, initial_state=None, chunk_size=64):
    """Chunked form of :func:`simple_gla_recurrent`: same arguments and results, ``O(L/C)``
    sequential steps (the inter-chunk state) instead of ``L``. fp32 inside (fp64 kept)."""
    dtype = q.dtype
    length, h, dk = k.shape
    dv = v.size(2)
    c = chunk_size
    pad = (-length) % c
    # [H, n, C, *]; padding rows (k = v = g = 0) leave the state unchanged.
    ct = compute_dtype(q)
    q, k, v = (F.pad(t.to(ct), (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(h, -1, c, t.size(-1)) for t in (q, k, v))
    g = F.pad(g.to(ct), (0, 0, 0, pad)).t().reshape(h, -1, c).cumsum(-1)
    strict_upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    # exp(G_i - G_j) for j <= i (masked before exp: the upper triangle would overflow)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(strict_upper, float("-inf")).exp()
    intra = (q @ k.transpose(-1, -2) * decay) @ v  # [H, n, C, V]: within-chunk contributions
    q_decayed = q * g.exp()[..., None]  # reads the state entering the chunk
    k_decayed = k * (g[..., -1:] - g).exp()[..., None]  # writes the state leaving the chunk
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.to(ct)
    outs = []
    for i in range(q.size(1)):
        outs.append(q_decayed[:, i] @ s + intra[:, i])
        s = s * g[:, i, -1:].exp()[..., None] + k_decayed[:, i].transpose(-1, -2) @ v[:, i]
    out = torch.cat(outs, 1)[:, :length].transpose(0, 1) if outs else v.new_zeros(h, 0, dv).transpose(0, 1)
    return (out * scale).to(dtype), s


def _fla_kernel():
    return fla_op("fla.ops.simple_gla", "chunk_simple_gla")


def resolve_ssd_backend(backend: str, device: torch.device) -> str:
    """``auto``: flash-linear-attention on CUDA when installed, else pure torch."""
    return resolve_backend(backend, device, _fla_kernel(), _WHAT)


def varlen_simple_gla(q, k, v, g, cu_seqlens, cu_seqlens_host, initial_state=None,
                      output_final_state=True, scale=1.0, backend="auto"):
    """Independent sequences packed along rows, each from its own initial state.

    Args:
        q, k: ``[R, H, K]``; v: ``[R, H, V]``; g: ``[R, H]`` (fp32 on the fla path).
        cu_seqlens: ``[n+1]`` int64 boundaries (device); cu_seqlens_host: the same on the host.
        initial_state: ``[n, H, K, V]`` or None (zeros).

    Returns:
        out ``[R, H, V]``, final states ``[n, H, K, V]`` fp32 (None unless requested).
    """
    return varlen_call((q, k, v, g), cu_seqlens, cu_seqlens_host, initial_state, output_final_state,
                       scale=scale, backend=backend, fla_kernel=_fla_kernel(),
                       torch_kernel=chunk_simple_gla_torch, what=_WHAT)


def tree_simple_gla(q, k, v, g, tree: RecurrentTree, scale=1.0, backend="auto", entry_states=None,
                    with_states=False):
    """Scalar-gated linear attention of every packed row over its root path.

    Args:
        q, k: ``[rows, H, K]``; v: ``[rows, H, V]``; g (log decay): ``[rows, H]``.
        tree: the micro-batch's :class:`RecurrentTree`.
        scale: query scale; backend: one of ``SSD_BACKENDS``.
        entry_states, with_states: as :func:`~ps_mcore.recurrent.scan.tree_scan`.

    Returns:
        ``[rows, H, V]``: what each row's own sequence computes alone (with ``with_states``:
        and the ``[exits, H, K, V]`` fp32 final states).
    """
    kernel = functools.partial(varlen_simple_gla, scale=scale, backend=backend)
    return tree_scan(kernel, (q, k, v, g), tree, "tree_simple_gla", entry_states, with_states)


def tree_mamba_chunk_scan(x, dt, A, B, C, tree: RecurrentTree, D=None, z=None, dt_bias=None,
                          dt_softplus=True, backend="auto", entry_states=None, with_states=False):
    """Mamba-2's SSD of every packed row over its root path (the arguments of mamba-ssm's
    ``mamba_chunk_scan_combined``, rows instead of ``[batch, seqlen]``).

    Args:
        x: ``[rows, H, P]``; dt: ``[rows, H]`` (``dt_bias`` added, then softplus if
        ``dt_softplus``); A: ``[H]`` (negative); B, C: ``[rows, G, N]`` with ``H % G == 0``
        (head ``h`` reads group ``h // (H / G)``); D: ``[H]``, ``[H, P]`` or None; z:
        ``[rows, H, P]`` or None (output gate ``silu(z)``); dt_bias: ``[H]`` or None.
        entry_states, with_states: a schedule call's kept ``[entries, H, N, P]`` SSM states
        and whether to return its exits' (:func:`~ps_mcore.recurrent.scan.tree_scan`).

    Returns:
        ``[rows, H, P]`` in x's dtype: ``y_t = (sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} dt_r A)
        dt_s x_s + D x_t) * silu(z_t)`` along each row's root path.
    """
    heads, groups = x.size(1), B.size(1)
    if heads % groups or C.size(1) != groups:
        raise ValueError(f"Mamba SSD: {heads} heads cannot share {groups} groups of B {tuple(B.shape)} / C {tuple(C.shape)}")
    ct = compute_dtype(x)  # dt, A, the decay and D's skip in fp32 (fp64 kept), as mamba-ssm
    dt = dt.to(ct) if dt_bias is None else dt.to(ct) + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)
    per_group = heads // groups
    q = C.repeat_interleave(per_group, dim=1).to(x.dtype)
    k = B.repeat_interleave(per_group, dim=1).to(x.dtype)
    v = (x.to(ct) * dt[..., None]).to(x.dtype)
    y = tree_simple_gla(q, k, v, dt * A.to(ct), tree, scale=1.0, backend=backend,
                        entry_states=entry_states, with_states=with_states)
    y, states = y if with_states else (y, None)
    if D is None and z is None:
        return (y, states) if with_states else y
    y = y.to(ct)
    if D is not None:
        y = y + (D.to(ct)[:, None] if D.dim() == 1 else D.to(ct)) * x.to(ct)
    if z is not None:
        y = y * F.silu(z.to(ct))
    return (y.to(x.dtype), states) if with_states else y.to(x.dtype)
