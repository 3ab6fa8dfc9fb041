"""A Hugging Face Qwen2 model (Qwen2.5-1.5B shapes, random init, bf16): forward + backward
with per-token log-probs, unshared batch vs. prefix tree, on every standard workload.

    python benchmarks/hf.py [--layers 4] [--out FILE]     # CUDA
    python benchmarks/hf.py --tiny                          # CPU smoke run, tiny dims

Baseline: what verl's FSDP engine runs with ``use_remove_padding`` (its default path): the
same HF model on the unshared sequences packed back to back into one row, position ids
restarting per sequence, and FlashAttention-2's varlen contract (the row split at the
position-id restarts, one causal segment per sequence), as transformers' ``flash_attention_2``
runs packed rows. Without the flash-attn package the attention implementation is
``varlen_fa2`` (``verl_flash_fallback.py``): the same contract on torch's own varlen flash
kernel (the math kernel on a CPU). Log-probs come from the same ``token_logprobs`` as the
tree's.

Tree: ``forward_tree`` (attention backend ``auto``) on the prefix forest, same weights.
Ideal = FLOP-weighted speedup (``ps_mcore.flops.DecoderShape``: linear FLOPs scale with
tokens, attention FLOPs with (query, key) pairs; LM head included).
"""

from __future__ import annotations

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
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True,
)


def build_model(dims: dict, layers: int, device: str, dtype: torch.dtype):
    """The baseline's model: FlashAttention-2 where flash-attn is installed, else ``varlen_fa2``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available() and device == "cuda":
        attn = "flash_attention_2"
    else:
        verl_flash_fallback.register_attention()
        attn = verl_flash_fallback.ATTN_NAME
    config = Qwen2Config(num_hidden_layers=layers, attn_implementation=attn, **dims)
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


class Steps(PairedSteps):
    """The baseline and tree fwd+bwd steps of one workload (weights: one per sample, like
    advantages)."""

    def __init__(self, model, sequences, device):
        self.model = model
        self.models = (model,)
        self.plan = plan_prefix_tree(sequences).to(device)  # planner defaults
        self.flat_plan = plan_unshared(sequences).to(device)  # rows = the sequences back to back
        lengths = [len(s) for s in sequences]
        self.base_pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        gen = torch.Generator().manual_seed(1)
        weights = torch.empty(len(sequences)).uniform_(-1, 1, generator=gen)
        self.token_weights = torch.repeat_interleave(weights, torch.tensor(lengths)).to(device)

    def base_logprobs(self):
        disable_tree_attention(self.model)  # the stock model, as verl runs it
        logits = self.model(input_ids=self.flat_plan.input_ids[None], position_ids=self.base_pos,
                            use_cache=False).logits[0]
        return token_logprobs(logits, self.flat_plan)[0]

    def tree_logprobs(self):
        return forward_tree(self.model, self.plan, return_logits=False, compute_logprobs=True).logprobs


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dims = TINY if args.tiny else QWEN25_15B
    scale = 1 / 32 if args.tiny else 1.0
    model = build_model(dims, args.layers, device, dtype)
    shape = decoder_shape(model.config)
    rows = workload_rows(args, shape, lambda seqs: Steps(model, seqs, device), decoder_row, scale,
                         reset=lambda: model.zero_grad(set_to_none=True))
    c = model.config
    backend = resolve_backend("auto", torch.empty(1, device=device, dtype=dtype))
    kernel = c._attn_implementation
    title = (
        f"HF Qwen2ForCausalLM ({'tiny' if args.tiny else 'Qwen2.5-1.5B'} shapes: hidden {c.hidden_size}, "
        f"{c.num_attention_heads}/{c.num_key_value_heads} heads x {c.head_dim}, vocab {c.vocab_size}, "
        f"{c.num_hidden_layers} layers, random init, {str(dtype).split('.')[-1]}), fwd+bwd with "
        "token log-probs; baseline = the unshared sequences packed into one row (verl's remove-padding "
        f"layout), varlen attention per sequence ({kernel}); tree = forward_tree (auto backend -> "
        f"{backend}, kernel per plan); MiB = peak allocated above the model"
    )
    return f"{title}\n\n{environment()}\n\n{markdown_table(DECODER_HEADERS, rows)}\n"


def main() -> None:
    args = parse_model_benchmark_args(model_benchmark_parser(__doc__), "benchmarks/hf.py")
    report = run(args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
