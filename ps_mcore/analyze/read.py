"""Reading rollout files (JSONL / parquet) into token sequences, prompt lengths and groups.

Columns are detected by name (see :mod:`ps_mcore.analyze`); text is tokenised with a local
Hugging Face tokenizer. Bad input raises :class:`AnalyzeError` naming the file and line /
column.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

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
