"""``TreeMambaMixer``: megatron-core's Mamba-2 mixer on prefix forests.

A subclass of the stock ``MambaMixer`` with the same parameters (state_dict keys, sharded
checkpoints and TP sharding unchanged). On a :class:`TreePackedSeqParams` batch it runs the
stock training computation (``_ssm_training``: mamba-ssm's ``mamba_split_conv1d_scan_combined``
then the gated RMSNorm) with every node of the forest starting from its parent's state:

    in_proj -> [z, xBC, dt] -> xBC: causal conv over each row's root path (+ bias), SiLU
    -> [x, B, C] -> SSD (dt = softplus(dt + dt_bias), A = -exp(A_log), D skip, ngroups),
    each node from its parent's final SSM state -> y * silu(z) -> norm (rmsnorm) -> out_proj

(kernels in :mod:`ps_mcore.recurrent`: ``tree_causal_conv1d``, ``tree_mamba_chunk_scan``).
Ordinary batches run the stock forward unchanged: sbhd, THD (standard ``PackedSeqParams``:
mamba-ssm's varlen path with ``seq_idx``) and inference.

Kernel: ``config.tree_mamba_backend`` (``auto`` | ``fla`` | ``torch``; default ``auto``:
flash-linear-attention's varlen ``chunk_simple_gla`` on CUDA, pure torch elsewhere; ``fla``
without flash-linear-attention raises). Refused on a tree batch, with a message: context
parallelism, inference caches.

Packages: importing this module imports megatron's ``mamba_mixer`` (megatron-core 0.16's
imports triton); building it needs einops, as the stock layer does. mamba-ssm is needed only by
the stock forward: without it the mixer builds with :class:`TorchGatedRMSNorm` as its ``norm``
(mamba-ssm's gated RMSNorm in torch, same ``norm.weight``), runs tree batches on the pure-torch
kernels, and refuses ordinary batches (sbhd, THD, inference), naming the package.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.ssm import mamba_mixer as stock_mamba
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ps_mcore.layer_specs.modules.dropout import tree_batch_dropout_refusal
from ps_mcore.layer_specs.modules.stock_init import init_stock_without, stock_forward_error
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams, call_entries
from ps_mcore.recurrent import (
    recurrent_tree, resolve_ssd_backend, tree_causal_conv1d, tree_conv_windows, tree_mamba_chunk_scan,
)

_WARNED_TORCH_ON_CUDA = False


class TorchGatedRMSNorm(torch.nn.Module):
    """mamba-ssm's gated RMSNorm (``RMSNormGated``) in torch, with the sharded checkpoint layout
    of megatron's ``ExtendedRMSNorm`` (``weight`` split over TP along dim 0): the Mamba mixer's
    ``norm`` where mamba-ssm is not installed. ``x``, ``z``: ``[..., hidden]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if z is not None and not self.norm_before_gate:
            x = x * F.silu(z.float())
        groups = x.reshape(*x.shape[:-1], -1, self.group_size or x.size(-1))
        out = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)).reshape(x.shape)
        out = out * self.weight.float()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.float())
        return out.to(dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``weight`` sharded along dim 0 over TP, as ``ExtendedRMSNorm`` saves it."""
        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


class TreeMambaMixer(MambaMixer):
    """Mamba-2 mixer that runs prefix-tree batches. Input/output ``[s, b, h]`` (sbhd) or
    ``[t, 1, h]`` (thd, ``t = T_pad / tp`` under sequence parallelism); returns
    ``(out, out_bias)`` like the stock module."""

    def __init__(self, config, *args, **kwargs):
        if stock_mamba.HAVE_MAMBA_SSM:
            super().__init__(config, *args, **kwargs)
            return
        init_stock_without(MambaMixer, self, (config, *args), kwargs,
                           {"HAVE_MAMBA_SSM": True, "ExtendedRMSNorm": TorchGatedRMSNorm})

    def forward(self, hidden_states, inference_context=None, *, inference_params=None,
                packed_seq_params=None):
        if not isinstance(packed_seq_params, TreePackedSeqParams):
            if not stock_mamba.HAVE_MAMBA_SSM:
                what = "sbhd batches" if packed_seq_params is None else "ordinary THD batches"
                raise stock_forward_error("TreeMambaMixer", "mamba-ssm", what, "prefix-tree batches")
            return super().forward(hidden_states, inference_context, inference_params=inference_params,
                                   packed_seq_params=packed_seq_params)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "Mamba (TreeMambaMixer) cannot run a prefix-tree batch with an inference context "
                "(conv/SSM state caches); run inference without TreePackedSeqParams"
            )
        if packed_seq_params.cp_size > 1 or self.cp.cp_size > 1:
            raise NotImplementedError(
                "Mamba (TreeMambaMixer) on a prefix-tree batch under context parallelism "
                "(context_parallel_size > 1) is not supported; use CP=1 for hybrid models with "
                "Mamba layers"
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
        if hidden_states.size(1) != 1:
            raise ValueError(f"packed (thd) batches have batch size 1, got hidden_states {tuple(hidden_states.shape)}")
        dropout = tree_batch_dropout_refusal(self, packed_seq_params)
        if dropout is not None:
            raise ValueError(dropout)
        backend = self._tree_backend(hidden_states.device)

        zxBCdt, _ = self.in_proj(hidden_states)  # [rows, 1, in_proj_dim / tp] (SP gathered)
        zxBCdt = zxBCdt[:, 0]
        rows = zxBCdt.size(0)
        plan = packed_seq_params.plan.to(zxBCdt.device)
        y = self._tree_ssm(zxBCdt, recurrent_tree(plan, rows), backend, plan)
        return self.out_proj(y[:, None])

    def _tree_backend(self, device: torch.device) -> str:
        """The SSD kernel for ``config.tree_mamba_backend``; errors name the option."""
        global _WARNED_TORCH_ON_CUDA
        requested = getattr(self.config, "tree_mamba_backend", "auto")
        try:
            backend = resolve_ssd_backend(requested, device)
        except (ImportError, ValueError) as err:
            raise type(err)(f"TreeMambaMixer (config.tree_mamba_backend={requested!r}): {err}") from err
        if backend == "torch" and device.type == "cuda" and requested == "auto" and not _WARNED_TORCH_ON_CUDA:
            _WARNED_TORCH_ON_CUDA = True
            warnings.warn(
                "TreeMambaMixer: flash-linear-attention is not installed, so Mamba layers run the "
                "pure-torch SSD kernel on the GPU (exact but slow); pip install fla-core",
                stacklevel=3,
            )
        return backend

    def _tree_ssm(self, zxBCdt: torch.Tensor, tree, backend: str, plan=None) -> torch.Tensor:
        """``_ssm_training`` over the forest: ``[rows, in_proj_dim / tp]`` -> ``[rows, d_inner / tp]``.
        ``plan``: the batch's plan (a schedule call's ContextPlan reads and keeps states)."""
        rows = zxBCdt.size(0)
        d_inner, groups, heads = self.cp.d_inner_local_tpcp, self.cp.ngroups_local_tpcp, self.cp.nheads_local_tpcp
        z, xBC, dt = torch.split(zxBCdt, [d_inner, d_inner + 2 * groups * self.d_state, heads], dim=-1)
        # One call of a cross-micro-batch schedule: segments that continue kept rows start from
        # their state and conv window; a kept call keeps those at its exits.
        entry_states, entry_windows = call_entries(plan, self.layer_number, "Mamba")
        weight = self.cp.get_conv1d_weight()
        exit_windows = tree_conv_windows(xBC, tree, weight.size(-1), entry_windows) if tree.num_exits else None
        xBC = self.act(tree_causal_conv1d(xBC, weight, self.cp.get_conv1d_bias(), tree, entry_windows))
        x, B, C = torch.split(xBC, [d_inner, groups * self.d_state, groups * self.d_state], dim=-1)
        D = self.cp.get_D()
        y, exit_states = tree_mamba_chunk_scan(
            x.reshape(rows, heads, self.headdim), dt,
            -torch.exp(self.cp.get_A_log().float()),  # A and dt_bias in fp32, as the stock call
            B.reshape(rows, groups, self.d_state), C.reshape(rows, groups, self.d_state), tree,
            D=D.float().reshape(heads, self.headdim) if self.D_has_hdim else D,
            z=z.reshape(rows, heads, self.headdim), dt_bias=self.cp.get_dt_bias().float(),
            backend=backend, entry_states=entry_states, with_states=True,
        )
        y = y.reshape(rows, d_inner)
        if exit_states is not None:
            y = plan.runtime.own_recurrent(self.layer_number, y, exit_states, exit_windows)
        # the stock fused kernel gates by silu(z) and the mixer's norm follows without z
        # (norm_before_gate=False: RMSNorm(y * silu(z)) per group of d_inner / ngroups)
        return self.norm(y) if self.rmsnorm else y
