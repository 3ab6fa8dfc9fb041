"""Test-only shims so megatron-core's stock ``GatedDeltaNet`` (0.16.1 and 0.19) builds and runs
on CPU.

The stock module refuses to build without flash-linear-attention (Triton, GPU only here) and
calls fla's ``l2norm``, ``chunk_gated_delta_rule`` and (0.19) ``causal_conv1d``. The shims
substitute Megatron's own pure-torch ``torch_chunk_gated_delta_rule`` and a torch depthwise
convolution (what the stock module runs in deterministic mode) and fla's l2 normalisation
formula written out here (not ps_mcore's ``l2norm``: the reference must not share the code
under test), and run the ``torch.compile``-wrapped helpers uncompiled. Never used by the
library.
"""

from __future__ import annotations


def _cpu_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None,
                       output_final_state=False, cu_seqlens=None):
    """fla's ``causal_conv1d`` (x ``[b, s, d]``, weight ``[d, w]``) for one unpacked batch, in
    torch: what 0.19's stock module runs in deterministic mode."""
    import torch.nn.functional as F

    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("the CPU causal_conv1d shim runs whole unpacked sequences only")
    width = weight.size(-1)
    y = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=width - 1, groups=weight.size(0))
    y = y[..., : x.size(1)].transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None


def _fla_l2norm(x, dim=-1, eps=1e-6, output_dtype=None):
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over ``dim``, in fp32 for 16-bit inputs."""
    import torch

    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf / torch.sqrt(xf.square().sum(dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _uncompiled(cls, *names) -> None:
    for name in names:  # megatron wraps these in torch.compile (jit_fuser)
        fn = cls.__dict__[name]
        setattr(cls, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def shim_gdn_for_cpu() -> None:
    from megatron.core.ssm import gated_delta_net as gdn

    if hasattr(gdn, "common"):  # megatron-core 0.19+: a package, the class in gdn.gdn
        from megatron.core.ssm.gated_delta_net import common, gdn as gdn_module

        common.HAVE_FLA = True
        common.l2norm = _fla_l2norm
        gdn_module.chunk_gated_delta_rule = gdn_module.torch_chunk_gated_delta_rule
        gdn_module.causal_conv1d = _cpu_causal_conv1d
        _uncompiled(common._GDNBase, "_apply_gated_norm", "_prepare_input_for_gated_delta_rule",
                    "_compute_g_and_beta")
        return
    gdn.HAVE_FLA = True
    gdn.l2norm = _fla_l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    _uncompiled(gdn.GatedDeltaNet, "_apply_gated_norm")


def gdn_config_overrides(**extra) -> dict:
    """Tiny GDN dimensions: 2 key heads of 8, 4 value heads of 6 (GVA 2), conv width 4."""
    return dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                linear_num_key_heads=2, linear_num_value_heads=4, **extra)


def gdn_layer_spec(config, layer_spec):
    """A local-spec layer with the STOCK GatedDeltaNet in its attention slot (the library's
    local tree layer spec with the mixer class swapped back), so to_tree_spec is exercised."""
    import dataclasses

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from ps_mcore.layer_specs.modules.gdn import get_gdn_layer_local_tree_spec

    spec = get_gdn_layer_local_tree_spec(layer_spec, conv_bias=True)
    mixer = dataclasses.replace(spec.submodules.self_attention, module=GatedDeltaNet)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=mixer))


def gdn_block_spec(config, pattern="G*G"):
    """A block of local-spec layers by ``pattern``: ``G`` a Gated DeltaNet layer (stock mixer),
    ``*`` an attention layer (dense MLP in both)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    attn = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                                    normalization=config.normalization)
    gdn = gdn_layer_spec(config, attn)
    return TransformerBlockSubmodules(
        layer_specs=[gdn if c == "G" else attn for c in pattern], layer_norm=attn.submodules.input_layernorm
    )


def sharpen_gdn_(model) -> None:
    """Decays away from 1 and short convolutions strong enough to reach across nodes, in every
    Gated DeltaNet layer (random init leaves both too mild for the tree to matter)."""
    import torch

    with torch.no_grad():
        for layer in model.decoder.layers:
            mixer = layer.self_attention
            if hasattr(mixer, "A_log"):
                mixer.A_log.copy_(torch.linspace(-1.0, 0.5, mixer.A_log.numel()))
                mixer.conv1d.weight.mul_(4.0)
