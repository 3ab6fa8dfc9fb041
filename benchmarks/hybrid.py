"""A Qwen3-Next-like hybrid block (3 Gated DeltaNet : 1 attention layers, megatron-core 0.16.1
GPTModel, local linear layers, random init, bf16): forward + backward with the LM head and
per-token log-probs, unshared THD batch vs. prefix tree, every standard workload.

    python benchmarks/hybrid.py [--layers 4] [--out FILE]   # CUDA; needs flash-linear-attention
    python benchmarks/hybrid.py --tiny                        # CPU smoke run, pure-torch kernels

Layers ``GGG*`` repeated (``G`` Gated DeltaNet: 16 key heads x 128, 32 value heads x 128, conv
width 4; ``*`` attention: 16/2 heads x 256, qk-layernorm), dense SwiGLU MLP (ffn 5120) in every
layer (Qwen3-Next uses MoE there), hidden 2048, vocab 151936. One model runs both paths:
  * baseline: the unshared batch as THD with standard ``PackedSeqParams`` (TreeGatedDeltaNet:
    one varlen ``chunk_gated_delta_rule`` call from zero states; per-sequence varlen attention);
  * tree: ``TreePackedSeqParams`` of the prefix forest (planner defaults): GDN level by level,
    each node from its parent's final state.
Ideal = FLOP-weighted speedup: every linear layer and the GDN recurrence scale with tokens,
attention scores with (query, key) pairs. GDN kernel: ``config.tree_gdn_backend`` = ``fla`` on
CUDA (fails loudly without flash-linear-attention), ``torch`` with ``--tiny``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import DECODER_HEADERS, decoder_row, environment, markdown_table, model_benchmark_parser, parse_model_benchmark_args, workload_rows, write_report  # noqa: E402
from model import Steps, init_parallel  # noqa: E402



@dataclasses.dataclass(frozen=True)
class HybridShape:
    layers: int
    pattern: str  # per layer: G (Gated DeltaNet) or * (attention), repeated
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_head_dim: int
    ffn: int
    vocab: int
    conv: int = 4
    window: None = None  # no sliding window (what measure's plan statistics ask)

    def kinds(self) -> str:
        return "".join(self.pattern[i % len(self.pattern)] for i in range(self.layers))

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of everything that scales with tokens (LM head included)."""
        h, n_attn = self.hidden, self.kinds().count("*")
        n_gdn = self.layers - n_attn
        attn = h * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * h
        qk, v = self.gdn_key_heads * self.gdn_head_dim, self.gdn_value_heads * self.gdn_head_dim
        in_proj = h * (2 * qk + 2 * v + 2 * self.gdn_value_heads)
        # chunked delta rule: ~4 state-sized products per token and value head (fwd)
        recurrence = 4 * self.gdn_value_heads * self.gdn_head_dim * self.gdn_head_dim
        gdn = in_proj + v * h + recurrence + (2 * qk + v) * self.conv
        return 2.0 * (n_attn * attn + n_gdn * gdn + self.layers * 3 * h * self.ffn + h * self.vocab)

    def ideal_speedup(self, stats: dict) -> float:
        per_pair = 4.0 * self.kinds().count("*") * self.heads * self.head_dim
        tok = self.linear_flops_per_token()
        return (stats["N"] * tok + stats["attn_pairs_unshared"] * per_pair) / (
            stats["T"] * tok + stats["attn_pairs_tree"] * per_pair
        )


QWEN3_NEXT = dict(pattern="GGG*", hidden=2048, heads=16, kv_heads=2, head_dim=256, gdn_key_heads=16,
                  gdn_value_heads=32, gdn_head_dim=128, ffn=5120, vocab=151936)
TINY = dict(pattern="GGG*", hidden=64, heads=4, kv_heads=2, head_dim=16, gdn_key_heads=2,
            gdn_value_heads=4, gdn_head_dim=8, ffn=128, vocab=512)


def build_hybrid_model(shape: HybridShape, device: str, dtype: torch.dtype, gdn_backend: str):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ps_mcore.layer_specs import to_tree_spec
    from ps_mcore.layer_specs.modules.gdn import get_gdn_layer_local_tree_spec

    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, qk_layernorm=True,
        add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=device == "cpu",
        apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        linear_conv_kernel_dim=shape.conv, linear_key_head_dim=shape.gdn_head_dim,
        linear_value_head_dim=shape.gdn_head_dim, linear_num_key_heads=shape.gdn_key_heads,
        linear_num_value_heads=shape.gdn_value_heads,
    )
    config.tree_gdn_backend = gdn_backend
    attn = to_tree_spec(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    gdn = get_gdn_layer_local_tree_spec(attn)
    spec = TransformerBlockSubmodules(
        layer_specs=[gdn if k == "G" else attn for k in shape.kinds()],
        layer_norm=attn.submodules.input_layernorm,
    )
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=shape.vocab, max_sequence_length=1 << 15,
                     position_embedding_type="rope", rotary_base=10_000_000,
                     share_embeddings_and_output_weights=False)
    return model.to(device).train()


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = HybridShape(layers=args.layers, **(TINY if args.tiny else QWEN3_NEXT))
    init_parallel(device)
    if device == "cpu":
        _cpu_stock_gdn()
    model = build_hybrid_model(shape, device, dtype, "torch" if args.tiny else "fla")
    if not args.tiny:  # say why the first workload is slow
        print("note: the first fla calls autotune every Triton kernel they use (minutes on a fresh "
              "machine; later processes reuse Triton's on-disk cache)", flush=True)
    rows = workload_rows(args, shape, lambda seqs: Steps(model, seqs, device, stock_thd=True), decoder_row,
                         1 / 32 if args.tiny else 1.0)
    title = (
        f"megatron-core GPTModel, Qwen3-Next-like hybrid ({'tiny' if args.tiny else 'full'} shapes: "
        f"layers {shape.kinds()}, hidden {shape.hidden}, attention {shape.heads}/{shape.kv_heads} "
        f"heads x {shape.head_dim}, GDN {shape.gdn_key_heads}/{shape.gdn_value_heads} heads x "
        f"{shape.gdn_head_dim}, conv {shape.conv}, ffn {shape.ffn}, vocab {shape.vocab}, "
        f"{str(dtype).split('.')[-1]}), fwd+bwd with LM head and token log-probs; baseline = "
        "unshared THD (standard PackedSeqParams); tree = TreePackedSeqParams; GDN kernel "
        f"{'torch' if args.tiny else 'fla chunk_gated_delta_rule'}; MiB = peak allocated above the idle model"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(DECODER_HEADERS, rows)}\n"


def _cpu_stock_gdn() -> None:
    """--tiny only: megatron's GatedDeltaNet refuses to build without flash-linear-attention;
    on CPU the tree module never calls it (pure-torch kernels), so let it build."""
    from megatron.core.ssm import gated_delta_net

    if not gated_delta_net.HAVE_FLA:
        gated_delta_net.HAVE_FLA = True
        norm = gated_delta_net.GatedDeltaNet.__dict__["_apply_gated_norm"]
        gated_delta_net.GatedDeltaNet._apply_gated_norm = getattr(norm, "_torchdynamo_orig_callable", norm)


def main() -> None:
    args = parse_model_benchmark_args(model_benchmark_parser(__doc__), "benchmarks/hybrid.py")
    report = run(args)
    write_report(report, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
