"""``ps-mcore analyze``: how much prefix sharing would save on your own rollouts.

Reads rollout files, cuts every file (one training step's batch) into micro-batches the way
verl does (fixed micro-batch size, ``uid`` groups kept together), plans each micro-batch with
:func:`~ps_mcore.planner.plan_prefix_tree` and reports, per mode, the token dedup N/T and the
attention-FLOP ratio, then how the thresholds (``min_prefix_len``, ``min_group_size``)
change the dedup. ``--plot`` draws the sharing structure of one micro-batch.

Inputs:

* JSONL (``.jsonl``/``.json``), one object per line, e.g. verl's ``trainer.rollout_data_dir``
  dumps (``input``/``output`` text, ``score``, ``step``; ``uid`` when present).
* Parquet (``.parquet``) with token-id list columns (or text columns).

Columns are detected by name: token ids ``prompt_ids``+``response_ids``,
``prompt_token_ids``+``response_token_ids``, ``prompts``+``responses``, ``input_ids`` or
``token_ids``; text ``input``+``output`` (verl's dump), ``prompt``+``response`` or ``text``
(text needs ``--tokenizer PATH``, a local Hugging Face tokenizer directory). ``--column``
names one column (whole sequences) or two (prompt, response) instead. A prompt/response split
gives prompt lengths, which ``prompt_only`` needs. ``uid`` groups samples; verl's TransferQueue
keys ``{uid}_{session}_{index}`` are grouped by their ``uid`` part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ps_mcore.planner import MODES, TreePlan, plan_prefix_tree
from ps_mcore.table import format_table
from ps_mcore.config import PrefixGrouperConfig

ID_PAIRS = (("prompt_ids", "response_ids"), ("prompt_token_ids", "response_token_ids"),
            ("prompts", "responses"))
ID_SINGLES = ("input_ids", "token_ids")
TEXT_PAIRS = (("input", "output"), ("prompt", "response"))
TEXT_SINGLES = ("text",)
DEFAULT_UID = "uid"
# verl's main_ppo_sync keys: {uid}_{session_id}_{index}; the GRPO group is the uid.
_VERL_KEY = re.compile(r"^(.+)_\d+_\d+$")
# The verl glue's defaults: thresholds, and the saved fraction below which a micro-batch
# runs verl's stock forward instead.
DEFAULTS = PrefixGrouperConfig()
FALLBACK_SAVED = DEFAULTS.min_saved_fraction


class AnalyzeError(ValueError):
    """A problem with the user's input; the message names the file and line / column."""


@dataclass
class Rollouts:
    """The samples of one file, in file order.

    Attributes:
        path: the file.
        sequences: unpadded int64 token sequences (prompt + response).
        prompt_lens: ``[B]`` prompt length per sample, or None without a prompt/response split.
        groups: per-sample group label (``uid``), or None.
        source: which columns were read, for the report.
        tokenized: True when the ids came from text through ``--tokenizer``.
    """

    path: str
    sequences: list[np.ndarray]
    prompt_lens: np.ndarray | None
    groups: list[Any] | None
    source: str
    tokenized: bool = False


# ----------------------------------------------------------------------------- reading


@dataclass
class _Table:
    """Column access over one file, with error locations (JSONL line / parquet row)."""

    path: str
    names: list[str]
    rows: int
    column: Callable[[str], list]
    where: Callable[[int, str], str]


def _jsonl_table(path: str) -> _Table:
    records: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except UnicodeEncodeError:  # undecodable bytes survive as surrogates
                raise AnalyzeError(f"{path}, line {lineno}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise AnalyzeError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})")
            if not isinstance(obj, dict):
                raise AnalyzeError(
                    f"{path}, line {lineno}: expected one JSON object per line, got {type(obj).__name__}"
                )
            records.append((lineno, obj))

    def column(name: str) -> list:
        out = []
        for lineno, obj in records:
            if name not in obj:
                raise AnalyzeError(
                    f"{path}, line {lineno}: no field {name!r} (fields: {', '.join(sorted(obj))})"
                )
            out.append(obj[name])
        return out

    names = sorted(records[0][1]) if records else []
    return _Table(path, names, len(records), column,
                  lambda i, col: f"{path}, line {records[i][0]}, field {col!r}")


def _parquet_table(path: str) -> _Table:
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise AnalyzeError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise AnalyzeError(f"{path}: not a readable parquet file ({e})") from None

    def column(name: str) -> list:
        import pyarrow as pa

        if name not in table.column_names:
            raise AnalyzeError(f"{path}: no column {name!r} (columns: {', '.join(table.column_names)})")
        col = table.column(name).combine_chunks()
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise AnalyzeError(f"{path}, column {name!r}, row {first}: null value")
        t = col.type
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            if not pa.types.is_integer(t.value_type):
                raise AnalyzeError(
                    f"{path}, column {name!r}: token ids must be integers, the column holds {t}"
                )
            # Vectorised: one flat array split at the list offsets, no per-token Python.
            lens = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
            flat_arr = pc.list_flatten(col)
            if flat_arr.null_count:
                row = int(np.flatnonzero(np.repeat(np.arange(len(lens)), lens)[
                    flat_arr.is_null().to_numpy(zero_copy_only=False)])[0])
                raise AnalyzeError(f"{path}, column {name!r}, row {row}: null token id")
            flat = flat_arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            return np.split(flat, np.cumsum(lens)[:-1])
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return col.to_pylist()
        raise AnalyzeError(
            f"{path}, column {name!r}: expected lists of token ids or text, the column holds {t}"
        )

    return _Table(path, list(table.column_names), table.num_rows, column,
                  lambda i, col: f"{path}, column {col!r}, row {i}")


def _open_table(path: str) -> _Table:
    if not os.path.isfile(path):
        raise AnalyzeError(f"{path}: no such file")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        table = _jsonl_table(path)
    elif lower.endswith(".parquet"):
        table = _parquet_table(path)
    else:
        raise AnalyzeError(f"{path}: unsupported file type (expected .jsonl, .json or .parquet)")
    if table.rows == 0:
        raise AnalyzeError(f"{path}: no rows")
    return table


def _choose_columns(table: _Table, override: Sequence[str] | None) -> tuple[str, ...]:
    if override:
        if len(override) > 2:
            raise AnalyzeError("--column takes one column (whole sequences) or two (prompt, response)")
        return tuple(override)
    for cols in ID_PAIRS + tuple((c,) for c in ID_SINGLES) + TEXT_PAIRS + tuple((c,) for c in TEXT_SINGLES):
        if all(c in table.names for c in cols):
            return cols
    raise AnalyzeError(
        f"{table.path}: found no token-id or text columns (columns: {', '.join(table.names)}); "
        "name them with --column SEQ or --column PROMPT --column RESPONSE"
    )


def _ids(value: Any, where: str) -> np.ndarray:
    """One row's token ids as int64, or a clear error."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, list):
        try:
            arr = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
        except ValueError:  # ragged nesting
            arr = np.asarray(value, dtype=object)
        if arr.ndim != 1:
            raise AnalyzeError(f"{where}: expected a flat list of token ids, got nested lists")
        if arr.dtype.kind not in "iu":
            bad = next((x for x in value if isinstance(x, bool) or not isinstance(x, int)), None)
            if bad is None:
                raise AnalyzeError(f"{where}: token ids must fit in int64")
            raise AnalyzeError(
                f"{where}: token ids must be integers, found {json.dumps(bad)[:40]} "
                f"({type(bad).__name__})"
            )
    else:
        raise AnalyzeError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    if arr.size and arr.min() < 0:
        raise AnalyzeError(f"{where}: token ids must be non-negative, found {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


class _Tokenizer:
    """A local Hugging Face tokenizer, loaded on first use (transformers stays optional)."""

    def __init__(self, path: str | None):
        self.path, self._tok, self.used = path, None, False

    def __call__(self, texts: list[str], table: _Table, col: str) -> list[np.ndarray]:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise AnalyzeError(f"{table.where(i, col)}: expected text, got {type(t).__name__}")
        if self.path is None:
            raise AnalyzeError(
                f"{table.path}: column {col!r} holds text (a verl rollout dump?); pass "
                "--tokenizer PATH (a local Hugging Face tokenizer directory) to count tokens"
            )
        if self._tok is None:
            self._tok = _load_tokenizer(self.path)
        self.used = True
        ids = self._tok(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]


def _load_tokenizer(path: str):
    try:
        import transformers
    except ImportError:
        raise AnalyzeError("--tokenizer needs transformers (pip install transformers)") from None
    transformers.logging.set_verbosity_error()  # keep the report (and errors) clean
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise AnalyzeError(f"--tokenizer {path}: could not load a local tokenizer ({e})") from None


def _column_ids(table: _Table, col: str, tokenize: _Tokenizer) -> list[np.ndarray]:
    values = table.column(col)
    if isinstance(values[0], str):  # the first row decides: text or token ids
        return tokenize(values, table, col)
    return [_ids(v, table.where(i, col)) for i, v in enumerate(values)]


def _group_labels(table: _Table, uid_column: str | None) -> list[Any] | None:
    name = uid_column or DEFAULT_UID
    if name not in table.names:
        if uid_column:
            raise AnalyzeError(f"{table.path}: no column {name!r} (columns: {', '.join(table.names)})")
        return None
    labels = [json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v
              for v in table.column(name)]
    keys = [_VERL_KEY.match(str(v)) for v in labels]
    if all(keys) and len(set(labels)) == len(labels):  # one unique key per row: verl's TQ keys
        return [m.group(1) for m in keys]
    return labels


def read_rollouts(
    path: str,
    columns: Sequence[str] | None = None,
    uid_column: str | None = None,
    tokenizer: str | None = None,
) -> Rollouts:
    """Read one JSONL / parquet file of rollouts.

    Args:
        path: the file (``.jsonl``, ``.json`` or ``.parquet``).
        columns: one column of whole sequences or two (prompt, response); detected if None.
        uid_column: the group column (default ``uid`` when present).
        tokenizer: local tokenizer directory, needed for text columns.

    Raises:
        AnalyzeError: naming the file and line (JSONL) or column / row (parquet).
    """
    table = _open_table(path)
    cols = _choose_columns(table, columns)
    tokenize = _Tokenizer(tokenizer)
    parts = [_column_ids(table, c, tokenize) for c in cols]
    tokenized = tokenize.used
    if len(parts) == 2:
        for i, p in enumerate(parts[0]):
            if p.size == 0:
                raise AnalyzeError(f"{table.where(i, cols[0])}: empty prompt")
        seqs = [np.concatenate([p, r]) for p, r in zip(*parts)]
        prompt_lens = np.array([p.size for p in parts[0]], dtype=np.int64)
    else:
        seqs, prompt_lens = parts[0], None
    for i, s in enumerate(seqs):
        if s.size == 0:
            raise AnalyzeError(f"{table.where(i, cols[0])}: empty sequence")
    groups = _group_labels(table, uid_column)
    source = " + ".join(cols) + (f", grouped by {uid_column or DEFAULT_UID}" if groups else "")
    return Rollouts(path, seqs, prompt_lens, groups, source, tokenized)


# ----------------------------------------------------------------------------- planning


def micro_batches(r: Rollouts, size: int) -> list[list[int]]:
    """Sample indices per micro-batch: file order with ``uid`` groups kept together (groups
    ordered by first appearance, which is verl's own order for its GRPO batches), cut into
    chunks of ``size`` as verl's fixed-size micro-batching does."""
    order = list(range(len(r.sequences)))
    if r.groups is not None:
        first: dict[Any, int] = {}
        for i, g in enumerate(r.groups):
            first.setdefault(g, i)
        order.sort(key=lambda i: first[r.groups[i]])
    return [order[a : a + size] for a in range(0, len(order), size)]


def plan_micro_batch(
    r: Rollouts, idx: list[int], mode: str, min_prefix_len: int, min_group_size: int
) -> TreePlan | None:
    """The plan the ps-mcore verl glue would build (``prompt_only`` shares whole prompts
    within a ``uid`` group, ``arbitrary_prefix`` any common prefix); None when ``mode`` needs
    prompt lengths the file lacks."""
    if mode == "prompt_only" and r.prompt_lens is None:
        return None
    prompt_only = mode == "prompt_only"
    return plan_prefix_tree(
        [r.sequences[i] for i in idx],
        mode=mode,
        min_prefix_len=min_prefix_len,
        min_group_size=min_group_size,
        prompt_lens=r.prompt_lens[idx] if prompt_only else None,
        group_ids=[r.groups[i] for i in idx] if prompt_only and r.groups is not None else None,
    )


@dataclass
class ModeSummary:
    """Sums over micro-batches of one mode and threshold setting."""

    N: int = 0
    T: int = 0
    pairs_unshared: float = 0.0
    pairs_tree: float = 0.0
    dedups: list[float] = field(default_factory=list)

    def add(self, stats: dict) -> None:
        self.N += stats["N"]
        self.T += stats["T"]
        self.pairs_unshared += stats["attn_pairs_unshared"]
        self.pairs_tree += stats["attn_pairs_tree"]
        self.dedups.append(stats["dedup"])

    @property
    def dedup(self) -> float:
        return self.N / self.T if self.T else float("nan")

    @property
    def attn_ratio(self) -> float:
        return self.pairs_unshared / self.pairs_tree if self.pairs_tree else float("nan")


def summarize(
    batches: list[tuple[Rollouts, list[int]]], mode: str, min_prefix_len: int, min_group_size: int
) -> ModeSummary | None:
    """Totals over all micro-batches, or None when ``mode`` is not computable on the data."""
    total = ModeSummary()
    for r, idx in batches:
        plan = plan_micro_batch(r, idx, mode, min_prefix_len, min_group_size)
        if plan is None:
            return None
        total.add(plan.stats())
    return total


# ----------------------------------------------------------------------------- report


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


def mode_table(batches, min_prefix_len: int, min_group_size: int) -> str:
    """Dedup, tokens saved and attention-FLOP ratio per mode (one row each)."""
    rows = []
    for mode in ("prompt_only", "arbitrary_prefix"):
        s = summarize(batches, mode, min_prefix_len, min_group_size)
        if s is None:
            rows.append([mode] + ["-"] * 6 + ["needs prompt/response columns in every file"])
            continue
        d = s.dedups
        sharing = sum(1 - 1 / x >= FALLBACK_SAVED for x in d)
        rows.append([
            mode, s.N, s.T, s.dedup, f"{100 * (1 - s.T / s.N):.1f}%", s.attn_ratio,
            f"{min(d):.2f} / {statistics.median(d):.2f} / {max(d):.2f}", f"{sharing}/{len(d)}",
        ])
    headers = ["mode", "N", "T", "dedup N/T", "tokens saved", "attn-FLOP ratio",
               "micro-batch dedup min / median / max",
               f"micro-batches saving >= {FALLBACK_SAVED:.0%}"]
    note = (f"A micro-batch saving less than {FALLBACK_SAVED:.0%} of its tokens runs verl's stock "
            "forward under the ps-mcore glue (prefix_grouper.min_saved_fraction).")
    return format_table(headers, rows) + "\n" + note


def threshold_table(batches, prefix_lens: list[int], group_sizes: list[int]) -> str:
    """Dedup N/T for every (mode, min_prefix_len) x min_group_size."""
    rows = []
    for mode in ("prompt_only", "arbitrary_prefix"):
        for mpl in prefix_lens:
            cells = [summarize(batches, mode, mpl, g) for g in group_sizes]
            if cells[0] is None:
                rows.append([mode, "-"] + ["-"] * len(group_sizes))
                break
            rows.append([mode, mpl] + [c.dedup for c in cells])
    headers = ["mode", "min_prefix_len"] + [f"min_group_size {g}" for g in group_sizes]
    return format_table(headers, rows)


def batch_table(batches, min_prefix_len: int, min_group_size: int) -> str:
    """One row per micro-batch: sequences, N, and T / dedup per mode."""
    rows = []
    for k, (r, idx) in enumerate(batches):
        n = int(sum(r.sequences[i].size for i in idx))
        row: list[object] = [k, os.path.basename(r.path), len(idx), n]
        for mode in ("prompt_only", "arbitrary_prefix"):
            plan = plan_micro_batch(r, idx, mode, min_prefix_len, min_group_size)
            st = plan.stats() if plan is not None else None
            row += ["-", "-"] if st is None else [st["T"], st["dedup"]]
        rows.append(row)
    headers = ["micro-batch", "file", "sequences", "N", "T prompt_only", "dedup prompt_only",
               "T arbitrary_prefix", "dedup arbitrary_prefix"]
    return format_table(headers, rows)


def _header(files: list[Rollouts], batches, mbs: int) -> str:
    seqs = [s.size for r in files for s in r.sequences]
    grouped = " (uid groups kept together)" if any(r.groups for r in files) else ""
    lines = [
        f"ps-mcore analyze: {len(files)} file(s), {len(seqs)} sequences, N = {sum(seqs)} tokens, "
        f"{len(batches)} micro-batches of up to {mbs} sequences{grouped}",
        f"sequence length: mean {statistics.mean(seqs):.0f}, min {min(seqs)}, max {max(seqs)}",
    ]
    for r in files:
        lines.append(f"  {r.path}: {len(r.sequences)} rows from {r.source}")
    return "\n".join(lines)


def add_analyze_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help=".jsonl / .json / .parquet rollouts")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="local Hugging Face tokenizer directory (for text columns)")
    parser.add_argument("--column", action="append", metavar="NAME",
                        help="sequence column, or twice: prompt column then response column")
    parser.add_argument("--uid-column", metavar="NAME",
                        help=f"group column (default {DEFAULT_UID!r} when present)")
    parser.add_argument("--micro-batch-size", type=_positive, default=8, metavar="N",
                        help="sequences per micro-batch, as verl's *_micro_batch_size_per_gpu "
                        "(default 8)")
    parser.add_argument("--min-prefix-len", type=_positive, default=DEFAULTS.min_prefix_len,
                        metavar="L", help=f"default {DEFAULTS.min_prefix_len}")
    parser.add_argument("--min-group-size", type=_positive, default=DEFAULTS.min_group_size,
                        metavar="G", help=f"default {DEFAULTS.min_group_size}")
    parser.add_argument("--sweep-prefix-lens", type=_int_list, default=[1, 8, 32, 128, 512],
                        metavar="L,L,...", help="min_prefix_len values of the threshold table")
    parser.add_argument("--sweep-group-sizes", type=_int_list, default=[2, 4, 8],
                        metavar="G,G,...", help="min_group_size values of the threshold table")
    parser.add_argument("--per-batch", action="store_true", help="also print one row per micro-batch")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="write a PNG of the sharing structure of one micro-batch")
    parser.add_argument("--plot-batch", type=int, metavar="K",
                        help="micro-batch to draw (default: the one with the highest dedup)")
    parser.add_argument("--plot-mode", choices=MODES, default="arbitrary_prefix")


def run_analyze(args: argparse.Namespace) -> int:
    """The ``analyze`` subcommand; raises :class:`AnalyzeError` on bad input (exit code 2)."""
    files = [read_rollouts(p, args.column, args.uid_column, args.tokenizer) for p in args.files]
    batches = [(r, idx) for r in files for idx in micro_batches(r, args.micro_batch_size)]
    plot_job = _plot_job(args, batches) if args.plot else None  # validate before printing
    out = [
        _header(files, batches, args.micro_batch_size),
        "",
        f"Sharing per mode (min_prefix_len {args.min_prefix_len}, min_group_size {args.min_group_size})",
        "",
        mode_table(batches, args.min_prefix_len, args.min_group_size),
        "",
        "Threshold effects: dedup N/T",
        "",
        threshold_table(batches, args.sweep_prefix_lens, args.sweep_group_sizes),
    ]
    if args.per_batch:
        out += ["", "Per micro-batch", "", batch_table(batches, args.min_prefix_len, args.min_group_size)]
    if any(r.tokenized for r in files):
        out += ["", "note: text was re-tokenised; verl dumps decode with skip_special_tokens, so "
                "chat-template special tokens are missing from the counts"]
    if plot_job is not None:
        plot_job()
        out += ["", f"wrote {args.plot}"]
    print("\n".join(out))
    return 0


def _plot_job(args, batches) -> Callable[[], None]:
    """Pick and plan the micro-batch to draw; return the drawing step."""
    plans = [plan_micro_batch(r, idx, args.plot_mode, args.min_prefix_len, args.min_group_size)
             for r, idx in batches]
    if plans[0] is None:
        raise AnalyzeError("--plot-mode prompt_only needs a prompt/response split in the data")
    k = args.plot_batch
    if k is None:
        k = max(range(len(plans)), key=lambda j: plans[j].num_input_tokens / plans[j].num_tokens)
    elif not 0 <= k < len(plans):
        raise AnalyzeError(f"--plot-batch {k}: there are {len(plans)} micro-batches (0..{len(plans) - 1})")
    _require_matplotlib()
    r = batches[k][0]
    title = f"{os.path.basename(r.path)}, micro-batch {k}, {args.plot_mode}"
    return lambda: plot_plan(plans[k], args.plot, title)


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise AnalyzeError("--plot needs matplotlib (pip install matplotlib, or ps-mcore[plot])") from None
    return matplotlib


# ----------------------------------------------------------------------------- plot


def node_layout(plan: TreePlan) -> dict[str, np.ndarray]:
    """Icicle layout of the plan's forest, one entry per node (pre-order).

    Returns arrays ``[M]``: ``start`` (first position), ``length`` (tokens), ``count``
    (sequences passing through), ``y`` (first sequence row the node covers); a node covers
    rows ``y .. y + count``: first the sequences ending on it, then its children side by side.
    And ``row`` ``[B]``: the row of each sequence (batch order).
    """
    cu = plan.cu_seqlens_q.numpy().astype(np.int64)
    length = np.diff(cu)
    start = plan.position_ids.numpy()[cu[:-1]]
    parent = plan.node_parent.numpy()
    m = len(length)
    last_rows = plan.unpack_index.numpy()[np.cumsum(plan.seq_lens) - 1]
    end_node = np.searchsorted(cu, last_rows, side="right") - 1
    ends = np.bincount(end_node, minlength=m)
    count = ends.copy()
    for v in range(m - 1, -1, -1):  # children follow parents in pre-order
        if parent[v] >= 0:
            count[parent[v]] += count[v]
    y = np.zeros(m, dtype=np.int64)
    cursor = np.zeros(m, dtype=np.int64)  # next free row for each node's next child
    root_cursor = 0
    for v in range(m):
        p = parent[v]
        if p < 0:
            y[v], root_cursor = root_cursor, root_cursor + count[v]
        else:
            y[v] = cursor[p]
            cursor[p] += count[v]
        cursor[v] = y[v] + ends[v]
    # Sequences ending on the same node take its first rows, in batch order.
    order = np.argsort(end_node, kind="stable")
    rank_in_node = np.arange(len(order)) - np.searchsorted(end_node[order], end_node[order])
    row = np.empty(len(order), dtype=np.int64)
    row[order] = y[end_node[order]] + rank_in_node
    return {"start": start, "length": length, "count": count, "y": y, "row": row}


def plot_plan(plan: TreePlan, path: str, title: str = "") -> None:
    """Write a PNG icicle chart of ``plan``: x = token position, one row per sequence, a box
    per tree node spanning the sequences that share it, colour = how many share it."""
    matplotlib = _require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colors

    lay = node_layout(plan)
    b = plan.num_sequences
    norm = colors.Normalize(vmin=1, vmax=max(2, int(lay["count"].max())))
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, 0.35 * b + 1.5))), dpi=110)
    ax.barh(lay["y"], lay["length"], left=lay["start"], height=lay["count"], align="edge",
            color=cmap(norm(lay["count"])), edgecolor="white", linewidth=0.6)
    longest = max(plan.seq_lens)
    for s, ln, c, y in zip(lay["start"], lay["length"], lay["count"], lay["y"]):
        if c > 1 and ln > 0.08 * longest:  # label only boxes wide enough to read
            ax.text(s + ln / 2, y + c / 2, f"{ln} tok x {c}", ha="center", va="center",
                    color="black" if norm(c) > 0.6 else "white", fontsize=8)
    ax.set_xlim(0, longest)
    ax.set_ylim(b, 0)
    if b <= 48:  # name the rows by batch index (the layout groups sharers together)
        ax.set_yticks(lay["row"] + 0.5, [str(i) for i in range(b)], fontsize=7)
    ax.set_xlabel("token position")
    ax.set_ylabel("sequence (index in the micro-batch)")
    st = plan.stats()
    ax.set_title(f"{title}\nN = {st['N']}, T = {st['T']}, dedup {st['dedup']:.2f}x, "
                 f"attention-FLOP ratio {st['attn_flop_ratio']:.2f}x", fontsize=10)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="sequences sharing")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise AnalyzeError(f"--plot {path}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)

