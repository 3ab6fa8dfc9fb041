"""Reading rollout files (JSONL / JSON array / parquet, or a directory of them) into token
sequences, prompt lengths and groups.

Columns are detected by name (see :mod:`ps_mcore.analyze`); text is tokenised with a local
Hugging Face tokenizer. Bad input raises :class:`AnalyzeError` naming the file and line /
column. Files are streamed: only the columns in use are kept, token rows as compact numpy
arrays (int32 where the ids fit), never as Python ints.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ps_mcore.analyze.progress import QUIET, Progress

ID_PAIRS = (("prompt_ids", "response_ids"), ("prompt_token_ids", "response_token_ids"),
            ("prompts", "responses"))
ID_SINGLES = ("input_ids", "token_ids")
TEXT_PAIRS = (("input", "output"), ("prompt", "response"))
TEXT_SINGLES = ("text",)
DEFAULT_UID = "uid"
SUFFIXES = (".jsonl", ".json", ".parquet")
# verl's main_ppo_sync keys: {uid}_{session_id}_{index}; the GRPO group is the uid.
_VERL_KEY = re.compile(r"^(.+)_\d+_\d+$")
_INT32_MAX = np.iinfo(np.int32).max
_INT64_MAX = np.iinfo(np.int64).max
TOKENIZE_CHUNK = 1024  # texts per tokenizer call: bounds the Python-int lists it returns


class AnalyzeError(ValueError):
    """A problem with the user's input; the message names the file and line / column."""


@dataclass
class Rollouts:
    """The samples of one file, in file order.

    Attributes:
        path: the file.
        sequences: unpadded token sequences (prompt + response), int32 numpy arrays where the
            ids fit (int64 otherwise).
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


def expand_paths(paths: Sequence[str]) -> list[str]:
    """The files to read: each path as given, a directory (verl's ``rollout_data_dir``) as its
    ``.jsonl`` / ``.json`` / ``.parquet`` files in name order (numbers compared as numbers,
    so ``2.jsonl`` comes before ``10.jsonl``)."""
    out = []
    for path in paths:
        path = str(path)
        if os.path.isdir(path):
            names = sorted((n for n in os.listdir(path) if n.lower().endswith(SUFFIXES)
                            and os.path.isfile(os.path.join(path, n))), key=_natural_key)
            if not names:
                raise AnalyzeError(f"{path}: directory holds no .jsonl, .json or .parquet files")
            out += [os.path.join(path, n) for n in names]
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise AnalyzeError(f"{path}: no such file or directory")
    return out


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


# ----------------------------------------------------------------------------- reading


@dataclass
class _Table:
    """The columns in use of one file, with error locations (JSONL line / parquet row)."""

    path: str
    names: list[str]
    rows: int
    columns: dict[str, list]
    row_name: Callable[[int], str]  # "line 7" / "row 6"
    where: Callable[[int, str], str]  # the full location of one cell

    def column(self, name: str) -> list:
        return self.columns[name]


def _json_records(path: str, step) -> Iterator[tuple[int, dict]]:
    """(line, object) per record of a JSONL file, or of a JSON array (``[{...}, {...}]``).
    Bytes are decoded strictly: invalid UTF-8 is an error naming its line."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        f.seek(0)
        if head.startswith(b"["):
            yield from _json_array(path, f.read(), step)
            return
        for lineno, raw in enumerate(f, 1):
            step.advance(len(raw))
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise AnalyzeError(_bad_utf8(path, lineno, raw, e)) from None
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise AnalyzeError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            yield lineno, obj


def _bad_utf8(path: str, lineno: int, raw: bytes, e: UnicodeDecodeError) -> str:
    column = raw.rfind(b"\n", 0, e.start) + 1
    return (f"{path}, line {lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
            f"{e.start - column + 1}); save the file as UTF-8")


def _json_array(path: str, data: bytes, step) -> Iterator[tuple[int, dict]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise AnalyzeError(_bad_utf8(path, data.count(b"\n", 0, e.start) + 1, data, e)) from None
    del data
    decoder = json.JSONDecoder()
    ws = re.compile(r"[ \t\r\n]*")
    pos = ws.match(text, ws.match(text, 0).end() + 1).end()  # first item, past "["
    lineno = counted = 0
    closed = text.startswith("]", pos)
    while not closed:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise AnalyzeError(f"{path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        lineno += text.count("\n", counted, pos) + (counted == 0)
        step.advance(pos - counted)
        counted = pos
        yield lineno, obj
        pos = ws.match(text, end).end()
        if not text.startswith(",", pos):
            closed = text.startswith("]", pos)
            break
        pos = ws.match(text, pos + 1).end()
    if closed:
        pos = ws.match(text, pos + 1).end()
    if not closed or pos != len(text):
        line = text.count("\n", 0, pos) + 1
        column = pos - text.rfind("\n", 0, pos)
        what = "expected ',' or ']' after an array item" if not closed else "data after the array"
        raise AnalyzeError(f"{path}, line {line}: not valid JSON ({what}, column {column})")
    step.advance(len(text) - counted)


def _json_table(path: str, pick, progress: Progress) -> _Table:
    """Stream the records, keeping only the columns ``pick`` chooses from the first record's
    fields (``pick(names) -> (token columns, other columns)``); token-id lists become compact
    arrays as they are read."""
    columns: dict[str, list] = {}
    token_cols: set[str] = set()
    lines: list[int] = []
    names: list[str] = []
    with progress.step(f"reading {os.path.basename(path)}", os.path.getsize(path), "bytes") as step:
        for lineno, obj in _json_records(path, step):
            if not isinstance(obj, dict):
                raise AnalyzeError(
                    f"{path}, line {lineno}: expected one JSON object per line (or a JSON array "
                    f"of objects), got {type(obj).__name__}"
                )
            if not lines:
                names = sorted(obj)
                tokens, others = pick(names)
                token_cols = set(tokens)
                columns = {c: [] for c in (*tokens, *others)}
            for name, out in columns.items():
                if name not in obj:
                    raise AnalyzeError(
                        f"{path}, line {lineno}: no field {name!r} (fields: {', '.join(sorted(obj))})"
                    )
                value = obj[name]
                if name in token_cols and isinstance(value, list):  # validated, compacted now
                    value = _ids(value, f"{path}, line {lineno}, field {name!r}")
                out.append(value)
            lines.append(lineno)
    return _Table(path, names, len(lines), columns, lambda i: f"line {lines[i]}",
                  lambda i, col: f"{path}, line {lines[i]}, field {col!r}")


def _parquet_table(path: str, pick, progress: Progress) -> _Table:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise AnalyzeError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        names = list(pq.read_schema(path).names)
        with progress.step(f"reading {os.path.basename(path)}", 1, "files") as step:
            tokens, others = pick(names)
            wanted = [c for c in (*tokens, *others) if c in names]
            table = pq.read_table(path, columns=wanted)
            step.advance()
    except AnalyzeError:
        raise
    except Exception as e:  # pyarrow raises several types for a bad file
        raise AnalyzeError(f"{path}: not a readable parquet file ({e})") from None

    def column(name: str) -> list:
        if name not in table.column_names:
            raise AnalyzeError(f"{path}: no column {name!r} (columns: {', '.join(names)})")
        col = table.column(name).combine_chunks()
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise AnalyzeError(f"{path}, column {name!r}, row {first}: null value")
        if name in others:  # group labels: any type
            return col.to_pylist()
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
                row = int(np.repeat(np.arange(len(lens)), lens)[
                    flat_arr.is_null().to_numpy(zero_copy_only=False)][0])
                raise AnalyzeError(f"{path}, column {name!r}, row {row}: null token id")
            flat = flat_arr.to_numpy(zero_copy_only=False)
            if flat.size and flat.min() < 0:
                row = int(np.repeat(np.arange(len(lens)), lens)[flat < 0][0])
                raise AnalyzeError(f"{path}, column {name!r}, row {row}: token ids must be "
                                   f"non-negative, found {int(flat.min())}")
            if flat.size and flat.dtype.kind == "u" and flat.max() > _INT64_MAX:
                raise AnalyzeError(f"{path}, column {name!r}: token ids must fit in int64")
            flat = _compact(flat)
            return np.split(flat, np.cumsum(lens)[:-1])  # views into one compact array
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return col.to_pylist()
        raise AnalyzeError(
            f"{path}, column {name!r}: expected lists of token ids or text, the column holds {t}"
        )

    columns = {c: column(c) for c in (*tokens, *others)}
    rows = table.num_rows
    del table
    return _Table(path, names, rows, columns, lambda i: f"row {i}",
                  lambda i, col: f"{path}, column {col!r}, row {i}")


def _open_table(path: str, pick, progress: Progress) -> _Table:
    if not os.path.isfile(path):
        raise AnalyzeError(f"{path}: no such file")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        table = _json_table(path, pick, progress)
    elif lower.endswith(".parquet"):
        table = _parquet_table(path, pick, progress)
    else:
        raise AnalyzeError(f"{path}: unsupported file type (expected .jsonl, .json or .parquet)")
    if table.rows == 0:
        raise AnalyzeError(f"{path}: no rows")
    return table


def _choose_columns(path: str, names: list[str], override: Sequence[str] | None) -> tuple[str, ...]:
    if override:
        if len(override) > 2:
            raise AnalyzeError("--column takes one column (whole sequences) or two (prompt, response)")
        return tuple(override)
    for cols in ID_PAIRS + tuple((c,) for c in ID_SINGLES) + TEXT_PAIRS + tuple((c,) for c in TEXT_SINGLES):
        if all(c in names for c in cols):
            return cols
    raise AnalyzeError(
        f"{path}: found no token-id or text columns (columns: {', '.join(names)}); "
        "name them with --column SEQ or --column PROMPT --column RESPONSE"
    )


def _compact(arr: np.ndarray) -> np.ndarray:
    """int32 when every id fits (half the memory of int64), else int64."""
    if arr.size == 0 or int(arr.max()) <= _INT32_MAX:
        return arr.astype(np.int32, copy=False)
    return arr.astype(np.int64, copy=False)


def _ids(value: Any, where: str) -> np.ndarray:
    """One row's token ids as a compact array, or a clear error."""
    if isinstance(value, list) and value:  # the common case, in as few numpy calls as possible
        arr = np.asarray(value)
        if arr.dtype == np.int64 and arr.ndim == 1:
            lo, hi = arr.min(), arr.max()
            if lo >= 0:
                return arr.astype(np.int32) if hi <= _INT32_MAX else arr
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, list):
        try:
            arr = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError):  # ragged nesting
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
    if arr.size and arr.dtype.kind == "u" and arr.max() > _INT64_MAX:
        raise AnalyzeError(f"{where}: token ids must fit in int64")
    return _compact(arr)


class _Tokenizer:
    """A local Hugging Face tokenizer, loaded on first use (transformers stays optional)."""

    def __init__(self, path: str | None, progress: Progress):
        self.path, self._tok, self.used, self.progress = path, None, False, progress

    def __call__(self, texts: list[str], table: _Table, col: str) -> list[np.ndarray]:
        if self.path is None:
            raise AnalyzeError(
                f"{table.path}: column {col!r} holds text (a verl rollout dump?); pass "
                "--tokenizer PATH (a local Hugging Face tokenizer directory) to count tokens"
            )
        if self._tok is None:
            self._tok = load_tokenizer(self.path)
        self.used = True
        out = []
        with self.progress.step(f"tokenising {col!r}", len(texts), "rows") as step:
            for a in range(0, len(texts), TOKENIZE_CHUNK):
                chunk = texts[a : a + TOKENIZE_CHUNK]
                ids = self._tok(chunk, add_special_tokens=False)["input_ids"]
                out += [_compact(np.asarray(x, dtype=np.int64)) for x in ids]
                step.advance(len(chunk))
        return out


def load_tokenizer(path: str):
    """``AutoTokenizer`` from a local directory (or a model already in the Hugging Face cache,
    named ``org/name``); never downloads."""
    if not os.path.exists(path) and not re.fullmatch(r"[\w.-]+/[\w.-]+", path):
        raise AnalyzeError(f"--tokenizer {path}: no tokenizer at {path} (no such directory; pass "
                           "a local Hugging Face tokenizer directory)")
    try:
        import transformers
    except ImportError:
        raise AnalyzeError("--tokenizer needs transformers (pip install transformers, or "
                           "ps-mcore[analyze])") from None
    transformers.logging.set_verbosity_error()  # keep the report (and errors) clean
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        if not os.path.exists(path):
            raise AnalyzeError(f"--tokenizer {path}: no tokenizer at {path} (no such directory, "
                               "and no model of that name in the Hugging Face cache)") from None
        reason = " ".join(str(e).split())[:300]
        raise AnalyzeError(f"--tokenizer {path}: could not load a local tokenizer ({reason})") from None


def _kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "token ids"


def _column_ids(table: _Table, col: str, tokenize: _Tokenizer) -> list[np.ndarray]:
    values = table.column(col)
    is_text = np.fromiter((isinstance(v, str) for v in values), dtype=bool, count=len(values))
    n_text = int(is_text.sum())
    if 0 < n_text < len(values):
        # Mixed: the kind most rows hold is the intended one (ties: the first row's); name
        # the first row that differs, and one that shows the intended kind.
        text_wanted = 2 * n_text > len(values) or (2 * n_text == len(values) and is_text[0])
        odd = int(np.flatnonzero(is_text != text_wanted)[0])
        example = int(np.flatnonzero(is_text == text_wanted)[0])
        raise AnalyzeError(
            f"{table.where(odd, col)}: holds {_kind(values[odd])}, but most rows hold "
            f"{_kind(values[example])} (e.g. {table.row_name(example)}); a column holds one or the other"
        )
    if n_text:
        return tokenize(values, table, col)
    # Lists were validated and compacted while reading; anything else is an error here.
    return [v if isinstance(v, np.ndarray) else _ids(v, table.where(i, col))
            for i, v in enumerate(values)]


def _group_labels(table: _Table, name: str | None) -> list[Any] | None:
    if name is None:
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
    progress: Progress = QUIET,
) -> Rollouts:
    """Read one JSONL / JSON-array / parquet file of rollouts.

    Args:
        path: the file (``.jsonl``, ``.json`` or ``.parquet``).
        columns: one column of whole sequences or two (prompt, response); detected if None.
        uid_column: the group column (default ``uid`` when present).
        tokenizer: local tokenizer directory, needed for text columns.
        progress: where reading / tokenising report progress.

    Raises:
        AnalyzeError: naming the file and line (JSON) or column / row (parquet).
    """
    chosen: dict[str, Any] = {}

    def pick(names: list[str]) -> list[str]:
        chosen["cols"] = _choose_columns(path, names, columns)
        uid = uid_column or DEFAULT_UID
        if uid not in names:
            if uid_column:
                raise AnalyzeError(f"{path}: no column {uid!r} (columns: {', '.join(names)})")
            uid = None
        chosen["uid"] = uid
        return chosen["cols"], ([uid] if uid and uid not in chosen["cols"] else [])

    table = _open_table(path, pick, progress)
    cols = chosen["cols"]
    tokenize = _Tokenizer(tokenizer, progress)
    parts = [_column_ids(table, c, tokenize) for c in cols]
    tokenized = tokenize.used
    if len(parts) == 2:
        for i, p in enumerate(parts[0]):
            if p.size == 0:
                raise AnalyzeError(f"{table.where(i, cols[0])}: empty prompt")
        prompts, responses = parts
        prompt_lens = np.array([p.size for p in prompts], dtype=np.int64)
        seqs = []
        for i in range(len(prompts)):  # both compact already; free each half as it is joined
            seqs.append(np.concatenate([prompts[i], responses[i]]))
            prompts[i] = responses[i] = None
    else:
        seqs, prompt_lens = parts[0], None
    del parts
    for i, s in enumerate(seqs):
        if s.size == 0:
            raise AnalyzeError(f"{table.where(i, cols[0])}: empty sequence")
    groups = _group_labels(table, chosen["uid"])
    source = " + ".join(cols) + (f", grouped by {chosen['uid']}" if groups else "")
    return Rollouts(path, seqs, prompt_lens, groups, source, tokenized)
