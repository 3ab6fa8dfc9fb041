"""Test-only shims so megatron-core 0.16.1's STOCK ``MambaMixer`` imports, builds and runs on CPU.

* ``triton`` (imported by ``megatron.core.inference...triton.tensor_ops`` at module import): when
  it is not installed, a stub sits in ``sys.modules`` only while megatron's Mamba modules are
  imported (enough for the import-time ``@triton.jit`` / ``tl.constexpr``); nothing here calls
  a Triton kernel, and torch never sees the stub afterwards.
* ``mamba_ssm`` (CUDA/Triton kernels): the stock training forward calls
  ``mamba_split_conv1d_scan_combined`` and builds ``RMSNormGated``. The stand-ins below are
  written from the Mamba-2 equations, token by token, independent of ``ps_mcore.recurrent``, and
  honour ``seq_idx`` (a packed sequence starts from zero conv and SSM state).
* ``einops.rearrange`` when einops is missing (the library's Mamba code does not use einops).

Never used by the library.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
import types

import torch
import torch.nn.functional as F

_MEGATRON_MAMBA_MODULES = (
    "megatron.core.ssm.mamba_mixer", "megatron.core.ssm.mamba_layer", "megatron.core.ssm.mamba_block",
    "megatron.core.models.mamba.mamba_model",
)


class _TritonStub:
    """Any attribute; called with one function it returns it (bare decorator), otherwise a
    decorator that returns its function (``@triton.jit(...)``, ``@triton.autotune(...)``)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> "_TritonStub":
        return _TritonStub(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return lambda fn: fn


def _stub_attribute(module: str, attr: str) -> _TritonStub:
    if attr.startswith("__"):  # __file__, __path__, ...: inspect and importlib probe these
        raise AttributeError(attr)
    return _TritonStub(f"{module}.{attr}")


@contextlib.contextmanager
def _triton_stub_while_importing():
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    import megatron.core  # noqa: F401  (imports torch._dynamo / _inductor, which probe the real triton)
    modules = {}
    for name in ("triton", "triton.language"):
        mod = types.ModuleType(name)
        mod.__getattr__ = functools.partial(_stub_attribute, name)  # PEP 562
        modules[name] = mod
    modules["triton"].language = modules["triton.language"]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- einops stand-in


def _axes(side: str) -> list[list[str]]:
    """``"b l (h p)"`` -> ``[["b"], ["l"], ["h", "p"]]``."""
    return [grp.strip("()").split() for grp in re.findall(r"\([^)]*\)|\S+", side)]


def rearrange(tensor: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
    """The subset of ``einops.rearrange`` megatron's Mamba mixer uses: permutations, groups in
    parentheses on either side, literal ``1`` axes."""
    left, right = (_axes(s) for s in pattern.split("->"))
    sizes = dict(sizes)
    for group, dim in zip(left, tensor.shape):
        names = [n for n in group if n != "1"]
        unknown = [n for n in names if n not in sizes]
        known = 1
        for n in names:
            known *= sizes.get(n, 1)
        if len(unknown) == 1:
            sizes[unknown[0]] = dim // known
    flat = [n for group in left for n in group if n != "1"]
    out = tensor.reshape([sizes[n] for n in flat])
    order = [n for group in right for n in group if n != "1"]
    out = out.permute([flat.index(n) for n in order])
    shape = []
    for group in right:
        size = 1
        for n in group:
            size *= 1 if n == "1" else sizes[n]
        shape.append(size)
    return out.reshape(shape)


# ----------------------------------------------------------------------------- mamba_ssm stand-ins


def mamba_ssd_reference(x, dt, A, B, C, D):
    """Mamba-2's recurrence of one sequence as its paper writes it (state ``[H, P, N]``):
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``.

    Args:
        x: ``[L, H, P]``; dt: ``[L, H]`` (after softplus); A: ``[H]``; B, C: ``[L, G, N]``
        (head ``h`` reads group ``h // (H / G)``); D: ``[H]`` or ``[H, P]``.
    """
    heads, groups = x.size(1), B.size(1)
    B, C = (t.repeat_interleave(heads // groups, dim=1) for t in (B, C))
    skip = D[:, None] if D.dim() == 1 else D
    s = x.new_zeros(heads, x.size(2), B.size(2))
    ys = []
    for t in range(x.size(0)):
        s = s * (dt[t] * A).exp()[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", s, C[t]) + skip * x[t])
    return torch.stack(ys)


def rms_norm_gated_reference(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba-ssm's gated RMSNorm (``layernorm_gated.rms_norm_ref``): optional ``x * silu(z)``
    before (``norm_before_gate=False``) or after the norm, RMS over groups of ``group_size``."""
    dtype = x.dtype
    ct = torch.promote_types(dtype, torch.float32)
    x = x.to(ct)
    if z is not None and not norm_before_gate:
        x = x * F.silu(z.to(ct))
    group = x.size(-1) if group_size is None else group_size
    xg = x.reshape(*x.shape[:-1], -1, group)
    out = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x.shape) * weight.to(ct)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(ct))
    return out.to(dtype)


class RMSNormGated(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` (same constructor, ``weight`` parameter)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return rms_norm_gated_reference(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                                     headdim=None, ngroups=1, norm_before_gate=True):
    """mamba-ssm's fused training kernel, token by token (what megatron's ``_ssm_training``
    uses: no norm, no out projection, no initial states): split ``zxbcdt`` = [z, xBC, dt];
    depthwise causal conv of xBC + bias, SiLU; split x, B, C; ``dt = softplus(dt + dt_bias)``;
    per head ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``;
    returns ``y * silu(z)`` ``[b, l, H * P]``. A new ``seq_idx`` value restarts conv and state."""
    if initial_states is not None or return_final_states or rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("the CPU stand-in covers megatron's training call only")
    if dt_limit != (0.0, float("inf")) or activation not in ("silu", "swish"):
        raise NotImplementedError(f"dt_limit={dt_limit}, activation={activation}")
    batch, length, _ = zxbcdt.shape
    heads = D.size(0)
    headdim = D.size(1) if D.dim() == 2 else headdim
    dim = heads * headdim
    state = (zxbcdt.size(-1) - 2 * dim - heads) // (2 * ngroups)
    ct = torch.promote_types(zxbcdt.dtype, torch.float32)
    z, xbc, dt = torch.split(zxbcdt.to(ct), [dim, dim + 2 * ngroups * state, heads], dim=-1)
    if seq_idx is None:
        seq_idx = torch.zeros(batch, length, dtype=torch.int32)
    width = conv1d_weight.size(-1)
    w = conv1d_weight.to(ct)
    outs = []
    for b in range(batch):
        conv = []
        for t in range(length):
            acc = conv1d_bias.to(ct).clone() if conv1d_bias is not None else xbc.new_zeros(xbc.size(-1))
            for j in range(width):
                src = t - width + 1 + j
                if src >= 0 and seq_idx[b, src] == seq_idx[b, t]:
                    acc = acc + w[:, j] * xbc[b, src]
            conv.append(F.silu(acc))
        x, bb, cc = torch.split(torch.stack(conv), [dim, ngroups * state, ngroups * state], dim=-1)
        delta = F.softplus(dt[b] + dt_bias.to(ct))
        bounds = [0, *(torch.nonzero(seq_idx[b, 1:] != seq_idx[b, :-1]).flatten() + 1).tolist(), length]
        y = torch.cat([  # every packed sequence from zero state
            mamba_ssd_reference(x[lo:hi].reshape(-1, heads, headdim), delta[lo:hi], A.to(ct),
                                bb[lo:hi].reshape(-1, ngroups, state), cc[lo:hi].reshape(-1, ngroups, state),
                                D.to(ct))
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ])
        outs.append(y.reshape(length, dim) * F.silu(z[b]))
    return torch.stack(outs).to(zxbcdt.dtype)


def _mamba_chunk_scan_unavailable(*args, **kwargs):
    raise NotImplementedError("mamba_chunk_scan_combined (inference / non-mem-eff path) has no CPU stand-in")


def shim_mamba_for_cpu():
    """Import megatron's Mamba modules (triton stubbed while importing if missing) and point
    ``MambaMixer`` at the stand-ins. Returns the ``mamba_mixer`` module."""
    with _triton_stub_while_importing():
        import megatron.core.ssm.mamba_mixer as mixer

        for name in _MEGATRON_MAMBA_MODULES[1:]:
            importlib.import_module(name)

    class ExtendedRMSNorm(RMSNormGated):
        """megatron's ``ExtendedRMSNorm`` (built on a MagicMock without mamba-ssm): weight
        sharded along dim 0."""

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            if not hasattr(self, "tp_group"):
                self.tp_group = mixer.parallel_state.get_tensor_model_parallel_group()
            return mixer.make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
            )

    mixer.HAVE_MAMBA_SSM = True
    mixer.RMSNormGated = RMSNormGated
    mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mixer.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    mixer.mamba_chunk_scan_combined = _mamba_chunk_scan_unavailable
    mixer._check_mamba_sequence_packing_support = lambda for_inference_not_training=True: (True, None)
    if importlib.util.find_spec("einops") is None:
        from megatron.core.ssm import mamba_context_parallel

        for module in (mixer, mamba_context_parallel):
            module.HAVE_EINOPS = True
            module.rearrange = rearrange
    return mixer
