"""A Hugging Face Qwen2 model (Qwen2.5-1.5B shapes, random init, bf16): forward + backward
with per-token log-probs, unshared batch vs. prefix tree, on every standard workload.

    python benchmarks/hf.py [--layers 4] [--out FILE]     # CUDA
    python benchmarks/hf.py --tiny                          # CPU smoke run, tiny dims

Baselines (stock transformers, attn_implementation="sdpa"; no flash-attn on the box):
  * padded:  one right-padded [B, Lmax] batch with its padding mask (SDPA then runs its
    masked kernel; pad rows cost linear and LM-head FLOPs too);
  * per-seq: one sequence per forward (no mask, so SDPA takes its causal flash path),
    gradients accumulated over the sequences.
The faster of the two per workload is the baseline. Both compute log-probs with the same
``token_logprobs`` helper as the tree (no-sharing plan). Tree: ``forward_tree`` (backend
auto -> gather-KV varlen flash). Ideal = FLOP-weighted speedup: (N * linear + unshared
attention pairs * attention) / (T * linear + tree pairs * attention), LM head included.
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
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True,
)


def build_model(dims: dict, layers: int, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_hidden_layers=layers, attn_implementation="sdpa", **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).train()


def decoder_shape(config) -> DecoderShape:
    return DecoderShape(
        layers=config.num_hidden_layers, hidden=config.hidden_size,
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, ffn=config.intermediate_size, vocab=config.vocab_size,
    )


class Steps:
    """The three fwd+bwd steps of one workload (weights: one per sample, like advantages)."""

    def __init__(self, model, sequences, device):
        self.model = model
        self.device = device
        self.seqs = [torch.as_tensor(s, device=device) for s in sequences]
        self.plan = plan_prefix_tree(sequences).to(device)  # planner defaults
        self.flat_plan = plan_unshared(sequences).to(device)
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

    def tree_logprobs(self):
        return forward_tree(self.model, self.plan, return_logits=False, compute_logprobs=True).logprobs

    def tree_step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        (self.tree_logprobs() * self.token_weights).sum().backward()

    @torch.no_grad()
    def max_logprob_diff(self) -> float:
        """Tree vs. per-sequence log-probs (a sanity check of the run, not a test)."""
        ref = torch.cat([self.seq_logprobs(i) for i in range(len(self.seqs))])
        return float((self.tree_logprobs() - ref).abs().max())


def measure(steps: Steps, warmup: int, iters: int, queued: bool = False) -> dict:
    model = steps.model
    out = {}
    disable_tree_attention(model)  # baselines run the untouched stock model
    for name, fn in (("padded", steps.padded_step), ("per-seq", steps.per_seq_step)):
        out[name] = (time_ms(fn, warmup, iters, queued), peak_mib(fn))
    out["tree"] = (time_ms(steps.tree_step, warmup, iters, queued), peak_mib(steps.tree_step))
    out["diff"] = steps.max_logprob_diff()
    model.zero_grad(set_to_none=True)
    return out


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dims = TINY if args.tiny else QWEN25_15B
    scale = 1 / 32 if args.tiny else 1.0
    model = build_model(dims, args.layers, device, dtype)
    headers = ["workload", "N", "T", "dedup", "attn ratio", "ideal", "baseline", "padded ms",
               "per-seq ms", "base ms", "tree ms", "speedup", "meas/ideal", "base MiB",
               "tree MiB", "max |dlogp|"]
    rows = []
    for i, name in enumerate(args.workloads):
        print(f"[{i + 1}/{len(args.workloads)}] {name}", flush=True)
        w = make_workload(name, seed=args.seed, scale=scale, vocab=model.config.vocab_size)
        steps = Steps(model, w.sequences, device)
        stats = steps.plan.stats()
        ideal = decoder_shape(model.config).ideal_speedup(stats)
        m = measure(steps, args.warmup, args.iters, not args.synced)
        base = min(("padded", "per-seq"), key=lambda k: m[k][0])
        speedup = m[base][0] / m["tree"][0]
        rows.append([name, stats["N"], stats["T"], stats["dedup"], stats["attn_flop_ratio"], ideal,
                     base, m["padded"][0], m["per-seq"][0], m[base][0], m["tree"][0], speedup,
                     speedup / ideal, m[base][1], m["tree"][1], m["diff"]])
        del steps
        if device == "cuda":
            torch.cuda.empty_cache()
    c = model.config
    backend = resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    title = (
        f"HF Qwen2ForCausalLM ({'tiny' if args.tiny else 'Qwen2.5-1.5B'} shapes: hidden {c.hidden_size}, "
        f"{c.num_attention_heads}/{c.num_key_value_heads} heads x {c.head_dim}, vocab {c.vocab_size}, "
        f"{c.num_hidden_layers} layers, random init, {str(dtype).split('.')[-1]}), fwd+bwd with "
        "token log-probs; baseline = the faster of stock sdpa padded batch / per-sequence; "
        f"tree = forward_tree (auto backend -> {backend}); MiB = peak allocated above the model"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n"


def main() -> None:
    args = parse_model_benchmark_args(model_benchmark_parser(__doc__), "benchmarks/hf.py")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
