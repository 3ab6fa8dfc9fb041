"""A Hugging Face model (random init, bf16): forward + backward with per-token log-probs,
unshared batch vs. prefix tree, on every standard workload.

    python benchmarks/hf.py [--model qwen2|gpt-oss|gemma3] [--layers N] [--out FILE]   # CUDA
    python benchmarks/hf.py --autocast [--model ...]       # plain bf16 vs fp32 weights under autocast
    python benchmarks/hf.py --tiny [--autocast] [--model ...]                          # CPU smoke run

Models: ``qwen2`` (Qwen2.5-1.5B shapes, 4 layers); ``gpt-oss`` (GPT-OSS-20B shapes: 64/8
heads x 64, 32 experts top-4, alternating window-128 and full layers, per-head sinks; 4
layers); ``gemma3`` (Gemma-3-4B shapes: 8/4 heads x 256, window 1024, 5 local : 1 global; 6
layers).

Baseline: what verl's FSDP engine runs with ``use_remove_padding`` (its default path): the
same HF model on the unshared sequences packed back to back into one row, position ids
restarting per sequence, one causal varlen segment per sequence.
  * ``qwen2``: the stock model with FlashAttention-2's varlen contract, as transformers'
    ``flash_attention_2`` runs packed rows; without the flash-attn package the attention
    implementation is ``varlen_fa2`` (``verl_flash_fallback.py``): the same contract on torch's
    own varlen flash kernel (the math kernel on a CPU).
  * ``gpt-oss``, ``gemma3``: the packed rows through ``forward_tree`` with ``plan_unshared``
    (one segment per sequence, the same kernels with the model's windows and sinks, nothing
    shared): ``varlen_fa2`` has no windows or sinks, and their stock attention on one packed
    row would build a dense ``[N, N]`` mask.
Log-probs come from the same ``token_logprobs`` as the tree's.

Tree: ``forward_tree`` (attention backend ``auto``) on the prefix forest, same weights.

``--autocast``: what HF Trainer / accelerate ``bf16=True`` run, fp32 weights with the forward
under ``torch.autocast(bfloat16)`` (CPU autocast with ``--tiny``), next to the plain run (bf16
weights; fp32 with ``--tiny``) of the same weights: baseline and tree time and peak memory in
each, and the tree/baseline peak-memory ratio under autocast over the plain one (the tree
casts q/k/v to the autocast dtype as sdpa and FlashAttention-2 do, so it should stay near 1).

Ideal = FLOP-weighted speedup (``ps_mcore.flops.DecoderShape``: linear FLOPs scale with
tokens, attention FLOPs with (query, key) pairs, windowed layers counting windowed pairs, MoE
counting the active experts; LM head included).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import verl_flash_fallback  # noqa: E402
from common import DECODER_HEADERS, PairedSteps, decoder_row, environment, markdown_table, model_benchmark_parser, parse_model_benchmark_args, workload_rows, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.flops import DecoderShape  # noqa: E402
from ps_mcore.fsdp_bridge import disable_tree_attention, forward_tree  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402

QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
    head_dim=128, vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768,
    tie_word_embeddings=True,
)
GPT_OSS_20B = dict(
    hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    vocab_size=201088, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
)
GEMMA3_4B = dict(
    hidden_size=2560, intermediate_size=10240, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    vocab_size=262208, sliding_window=1024, query_pre_attn_scalar=256,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, tie_word_embeddings=True,
)
# --model -> (config class name, full dims, tiny extras, default layers)
MODELS = {
    "qwen2": ("Qwen2Config", QWEN25_15B, dict(max_position_embeddings=4096), 4),
    "gpt-oss": ("GptOssConfig", GPT_OSS_20B, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16), 4),
    "gemma3": ("Gemma3TextConfig", GEMMA3_4B, dict(sliding_window=32), 6),
}
STOCK_PACKED = ("qwen2",)  # models whose stock attention runs verl's packed row (module docstring)


def build_model(name: str, tiny: bool, layers: int | None, device: str, dtype: torch.dtype):
    """The model with the baseline's attention: FlashAttention-2 where flash-attn is installed,
    else ``varlen_fa2`` (the tree replaces it inside ``forward_tree`` and restores it after)."""
    import transformers
    from transformers.utils import is_flash_attn_2_available

    cls, dims, tiny_extra, default_layers = MODELS[name]
    dims = dict(TINY, **tiny_extra) if tiny else dims
    if is_flash_attn_2_available() and device == "cuda":
        attn = "flash_attention_2"
    else:
        verl_flash_fallback.register_attention()
        attn = verl_flash_fallback.ATTN_NAME
    config = getattr(transformers, cls)(num_hidden_layers=layers or default_layers, attn_implementation=attn, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def decoder_shape(config) -> DecoderShape:
    """FLOP shape: windowed layers count windowed pairs; MoE counts its active experts."""
    types = list(getattr(config, "layer_types", None) or [])
    windowed = sum(t == "sliding_attention" for t in types)
    return DecoderShape(
        layers=config.num_hidden_layers, hidden=config.hidden_size,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, ffn=config.intermediate_size * getattr(config, "num_experts_per_tok", 1),
        vocab=config.vocab_size, window=config.sliding_window if windowed else None,
        window_layers=windowed or None,
    )


class Steps(PairedSteps):
    """The baseline and tree fwd+bwd steps of one workload (weights: one per sample, like
    advantages); ``autocast``: the dtype both forwards run under ``torch.autocast`` (the
    backward outside it, as HF Trainer runs it), None for none."""

    def __init__(self, model, sequences, device, stock_packed: bool, autocast: torch.dtype | None = None):
        self.model = model
        self.models = (model,)
        self.stock_packed = stock_packed
        self.device_type = torch.device(device).type
        self.autocast = autocast
        self.plan = plan_prefix_tree(sequences).to(device)  # planner defaults
        self.flat_plan = plan_unshared(sequences).to(device)  # rows = the sequences back to back
        lengths = [len(s) for s in sequences]
        self.base_pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        gen = torch.Generator().manual_seed(1)
        weights = torch.empty(len(sequences)).uniform_(-1, 1, generator=gen)
        self.token_weights = torch.repeat_interleave(weights, torch.tensor(lengths)).to(device)

    def _precision(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast)

    def base_logprobs(self):
        if not self.stock_packed:
            return self.tree_logprobs(self.flat_plan)
        disable_tree_attention(self.model)  # the stock model, as verl runs it
        with self._precision():
            logits = self.model(input_ids=self.flat_plan.input_ids[None], position_ids=self.base_pos,
                                use_cache=False).logits[0]
            return token_logprobs(logits, self.flat_plan)[0]

    def tree_logprobs(self, plan=None):
        plan = self.plan if plan is None else plan
        with self._precision():
            return forward_tree(self.model, plan, return_logits=False, compute_logprobs=True).logprobs


def precision_row(name: str, m, steps) -> list:
    """workload, N, T, base ms, tree ms, base MiB, tree MiB, mem ratio, max |dlogp|."""
    return [name, m.stats["N"], m.stats["T"], m.base_ms, m.tree_ms, m.base_mib, m.tree_mib,
            m.tree_mib / m.base_mib, steps.max_logprob_diff()]


def autocast_table(args, model, shape, device, plain: str, stock_packed: bool, scale: float) -> str:
    """Both precisions of the same weights per workload: ``plain`` (the model as built), then
    fp32 weights under ``torch.autocast(bfloat16)``; the tree/baseline peak-memory ratio of
    each and the autocast one over the plain one."""
    rows = {}
    for precision, autocast in ((plain, None), ("amp", torch.bfloat16)):
        if autocast is not None:
            model.float()  # the same weights, now fp32 under autocast
        rows[precision] = workload_rows(
            args, shape, lambda seqs, a=autocast: Steps(model, seqs, device, stock_packed, a), precision_row, scale)
    cols = ["base ms", "tree ms", "base MiB", "tree MiB", "mem ratio"]
    headers = (["workload", "N", "T"] + [f"{plain} {c}" for c in cols] + [f"amp {c}" for c in cols]
               + [f"amp/{plain} mem ratio", "amp max |dlogp|"])
    table = [p[:8] + a[3:8] + [a[7] / p[7], a[8]] for p, a in zip(rows[plain], rows["amp"])]
    return markdown_table(headers, table)


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    scale = 1 / 32 if args.tiny else 1.0
    model = build_model(args.model, args.tiny, args.layers, device, dtype)
    shape = decoder_shape(model.config)
    stock_packed = args.model in STOCK_PACKED
    plain = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    c = model.config
    backend = resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    base = (f"the stock model, varlen attention per sequence ({c._attn_implementation})" if stock_packed
            else "forward_tree on the unshared plan (one segment per sequence)")
    window = f", window {shape.window} on {shape.layer_split()[1]} layers" if shape.window else ""
    title = (
        f"HF {type(model).__name__} ({'tiny' if args.tiny else args.model} shapes: hidden {c.hidden_size}, "
        f"{c.num_attention_heads}/{c.num_key_value_heads} heads x {c.head_dim}, vocab {c.vocab_size}, "
        f"{c.num_hidden_layers} layers{window}, random init, {plain}), fwd+bwd with "
        "token log-probs; baseline = the unshared sequences packed into one row (verl's remove-padding "
        f"layout), {base}; tree = forward_tree (auto backend -> {backend}, kernel per plan); "
    )
    if args.autocast:
        title += (
            f"{plain} = the model in {plain}, amp = the same weights in fp32 with the forward under "
            f"torch.autocast({device}, bfloat16); mem ratio = tree MiB / base MiB, MiB = peak allocated "
            f"above the model; amp/{plain} mem ratio: the autocast ratio over the plain one"
        )
        table = autocast_table(args, model, shape, device, plain, stock_packed, scale)
    else:
        title += ("attn ratio = the full-attention layers' (the ideal counts windowed pairs); MiB = peak "
                  "allocated above the model")
        table = markdown_table(DECODER_HEADERS, workload_rows(
            args, shape, lambda seqs: Steps(model, seqs, device, stock_packed), decoder_row, scale))
    return f"{title}\n\n{environment()}\n\n{table}\n"


def main() -> None:
    parser = model_benchmark_parser(__doc__)
    parser.set_defaults(layers=None)  # the model's own default (MODELS)
    parser.add_argument("--model", choices=list(MODELS), default="qwen2")
    parser.add_argument("--autocast", action="store_true",
                        help="also run fp32 weights under torch.autocast(bfloat16) and compare peak-memory ratios")
    args = parse_model_benchmark_args(parser, "benchmarks/hf.py")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
