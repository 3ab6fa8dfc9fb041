"""Gated delta rule (Gated DeltaNet's recurrence) over a prefix forest.

Per head, with state ``S`` of shape ``[K, V]`` and ``q`` scaled by ``scale``::

    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = S_t^T q_t

:func:`tree_gated_delta_rule` runs the forest level by level through
:func:`~ps_mcore.recurrent.scan.tree_scan` (each node from its parent's final state).
Kernels: flash-linear-attention's ``chunk_gated_delta_rule`` (varlen, ``initial_state`` /
``output_final_state``) on GPUs, a pure-torch chunked form elsewhere (CPU tests), checked
against the token-by-token recurrence.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ps_mcore.recurrent.scan import (
    BACKENDS, compute_dtype, fla_op, resolve_backend, tree_scan, varlen_call,
)
from ps_mcore.recurrent.tree import RecurrentTree

GDN_BACKENDS = BACKENDS
_WHAT = "gated delta rule"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt(x.to(compute_dtype(x)).pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


def gated_delta_rule_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token recurrence of one sequence (the reference for the chunked forms).

    Args:
        q, k: ``[L, H, K]``; v: ``[L, H, V]``; g (log decay), beta: ``[L, H]``.
        scale: query scale (default ``K ** -0.5``).
        initial_state: ``[H, K, V]`` or None (zeros).

    Returns:
        out ``[L, H, V]`` (dtype of q), final state ``[H, K, V]`` (fp32, fp64 for fp64 inputs).
    """
    dtype = q.dtype
    scale = q.size(-1) ** -0.5 if scale is None else scale
    ct = compute_dtype(q)
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    h, dk, dv = k.size(1), k.size(2), v.size(2)
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.to(ct)
    outs = []
    for t in range(q.size(0)):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, s))
    out = torch.stack(outs) if outs else v.new_zeros(0, h, dv)
    return out.to(dtype), s


def chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64):
    """Chunked (WY) form of :func:`gated_delta_rule_recurrent`: same arguments and results,
    ``O(L/C)`` sequential steps instead of ``L``. fp32 inside."""
    dtype = q.dtype
    length, h, dk = k.shape
    dv = v.size(2)
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size
    pad = (-length) % c
    # [H, n, C, *]; padding rows (k = v = beta = g = 0) leave the state unchanged.
    ct = compute_dtype(q)
    q, k, v = (F.pad(t.to(ct), (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(h, -1, c, t.size(-1)) for t in (q, k, v))
    g, beta = (F.pad(t.to(ct), (0, 0, 0, pad)).t().reshape(h, -1, c) for t in (g, beta))
    q = q * scale
    g = g.cumsum(-1)
    strict_upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(strict_upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    wy = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    u = wy @ (v * beta[..., None])
    w = wy @ (k_beta * g.exp()[..., None])
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.to(ct)
    outs = []
    for i in range(q.size(1)):
        qi, ki, gi = q[:, i], k[:, i], g[:, i]
        v_new = u[:, i] - w[:, i] @ s
        attn = qi @ ki.transpose(-1, -2) * decay[:, i]
        outs.append((qi * gi.exp()[..., None]) @ s + attn @ v_new)
        g_last = gi[:, -1:]
        s = s * g_last.exp()[..., None] + (ki * (g_last - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    out = torch.cat(outs, 1)[:, :length].transpose(0, 1) if outs else v.new_zeros(h, 0, dv).transpose(0, 1)
    return out.to(dtype), s


def _fla_kernel():
    return fla_op("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def resolve_gdn_backend(backend: str, device: torch.device) -> str:
    """``auto``: flash-linear-attention on CUDA when installed, else pure torch."""
    return resolve_backend(backend, device, _fla_kernel(), _WHAT)


def varlen_gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_host, initial_state=None,
                            output_final_state=True, scale=None, backend="auto"):
    """Independent sequences packed along rows, each from its own initial state.

    Args:
        q, k: ``[R, H, K]``; v: ``[R, H, V]``; g, beta: ``[R, H]``.
        cu_seqlens: ``[n+1]`` int64 boundaries (device); cu_seqlens_host: the same on the host.
        initial_state: ``[n, H, K, V]`` or None (zeros).

    Returns:
        out ``[R, H, V]``, final states ``[n, H, K, V]`` fp32 (None unless requested).
    """
    return varlen_call((q, k, v, g, beta), cu_seqlens, cu_seqlens_host, initial_state, output_final_state,
                       scale=scale, backend=backend, fla_kernel=_fla_kernel(),
                       torch_kernel=chunk_gated_delta_rule_torch, what=_WHAT)


def tree_gated_delta_rule(q, k, v, g, beta, tree: RecurrentTree, scale=None, backend="auto",
                          entry_states=None, with_states=False):
    """Gated delta rule of every packed row over its root path.

    Args:
        q, k: ``[rows, H, K]``; v: ``[rows, H, V]``; g (log decay), beta: ``[rows, H]``.
        tree: the micro-batch's :class:`RecurrentTree`.
        scale: query scale (default ``K ** -0.5``); backend: one of ``GDN_BACKENDS``.
        entry_states, with_states: a schedule call's kept ``[entries, H, K, V]`` states and
            whether to return its exits' (:func:`~ps_mcore.recurrent.scan.tree_scan`).

    Returns:
        ``[rows, H, V]``: what each row's own sequence computes alone (with ``with_states``:
        and the ``[exits, H, K, V]`` fp32 final states).
    """
    kernel = functools.partial(varlen_gated_delta_rule, scale=scale, backend=backend)
    return tree_scan(kernel, (q, k, v, g, beta), tree, "tree_gated_delta_rule", entry_states, with_states)
