"""A Hugging Face model (random init, bf16): forward + backward with per-token log-probs,
unshared batch vs. prefix tree, on every standard workload.

    python benchmarks/hf.py [--model qwen2|gpt-oss|gemma3] [--layers N] [--out FILE]   # CUDA
    python benchmarks/hf.py --tiny [--model ...]                                       # CPU smoke run

Models: ``qwen2`` (Qwen2.5-1.5B shapes, 4 layers); ``gpt-oss`` (GPT-OSS-20B shapes: 64/8
heads x 64, 32 experts top-4, alternating window-128 and full layers, per-head sinks; 4
layers); ``gemma3`` (Gemma-3-4B shapes: 8/4 heads x 256, window 1024, 5 local : 1 global; 6
layers). Baselines (stock transformers; no flash-attn on the box):
  * padded:  one right-padded [B, Lmax] batch with its padding mask (SDPA then runs its
    masked kernel; pad rows cost linear and LM-head FLOPs too);
  * per-seq: one sequence per forward (SDPA; causal flash path where no window masks),
    gradients accumulated over the sequences;
  * packed:  the unshared batch through ``forward_tree`` with ``plan_unshared`` (the same
    varlen kernels and variant, nothing shared). GPT-OSS runs only this one: its stock
    attention has no SDPA path (sinks), and eager materialises every [H, L, L] score matrix.
The fastest per workload is the baseline. All compute log-probs with the same
``token_logprobs`` helper as the tree (no-sharing plan). Tree: ``forward_tree`` (backend
auto). Ideal = FLOP-weighted speedup: (N * linear + unshared attention pairs * attention) /
(T * linear + tree pairs * attention), LM head included, windowed layers counting windowed
pairs, MoE counting the active experts.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, model_benchmark_parser, parse_model_benchmark_args, peak_mib, time_ms, write_report  # noqa: E402

from ps_mcore import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.attention import resolve_backend  # noqa: E402
from ps_mcore.flops import DecoderShape  # noqa: E402
from ps_mcore.fsdp_bridge import disable_tree_attention, forward_tree  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402
from ps_mcore.workloads import make_workload  # noqa: E402

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
# --model -> (config class name, full dims, tiny extras, stock attention, default layers)
MODELS = {
    "qwen2": ("Qwen2Config", QWEN25_15B, dict(max_position_embeddings=4096), "sdpa", 4),
    "gpt-oss": ("GptOssConfig", GPT_OSS_20B, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
                "eager", 4),
    "gemma3": ("Gemma3TextConfig", GEMMA3_4B, dict(sliding_window=32), "sdpa", 6),
}


def build_model(name: str, tiny: bool, layers: int | None, device: str, dtype: torch.dtype):
    import transformers

    cls, dims, tiny_extra, attn, default_layers = MODELS[name]
    dims = dict(TINY, **tiny_extra) if tiny else dims
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


class Steps:
    """The three fwd+bwd steps of one workload (weights: one per sample, like advantages)."""

    def __init__(self, model, sequences, device):
        self.model = model
        self.device = device
        self.seqs = [torch.as_tensor(s, device=device) for s in sequences]
        self.plan = plan_prefix_tree(sequences).to(device)  # planner defaults
        self.flat_plan = plan_unshared(sequences).to(device)  # also the "packed" baseline's plan
        self.seq_plans = [plan_prefix_tree([s]).to(device) for s in sequences]
        gen = torch.Generator().manual_seed(1)
        self.weights = torch.empty(len(sequences)).uniform_(-1, 1, generator=gen).tolist()
        lens = torch.tensor([len(s) for s in sequences])
        self.token_weights = torch.repeat_interleave(torch.tensor(self.weights), lens).to(device)
        width = int(lens.max())
        self.padded_ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
        self.pad_mask = torch.zeros_like(self.padded_ids)
        for i, s in enumerate(self.seqs):
            self.padded_ids[i, : len(s)] = s
            self.pad_mask[i, : len(s)] = 1
        # rows of the flattened padded logits that hold real tokens, in batch order
        self.valid_rows = torch.nonzero(self.pad_mask.reshape(-1))[:, 0]

    def padded_logprobs(self):
        logits = self.model(input_ids=self.padded_ids, attention_mask=self.pad_mask, use_cache=False).logits
        rows = logits.reshape(-1, logits.size(-1)).index_select(0, self.valid_rows)
        return token_logprobs(rows, self.flat_plan)[0]

    def padded_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        (self.padded_logprobs() * self.token_weights).sum().backward()

    def seq_logprobs(self, i: int):
        logits = self.model(input_ids=self.seqs[i][None], use_cache=False).logits[0]
        return token_logprobs(logits, self.seq_plans[i])[0]

    def per_seq_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for i, w in enumerate(self.weights):
            (self.seq_logprobs(i).sum() * w).backward()

    def tree_logprobs(self, plan=None):
        plan = self.plan if plan is None else plan
        return forward_tree(self.model, plan, return_logits=False, compute_logprobs=True).logprobs

    def tree_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        (self.tree_logprobs() * self.token_weights).sum().backward()

    def packed_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        (self.tree_logprobs(self.flat_plan) * self.token_weights).sum().backward()

    @torch.no_grad()
    def max_logprob_diff(self) -> float:
        """Tree vs. per-sequence log-probs (a sanity check of the run, not a test)."""
        ref = torch.cat([self.seq_logprobs(i) for i in range(len(self.seqs))])
        return float((self.tree_logprobs() - ref).abs().max())


def measure(steps: Steps, warmup: int, iters: int, queued: bool = False, stock: bool = True) -> dict:
    model = steps.model
    out = {}
    disable_tree_attention(model)  # baselines run the untouched stock model
    stock_steps = (("padded", steps.padded_step), ("per-seq", steps.per_seq_step)) if stock else ()
    for name, fn in stock_steps:
        out[name] = (time_ms(fn, warmup, iters, queued), peak_mib(fn))
    for name, fn in (("packed", steps.packed_step), ("tree", steps.tree_step)):
        out[name] = (time_ms(fn, warmup, iters, queued), peak_mib(fn))
    out["diff"] = steps.max_logprob_diff()
    model.zero_grad(set_to_none=True)
    return out


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    scale = 1 / 32 if args.tiny else 1.0
    model = build_model(args.model, args.tiny, args.layers, device, dtype)
    shape = decoder_shape(model.config)
    stock = args.model != "gpt-oss"  # module docstring: GPT-OSS has no SDPA path
    headers = ["workload", "N", "T", "dedup", "attn ratio", "ideal", "baseline", "padded ms",
               "per-seq ms", "packed ms", "base ms", "tree ms", "speedup", "meas/ideal", "base MiB",
               "tree MiB", "max |dlogp|"]
    rows = []
    for i, name in enumerate(args.workloads):
        print(f"[{i + 1}/{len(args.workloads)}] {name}", flush=True)
        w = make_workload(name, seed=args.seed, scale=scale, vocab=model.config.vocab_size)
        steps = Steps(model, w.sequences, device)
        stats = steps.plan.stats(window=shape.window)
        ideal = shape.ideal_speedup(stats)
        m = measure(steps, args.warmup, args.iters, not args.synced, stock)
        base = min((k for k in ("padded", "per-seq", "packed") if k in m), key=lambda k: m[k][0])
        speedup = m[base][0] / m["tree"][0]
        nan = (float("nan"), float("nan"))
        ratio = stats["attn_flop_ratio_window"] if shape.window and shape.layer_split()[0] == 0 else stats["attn_flop_ratio"]
        rows.append([name, stats["N"], stats["T"], stats["dedup"], ratio, ideal,
                     base, m.get("padded", nan)[0], m.get("per-seq", nan)[0], m["packed"][0], m[base][0],
                     m["tree"][0], speedup, speedup / ideal, m[base][1], m["tree"][1], m["diff"]])
        del steps
        if device == "cuda":
            torch.cuda.empty_cache()
    c = model.config
    backend = resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    window = f", window {shape.window} on {shape.layer_split()[1]} layers" if shape.window else ""
    title = (
        f"HF {type(model).__name__} ({'tiny' if args.tiny else args.model} shapes: hidden {c.hidden_size}, "
        f"{c.num_attention_heads}/{c.num_key_value_heads} heads x {c.head_dim}, vocab {c.vocab_size}, "
        f"{c.num_hidden_layers} layers{window}, random init, {str(dtype).split('.')[-1]}), fwd+bwd with "
        "token log-probs; baseline = the fastest of stock padded batch / per-sequence (not GPT-OSS) / "
        f"packed unshared batch; tree = forward_tree (auto backend -> {backend}); attn ratio = the "
        "windowed one where every layer has the window; MiB = peak allocated above the model"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n"


def main() -> None:
    parser = model_benchmark_parser(__doc__)
    parser.set_defaults(layers=None)  # the model's own default (MODELS)
    parser.add_argument("--model", choices=list(MODELS), default="qwen2")
    args = parse_model_benchmark_args(parser, "benchmarks/hf.py")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
