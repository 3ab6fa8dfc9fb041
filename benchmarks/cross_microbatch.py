"""Mini-batches larger than the micro-batch token budget, one H200: stock vs split vs the
cross-micro-batch schedule (Qwen2.5-1.5B shapes, random init, bf16, fwd+bwd with the LM head
and per-token log-probs, gradient accumulation over the micro-batches).

    python benchmarks/cross_microbatch.py [--layers 4] [--out FILE]   # CUDA; TE spec when TE imports
    python benchmarks/cross_microbatch.py --tiny                      # CPU smoke run, tiny dims
    python benchmarks/cross_microbatch.py --profile                   # + where split's and the schedule's time goes

Workloads (full scale):
  * agent: a 24k-token history with 16 branches of 4k (N 458k, T 90k), budget 32k;
  * grpo: two GRPO groups of 8 with 20k and 28k prompts and ~1k responses (N 410k, T 66k),
    budgets 16k and 32k;
  * grpo-wide: one 2k prompt with 16 responses of ~512 (fits a 32k budget: the schedule is one
    step, today's path).

Methods, each one mini-batch = every micro-batch's forward + backward, queued:
  * stock: verl's dynamic batching of the unshared samples (first-fit by raw tokens under the
    budget, one THD micro-batch each; the stock TE model with TE's fused attention under
    ``--spec te``). A sample longer than the budget cannot run: the stock row then uses the
    next power-of-two budget that holds every sample (the method column says which);
  * split: sharing units (the verl glue's) larger than the budget split into pieces that each
    recompute their shared prefix, pieces first-fit into micro-batches, each one prefix tree;
  * schedule: the whole mini-batch's forest under the budget (ps_mcore.minibatch.schedule_tree,
    kv_row_cost estimated from the model's shape): every row once, kept K/V across steps.

Columns: micro-batches, tokens computed (recomputed forwards after a +), ms (median of --iters
whole mini-batches), speedup vs stock, ideal (FLOP ratio unshared / tree: linear FLOPs per
token, attention per (query, key) pair, LM head included), meas/ideal, peak MiB (allocated above
the idle model, whole mini-batch), kept MiB (the schedule's largest kept K/V + accumulators),
max |dlogp| (vs stock, bf16 noise: a sanity check). Targets: schedule meas/ideal >= 0.9; peak
<= stock's peak (one budget's micro-batch) + kept; grpo-wide schedule ms within 1% of split.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, markdown_table, peak_mib, profile_steps, time_ms, write_report  # noqa: E402
from model import QWEN25_15B, TINY, build_model, init_parallel, thd_params  # noqa: E402

from ps_mcore.analyze.budget import first_fit  # noqa: E402  (analyze --max-tokens packs the same way)
from ps_mcore.flops import DecoderShape  # noqa: E402
from ps_mcore.integrations.verl_common.config import PrefixGrouperConfig  # noqa: E402
from ps_mcore.integrations.verl_common.microbatch import split_units  # noqa: E402
from ps_mcore.logprobs import token_logprobs  # noqa: E402
from ps_mcore.minibatch import kept_kv_row_cost, schedule_tree  # noqa: E402
from ps_mcore.planner import plan_prefix_tree, plan_unshared  # noqa: E402
from ps_mcore.schedule import ScheduleRunner  # noqa: E402


def agent(rng, scale, vocab):
    history = rng.integers(0, vocab, int(24576 * scale))
    return [np.concatenate([history, rng.integers(0, vocab, int(4096 * scale))]) for _ in range(16)]


def grpo(rng, scale, vocab):
    seqs = []
    for prompt_len in (20480, 28672):
        prompt = rng.integers(0, vocab, int(prompt_len * scale))
        seqs += [np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(768, 1280) * scale))])
                 for _ in range(8)]
    return seqs


def grpo_wide(rng, scale, vocab):
    prompt = rng.integers(0, vocab, int(2048 * scale))
    return [np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(384, 640) * scale))])
            for _ in range(16)]


CONFIGS = (("agent 24k + 16x4k", agent, 32768), ("grpo 20k/28k prompts", grpo, 16384),
           ("grpo 20k/28k prompts", grpo, 32768), ("grpo-wide (fits)", grpo_wide, 32768))


class Runs:
    """The three ways to run one mini-batch of ``seqs`` under ``budget`` on ``tree_model`` (and
    ``stock_model`` for the stock run)."""

    def __init__(self, tree_model, stock_model, seqs, budget, device, kv_row_cost):
        from ps_mcore.layer_specs import TreePackedSeqParams

        self.tree_model, self.stock_model, self.device = tree_model, stock_model, device
        self.seqs = seqs
        lens = [len(s) for s in seqs]
        self.offsets = np.concatenate([[0], np.cumsum(lens)])
        gen = torch.Generator().manual_seed(1)
        weights = torch.empty(len(seqs)).uniform_(0.2, 2.0, generator=gen)
        self.weights = torch.repeat_interleave(weights, torch.tensor(lens)).to(device)
        self.logprobs: dict[str, torch.Tensor] = {}
        self.kept_mib = 0.0
        # stock: unshared micro-batches by raw tokens; over-long samples need the next power of 2
        self.stock_budget = budget if max(lens) <= budget else 1 << (max(lens) - 1).bit_length()
        self.stock_parts = first_fit(lens, self.stock_budget)
        self.stock_batches = []
        for part in self.stock_parts:
            flat = plan_unshared([seqs[i] for i in part]).to(device)
            self.stock_batches.append((part, flat, thd_params([lens[i] for i in part], device)))
        # split: the verl glue's units, pieces over the budget split, first-fit by their T
        self.split_ok = max(lens) <= budget
        config = PrefixGrouperConfig(mode="arbitrary_prefix")
        pieces = split_units(seqs, config, budget) if self.split_ok else []
        piece_plans = [plan_prefix_tree([seqs[i] for i in p]) for p in pieces]
        bins = first_fit([p.num_tokens for p in piece_plans], budget)
        self.split_batches = []
        for b in bins:
            part = sorted(i for j in b for i in pieces[j])
            plan = plan_prefix_tree([seqs[i] for i in part]).to(device)
            self.split_batches.append((part, plan, TreePackedSeqParams.from_plan(plan)))
        self.split_tokens = sum(p.num_tokens for p in piece_plans)
        # schedule: the whole forest
        self.tree = plan_prefix_tree(seqs)
        self.plan = schedule_tree(self.tree, budget, kv_row_cost=kv_row_cost)

    def _tokens(self, part) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in part])).to(self.device)

    def _backward(self, name: str, part, logprobs: torch.Tensor) -> None:
        rows = self._tokens(part)
        self.logprobs.setdefault(name, torch.zeros(int(self.offsets[-1]), device=self.device))[rows] = logprobs.detach()
        (logprobs * self.weights[rows]).sum().backward()

    def stock(self) -> None:
        self.stock_model.zero_grad(set_to_none=True)
        for part, flat, psp in self.stock_batches:
            pos = flat.position_ids
            logits = self.stock_model(input_ids=flat.input_ids[None], position_ids=pos[None],
                                      attention_mask=None, packed_seq_params=psp)[0]
            self._backward("stock", part, token_logprobs(logits, flat)[0])

    def split(self) -> None:
        self.tree_model.zero_grad(set_to_none=True)
        for part, plan, psp in self.split_batches:
            logits = self.tree_model(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None],
                                     attention_mask=None, packed_seq_params=psp)[0]
            self._backward("split", part, token_logprobs(logits, plan)[0])

    def schedule(self) -> None:
        from ps_mcore.layer_specs.schedule import gpt_call

        self.tree_model.zero_grad(set_to_none=True)
        runner = ScheduleRunner(self.plan, gpt_call(self.tree_model))
        kept = 0
        for j, step in enumerate(self.plan.steps):
            out = runner.forward(j)
            kept = max(kept, runner.kept_bytes())
            self._backward("schedule", list(step.samples), out["log_probs"])
        runner.finish()
        self.kept_mib = max(self.kept_mib, kept / 2**20)

    def max_diff(self, name: str) -> float:
        if name not in self.logprobs or "stock" not in self.logprobs:
            return float("nan")
        return float((self.logprobs[name] - self.logprobs["stock"]).abs().max())


def run(args) -> str:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dims = TINY if args.tiny else QWEN25_15B
    shape = DecoderShape(layers=args.layers, **dims)
    scale = 1 / 64 if args.tiny else 1.0
    init_parallel(device)
    spec = args.spec
    if spec == "auto":
        try:
            import transformer_engine  # noqa: F401

            spec = "te" if device == "cuda" else "local"
        except ImportError:
            spec = "local"
    if spec == "te":
        stock_model, tree_model = build_model(shape, device, dtype, fusions=True, spec="te")
    else:
        tree_model = stock_model = build_model(shape, device, dtype, fusions=not args.tiny)
    cost = kept_kv_row_cost(shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                            shape.ffn, shape.vocab, dtype_bytes=2 if dtype == torch.bfloat16 else 4)
    rows, profiles = [], []
    stock_cache: dict[str, tuple[float, float, int]] = {}
    for name, make, budget in CONFIGS:
        budget = int(budget * scale)
        seqs = make(np.random.default_rng(args.seed), scale, shape.vocab)
        print(f"{name} @ {budget}", flush=True)
        runs = Runs(tree_model, stock_model, seqs, budget, device, cost)
        stats = runs.tree.stats()
        ideal = shape.ideal_speedup(stats)
        n, t = stats["N"], stats["T"]

        def measure(fn):
            ms = time_ms(fn, args.warmup, args.iters, queued=True)
            tree_model.zero_grad(set_to_none=True)
            stock_model.zero_grad(set_to_none=True)
            mib = peak_mib(fn)
            tree_model.zero_grad(set_to_none=True)
            stock_model.zero_grad(set_to_none=True)
            return ms, mib

        key = f"{name}@{runs.stock_budget}"
        if key not in stock_cache:
            stock_cache[key] = (*measure(runs.stock), len(runs.stock_parts))
        stock_ms, stock_mib, stock_mbs = stock_cache[key]
        runs.stock()  # its log-probs, for the sanity column
        label = f"{name}, budget {budget}"
        rows.append([label, f"stock (budget {runs.stock_budget})", stock_mbs, n, stock_ms, 1.0, ideal,
                     "-", stock_mib, "-", "-"])
        if runs.split_ok:
            ms, mib = measure(runs.split)
            rows.append([label, "split", len(runs.split_batches), runs.split_tokens, ms, stock_ms / ms,
                         ideal, stock_ms / ms / ideal, mib, "-", runs.max_diff("split")])
        else:
            rows.append([label, "split", "-", "-", "-", "-", ideal, "-", "-", "-", "-"])
        ms, mib = measure(runs.schedule)
        tokens = f"{t}" + (f" + {runs.plan.recomputed_tokens}" if runs.plan.recomputed_tokens else "")
        rows.append([label, "schedule", runs.plan.num_steps, tokens, ms, stock_ms / ms, ideal,
                     stock_ms / ms / ideal, mib, runs.kept_mib, runs.max_diff("schedule")])
        print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
        if args.profile:
            steps = {"split": runs.split} if runs.split_ok else {}
            profiles.append(profile_steps({**steps, "schedule": runs.schedule}, f"profile: {label}", iters=1))
            print(profiles[-1], flush=True)
        del runs
        if device == "cuda":
            torch.cuda.empty_cache()
    headers = ["mini-batch", "method", "micro-batches", "tokens", "ms", "speedup", "ideal", "meas/ideal",
               "peak MiB", "kept MiB", "max |dlogp|"]
    title = (f"Cross-micro-batch schedule vs split vs stock: megatron-core GPTModel "
             f"({'tiny' if args.tiny else 'Qwen2.5-1.5B'} shapes, {shape.layers} layers, {spec} spec, "
             f"{str(dtype).split('.')[-1]}), kv_row_cost {cost:.3g}, one mini-batch per timing "
             f"(every micro-batch fwd+bwd, queued)")
    return f"{title}\n\n{environment()}\n\n{markdown_table(headers, rows)}\n" + "".join(f"\n{p}\n" for p in profiles)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--spec", choices=("auto", "te", "local"), default="auto",
                   help="auto: the TE spec (stock TE model as the stock run) when transformer-engine imports")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny dims, workloads at 1/64")
    p.add_argument("--out", help="also write the table (markdown) here")
    p.add_argument("--profile", action="store_true",
                   help="per mini-batch, split and schedule once more under the CUDA profiler (GPU only)")
    args = p.parse_args()
    if args.profile and args.tiny:
        p.error("--profile needs the GPU: not with --tiny")
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("benchmarks/cross_microbatch.py needs a CUDA GPU (or --tiny for a CPU smoke run)")
    if args.tiny:
        args.warmup, args.iters = 0, 1
    write_report(run(args), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
