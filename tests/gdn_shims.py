"""Test-only shims so megatron-core 0.16.1's stock ``GatedDeltaNet`` builds and runs on CPU.

The stock module refuses to build without flash-linear-attention (Triton, GPU only here) and
calls fla's ``l2norm`` and ``chunk_gated_delta_rule``. The shims substitute Megatron's own
pure-torch ``torch_chunk_gated_delta_rule`` (what the stock module runs in deterministic mode)
and the same l2 normalisation formula, and run ``_apply_gated_norm`` uncompiled (megatron
wraps it in ``torch.compile``). Never used by the library.
"""

from __future__ import annotations


def shim_gdn_for_cpu() -> None:
    from megatron.core.ssm import gated_delta_net as gdn

    from ps_mcore.recurrent import l2norm

    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    norm = gdn.GatedDeltaNet.__dict__["_apply_gated_norm"]
    gdn.GatedDeltaNet._apply_gated_norm = getattr(norm, "_torchdynamo_orig_callable", norm)


def gdn_config_overrides(**extra) -> dict:
    """Tiny GDN dimensions: 2 key heads of 8, 4 value heads of 6 (GVA 2), conv width 4."""
    return dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                linear_num_key_heads=2, linear_num_value_heads=4, **extra)


def gdn_layer_spec(config, layer_spec):
    """A local-spec transformer layer with Gated DeltaNet in its attention slot (what
    megatron-core 0.16's experimental hybrid block builds with TE modules)."""
    import dataclasses

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = layer_spec.submodules.input_layernorm
    mixer = ModuleSpec(
        module=GatedDeltaNet,
        params={"conv_bias": True},
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear),
    )
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=mixer))
