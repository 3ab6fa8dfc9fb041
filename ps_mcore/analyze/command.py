"""The ``ps-mcore analyze`` subcommand: its arguments and the run (read -> report -> plot)."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from ps_mcore.analyze import report
from ps_mcore.analyze.budget import budget_table
from ps_mcore.analyze.plot import _require_matplotlib, plot_plan
from ps_mcore.analyze.progress import Progress
from ps_mcore.analyze.read import DEFAULT_UID, AnalyzeError, expand_paths, read_rollouts
from ps_mcore.minibatch import DEFAULT_KV_ROW_COST
from ps_mcore.planner import MODES


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = _int_list(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


def add_analyze_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help=".jsonl / .json / .parquet rollouts, or a directory of them "
                        "(verl's trainer.rollout_data_dir)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="local Hugging Face tokenizer directory (for text columns)")
    parser.add_argument("--column", action="append", metavar="NAME",
                        help="sequence column, or twice: prompt column then response column")
    parser.add_argument("--uid-column", metavar="NAME",
                        help=f"group column (default {DEFAULT_UID!r} when present)")
    parser.add_argument("--micro-batch-size", type=_positive, default=8, metavar="N",
                        help="sequences per micro-batch, as verl's *_micro_batch_size_per_gpu "
                        "(default 8)")
    parser.add_argument("--min-prefix-len", type=_positive, default=report.DEFAULTS.min_prefix_len,
                        metavar="L", help=f"default {report.DEFAULTS.min_prefix_len}")
    parser.add_argument("--min-group-size", type=_positive, default=report.DEFAULTS.min_group_size,
                        metavar="G", help=f"default {report.DEFAULTS.min_group_size}")
    parser.add_argument("--sweep-prefix-lens", type=_int_list, default=[1, 8, 32, 128, 512],
                        metavar="L,L,...", help="min_prefix_len values of the threshold table")
    parser.add_argument("--sweep-group-sizes", type=_int_list, default=[2, 4, 8],
                        metavar="G,G,...", help="min_group_size values of the threshold table")
    parser.add_argument("--window", type=_positive, metavar="W",
                        help="also count the attention pairs of a sliding-window layer of W positions "
                        "(Gemma 3 local, GPT-OSS, Mistral layers): one more attn-FLOP ratio column")
    parser.add_argument("--per-batch", action="store_true", help="also print one row per micro-batch")
    parser.add_argument("--max-tokens", type=_positive, metavar="N",
                        help="micro-batch token budget: also report what each mini-batch computes "
                        "under it, unshared vs split sharing units vs the schedule across micro-batches")
    parser.add_argument("--mini-batch-size", type=_positive, metavar="B",
                        help="with --max-tokens: samples per mini-batch (uid groups kept together; "
                        "default: each file is one mini-batch)")
    parser.add_argument("--kv-row-cost", type=float, default=DEFAULT_KV_ROW_COST, metavar="C",
                        help="with --max-tokens: budget tokens a kept prefix K/V row costs "
                        f"(default {DEFAULT_KV_ROW_COST:g}; see ps_mcore.minibatch.kept_kv_row_cost)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="write a PNG of the sharing structure of one micro-batch (the name "
                        "must end in .png)")
    parser.add_argument("--plot-batch", type=int, metavar="K",
                        help="with --plot: micro-batch to draw (default: the one with the highest "
                        "dedup)")
    parser.add_argument("--plot-mode", choices=MODES,
                        help="with --plot: the mode to draw (default arbitrary_prefix)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress on stderr (it is shown on a terminal, and every 10 s "
                        "of a long run otherwise)")


def _check_usage(args: argparse.Namespace) -> None:
    parser = getattr(args, "parser", None)
    problems = []
    if args.plot is None:
        problems += [f"{flag} needs --plot" for flag, v in
                     (("--plot-batch", args.plot_batch), ("--plot-mode", args.plot_mode)) if v is not None]
    elif not args.plot.lower().endswith(".png"):
        problems.append(f"--plot {args.plot}: the plot is a PNG; name the file OUT.png")
    if args.max_tokens is None:
        problems += [f"{flag} needs --max-tokens" for flag, v in
                     (("--mini-batch-size", args.mini_batch_size),) if v is not None]
    elif not 0 < args.kv_row_cost <= 1:
        problems.append(f"--kv-row-cost {args.kv_row_cost:g}: must be in (0, 1]")
    if problems:
        if parser is None:
            raise AnalyzeError(problems[0])
        parser.error(problems[0])  # usage error, exit 2


def run_analyze(args: argparse.Namespace) -> int:
    """The ``analyze`` subcommand; raises :class:`AnalyzeError` on bad input (exit code 2)."""
    _check_usage(args)
    progress = Progress(quiet=args.quiet)
    files = [read_rollouts(p, args.column, args.uid_column, args.tokenizer, progress)
             for p in expand_paths(args.files)]
    batches = [(r, idx) for r in files for idx in report.micro_batches(r, args.micro_batch_size)]
    tries = report.build_tries(batches, progress, getattr(args, "window", None))
    plot_job = _plot_job(args, batches, tries) if args.plot else None  # validate before printing
    out = [
        report._header(files, batches, args.micro_batch_size),
        "",
        f"Sharing per mode (min_prefix_len {args.min_prefix_len}, min_group_size {args.min_group_size})",
        "",
        report.mode_table(tries, args.min_prefix_len, args.min_group_size),
        "",
        "Threshold effects: dedup N/T",
        "",
        report.threshold_table(tries, args.sweep_prefix_lens, args.sweep_group_sizes),
    ]
    if args.max_tokens is not None:
        out += ["", f"Under a micro-batch budget of {args.max_tokens} tokens", "",
                budget_table(files, args.max_tokens, args.mini_batch_size, args.min_prefix_len,
                             args.min_group_size, args.kv_row_cost)]
    if args.per_batch:
        out += ["", "Per micro-batch", "",
                report.batch_table(batches, tries, args.min_prefix_len, args.min_group_size)]
    if any(r.tokenized for r in files):
        out += ["", "note: text was re-tokenised; verl dumps decode with skip_special_tokens, so "
                "chat-template special tokens are missing from the counts"]
    if plot_job is not None:
        plot_job()
        out += ["", f"wrote {args.plot}"]
    print("\n".join(out))
    return 0


def _plot_job(args, batches, tries) -> Callable[[], None]:
    """Pick and plan the micro-batch to draw; return the drawing step."""
    mode = args.plot_mode or "arbitrary_prefix"
    if tries[mode] is None:
        raise AnalyzeError("--plot-mode prompt_only needs a prompt/response split in the data")
    k = args.plot_batch
    if k is None:
        k = int(tries[mode].evaluate(args.min_prefix_len, args.min_group_size).dedups.argmax())
    elif not 0 <= k < len(batches):
        raise AnalyzeError(f"--plot-batch {k}: there are {len(batches)} micro-batches (0..{len(batches) - 1})")
    _require_matplotlib()
    r, idx = batches[k]
    plan = report.plan_micro_batch(r, idx, mode, args.min_prefix_len, args.min_group_size)
    title = f"{os.path.basename(r.path)}, micro-batch {k}, {mode}"
    return lambda: plot_plan(plan, args.plot, title)
