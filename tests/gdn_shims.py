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
    """A local-spec layer with the STOCK GatedDeltaNet in its attention slot (the library's
    local tree layer spec with the mixer class swapped back), so to_tree_spec is exercised."""
    import dataclasses

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from ps_mcore.layer_specs.gdn import get_gdn_layer_local_tree_spec

    spec = get_gdn_layer_local_tree_spec(layer_spec, conv_bias=True)
    mixer = dataclasses.replace(spec.submodules.self_attention, module=GatedDeltaNet)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=mixer))
