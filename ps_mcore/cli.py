"""The ``ps-mcore`` command (also ``python -m ps_mcore``).

    ps-mcore demo                      every standard workload, shared vs. unshared, parity check
    ps-mcore analyze FILE [FILE ...]   what sharing would save on your rollouts (JSONL / parquet)
    ps-mcore bench [--suite NAME] ...  the benchmarks/ suites (GPU), extra args passed through

Exit codes: 0 ok; 1 a check or benchmark failed (demo parity, a suite's own error, a GPU
suite without CUDA); 2 bad usage or bad input (one line naming the option, or the file and
line / column); 141 the reader closed the output pipe (e.g. ``| head``), as other Unix tools.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import ps_mcore
from ps_mcore import analyze, demo
from ps_mcore.analyze import AnalyzeError

SUITES = ("planner", "attention", "model", "hf")
# Suites that need CUDA; "model" and "hf" also have a --tiny CPU smoke run.
GPU_SUITES = {"attention": False, "model": True, "hf": True}  # name -> has --tiny


# ----------------------------------------------------------------------------- bench


def find_benchmarks(explicit: str | None = None) -> Path | None:
    """The benchmarks/ folder: ``--benchmarks-dir``, else next to the ps_mcore package (a
    source checkout / editable install), else ./benchmarks."""
    if explicit:
        return Path(explicit)
    for candidate in (Path(ps_mcore.__file__).resolve().parents[1] / "benchmarks",
                      Path.cwd() / "benchmarks"):
        if candidate.is_dir():
            return candidate
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_bench(args: argparse.Namespace, extra: list[str]) -> int:
    """Run one suite (or all) as ``python benchmarks/<suite>.py <extra>``; returns the worst
    exit status. GPU suites are skipped with a message when CUDA is missing."""
    folder = find_benchmarks(args.benchmarks_dir)
    if folder is None:
        print("ps-mcore bench: benchmarks/ not found; they ship with the source repository: run "
              "from a checkout or pass --benchmarks-dir PATH", file=sys.stderr)
        return 2
    suites = SUITES if args.suite == "all" else (args.suite,)
    cuda = _cuda_available()
    status = 0
    for name in suites:
        script = folder / f"{name}.py"
        if not script.is_file():
            print(f"ps-mcore bench: {script} not found", file=sys.stderr)
            status = max(status, 2)
            continue
        if name in GPU_SUITES and not cuda and not (GPU_SUITES[name] and "--tiny" in extra):
            hint = " (or pass --tiny for a CPU smoke run)" if GPU_SUITES[name] else ""
            print(f"ps-mcore bench: skipping {name}: it needs a CUDA GPU and "
                  f"torch.cuda.is_available() is False{hint}", file=sys.stderr)
            status = max(status, 1 if args.suite != "all" else 0)
            continue
        args_for = extra
        if args.suite == "all" and not GPU_SUITES.get(name):  # --tiny means "model and hf on CPU"
            args_for = [a for a in extra if a != "--tiny"]
        cmd = [sys.executable, str(script), *args_for]
        print(f"ps-mcore bench: running {' '.join(cmd)}", file=sys.stderr, flush=True)
        rc = subprocess.call(cmd, env={**os.environ, "MPLBACKEND": "Agg"})
        if rc:
            print(f"ps-mcore bench: {name} exited with status {rc}", file=sys.stderr)
            status = max(status, 1)
    return status


# ----------------------------------------------------------------------------- parser


def plain_text(doc: str) -> str:
    """A reST docstring as ``--help`` prints it: roles become their target's last name (or the
    target, without a ``~``), double backquotes go."""
    doc = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"\1", doc)
    doc = re.sub(r":\w+:`([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="every standard workload through a tiny Megatron GPT, "
                       "shared vs. unshared, with a parity check",
                       description=plain_text(demo.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_demo_arguments(p)  # megatron-core is imported when the demo runs
    p.set_defaults(func=demo.run_demo, parser=p)


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="how much prefix sharing would save on your rollouts",
                       description=plain_text(analyze.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    analyze.add_analyze_arguments(p)
    p.set_defaults(func=analyze.run_analyze, parser=p)


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="run the benchmarks/ suites (GPU); unknown arguments go to the suite",
        description="Runs python benchmarks/<suite>.py with the remaining arguments (e.g. "
        "--workloads grpo-wide --out table.md; with --suite all they go to every suite, except "
        "--tiny, which only model and hf take). GPU suites are skipped without CUDA.",
    )
    p.add_argument("--suite", choices=SUITES + ("all",), default="all")
    p.add_argument("--benchmarks-dir", metavar="PATH", help="the benchmarks/ folder (default: found "
                   "next to the installed package or in the current directory)")
    p.set_defaults(func=run_bench, passthrough=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ps-mcore", description=plain_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ps-mcore {ps_mcore.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,analyze,bench}")
    _add_demo(sub)
    _add_analyze(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ps-mcore`` console script; returns the exit status."""
    try:
        try:
            status = _dispatch(argv)
        except SystemExit:  # argparse: --help, --version, usage errors
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        return _closed_pipe()


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if getattr(args, "passthrough", False):
            return args.func(args, extra[1:] if extra[:1] == ["--"] else extra)
        if extra:
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except AnalyzeError as e:  # bad input: the message only, no traceback
        print(f"ps-mcore {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


SIGPIPE_STATUS = 128 + 13


def _closed_pipe() -> int:
    """The reader of stdout went away (``ps-mcore analyze ... | head``): stop quietly. Python
    flushes stdout again at exit (a second error): point it at /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
