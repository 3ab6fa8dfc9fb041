"""MoE and MLA GPTModels: the stock transformer-engine model on the unshared THD batch vs the
same weights with tree specs on the prefix tree (fwd + bwd, LM head, token log-probs).

    python benchmarks/moe_mla.py --model moe [--layers 4] [--out FILE]   # H200 + TE, bf16
    python benchmarks/moe_mla.py --model mla
    python benchmarks/moe_mla.py --model moe --tiny     # CPU smoke run: local spec, tiny dims

moe: Qwen3-30B-A3B layer shapes (hidden 2048, 32/4 heads x 128, 128 experts top-8, expert ffn
768, qk-layernorm, vocab 151936), 4 layers, TE spec with grouped GEMM, alltoall dispatcher, aux
loss 1e-3 (exact on trees: multiplicity-weighted). mla: DeepSeek-V3-like MLA (hidden 2048, 16
heads, q_lora 1536, kv_lora 512, qk 128 + rope 64, v 128), dense SwiGLU ffn 8192, 4 layers.
Baseline: ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (TE linear layers
and TE DotProductAttention) on the unshared batch packed as THD with standard
``PackedSeqParams``. Tree: ``to_tree_spec`` of that spec (same weights; TE linear layers, our
core attention) on ``TreePackedSeqParams``. Ideal: FLOP-weighted speedup (``ps_mcore.flops``
with the active-expert / MLA projections). bf16 error: max |log-prob - fp32 stock log-prob| of
each bf16 run (the fp32 reference: the same weights in the tree-spec model in fp32 with the
exact ``chunked`` kernel on the unshared THD batch, since TE's THD attention needs 16-bit).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, model_benchmark_parser, parse_model_benchmark_args, workload_rows, write_report  # noqa: E402
from model import init_parallel, thd_params  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.flops import DecoderShape, MoEShape  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

WORKLOADS = ("grpo-long-prompt", "agent-tree", "step-wise")
MOE = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936,
           experts=128, topk=8, expert_ffn=768)
MLA = dict(hidden=2048, heads=16, kv_heads=16, head_dim=128, ffn=8192, vocab=151936,
           q_lora=1536, kv_lora=512, qk=128, rope=64, v=128)
TINY_MOE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=512,
                experts=8, topk=2, expert_ffn=32)
TINY_MLA = dict(hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=96, vocab=512,
                q_lora=32, kv_lora=24, qk=16, rope=8, v=12)


@dataclasses.dataclass(frozen=True)
class MLAShape(DecoderShape):
    """MLA projections (q lora, kv lora, up-projections, output) + dense SwiGLU; attention
    scores over qk+rope dims, values over v dims."""

    q_lora: int = 0
    kv_lora: int = 0
    qk: int = 0
    rope: int = 0
    v: int = 0

    def linear_flops_per_token(self) -> float:
        h, n = self.hidden, self.heads
        q = h * self.q_lora + self.q_lora * n * (self.qk + self.rope)
        kv = h * (self.kv_lora + self.rope) + self.kv_lora * n * (self.qk + self.v)
        mlp = 3 * h * self.ffn
        return 2.0 * (self.layers * (q + kv + n * self.v * h + mlp) + h * self.vocab)

    def attention_flops_per_pair(self) -> float:
        return 2.0 * self.layers * self.heads * (self.qk + self.rope + self.v)


def build_config(kind: str, dims: dict, layers: int, dtype, device: str):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    common = dict(
        num_layers=layers, hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
        ffn_hidden_size=dims["ffn"], normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=device == "cpu",
        apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if kind == "moe":
        return TransformerConfig(
            **common, num_query_groups=dims["kv_heads"], kv_channels=dims["head_dim"],
            qk_layernorm=True, num_moe_experts=dims["experts"], moe_router_topk=dims["topk"],
            moe_ffn_hidden_size=dims["expert_ffn"], moe_grouped_gemm=device == "cuda",
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32",
        )
    return MLATransformerConfig(
        **common, multi_latent_attention=True, q_lora_rank=dims["q_lora"],
        kv_lora_rank=dims["kv_lora"], qk_head_dim=dims["qk"], qk_pos_emb_head_dim=dims["rope"],
        v_head_dim=dims["v"], rope_type="rope", rotary_base=10000, qk_layernorm=True,
    )


def _gpt(config, spec, vocab: int, device: str):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=vocab, max_sequence_length=1 << 15,
                    position_embedding_type="rope", rotary_base=1_000_000,
                    share_embeddings_and_output_weights=False).to(device).train()


def _spec(config, use_te: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")


def build_pair(config, vocab: int, device: str, tiny: bool):
    """(stock model, tree model) with identical weights. With ``--tiny`` (no TE on CPU) the
    "stock" model is the tree-spec model itself (it runs ordinary THD batches per sequence)."""
    from ps_mcore.layer_specs import to_tree_spec

    tree = _gpt(config, to_tree_spec(_spec(config, not tiny)), vocab, device)
    if tiny:
        return tree, tree
    stock = _gpt(config, _spec(config, True), vocab, device)
    # TE's DotProductAttention carries _extra_state keys our core attention lacks.
    missing, unexpected = tree.load_state_dict(stock.state_dict(), strict=False)
    assert not missing and all(k.endswith("_extra_state") for k in unexpected), (missing, unexpected)
    return stock, tree


def build_reference(config32, tree, vocab: int, device: str, tiny: bool):
    """The fp32 reference: the tree-spec model (same linear layers as ``tree``, so the same
    state_dict keys) in fp32 with the exact fp32 ``chunked`` kernel, run on the unshared THD
    batch (one segment per sequence). TE's THD attention needs 16-bit inputs."""
    from ps_mcore.layer_specs import to_tree_spec

    config32.tree_attention_backend = "chunked"
    ref = _gpt(config32, to_tree_spec(_spec(config32, not tiny)), vocab, device)
    ref.load_state_dict(tree.state_dict(), strict=True)  # copies cast to fp32
    return ref


class Runs:
    def __init__(self, stock, tree, sequences, device):
        from ps_mcore.layer_specs import TreePackedSeqParams

        self.stock, self.tree = stock, tree
        self.models = (stock, tree)
        self.plan = plan_prefix_tree(sequences).to(device)
        self.flat = plan_unshared(sequences).to(device)
        lengths = [len(s) for s in sequences]
        self.base_psp = thd_params(lengths, device)
        self.base_pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        self.tree_psp = TreePackedSeqParams.from_plan(self.plan)
        gen = torch.Generator().manual_seed(1)
        w = torch.empty(len(sequences)).uniform_(0.2, 2.0, generator=gen)
        self.weights = torch.repeat_interleave(w, torch.tensor(lengths)).to(device)

    def base_lp(self, model=None):
        model = model or self.stock
        logits = model(input_ids=self.flat.input_ids[None], position_ids=self.base_pos[None],
                       attention_mask=None, packed_seq_params=self.base_psp)[0]
        return token_logprobs(logits, self.flat)[0]

    def tree_lp(self, model=None):
        model = model or self.tree
        logits = model(input_ids=self.plan.input_ids[None], position_ids=self.plan.position_ids[None],
                       attention_mask=None, packed_seq_params=self.tree_psp)[0]
        return token_logprobs(logits, self.plan)[0]

    def base_step(self):
        self.stock.zero_grad(set_to_none=True)
        (self.base_lp() * self.weights).sum().backward()

    def tree_step(self):
        self.tree.zero_grad(set_to_none=True)
        (self.tree_lp() * self.weights).sum().backward()


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    init_parallel(device)
    if device == "cpu":  # test-only-style shims for megatron MoE/MLA without TE or CUDA
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from megatron_shims import enable_cpu_mla, enable_cpu_moe

        enable_cpu_moe(), enable_cpu_mla()
    dims = (TINY_MOE if args.model == "moe" else TINY_MLA) if args.tiny else (MOE if args.model == "moe" else MLA)
    shape_cls = MoEShape if args.model == "moe" else MLAShape
    shape = shape_cls(layers=args.layers, **dims)
    config = build_config(args.model, dims, args.layers, dtype, device)
    stock, tree = build_pair(config, dims["vocab"], device, args.tiny)
    ref = build_reference(build_config(args.model, dims, args.layers, torch.float32, device),
                          tree, dims["vocab"], device, args.tiny)
    headers = ["workload", "N", "T", "dedup", "attn ratio", "ideal", "stock ms", "tree ms",
               "speedup", "meas/ideal", "stock MiB", "tree MiB", "bf16 err stock", "bf16 err tree"]

    def row(name, m, runs):
        with torch.no_grad():
            lp32 = runs.base_lp(ref).float()
            err_stock = float((runs.base_lp().float() - lp32).abs().max())
            err_tree = float((runs.tree_lp().float() - lp32).abs().max())
        return m.row(name) + [err_stock, err_tree]

    rows = workload_rows(args, shape, lambda seqs: Runs(stock, tree, seqs, device), row,
                         1 / 32 if args.tiny else 1.0)
    title = (
        f"{args.model.upper()} GPTModel ({'tiny' if args.tiny else 'H200-scaled'} dims {dims}, "
        f"{args.layers} layers, {str(dtype).split('.')[-1]}, random init): stock "
        f"{'(tiny: tree-spec model on unshared THD)' if args.tiny else 'TE spec'} on the unshared "
        "THD batch vs to_tree_spec on the prefix tree; fwd+bwd with LM head and weighted token "
        "log-probs; bf16 err = max |log-prob - fp32 reference|"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n"


def main() -> None:
    p = model_benchmark_parser(__doc__)
    p.add_argument("--model", choices=("moe", "mla"), required=True)
    p.set_defaults(workloads=list(WORKLOADS))
    args = parse_model_benchmark_args(p, "benchmarks/moe_mla.py")
    report = run(args)
    write_report(report, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
