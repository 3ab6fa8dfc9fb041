"""``TreeGatedDeltaNet``: megatron-core's Gated DeltaNet mixer on prefix forests.

A subclass of the stock ``GatedDeltaNet`` with the same parameters (state_dict keys, sharded
checkpoints and TP sharding unchanged). On a :class:`TreePackedSeqParams` batch each node of
the forest starts its gated delta recurrence from its parent's final state and its short
convolution from the last ``linear_conv_kernel_dim - 1`` inputs of its ancestors (kernels in
:mod:`ps_mcore.recurrent`). On an ordinary THD batch (standard ``PackedSeqParams``, which the
stock 0.16 module refuses) every sequence runs from zero state through the same kernels
(under context parallelism, which 0.19's stock module supports, the stock forward runs).
Without packed params (sbhd) the stock forward runs.

Kernel: ``config.tree_gdn_backend`` (``auto`` | ``fla`` | ``torch``; default ``auto``:
flash-linear-attention's varlen ``chunk_gated_delta_rule`` on CUDA, pure torch elsewhere).
Without flash-linear-attention (a CPU install) the module still builds, unless ``fla`` is asked
for: tree and THD batches run the pure-torch kernels; what needs the stock forward (sbhd
batches, THD under context parallelism, inference) raises, naming the package.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as stock_gdn
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from ps_mcore.layer_specs.modules.dropout import tree_batch_dropout_refusal
from ps_mcore.layer_specs.modules.stock_init import init_stock_without, stock_forward_error
from ps_mcore.layer_specs.packed_params import TreePackedSeqParams, call_entries, plan_for_thd
from ps_mcore.recurrent import l2norm, recurrent_tree, tree_causal_conv1d, tree_conv_windows, tree_gated_delta_rule

_FLA = "flash-linear-attention"


class TreeGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet that runs prefix-tree and THD batches. Input/output ``[s, b, h]``
    (sbhd) or ``[t, 1, h]`` (thd, ``t = T_pad / tp`` under sequence parallelism)."""

    def __init__(self, config, *args, **kwargs):
        if stock_gdn.HAVE_FLA:
            super().__init__(config, *args, **kwargs)
            return
        if getattr(config, "tree_gdn_backend", "auto") == "fla":
            raise ImportError(f"TreeGatedDeltaNet (config.tree_gdn_backend='fla'): {_FLA} is not installed")
        init_stock_without(GatedDeltaNet, self, (config, *args), kwargs, {"HAVE_FLA": True})

    def _setup_variant_attrs(self):
        # megatron-core 0.19's constructor insists on a kernel for its stock forward (fla's, None
        # without fla, which is refused in forward): name megatron's own pure-torch one.
        super()._setup_variant_attrs()
        if self.gated_delta_rule is None:
            self.gated_delta_rule = stock_gdn.torch_chunk_gated_delta_rule

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        tree_batch = isinstance(packed_seq_params, TreePackedSeqParams)
        # megatron-core 0.19's stock GDN runs THD under context parallelism (its own
        # all-to-alls); the THD path below does not, so an ordinary batch goes to it.
        if packed_seq_params is None or (not tree_batch and getattr(self, "cp_size", 1) > 1):
            if not stock_gdn.HAVE_FLA:
                what = "sbhd batches" if packed_seq_params is None else "THD batches under context parallelism"
                raise stock_forward_error("TreeGatedDeltaNet", _FLA, what, "prefix-tree and THD batches")
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                inference_params=inference_params, **kwargs,
            )
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("TreeGatedDeltaNet: inference with packed sequences is not supported")
        if hidden_states.size(1) != 1:
            raise ValueError(f"packed (thd) batches have batch size 1, got hidden_states {tuple(hidden_states.shape)}")
        if tree_batch and packed_seq_params.cp_size > 1:
            raise NotImplementedError(
                "Gated DeltaNet on a prefix-tree batch under context parallelism is not "
                "supported (megatron-core 0.16's GatedDeltaNet has no CP at all)"
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}")
        dropout = tree_batch_dropout_refusal(self, packed_seq_params) if tree_batch else None
        if dropout is not None:
            raise ValueError(dropout)

        qkvzba, _ = self.in_proj(hidden_states)  # [rows, 1, in_proj_dim / tp] (SP gathered)
        qkvzba = qkvzba[:, 0]
        rows = qkvzba.size(0)
        if tree_batch:
            plan = packed_seq_params.plan.to(qkvzba.device)
        else:
            plan = plan_for_thd(packed_seq_params, rows, qkvzba.device)
        tree = recurrent_tree(plan, rows)
        # One call of a cross-micro-batch schedule: segments that continue kept rows start from
        # their state and conv window; a kept call keeps those at its exits.
        entry_states, entry_windows = call_entries(plan, self.layer_number, "Gated DeltaNet")

        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            qkvzba,
            [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
             self.num_value_heads // tp, self.num_value_heads // tp],
            dim=-1,
        )
        exit_windows = (tree_conv_windows(qkv, tree, self.conv1d.weight.size(-1), entry_windows)
                        if tree.num_exits else None)
        qkv = self.act_fn(tree_causal_conv1d(qkv, self.conv1d.weight, self.conv1d.bias, tree, entry_windows))
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = query.reshape(rows, -1, self.key_head_dim)
        key = key.reshape(rows, -1, self.key_head_dim)
        value = value.reshape(rows, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            norm = stock_gdn.l2norm if query.is_cuda and stock_gdn.HAVE_FLA else l2norm
            query, key = norm(query.contiguous()), norm(key.contiguous())
        group = self.num_value_heads // self.num_key_heads
        if group > 1:
            query = query.repeat_interleave(group, dim=1)
            key = key.repeat_interleave(group, dim=1)
        g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)  # fp32, as stock
        out, exit_states = tree_gated_delta_rule(
            query.contiguous(), key.contiguous(), value.contiguous(), g, beta.sigmoid().contiguous(),
            tree, backend=getattr(self.config, "tree_gdn_backend", "auto"),
            entry_states=entry_states, with_states=True,
        )
        if exit_states is not None:
            out = plan.runtime.own_recurrent(self.layer_number, out, exit_states, exit_windows)
        gate = gate.reshape(rows, -1, self.value_head_dim)
        norm_out = self._apply_gated_norm(out, gate.contiguous()).reshape(rows, 1, -1)
        return self.out_proj(norm_out)


def get_gdn_layer_local_tree_spec(layer_spec, conv_bias: bool = False):
    """A transformer layer with :class:`TreeGatedDeltaNet` in the attention slot, built from a
    local-spec GPT layer (``get_gpt_layer_local_spec(...)``: its norms, MLP and bda).

    megatron-core 0.16 builds Gated DeltaNet layers only with transformer-engine modules
    (``get_transformer_block_with_experimental_attention_variant_spec``); this is the same
    layer with Megatron's local linear layers (``in_proj`` column-parallel, ``out_proj``
    row-parallel, ``out_norm`` the layer's norm class). Pass the stock ``GatedDeltaNet``
    layer through ``to_tree_spec`` instead when you need the stock spec object.
    """
    mixer = ModuleSpec(
        module=TreeGatedDeltaNet,
        params={"conv_bias": conv_bias},
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=layer_spec.submodules.input_layernorm,
            out_proj=RowParallelLinear,
        ),
    )
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=mixer)
    )
