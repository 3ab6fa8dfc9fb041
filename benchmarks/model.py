"""A megatron-core GPTModel block (random init, bf16): forward + backward with the LM head and
per-token log-probs, unshared THD batch vs. prefix tree, every standard workload.

    python benchmarks/model.py [--layers 4] [--out FILE]     # CUDA (NCCL world 1)
    python benchmarks/model.py --tiny                          # CPU smoke run (gloo), tiny dims
    torchrun --standalone --nproc_per_node 2 benchmarks/model.py --tp 2   # or --cp 2, --tp 2 --cp 2
    torchrun --standalone --nproc_per_node 2 benchmarks/model.py --tiny --cp 2   # CPU (gloo)
    python benchmarks/model.py --spec te                       # CUDA + transformer-engine
    python benchmarks/model.py --spec te --arch gpt-oss-20b gemma3-4b --minibatch-budget 32768
    python benchmarks/model.py --spec te --fp8 delayed         # ... with TE's FP8 linears (recipe:
                                                               # delayed, tensorwise, blockwise, mxfp8)
    python benchmarks/model.py --builder bridge                # CUDA + TE + Megatron-Bridge

``--arch`` (one table, a row per family and workload; :data:`ARCHS`): ``qwen2.5-1.5b`` (the
default: Qwen2.5-1.5B layer shapes, 4 layers), ``gpt-oss-20b`` (GPT-OSS-20B layer shapes,
Megatron-Bridge's GPT-OSS settings: a sliding window of 128 on every other layer, learnable
sinks, MoE 32 experts top-4 with router and expert biases, 4 layers) and ``gemma3-4b`` (Gemma
3 4B layer shapes, 5 local layers with a window of 1024 : 1 global, 6 layers). The windows and
sinks are megatron-core's own options (``window_size``, ``window_attn_skip_freq``,
``softmax_type``); the ideal counts a windowed layer's (query, key) pairs inside its window.
``--minibatch-budget TOKENS`` adds a whole GRPO mini-batch (8 prompts of 2048 tokens x 8
responses of ~1024: ``grpo-minibatch``) packed into micro-batches under the budget as
training runs it: the baseline its unshared samples first-fit by tokens, the tree its GRPO
groups first-fit by their deduplicated tokens, one step = every micro-batch queued.

``--fp8 RECIPE`` (with ``--spec te``) runs both models under TE's FP8 recipe (``fp8="hybrid"``):
the stock model on verl's FP8 THD layout (each sequence padded to 16 rows, the total to 128:
``ps_mcore.layer_specs.fp8.fp8_thd_layout``), the tree's packed rows padded to 128
(``tree_row_multiple``), tree attention in bf16.

``--spec te`` (TP=CP=1): the baseline is what users run today, the STOCK TE model
(``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``: TE fused attention with
TE's window and sinks, fused RoPE, TE grouped experts) on the unshared THD batch; the tree
model is ``to_tree_spec`` of the same spec with the stock model's weights (strict load), RoPE
fusion on in both. Where stock TE cannot run an architecture on THD batches here (TE raises,
e.g. no attention backend for learnable sinks on THD with this cuDNN), the table says so and
that architecture's baseline is the tree model on the unshared batch as a plan without sharing
(column ``baseline``). Table: workload, ideal, base ms, tree ms, speedup, meas/ideal, peak
memory.

``--builder bridge`` (TP=CP=1, the default architecture): the models come from Megatron-Bridge
as verl 0.9.1's Megatron engine builds them: a Qwen2 Hugging Face checkpoint with Qwen2.5-1.5B
shapes (random weights, bf16, written to a temporary folder), ``AutoBridge.from_hf_pretrained``,
the provider's own TE spec and defaults (for Qwen2: ``apply_rope_fusion`` off, so the stock model
runs Megatron's unfused THD RoPE, as verl 0.9.1 leaves it; ``--fusions`` turns it on in both);
the stock model is the provider's, the tree model the provider with ``tree_provider_spec``;
Bridge loads the checkpoint into both (every parameter checked). Same table as ``--spec te``.

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
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import DECODER_HEADERS, PairedSteps, decoder_row, environment, markdown_table, measure, model_benchmark_parser, parse_model_benchmark_args, workload_rows, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.flops import DecoderShape, MoEShape  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

QWEN25_15B = dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512)


@dataclass(frozen=True)
class Arch:
    """A model family's block (one row of :data:`ARCHS`).

    dims / tiny: the :class:`~ps_mcore.flops.DecoderShape` fields (MoE: :class:`MoEShape`'s,
    with ``experts``) at full and ``--tiny`` scale; options: ``tiny -> `` the family's
    ``TransformerConfig`` options beyond the common ones (its windows, sinks, activation,
    MoE routing); layers: the default block depth; rotary_base: the RoPE base."""

    dims: dict
    tiny: dict
    options: Callable[[bool], dict]
    layers: int = 4
    rotary_base: float = 1_000_000


def _qwen_options(tiny: bool) -> dict:
    import torch.nn.functional as F

    return dict(add_qkv_bias=True, activation_func=F.silu)


def _gpt_oss_options(tiny: bool) -> dict:
    """Megatron-Bridge's GPT-OSS settings: windows of 128 on every other layer (the first
    windowed), learnable sinks, biases everywhere (router included), clamped quick-GELU GLU,
    MoE without balancing loss; RoPE for YaRN (same FLOPs)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    if tiny:  # its jit_fuser would compile per shape on the CPU
        quick_gelu = getattr(quick_gelu, "_torchdynamo_orig_callable", quick_gelu)
    return dict(add_bias_linear=True, activation_func=quick_gelu, activation_func_clamp_value=7.0,
                glu_linear_offset=1.0, window_size=(3 if tiny else 127, 0), window_attn_skip_freq=2,
                softmax_type="learnable", moe_router_load_balancing_type="none",
                moe_router_pre_softmax=False, moe_token_dispatcher_type="alltoall",
                bias_dropout_fusion=False)  # TE's grouped experts with biases refuse that fusion


def _gemma3_options(tiny: bool) -> dict:
    """Gemma 3's attention pattern: 5 local layers (window 1024) : 1 global, GeGLU, qk-norm."""
    import torch.nn.functional as F

    return dict(activation_func=F.gelu, qk_layernorm=True, window_size=(31 if tiny else 1023, 0),
                window_attn_skip_freq=6)


ARCHS = {
    "qwen2.5-1.5b": Arch(QWEN25_15B, TINY, _qwen_options),
    "gpt-oss-20b": Arch(
        dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn=2880, vocab=201088, experts=32, topk=4,
             expert_ffn=2880),
        dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=32, vocab=512, experts=4, topk=2, expert_ffn=32),
        _gpt_oss_options, layers=4, rotary_base=150_000),
    "gemma3-4b": Arch(
        dict(hidden=2560, heads=8, kv_heads=4, head_dim=256, ffn=10240, vocab=262144),
        dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=512),
        _gemma3_options, layers=6),
}
DEFAULT_ARCH = "qwen2.5-1.5b"


def arch_shape(name: str, layers: int | None = None, tiny: bool = False) -> DecoderShape:
    """The FLOP shape of ``layers`` (default: the family's) layers of ``ARCHS[name]``; its
    windowed layers are the ones megatron-core windows (``layer_window``)."""
    from types import SimpleNamespace

    from ps_mcore.layer_specs.modules.core_attention import layer_window

    arch = ARCHS[name]
    dims, options = (arch.tiny if tiny else arch.dims), arch.options(tiny)
    layers = layers or arch.layers
    config = SimpleNamespace(window_size=options.get("window_size"),
                             window_attn_skip_freq=options.get("window_attn_skip_freq"))
    windows = [w for w in (layer_window(config, n) for n in range(1, layers + 1)) if w is not None]
    cls = MoEShape if "experts" in dims else DecoderShape
    return cls(layers=layers, **dims, window=windows[0] if windows else None,
               window_layers=len(windows) if windows else None)


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
    spec: str = "local", backend: str = "auto", arch: str = DEFAULT_ARCH, tiny: bool = False,
    fp8: str | None = None,
):
    """The tree model (``spec="local"``); for ``spec="te"`` the pair (stock TE model, tree
    model of the same spec with the stock weights). ``arch``: the family's config options
    (:data:`ARCHS`; ``tiny`` picks their ``--tiny`` scale, e.g. its window); ``shape`` gives
    the dimensions (an :class:`MoEShape` builds MoE layers); ``fp8``: a TE FP8 recipe for both.
    Both come from megatron-core's
    ``get_gpt_decoder_block_spec`` (TE or local layers); the tree model is its ``to_tree_spec``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ps_mcore.layer_specs import to_tree_spec

    moe = {}
    if isinstance(shape, MoEShape):
        moe = dict(num_moe_experts=shape.experts, moe_router_topk=shape.topk,
                   moe_ffn_hidden_size=shape.expert_ffn, moe_grouped_gemm=spec == "te")
    options = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_cpu_initialization=device == "cpu",
        apply_rope_fusion=spec == "te",  # TE's fused THD RoPE takes the per-token tree table
        bias_activation_fusion=fusions, bias_dropout_fusion=fusions, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, context_parallel_size=cp, **moe,
        **(dict(fp8="hybrid", fp8_recipe=fp8) if fp8 else {}),
    )
    config = TransformerConfig(**{**options, **ARCHS[arch].options(tiny)})
    config.tree_attention_backend = backend  # read by TreeCoreAttention (the stock model ignores it)

    def gpt(layer_spec):
        torch.manual_seed(0)
        model = GPTModel(
            config, layer_spec, vocab_size=shape.vocab, max_sequence_length=1 << 15,
            position_embedding_type="rope", rotary_base=ARCHS[arch].rotary_base,
            share_embeddings_and_output_weights=False,
        )
        return model.to(device).train()

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=spec == "te", normalization="RMSNorm")
    if spec == "local":
        return gpt(to_tree_spec(block))
    stock, tree = gpt(block), gpt(to_tree_spec(block))
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


class _Plans:
    """The tree plans of a mini-batch's micro-batches as one plan for :func:`common.measure`:
    ``stats`` sums tokens and (query, key) pairs."""

    ADDITIVE = ("N", "T", "attn_pairs_unshared", "attn_pairs_tree", "attn_pairs_unshared_window",
                "attn_pairs_tree_window")

    def __init__(self, plans: list):
        self.plans = plans

    def stats(self, window: int | None = None) -> dict:
        parts = [p.stats(window=window) for p in self.plans]
        out = {key: sum(s[key] for s in parts) for key in self.ADDITIVE if key in parts[0]}
        out.update(dedup=out["N"] / out["T"], attn_flop_ratio=out["attn_pairs_unshared"] / out["attn_pairs_tree"])
        if window is not None:
            out["window"] = window
        return out


class MiniBatchSteps:
    """One whole mini-batch under a micro-batch token budget, its micro-batches queued with
    gradient accumulation (one step = every micro-batch's forward + backward).

    Baseline: the unshared samples first-fit by tokens into micro-batches (verl's dynamic
    batching), each an unshared batch. Tree: whole sharing groups (``group_ids``) first-fit by
    their deduplicated tokens, each micro-batch one prefix forest. ``make_steps(sequences)``
    builds a micro-batch's :class:`Steps`; the baseline runs their ``base_logprobs``, the tree
    their ``tree_logprobs``."""

    def __init__(self, workload, budget: int, make_steps):
        from ps_mcore.analyze.budget import first_fit

        seqs = workload.sequences
        self.lengths = [len(s) for s in seqs]
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(workload.group_ids):
            groups.setdefault(g, []).append(i)
        members = list(groups.values())
        group_rows = [plan_prefix_tree([seqs[i] for i in m]).num_tokens for m in members]
        tree_bins = [sorted(i for g in b for i in members[g]) for b in first_fit(group_rows, budget)]

        def parts(bins):
            return [(idx, make_steps([seqs[i] for i in idx])) for idx in bins]

        self.base_parts = parts(first_fit(self.lengths, budget))
        self.tree_parts = parts(tree_bins)
        self.plan = _Plans([steps.plan for _, steps in self.tree_parts])
        self.models = self.tree_parts[0][1].models  # every micro-batch's Steps runs the same models

    def _step(self, parts, logprobs: str) -> None:
        for model in self.models:
            model.zero_grad(set_to_none=True)
        for _, steps in parts:
            (getattr(steps, logprobs)() * steps.token_weights).sum().backward()

    def base_step(self) -> None:
        self._step(self.base_parts, "base_logprobs")

    def tree_step(self) -> None:
        self._step(self.tree_parts, "tree_logprobs")

    def _by_sample(self, parts, logprobs: str) -> torch.Tensor:
        pieces = {}
        for idx, steps in parts:
            lp = getattr(steps, logprobs)()
            pieces.update(zip(idx, torch.split(lp, [self.lengths[i] for i in idx])))
        return torch.cat([pieces[i] for i in range(len(self.lengths))])

    @torch.no_grad()
    def max_logprob_diff(self) -> float:
        return float((self._by_sample(self.tree_parts, "tree_logprobs")
                      - self._by_sample(self.base_parts, "base_logprobs")).abs().max())


def minibatch_rows(args, shape, make_steps, row, scale: float = 1.0) -> list[list]:
    """The ``--minibatch-budget`` row: a whole GRPO mini-batch (``grpo-minibatch``) under the
    budget (x ``scale``), baseline and tree each packed into micro-batches."""
    if not args.minibatch_budget:
        return []
    from ps_mcore.workloads import make_workload

    budget = max(1, int(args.minibatch_budget * scale))
    w = make_workload("grpo-minibatch", seed=args.seed, scale=scale, vocab=shape.vocab)
    steps = MiniBatchSteps(w, budget, make_steps)
    name = f"grpo-minibatch @{budget} ({len(steps.base_parts)} vs {len(steps.tree_parts)} mb)"
    if dist.get_rank() == 0:
        print(f"[+] {name}", flush=True)
    measured = measure(steps, shape, args.warmup, args.iters, not args.synced)
    result = row(name, measured, steps)
    del steps
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [result]


def _dims(shape: DecoderShape) -> str:
    """The model dimensions, for the table titles."""
    moe = (f", {shape.experts} experts top-{shape.topk} x ffn {shape.expert_ffn}"
           if isinstance(shape, MoEShape) else f", ffn {shape.ffn}")
    window = ("" if shape.window is None else
              f", window {shape.window} on {shape.layer_split()[1]} of the layers")
    return (f"hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}"
            f"{moe}, vocab {shape.vocab}, {shape.layers} layers{window}")


def _title(model: str, baseline: str, tree: str, device: str, dtype: torch.dtype, idle: str, backend: str) -> str:
    """The table title: ``megatron-core GPTModel{model}``, what the baseline and tree runs are."""
    if backend == "auto":  # the kernel choice may still pick cuDNN per plan where TE is present
        backend = f"auto -> {resolve_backend('auto', torch.empty(1, device=device, dtype=dtype))} (kernel per plan)"
    return (f"megatron-core GPTModel{model}, fwd+bwd with LM head and token log-probs; baseline = "
            f"{baseline}; tree = {tree}; tree attention backend {backend}; MiB = peak "
            f"allocated above the idle {idle}")


def _shapes(args) -> str:
    return "; ".join(f"{arch}: {_dims(arch_shape(arch, args.layers, args.tiny))}" for arch in args.arch)


def _local_rows(args, arch: str, device: str, dtype: torch.dtype, scale: float) -> list[list]:
    """One architecture's rows with the local spec (one model runs both paths)."""
    shape = arch_shape(arch, args.layers, args.tiny)
    model = build_model(shape, device, dtype, args.fusions, args.tp, args.cp, backend=args.backend,
                        arch=arch, tiny=args.tiny)

    def make(seqs):
        return Steps(model, seqs, device)

    rows = workload_rows(args, shape, make, decoder_row, scale, verbose=dist.get_rank() == 0)
    rows += minibatch_rows(args, shape, make, decoder_row, scale)
    return [[arch] + r for r in rows]


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    scale = 1 / 32 if args.tiny else 1.0
    init_parallel(device, args.tp, args.cp)
    if args.tiny and any("experts" in ARCHS[a].tiny for a in args.arch):
        # the CPU smoke run's MoE: megatron's local experts need the test-only CPU shims
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from megatron_shims import allow_local_expert_bias_backward, enable_cpu_moe

        enable_cpu_moe(), allow_local_expert_bias_backward()
    if args.builder == "bridge":
        return run_bridge(args, device, dtype)
    if args.spec == "te":
        return run_te(args, device, dtype)
    rows = [r for arch in args.arch for r in _local_rows(args, arch, device, dtype, scale)]
    title = _title(
        f" ({'tiny ' if args.tiny else ''}shapes: {_shapes(args)}; tree local spec, random init, "
        f"TP={args.tp}, CP={args.cp}, {str(dtype).split('.')[-1]})",
        "the same model on the unshared batch as a plan without sharing (one causal varlen segment "
        "per sequence, same kernels and RoPE path as the tree; the local spec has no stock "
        "packed-sequence path: --spec te compares with stock TE)", "TreePackedSeqParams of the prefix "
        "forest", device, dtype, "model", args.backend)
    return f"{title}\n\n{environment()}\n\n{markdown_table(['model'] + DECODER_HEADERS, rows)}\n"


def stock_te_refusal(stock, shape: DecoderShape, device: str) -> str | None:
    """Why the stock TE model cannot run a forward + backward on an unshared THD batch here
    (e.g. no TE attention backend takes learnable sinks on THD with this cuDNN), or None. Two
    sequences longer than the window, so a windowed layer really windows; each a multiple of 16
    and 128 in all, so a stock model under ``--fp8`` takes them as verl's FP8 THD layout would
    (a probe that fails on FP8 row counts would name the wrong reason and change the baseline)."""
    first = -(-max(64, 2 * (shape.window or 0) + 17) // 16) * 16
    lengths = [first, -(-(first + 48) // 128) * 128 - first]
    ids = torch.randint(0, shape.vocab, (sum(lengths),), device=device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    try:
        logits = stock(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                       packed_seq_params=thd_params(lengths, device))
        logits.float().sum().backward()
    except Exception as error:  # noqa: BLE001  (whatever TE raises: the table says it)
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    finally:
        stock.zero_grad(set_to_none=True)
    return None


def te_backends_selected(run: Callable[[], object]) -> tuple[object, list[str]]:
    """``run()``'s result and the attention backends Transformer Engine selected meanwhile, one
    per window size (read from TE's private ``get_attention_backend``; empty where this TE
    cannot be watched so)."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

        original = dpa_utils.get_attention_backend
    except (ImportError, AttributeError):
        return run(), []
    seen: dict[str, str] = {}

    def watch(params):
        result = original(params)
        try:
            flash, flash_version, fused, fused_backend, unfused = result[:5]
            name = (f"FlashAttention {flash_version}" if flash else f"FusedAttention ({fused_backend})" if fused
                    else "UnfusedDotProductAttention" if unfused else "none")
            seen[str(getattr(params, "window_size", "?"))] = name
        except (TypeError, ValueError):
            pass
        return result

    dpa_utils.get_attention_backend = watch
    try:
        return run(), [f"window {w}: {name}" for w, name in seen.items()]
    finally:
        dpa_utils.get_attention_backend = original


def _te_rows(args, arch: str, shape: DecoderShape, stock, tree, device: str) -> tuple[list[list], str]:
    """One architecture's rows of the TE table (stock model vs tree model, same weights) and the
    note on its baseline: TE's attention backends, or why stock TE cannot run it."""
    refusal, backends = te_backends_selected(lambda: stock_te_refusal(stock, shape, device))
    note = f"{arch}: stock TE attention backends: {'; '.join(backends) or 'not seen'}"
    unfused = [b for b in backends if b.endswith("UnfusedDotProductAttention")]
    if refusal is None and unfused:
        # TE's unfused attention materialises [S, S] scores per head: a baseline nobody trains
        # with, out of memory at these lengths, and it would inflate every speedup
        refusal = f"TE has no fused kernel for it here and falls back to its unfused attention ({'; '.join(unfused)})"
    base_model, baseline = stock, "TE stock"
    if refusal is not None:
        note = (f"{arch}: stock TE cannot run it on THD batches here ({refusal}); its baseline is the "
                "tree model on the unshared batch as a plan without sharing (same kernels)")
        base_model, baseline = None, "unshared plan"
        del stock
        torch.cuda.empty_cache()

    def make(seqs):
        return Steps(tree, seqs, device, base_model=base_model)

    def row(name, m, steps):
        return [name, m.stats["N"], m.stats["T"], m.stats["dedup"], m.ideal, m.base_ms, m.tree_ms, m.speedup,
                m.speedup / m.ideal, m.base_mib, m.tree_mib, m.tree_mib / m.base_mib, steps.max_logprob_diff()]

    arch_rows = workload_rows(args, shape, make, row) + minibatch_rows(args, shape, make, row)
    return [[arch, baseline] + r for r in arch_rows], note


def _built_te_rows(args, arch: str, device: str, dtype: torch.dtype) -> tuple[list[list], str]:
    shape = arch_shape(arch, args.layers)
    stock, tree = build_model(shape, device, dtype, args.fusions, spec="te", backend=args.backend, arch=arch,
                              fp8=args.fp8)
    return _te_rows(args, arch, shape, stock, tree, device)


def te_table(args, device: str, dtype: torch.dtype, rows: list[list], notes: list[str], model: str) -> str:
    """The ``--spec te`` / ``--builder bridge`` table: stock TE model on the unshared THD batch
    vs the tree model on the prefix tree, a row per architecture and workload."""
    headers = ["model", "baseline", "workload", "N", "T", "dedup", "ideal", "base ms", "tree ms", "speedup",
               "meas/ideal", "base MiB", "tree MiB", "mem ratio", "max |dlogp|"]
    title = _title(
        model, "STOCK TE spec (TE fused attention with TE's window and sinks, fused RoPE) on the unshared "
        "THD batch (TE stock)" + (f" in verl's FP8 THD layout, FP8 {args.fp8} recipe (hybrid) in both, tree "
                                  "rows padded to 128" if args.fp8 else ""),
        "to_tree_spec(TE spec) on TreePackedSeqParams, fused RoPE on", device, dtype,
        "models", args.backend)
    title += ("; ideal counts the windowed layers' (query, key) pairs inside their window; "
              "grpo-minibatch: one whole mini-batch, micro-batches queued (baseline vs tree micro-batch counts)")
    notes_text = "".join(f"\n\n* {n}" for n in notes)
    return f"{title}\n\n{environment()}{notes_text}\n\n{markdown_table(headers, rows)}\n"


def run_te(args, device: str, dtype: torch.dtype) -> str:
    """Stock TE model on the unshared THD batch vs. its tree spec on the prefix tree, per
    architecture; where stock TE cannot run the architecture's attention on THD batches, the
    baseline is the tree model on the unshared batch as a plan without sharing (same kernels)."""
    rows, notes = [], []
    for arch in args.arch:
        arch_rows, note = _built_te_rows(args, arch, device, dtype)
        rows, notes = rows + arch_rows, notes + [note]
        torch.cuda.empty_cache()  # the models are gone with _built_te_rows' frame
    return te_table(args, device, dtype, rows, notes,
                    f", transformer-engine spec (shapes: {_shapes(args)}; random init, bf16)")


def run_bridge(args, device: str, dtype: torch.dtype) -> str:
    """The provider's stock model vs its tree model, both built and loaded by Megatron-Bridge."""
    from bridge_models import bridge_model_pair

    shape = arch_shape(DEFAULT_ARCH, args.layers)
    stock, tree, versions = bridge_model_pair(shape, shape.layers, args.backend, rope_fusion=args.fusions)
    rows, note = _te_rows(args, DEFAULT_ARCH, shape, stock, tree, device)
    return te_table(args, device, dtype, rows, [note],
                    f" built by Megatron-Bridge ({versions}; Qwen2 HF checkpoint, Qwen2.5-1.5B shapes: "
                    f"{_dims(shape)}, random weights, bf16, the provider's TE spec and defaults"
                    f"{', apply_rope_fusion on in both (--fusions)' if args.fusions else ''})")


def main() -> None:
    p = model_benchmark_parser(__doc__)
    p.set_defaults(layers=None)  # each architecture's own block depth (ARCHS)
    p.add_argument("--arch", nargs="+", default=[DEFAULT_ARCH], choices=list(ARCHS),
                   help="model families, one table: qwen2.5-1.5b (dense), gpt-oss-20b (window-128 and "
                        "full layers alternating, sinks, MoE 32 experts top-4), gemma3-4b (5 local "
                        "window-1024 : 1 global)")
    p.add_argument("--minibatch-budget", type=int, default=0, metavar="TOKENS",
                   help="also time a whole GRPO mini-batch (8 prompts of 2048 x 8 responses of ~1024) "
                        "packed into micro-batches of at most TOKENS tokens (e.g. 32768)")
    p.add_argument("--fusions", action="store_true",
                   help="megatron's bias-activation / bias-dropout fusions (torch.compile'd); with --builder "
                        "bridge: the provider's apply_rope_fusion on in both models")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (run under torchrun)")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (run under torchrun)")
    p.add_argument("--backend", default="auto", help="tree attention backend of the tree model (config.tree_attention_backend)")
    p.add_argument("--spec", choices=("local", "te"), default="local",
                   help="te: stock TE model (baseline) vs to_tree_spec(TE spec); CUDA + TE, TP=CP=1")
    p.add_argument("--builder", choices=("direct", "bridge"), default="direct",
                   help="bridge: both models built by Megatron-Bridge from an HF checkpoint (its TE spec); "
                        "CUDA + TE + Megatron-Bridge, TP=CP=1, the default --arch")
    p.add_argument("--fp8", choices=("delayed", "tensorwise", "blockwise", "mxfp8"), default=None,
                   help="TE FP8 recipe for both models (with --spec te)")
    args = parse_model_benchmark_args(p, "benchmarks/model.py")
    if (args.spec == "te" or args.builder == "bridge") and (args.tiny or args.tp > 1 or args.cp > 1):
        sys.exit("--spec te / --builder bridge run on CUDA with transformer-engine, TP=CP=1 (no --tiny)")
    if args.builder == "bridge" and args.arch != [DEFAULT_ARCH]:
        sys.exit(f"--builder bridge builds the {DEFAULT_ARCH} Qwen2 checkpoint only")
    if args.spec == "local" and not args.tiny and "gpt-oss-20b" in args.arch:
        sys.exit("gpt-oss-20b runs with --spec te on the GPU: megatron-core's local experts cannot "
                 "backward through expert biases at TP=1 (an in-place add on an autograd view)")
    if args.fp8 and (args.spec != "te" or args.builder == "bridge"):
        sys.exit("--fp8 needs --spec te with --builder direct (the models' FP8 recipe is set where "
                 "this script builds them; the Megatron-Bridge provider's is not)")
    report = run(args)
    if dist.get_rank() == 0:
        write_report(report, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
