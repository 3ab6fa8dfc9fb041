"""A megatron-core GPTModel (Qwen2.5-1.5B shapes, random init, bf16): forward + backward with
the LM head and per-token log-probs, unshared THD batch vs. prefix tree, every standard workload.

    python benchmarks/model.py [--layers 4] [--out FILE]     # CUDA (NCCL world 1)
    python benchmarks/model.py --tiny                          # CPU smoke run (gloo), tiny dims
    torchrun --standalone --nproc_per_node 2 benchmarks/model.py --tp 2   # or --cp 2, --tp 2 --cp 2
    torchrun --standalone --nproc_per_node 2 benchmarks/model.py --tiny --cp 2   # CPU (gloo)
    python benchmarks/model.py --spec te                       # CUDA + transformer-engine
    python benchmarks/model.py --spec te --fp8 delayed         # ... with TE's FP8 linears (recipe:
                                                               # delayed, tensorwise, blockwise, mxfp8)
    python benchmarks/model.py --builder bridge                # CUDA + TE + Megatron-Bridge

``--spec te`` (TP=CP=1): the baseline is what users run today, the STOCK TE model
(``get_gpt_layer_with_transformer_engine_spec``: TE fused attention, fused RoPE) on the
unshared THD batch; the tree model is ``to_tree_spec`` of the same spec with the stock model's
weights (strict load), RoPE fusion on in both. Table: workload, ideal, TE stock ms, tree ms,
speedup, meas/ideal, peak memory. ``--fp8 RECIPE`` runs both models under TE's FP8 recipe
(``fp8="hybrid"``): the stock model on verl's FP8 THD layout (each sequence padded to 16 rows, the
total to 128: ``ps_mcore.layer_specs.fp8.fp8_thd_layout``), the tree's packed rows padded to 128
(``tree_row_multiple``), tree attention in bf16.

``--builder bridge`` (TP=CP=1): the models come from Megatron-Bridge as verl 0.9.1's Megatron
engine builds them: a Qwen2 Hugging Face checkpoint with Qwen2.5-1.5B shapes (random weights,
bf16, written to a temporary folder), ``AutoBridge.from_hf_pretrained``, the provider's own TE
spec (its defaults: fusions, fused RoPE); the stock model is the provider's, the tree model the
provider with ``tree_provider_spec``; Bridge loads the checkpoint into both (every parameter
checked). Same table as ``--spec te``.

The world is one model replica (world size = tp * cp); rank 0 prints the table (its times).
Default (local spec): one model (tree layer specs, local linear layers; no sequence
parallelism: the local spec's torch norms refuse it) runs both paths:
  * baseline: the unshared batch as a plan without sharing (``plan_unshared``: the sequences
    back to back, one causal varlen segment each, no gather), through the same
    ``TreePackedSeqParams`` path, kernels and RoPE as the tree, so the table shows what
    sharing alone changes (no-sharing reads 1.00x by construction). The local spec has no
    stock packed-sequence path to stand for: Megatron's local ``DotProductAttention`` refuses
    packed sequences, and its unfused THD RoPE reads the bounds back to the host (six syncs
    per layer), which made a standard-``PackedSeqParams`` baseline slower than the same rows
    through the tree path. The stock baseline users run is ``--spec te``'s. Under CP the
    unshared plan goes through the same CP path (K/V all-gather, local queries);
  * tree: ``TreePackedSeqParams.from_plan`` of the prefix forest (planner defaults), padded to
    2*cp*tp rows and cut into Megatron's CP chunks under CP.
Loss: sum over tokens of a per-sample weight x token log-probs (vocab-parallel under TP,
combined over CP with ``cp_token_logprobs``). Ideal = FLOP-weighted speedup
(``ps_mcore.flops.DecoderShape``: linear FLOPs scale with tokens, attention FLOPs with
(query, key) pairs; LM head included). MiB = rank 0's peak allocated above the idle model; the
memory target is tree <= baseline x T/N + 15%.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import DECODER_HEADERS, PairedSteps, decoder_row, environment, markdown_table, model_benchmark_parser, parse_model_benchmark_args, workload_rows, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.flops import DecoderShape  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

QWEN25_15B = dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512)


def init_parallel(device: str, tp: int = 1, cp: int = 1) -> None:
    """torch.distributed (NCCL on CUDA, gloo on CPU; torchrun's world or a world of 1) and
    Megatron parallel state with TP=tp, CP=cp (one model replica: world size = tp * cp)."""
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":  # megatron allocates on torch.cuda.current_device(): point it at the CPU
        torch.cuda.current_device = lambda: "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * cp:
        sys.exit(f"benchmarks/model.py runs one model replica: world size {world} != tp*cp = {tp * cp}")
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if world > 1:  # torchrun
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():  # e.g. an earlier test in this process
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:  # the CPU has no CUDA RNG to fork
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_model(
    shape: DecoderShape, device: str, dtype: torch.dtype, fusions: bool, tp: int = 1, cp: int = 1,
    spec: str = "local", backend: str = "auto", fp8: str | None = None,
):
    """The tree model (``spec="local"``); for ``spec="te"`` the pair (stock TE model, tree
    model of the same spec with the stock weights); ``fp8``: a TE FP8 recipe for both."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ps_mcore.layer_specs import get_gpt_layer_local_tree_spec

    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0, hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=device == "cpu",
        apply_rope_fusion=spec == "te",  # TE's fused THD RoPE takes the per-token tree table
        bias_activation_fusion=fusions, bias_dropout_fusion=fusions, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        **(dict(fp8="hybrid", fp8_recipe=fp8) if fp8 else {}),
    )
    config.tree_attention_backend = backend  # read by TreeCoreAttention (the stock model ignores it)

    def gpt(layer_spec):
        torch.manual_seed(0)
        model = GPTModel(
            config, layer_spec, vocab_size=shape.vocab, max_sequence_length=1 << 15,
            position_embedding_type="rope", rotary_base=1_000_000,
            share_embeddings_and_output_weights=False,
        )
        return model.to(device).train()

    if spec == "local":
        return gpt(get_gpt_layer_local_tree_spec(normalization="RMSNorm"))
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from ps_mcore.layer_specs import to_tree_spec

    te_spec = get_gpt_layer_with_transformer_engine_spec()
    stock, tree = gpt(te_spec), gpt(to_tree_spec(te_spec))
    tree.load_state_dict(stock.state_dict(), strict=True)  # TE checkpoint keys, both ways
    return stock, tree


def thd_params(lengths: list[int], device: str):
    """Standard PackedSeqParams of sequences packed back to back (what verl passes)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.cumsum(torch.tensor([0] + lengths), 0).to(device=device, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


class Steps(PairedSteps):
    """The baseline and tree fwd+bwd steps of one workload (one weight per sample).

    The baseline runs ``base_model`` (default: ``model``) on the unshared batch: as standard
    THD ``PackedSeqParams`` when ``stock_thd`` (default: when a separate stock model is given)
    and CP=1, else as a plan without sharing through the tree path."""

    def __init__(self, model, sequences, device, base_model=None, stock_thd: bool | None = None):
        from megatron.core import parallel_state as ps

        from ps_mcore.layer_specs import TreePackedSeqParams
        from ps_mcore.layer_specs.fp8 import fp8_thd_layout, tree_row_multiple

        self.model = model
        self.base_model = model if base_model is None else base_model  # --spec te: stock TE
        self.models = (model,) if base_model is None else (model, base_model)
        self.tp_group, self.cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        pad = tree_row_multiple(model.config, ps.get_tensor_model_parallel_world_size() if cp > 1 else 1, cp)

        def packed(plan):
            return TreePackedSeqParams.from_plan(plan, pad, cp_size=cp, cp_rank=cp_rank)

        self.plan = plan_prefix_tree(sequences).to(device)
        self.flat = plan_unshared(sequences).to(device)
        assert self.flat.is_trivial  # rows = the sequences back to back, as in thd_params
        lengths = [len(s) for s in sequences]
        self.tree_psp = packed(self.plan)
        if stock_thd is None:
            stock_thd = base_model is not None
        self.base_rows = None  # rows of the real tokens in the baseline layout (None: all rows)
        if stock_thd and cp == 1 and getattr(self.base_model.config, "fp8", None):  # verl's FP8 THD layout
            self.base_psp, self.base_rows = fp8_thd_layout(lengths, device=device)
            total = int(self.base_psp.cu_seqlens_q[-1])
            ids = self.flat.input_ids
            self.base_ids = ids.new_zeros(total).index_copy(0, self.base_rows, ids)
            self.base_pos = torch.zeros_like(self.base_ids)  # THD RoPE reads cu_seqlens, not these
        elif stock_thd and cp == 1:  # standard THD packing, Megatron's own THD RoPE
            self.base_psp = thd_params(lengths, device)
            self.base_ids = self.flat.input_ids
            self.base_pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
        else:  # the unshared plan through the same path as the tree (and under CP, the same CP path)
            self.base_psp = packed(self.flat)
            self.base_ids = self.base_psp.cp_shard(self.flat.input_ids)
            self.base_pos = self.base_psp.cp_shard(self.base_psp.position_ids)
        self.tree_ids = self.tree_psp.cp_shard(self.plan.input_ids)
        self.tree_pos = self.tree_psp.cp_shard(self.tree_psp.position_ids)
        gen = torch.Generator().manual_seed(1)
        weights = torch.empty(len(sequences)).uniform_(0.2, 2.0, generator=gen)
        self.token_weights = torch.repeat_interleave(weights, torch.tensor(lengths)).to(device)

    def _logprobs(self, plan, ids, pos, psp):
        from ps_mcore.layer_specs import TreePackedSeqParams, cp_token_logprobs

        model = self.model if isinstance(psp, TreePackedSeqParams) else self.base_model
        logits = model(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                            packed_seq_params=psp)[0]
        if isinstance(psp, TreePackedSeqParams):
            return cp_token_logprobs(logits, psp, tp_group=self.tp_group, cp_group=self.cp_group)[0]
        if self.base_rows is not None:
            logits = logits.index_select(0, self.base_rows)
        return token_logprobs(logits, plan, tp_group=self.tp_group)[0]

    def base_logprobs(self):
        return self._logprobs(self.flat, self.base_ids, self.base_pos, self.base_psp)

    def tree_logprobs(self):
        return self._logprobs(self.plan, self.tree_ids, self.tree_pos, self.tree_psp)


def _dims(shape: DecoderShape) -> str:
    """The model dimensions, for the table titles."""
    return (f"hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, "
            f"ffn {shape.ffn}, vocab {shape.vocab}, {shape.layers} layers")


def _title(model: str, baseline: str, tree: str, device: str, dtype: torch.dtype, idle: str, backend: str) -> str:
    """The table title: ``megatron-core GPTModel{model}``, what the baseline and tree runs are."""
    if backend == "auto":  # the kernel choice may still pick cuDNN per plan where TE is present
        backend = f"auto -> {resolve_backend('auto', torch.empty(1, device=device, dtype=dtype))} (kernel per plan)"
    return (f"megatron-core GPTModel{model}, fwd+bwd with LM head and token log-probs; baseline = "
            f"{baseline}; tree = {tree}; tree attention backend {backend}; MiB = peak "
            f"allocated above the idle {idle}")


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = DecoderShape(layers=args.layers, **(TINY if args.tiny else QWEN25_15B))
    scale = 1 / 32 if args.tiny else 1.0
    init_parallel(device, args.tp, args.cp)
    if args.builder == "bridge":
        return run_bridge(args, shape, device, dtype)
    if args.spec == "te":
        return run_te(args, shape, device, dtype)
    model = build_model(shape, device, dtype, args.fusions, args.tp, args.cp, backend=args.backend)
    rows = workload_rows(args, shape, lambda seqs: Steps(model, seqs, device), decoder_row, scale,
                         reset=lambda: model.zero_grad(set_to_none=True), verbose=dist.get_rank() == 0)
    title = _title(
        f" ({'tiny' if args.tiny else 'Qwen2.5-1.5B'} shapes: {_dims(shape)}, tree local spec, random "
        f"init, TP={args.tp}, CP={args.cp}"
        f", {str(dtype).split('.')[-1]})",
        "the same model on the unshared batch as a plan without sharing (one causal varlen segment "
        "per sequence, same kernels and RoPE path as the tree; the local spec has no stock "
        "packed-sequence path: --spec te compares with stock TE)", "TreePackedSeqParams of the prefix "
        "forest", device, dtype, "model", args.backend)
    return f"{title}\n\n{environment()}\n\n{markdown_table(DECODER_HEADERS, rows)}\n"


def run_te(args, shape: DecoderShape, device: str, dtype: torch.dtype) -> str:
    """Stock TE model on the unshared THD batch vs. its tree spec on the prefix tree."""
    stock, tree = build_model(shape, device, dtype, args.fusions, spec="te", backend=args.backend, fp8=args.fp8)
    fp8 = f", FP8 {args.fp8} recipe (hybrid) in both, tree rows padded to 128" if args.fp8 else ""
    return te_table(args, shape, device, dtype, stock, tree,
                    f", transformer-engine spec (Qwen2.5-1.5B shapes: {_dims(shape)}, random init, bf16{fp8})")


def run_bridge(args, shape: DecoderShape, device: str, dtype: torch.dtype) -> str:
    """The provider's stock model vs its tree model, both built and loaded by Megatron-Bridge."""
    from bridge_models import bridge_model_pair

    stock, tree, versions = bridge_model_pair(shape, args.layers, args.backend)
    return te_table(args, shape, device, dtype, stock, tree,
                    f" built by Megatron-Bridge ({versions}; Qwen2 HF checkpoint, Qwen2.5-1.5B shapes: "
                    f"{_dims(shape)}, random weights, bf16, the provider's TE spec and defaults)")


def te_table(args, shape: DecoderShape, device: str, dtype: torch.dtype, stock, tree, model: str) -> str:
    """The ``--spec te`` / ``--builder bridge`` table: stock TE model on the unshared THD batch
    vs the tree model on the prefix tree."""
    headers = ["workload", "N", "T", "ideal", "TE stock ms", "tree ms", "speedup", "meas/ideal",
               "TE stock MiB", "tree MiB", "mem ratio", "max |dlogp|"]

    def row(name, m, steps):
        return [name, m.stats["N"], m.stats["T"], m.ideal, m.base_ms, m.tree_ms, m.speedup,
                m.speedup / m.ideal, m.base_mib, m.tree_mib, m.tree_mib / m.base_mib,
                steps.max_logprob_diff()]

    rows = workload_rows(args, shape, lambda seqs: Steps(tree, seqs, device, base_model=stock), row)
    title = _title(
        model,
        "STOCK TE spec (TE fused attention, fused RoPE) on the unshared THD batch"
        + (" in verl's FP8 THD layout" if args.fp8 else ""),
        "to_tree_spec(TE spec) on TreePackedSeqParams, fused RoPE on", device, dtype, "models", args.backend)
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n"


def main() -> None:
    p = model_benchmark_parser(__doc__)
    p.add_argument("--fusions", action="store_true",
                   help="megatron's bias-activation / bias-dropout fusions (torch.compile'd)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (run under torchrun)")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (run under torchrun)")
    p.add_argument("--backend", default="auto", help="tree attention backend of the tree model (config.tree_attention_backend)")
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="te: stock TE model (baseline) vs to_tree_spec(TE spec); CUDA + TE, TP=CP=1")
    p.add_argument("--builder", choices=("direct", "bridge"), default="direct",
                   help="bridge: both models built by Megatron-Bridge from an HF checkpoint (its TE spec); "
                        "CUDA + TE + Megatron-Bridge, TP=CP=1")
    p.add_argument("--fp8", choices=("delayed", "tensorwise", "blockwise", "mxfp8"), default=None,
                   help="TE FP8 recipe for both models (with --spec te)")
    args = parse_model_benchmark_args(p, "benchmarks/model.py")
    if (args.spec == "te" or args.builder == "bridge") and (args.tiny or args.tp > 1 or args.cp > 1):
        sys.exit("--spec te / --builder bridge run on CUDA with transformer-engine, TP=CP=1 (no --tiny)")
    if args.fp8 and (args.spec != "te" or args.builder == "bridge"):
        sys.exit("--fp8 needs --spec te with --builder direct (the models' FP8 recipe is set where "
                 "this script builds them; the Megatron-Bridge provider's is not)")
    report = run(args)
    if dist.get_rank() == 0:
        write_report(report, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
