"""``ps-mcore analyze`` / ``bench`` / ``--version`` on the CPU: numbers against
plan_prefix_tree computed here, malformed inputs (message names the line / column, exit 2,
nothing else printed), the plot (a real, non-blank PNG) and the icicle layout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from forests import nasty_forests, random_forest

from ps_mcore import __version__, plan_prefix_tree
from ps_mcore.analyze import ModeTries, Progress, Rollouts, node_layout, read_rollouts
from ps_mcore.cli import main


ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fixtures


def _rollouts(seed: int = 0):
    """4 GRPO groups of 4 (uid g0..g3) interleaved in file order (g0, g1, g2, g3, g0, ...), so
    keeping groups together changes the micro-batches. Groups g0 and g1 use the same prompt
    (the same question sampled twice): prompt_only must not share it across uids. Responses
    sometimes share a first chunk, which arbitrary_prefix shares and prompt_only does not."""
    rng = np.random.default_rng(seed)
    prompts = {g: list(rng.integers(0, 500, int(rng.integers(30, 60)))) for g in range(4)}
    prompts[1] = prompts[0]
    common = list(rng.integers(0, 500, 20))
    rows = []
    for k in range(4):
        for g in range(4):
            head = common if k % 2 == 0 else []
            resp = head + list(rng.integers(0, 500, int(rng.integers(5, 40))))
            rows.append({"uid": f"g{g}", "prompt": [int(x) for x in prompts[g]],
                         "response": [int(x) for x in resp]})
    return rows  # round-robin over the groups: g0, g1, g2, g3, g0, ...


def _expected(rows, mode="arbitrary_prefix", mbs=4, min_prefix_len=8, min_group_size=2):
    """N, T, dedup, attention-FLOP ratio summed over verl-like micro-batches."""
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r["uid"], i)
    order = sorted(range(len(rows)), key=lambda i: (first[rows[i]["uid"]], i))
    n = t = pu = pt = 0
    for a in range(0, len(order), mbs):
        idx = order[a : a + mbs]
        seqs = [rows[i]["prompt"] + rows[i]["response"] for i in idx]
        kw = {}
        if mode == "prompt_only":
            kw = dict(prompt_lens=[len(rows[i]["prompt"]) for i in idx],
                      group_ids=[rows[i]["uid"] for i in idx])
        st = plan_prefix_tree(seqs, mode=mode, min_prefix_len=min_prefix_len,
                              min_group_size=min_group_size, **kw).stats()
        n, t = n + st["N"], t + st["T"]
        pu, pt = pu + st["attn_pairs_unshared"], pt + st["attn_pairs_tree"]
    return n, t, n / t, pu / pt


def _arrow():
    return pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _table_rows(out: str, first_cell: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("|") and line.strip("| ").startswith(first_cell + " ")
    ]


def _mode_row(out, mode):
    rows = [r for r in _table_rows(out, mode) if len(r) == 8]
    assert len(rows) == 1, out
    return rows[0]


def _close(cell: str, value: float) -> bool:
    return abs(float(cell) - value) <= 5e-3 * abs(value)  # the table prints 3 significant digits


# ----------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("mbs", [4, 8])
def test_jsonl_token_ids_match_the_planner(tmp_path, capsys, mbs):
    rows = _rollouts()
    path = tmp_path / "r.jsonl"
    _write_jsonl(path, [{"prompt_ids": r["prompt"], "response_ids": r["response"], "uid": r["uid"],
                         "score": 1.0} for r in rows])
    rc, out, err = _run(capsys, "analyze", path, "--micro-batch-size", mbs)
    assert rc == 0, err
    for mode in ("prompt_only", "arbitrary_prefix"):
        n, t, dedup, ratio = _expected(rows, mode, mbs)
        row = _mode_row(out, mode)
        assert (int(row[1]), int(row[2])) == (n, t), (mode, row)
        assert _close(row[3], dedup) and _close(row[5], ratio), (mode, row)
    # the fixture makes the modes differ, and file-order micro-batches would differ
    assert _expected(rows, "arbitrary_prefix", mbs)[1] < _expected(rows, "prompt_only", mbs)[1]
    in_file_order = [{**r, "uid": i // mbs} for i, r in enumerate(rows)]
    assert _expected(in_file_order, "arbitrary_prefix", mbs)[1] != _expected(rows, "arbitrary_prefix", mbs)[1]
    assert "16 sequences" in out and f"{16 // mbs} micro-batches" in out


def test_threshold_sweep_matches_the_planner(tmp_path, capsys):
    rows = _rollouts(1)
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompts": r["prompt"], "responses": r["response"],
                                                 "uid": r["uid"]} for r in rows])
    rc, out, _ = _run(capsys, "analyze", path, "--micro-batch-size", 4,
                      "--sweep-prefix-lens", "1,25,45", "--sweep-group-sizes", "2,3")
    assert rc == 0
    seen = set()
    for mode in ("prompt_only", "arbitrary_prefix"):
        table = {int(r[1]): r[2:] for r in _table_rows(out, mode) if len(r) == 4}
        assert sorted(table) == [1, 25, 45]
        for mpl, cells in table.items():
            for g, cell in zip((2, 3), cells):
                expected = _expected(rows, mode, 4, mpl, g)[2]
                assert _close(cell, expected), (mode, mpl, g, cell, expected)
                seen.add(round(expected, 3))
    assert len(seen) >= 3  # the thresholds do change the dedup on this fixture


def test_max_tokens_reports_split_vs_schedule(tmp_path, capsys):
    """Under a budget smaller than a GRPO group, the split recomputes each group's prompt
    per piece; the schedule computes the mini-batch's tree once (independent numbers: the
    planner's T and the sum of each unit's pieces)."""
    from ps_mcore.analyze.budget import first_fit_bins

    rows = _rollouts(1)
    path = _write_jsonl(tmp_path / "r.jsonl", rows)
    budget = 120
    rc, out, err = _run(capsys, "analyze", path, "--max-tokens", budget, "--kv-row-cost", "0.25", "-q")
    assert rc == 0, err
    seqs = [r["prompt"] + r["response"] for r in rows]
    n = sum(len(s) for s in seqs)
    [stock] = _table_rows(out, "unshared (stock)")
    [split] = _table_rows(out, "split sharing units")
    [sched] = _table_rows(out, "schedule across micro-batches")
    assert int(stock[1]) == n and int(stock[4]) == first_fit_bins([len(s) for s in seqs], budget)
    tree = plan_prefix_tree(seqs)
    assert int(sched[1]) == tree.num_tokens < int(split[1]) < n
    assert int(sched[4]) > 1
    assert "micro-batch budget 120 tokens" in out
    rc, out, err = _run(capsys, "analyze", path, "--max-tokens", 120, "--mini-batch-size", 8, "-q")
    assert rc == 0 and "2 mini-batch(es) (8 samples each)" in out
    with pytest.raises(SystemExit) as exit_:
        _run(capsys, "analyze", path, "--mini-batch-size", 8)
    assert exit_.value.code == 2 and "--mini-batch-size needs --max-tokens" in capsys.readouterr().err
    rc, out, _ = _run(capsys, "analyze", path, "--max-tokens", 40, "-q")
    assert "longer than the budget: unshared and split cannot run them" in out


def test_parquet_without_prompt_split_and_uid(tmp_path, capsys):
    pa, pq = _arrow()
    rows = _rollouts(2)
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"input_ids": [r["prompt"] + r["response"] for r in rows],
                             "reward": [0.5] * len(rows)}), path)
    rc, out, err = _run(capsys, "analyze", path, "--micro-batch-size", 8)
    assert rc == 0, err
    row = _mode_row(out, "prompt_only")
    assert row[1] == "-" and "prompt/response" in row[-1]
    # no uid: micro-batches are file order
    flat = [{**r, "uid": "x"} for r in rows]
    n, t, dedup, ratio = _expected(flat, "arbitrary_prefix", mbs=8)
    row = _mode_row(out, "arbitrary_prefix")
    assert (int(row[1]), int(row[2])) == (n, t) and _close(row[5], ratio)


def test_parquet_column_override_and_verl_transferqueue_keys(tmp_path, capsys):
    pa, pq = _arrow()
    rows = _rollouts(3)
    # main_ppo_sync's dump keys: {uid}_{session}_{index}, unique per row; the group is the uid
    keys = [f"{r['uid']}-uuid_{k}_0" for k, r in enumerate(rows)]
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"q": [r["prompt"] for r in rows], "a": [r["response"] for r in rows],
                             "uid": keys}), path)
    rc, out, err = _run(capsys, "analyze", path, "--column", "q", "--column", "a",
                        "--micro-batch-size", 8)
    assert rc == 0, err
    n, t, _, _ = _expected(rows, "prompt_only", mbs=8)
    row = _mode_row(out, "prompt_only")
    assert (int(row[1]), int(row[2])) == (n, t) and t < n
    # g0 and g1 share a prompt inside one micro-batch: sharing it across uids would differ
    one_group = [{**r, "uid": "all"} for r in sorted(rows, key=lambda r: r["uid"])]  # same batches
    assert _expected(one_group, "prompt_only", mbs=8)[1] < t


def _word_tokenizer(path: Path, words: list[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    # A BOS the tokenizer adds by default: verl's decoded text carries none, analyze must not add it.
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", words.index("[BOS]"))])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def test_verl_text_dump_with_a_local_tokenizer(tmp_path, capsys):
    words = ["[UNK]", "[BOS]"] + [f"w{i}" for i in range(60)]
    rng = np.random.default_rng(4)
    text = lambda n: " ".join(f"w{x}" for x in rng.integers(0, 60, n))  # noqa: E731
    rows = []
    for g in range(3):
        prompt = text(int(rng.integers(10, 20)))
        for _ in range(4):
            rows.append({"input": prompt, "output": text(int(rng.integers(3, 12))), "gts": None,
                         "score": 0.0, "step": 7, "uid": f"u{g}"})
    dump = _write_jsonl(tmp_path / "7.jsonl", rows)
    tok_dir = tmp_path / "tok"
    _word_tokenizer(tok_dir, words)

    rc, out, err = _run(capsys, "analyze", dump, "--micro-batch-size", 4)
    assert rc == 2 and out == "" and "--tokenizer" in err and "'input'" in err

    rc, out, err = _run(capsys, "analyze", dump, "--tokenizer", tok_dir, "--micro-batch-size", 4)
    assert rc == 0, err
    ids = lambda s: [words.index(w) for w in s.split()]  # noqa: E731
    as_ids = [{"uid": r["uid"], "prompt": ids(r["input"]), "response": ids(r["output"])} for r in rows]
    for mode in ("prompt_only", "arbitrary_prefix"):
        n, t, _, _ = _expected(as_ids, mode)
        row = _mode_row(out, mode)
        assert (int(row[1]), int(row[2])) == (n, t), (mode, row)
    assert "re-tokenised" in out

    rc, out, err = _run(capsys, "analyze", dump, "--tokenizer", tmp_path / "missing")
    assert rc == 2 and out == "" and f"no tokenizer at {tmp_path / 'missing'}" in err
    assert "repo" not in err.lower() and err.count("\n") == 1, err
    (tmp_path / "empty").mkdir()
    rc, out, err = _run(capsys, "analyze", dump, "--tokenizer", tmp_path / "empty")
    assert rc == 2 and out == "" and "could not load a local tokenizer" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- bad input


def _assert_clean_error(capsys, argv, *needles):
    rc, out, err = _run(capsys, "analyze", *argv)
    assert rc == 2 and out == "", (rc, out)
    assert "Traceback" not in err and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_malformed_jsonl(tmp_path, capsys):
    good = json.dumps({"input_ids": [1, 2, 3]})
    cases = {
        "bad_json": ([good, good, '{"input_ids": [1, 2,', good], ["line 3", "not valid JSON"]),
        "not_object": ([good, "[1, 2, 3]"], ["line 2", "JSON object"]),
        "missing": ([good, good, json.dumps({"ids": [1]})], ["line 3", "'input_ids'", "ids"]),
        "float_ids": ([good, json.dumps({"input_ids": [1, 1.5]})], ["line 2", "integers", "1.5"]),
        "string_ids": ([good, json.dumps({"input_ids": [1, "a"]})], ["line 2", "integers"]),
        "negative": ([json.dumps({"input_ids": [4, -2]})], ["line 1", "non-negative", "-2"]),
        "empty": ([good, json.dumps({"input_ids": []})], ["line 2", "empty"]),
        "nested": ([json.dumps({"input_ids": [[1, 2], [3, 4]]})], ["line 1", "flat list"]),
        "number": ([json.dumps({"input_ids": 5})], ["line 1", "list of token ids"]),
    }
    for name, (lines, needles) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        _assert_clean_error(capsys, [path], str(path), *needles)
    empty_prompt = _write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [], "response_ids": [1, 2]}])
    _assert_clean_error(capsys, [empty_prompt], "line 1", "empty prompt")


def test_malformed_parquet_and_files(tmp_path, capsys):
    pa, pq = _arrow()
    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [1, 3]]}), ok)
    _assert_clean_error(capsys, [ok, "--column", "tokens"], "column 'tokens'", "input_ids")
    floats = tmp_path / "f.parquet"
    pq.write_table(pa.table({"input_ids": [[1.0, 2.5]]}), floats)
    _assert_clean_error(capsys, [floats], "column 'input_ids'", "integers", "double")
    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int64()))}), nulls)
    _assert_clean_error(capsys, [nulls], "column 'input_ids', row 1", "null")
    neg = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [3, -1]]}), neg)
    _assert_clean_error(capsys, [neg], "column 'input_ids', row 1", "non-negative")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    _assert_clean_error(capsys, [junk], str(junk), "parquet")
    _assert_clean_error(capsys, [tmp_path / "absent.jsonl"], "no such file")
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    _assert_clean_error(capsys, [csv], "unsupported file type")
    _assert_clean_error(capsys, [ok, "--uid-column", "group"], "column 'group'")
    _assert_clean_error(capsys, [ok, "--plot", tmp_path / "p.png", "--plot-batch", "5"], "--plot-batch 5")


# ----------------------------------------------------------------------------- plot


def test_plot_writes_a_non_blank_png(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    rows = _rollouts(5)
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompt_ids": r["prompt"], "response_ids": r["response"],
                                                 "uid": r["uid"]} for r in rows])
    png = tmp_path / "tree.png"
    rc, out, err = _run(capsys, "analyze", path, "--plot", png, "--micro-batch-size", 8)
    assert rc == 0, err
    assert f"wrote {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    pixels = image.imread(png)[..., :3]
    non_white = np.any(pixels < 0.95, axis=-1).mean()
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert non_white > 0.2 and len(colours) > 20, (non_white, len(colours))


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 4]}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    png = tmp_path / "p.png"
    _assert_clean_error(capsys, [path, "--plot", png], "matplotlib")
    assert not png.exists()


def _path_nodes(plan, s: int) -> set[int]:
    cu = plan.cu_seqlens_q.numpy()
    start = int(sum(plan.seq_lens[:s]))
    rows = plan.unpack_index.numpy()[start : start + plan.seq_lens[s]]
    return set((np.searchsorted(cu, rows, side="right") - 1).tolist())


@pytest.mark.parametrize("mode", ["arbitrary_prefix", "prompt_only"])
def test_icicle_layout_covers_exactly_each_sequences_path(mode):
    rng = np.random.default_rng(0)
    batches = list(nasty_forests().values()) + [random_forest(rng, 10, 30) for _ in range(30)]
    for seqs in batches:
        kw = {"prompt_lens": [max(1, len(s) // 2) for s in seqs]} if mode == "prompt_only" else {}
        plan = plan_prefix_tree(seqs, mode=mode, min_prefix_len=2, **kw)
        lay = node_layout(plan)
        assert sorted(lay["row"].tolist()) == list(range(len(seqs)))
        assert np.array_equal(lay["length"], np.diff(plan.cu_seqlens_q.numpy()))
        for s in range(len(seqs)):
            r = lay["row"][s]
            covering = {v for v in range(plan.num_nodes) if lay["y"][v] <= r < lay["y"][v] + lay["count"][v]}
            assert covering == _path_nodes(plan, s), (seqs, s)


# ----------------------------------------------------------------------------- commands


def test_module_help_and_version():
    help_ = subprocess.run([sys.executable, "-m", "ps_mcore", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and all(c in help_.stdout for c in ("demo", "analyze", "bench"))
    version = subprocess.run([sys.executable, "-m", "ps_mcore", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"ps-mcore {__version__}"


def test_no_command_and_unknown_arguments(capsys):
    rc, out, err = _run(capsys)
    assert rc == 2 and "analyze" in err
    with pytest.raises(SystemExit) as e:
        main(["analyze", "x.jsonl", "--no-such-flag"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,status", [
    (["analyze", "ROLLOUTS", "-q", "--per-batch"], {141}),
    (["--help"], {0, 141}),  # argparse itself drops a failed help write
    (["analyze", "--help"], {0, 141}),
])
def test_a_closed_output_pipe_ends_quietly(tmp_path, argv, status):
    """``ps-mcore ... | head``: the reader is gone before the output is written; the command
    stops (SIGPIPE's status where it noticed) and prints nothing, no BrokenPipeError."""
    path = _write_jsonl(tmp_path / "r.jsonl", _rollouts())
    argv = [str(path) if a == "ROLLOUTS" else a for a in argv]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "ps_mcore", *argv], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write_end)
    assert out.returncode in status and out.stderr == "", (out.returncode, out.stderr[-2000:])


def test_demo_is_wired(capsys):
    pytest.importorskip("ps_mcore.demo")
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0 and "--workloads" in capsys.readouterr().out


def test_bench_passes_arguments_through(tmp_path, capfd):
    (tmp_path / "planner.py").write_text(
        "import sys\nprint('ARGS', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    rc = main(["bench", "--suite", "planner", "--benchmarks-dir", str(tmp_path), "--out", "t.md"])
    assert rc == 0 and "ARGS ['--out', 't.md']" in capfd.readouterr().out
    rc = main(["bench", "--suite", "planner", "--benchmarks-dir", str(tmp_path), "--", "--fail"])
    out, err = capfd.readouterr()
    assert rc == 1 and "ARGS ['--fail']" in out and "exited with status 3" in err


def test_bench_says_when_not_found_or_no_cuda(tmp_path, capsys, monkeypatch):
    import ps_mcore.cli as cli

    rc = main(["bench", "--suite", "model", "--benchmarks-dir", str(tmp_path)])
    assert rc == 2 and "model.py not found" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    rc = main(["bench", "--suite", "attention", "--benchmarks-dir", str(ROOT / "benchmarks")])
    err = capsys.readouterr().err
    assert rc == 1 and "needs a CUDA GPU" in err and "running" not in err
    monkeypatch.setattr(cli, "find_benchmarks", lambda explicit=None: None)
    assert main(["bench"]) == 2 and "benchmarks/ not found" in capsys.readouterr().err


# ----------------------------------------------------------------------------- sweep


def test_one_trie_pass_equals_planning_at_every_threshold():
    """ModeTries.evaluate(L, G) == plan_prefix_tree(..., L, G) on every micro-batch: T exactly,
    attention pairs exactly (integers in float64), both modes, groups and prompt splits."""
    rng = np.random.default_rng(7)
    batches = list(nasty_forests(3).values()) + [random_forest(rng, 10, 40) for _ in range(60)]
    files = []
    for seqs in batches:
        b = len(seqs)
        prompt_lens = np.array([int(rng.integers(1, len(s) + 1)) for s in seqs])
        groups = [int(g) for g in rng.integers(0, 3, b)] if rng.random() < 0.5 else None
        files.append(Rollouts("x", [np.asarray(s, dtype=np.int32) for s in seqs], prompt_lens,
                              groups, "test"))
    micro = [(r, list(range(len(r.sequences)))) for r in files]
    thresholds = [(1, 2), (1, 3), (2, 2), (3, 4), (8, 2), (5, 1), (40, 2)]
    for mode in ("arbitrary_prefix", "prompt_only"):
        tries = ModeTries.build(micro, mode)
        for mpl, g in thresholds:
            got = tries.evaluate(mpl, g)
            for k, (r, idx) in enumerate(micro):
                kw = {}
                if mode == "prompt_only":
                    kw = dict(prompt_lens=r.prompt_lens, group_ids=r.groups)
                st = plan_prefix_tree(r.sequences, mode=mode, min_prefix_len=mpl,
                                      min_group_size=g, **kw).stats()
                assert (got.N[k], got.T[k]) == (st["N"], st["T"]), (mode, mpl, g, k)
                assert got.pairs_tree[k] == st["attn_pairs_tree"], (mode, mpl, g, k)
                assert got.pairs_unshared[k] == st["attn_pairs_unshared"]
    # the thresholds matter on these inputs (the test would see a wrong rule)
    tries = ModeTries.build(micro, "arbitrary_prefix")
    assert len({tries.evaluate(m, g).T.sum() for m, g in thresholds}) >= 4


def test_rows_are_held_as_compact_arrays(tmp_path):
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompt_ids": [1, 2, 3], "response_ids": [4]},
                                                {"prompt_ids": [1, 2], "response_ids": [2**40]}])
    r = read_rollouts(path)
    assert [s.dtype for s in r.sequences] == [np.int32, np.int64]
    assert [s.tolist() for s in r.sequences] == [[1, 2, 3, 4], [1, 2, 2**40]]


# ----------------------------------------------------------------------------- inputs


def _id_rows(seed=0):
    return [{"prompt_ids": r["prompt"], "response_ids": r["response"], "uid": r["uid"]}
            for r in _rollouts(seed)]


def test_a_directory_reads_its_rollout_files_in_name_order(tmp_path, capsys):
    dump = tmp_path / "rollout_data_dir"
    dump.mkdir()
    for step in (10, 2):  # name order puts 2 before 10
        _write_jsonl(dump / f"{step}.jsonl", _id_rows(step))
    (dump / "notes.txt").write_text("not rollouts")
    rc, out, err = _run(capsys, "analyze", dump, "--micro-batch-size", 4)
    assert rc == 0, err
    assert out.index("2.jsonl:") < out.index("10.jsonl:") and "2 file(s), 32 sequences" in out
    n = sum(_expected(_rollouts(s), "arbitrary_prefix", 4)[0] for s in (2, 10))
    t = sum(_expected(_rollouts(s), "arbitrary_prefix", 4)[1] for s in (2, 10))
    assert _mode_row(out, "arbitrary_prefix")[1:3] == [str(n), str(t)]
    (tmp_path / "empty").mkdir()
    _assert_clean_error(capsys, [tmp_path / "empty"], "no .jsonl, .json or .parquet files")


def test_a_json_array_file_is_read(tmp_path, capsys):
    rows = _id_rows(1)
    array = tmp_path / "r.json"
    array.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    lines = _write_jsonl(tmp_path / "r.jsonl", rows)
    rc, out_array, err = _run(capsys, "analyze", array, "--micro-batch-size", 4)
    assert rc == 0, err
    rc, out_lines, _ = _run(capsys, "analyze", lines, "--micro-batch-size", 4)
    strip = lambda out: [x for x in out.splitlines() if "r.json" not in x]  # noqa: E731
    assert strip(out_array) == strip(out_lines)
    assert _mode_row(out_array, "prompt_only")[1:3] == [str(v) for v in _expected(_rollouts(1), "prompt_only")[:2]]
    # errors name the line of the bad element
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"input_ids": [1, 2]},\n{"input_ids": [1, -3]}\n]')
    _assert_clean_error(capsys, [bad], "line 3", "non-negative")
    unclosed = tmp_path / "unclosed.json"
    unclosed.write_text('[{"input_ids": [1, 2]}\n{"input_ids": [3]}]')
    _assert_clean_error(capsys, [unclosed], "line 2", "not valid JSON")


def test_mixed_text_and_token_rows_name_the_odd_row(tmp_path, capsys):
    first_text = [json.dumps({"input_ids": "hello world"})] + [json.dumps({"input_ids": [1, 2]})] * 3
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(first_text) + "\n")
    _assert_clean_error(capsys, [path], "line 1", "holds text", "token ids (e.g. line 2)")
    last_text = [json.dumps({"text": "a b"})] * 3 + [json.dumps({"text": [5, 6]})]
    path.write_text("\n".join(last_text) + "\n")
    _assert_clean_error(capsys, [path], "line 4", "holds token ids", "text (e.g. line 1)")


def test_invalid_utf8_is_an_error_naming_the_line(tmp_path, capsys):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"input": "ok", "output": "fine"}\n{"input": "caf\xe9", "output": "x"}\n')
    _assert_clean_error(capsys, [path, "--tokenizer", tmp_path], "line 2", "UTF-8", "0xe9")
    array = tmp_path / "u.json"
    array.write_bytes(b'[{"text": "ok"},\n {"text": "\xff"}]')
    _assert_clean_error(capsys, [array], "line 2", "UTF-8")


# ----------------------------------------------------------------------------- usage


def test_plot_options_need_plot_and_a_png_name(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "r.jsonl", _id_rows(0))
    for extra in (["--plot-batch", "1"], ["--plot-mode", "prompt_only"]):
        with pytest.raises(SystemExit) as e:
            main(["analyze", path, *extra])
        assert e.value.code == 2 and f"{extra[0]} needs --plot" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["analyze", path, "--plot", str(tmp_path / "out.txt")])
    assert e.value.code == 2 and "name the file OUT.png" in capsys.readouterr().err
    assert not (tmp_path / "out.txt").exists()


def test_help_is_plain_text():
    help_ = subprocess.run([sys.executable, "-m", "ps_mcore", "analyze", "--help"],
                           capture_output=True, text=True, cwd=ROOT)
    assert help_.returncode == 0 and "ps-mcore analyze: how much" in help_.stdout
    assert "plan_prefix_tree would" in help_.stdout
    top = subprocess.run([sys.executable, "-m", "ps_mcore", "--help"], capture_output=True,
                         text=True, cwd=ROOT)
    assert top.returncode == 0 and "The ps-mcore command (also python -m ps_mcore)" in top.stdout
    for text in (help_.stdout, top.stdout):
        assert "``" not in text and not re.search(r":(func|mod|class|meth):`", text), text


def test_colour_bar_ticks_are_integers():
    pytest.importorskip("matplotlib")
    from ps_mcore.analyze import plot_figure

    for seqs in ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[1] * 9 + [k] for k in range(7)]):
        fig = plot_figure(plan_prefix_tree(seqs, min_prefix_len=1))
        bar = fig.axes[-1]
        lo, hi = bar.get_ylim()
        ticks = [t for t in bar.get_yticks() if lo - 1e-9 <= t <= hi + 1e-9]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


# ----------------------------------------------------------------------------- progress


class _Terminal:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_live_on_a_terminal_periodic_in_a_log_none_when_quiet():
    clock = iter(np.arange(0.0, 1000.0, 0.5)).__next__  # each reading: half a second later
    term = _Terminal(True)
    with Progress(term, clock=clock).step("reading r.jsonl", 3_000_000, "bytes") as step:
        for _ in range(3):
            step.advance(1_000_000)
    assert "[" in term.text and "1.0 MB/3.0 MB (33%)" in term.text and "3.0 MB/3.0 MB (100%)" in term.text
    assert term.text.endswith("\r")  # the live line is erased afterwards

    log = _Terminal(False)
    with Progress(log, clock=clock).step("building tries", 100, "micro-batches") as step:
        for _ in range(100):
            step.advance()
    lines = log.text.splitlines()
    assert "\r" not in log.text and 4 <= len(lines) <= 6, lines  # every 10 s of 50 s
    assert lines[0].startswith("ps-mcore analyze: building tries: ") and "micro-batches" in lines[0]

    quiet = _Terminal(True)
    with Progress(quiet, quiet=True, clock=clock).step("x", 10, "rows") as step:
        for _ in range(10):
            step.advance()
    assert quiet.text == ""


def test_analyze_shows_progress_on_a_terminal(tmp_path, capsys, monkeypatch):
    path = _write_jsonl(tmp_path / "r.jsonl", _id_rows(0))
    term = _Terminal(True)
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr("ps_mcore.analyze.progress.TTY_INTERVAL_S", 0.0)
    assert main(["analyze", path]) == 0
    assert "reading r.jsonl" in term.text and "building tries" in term.text
    term.text = ""
    assert main(["analyze", path, "--quiet"]) == 0
    assert term.text == ""
    assert "Threshold effects" in capsys.readouterr().out


def test_the_readme_analyze_line_runs(tmp_path, capsys, monkeypatch):
    """The README's `ps-mcore analyze my_rollouts/*.jsonl --tokenizer ... --plot tree.png` on
    a verl text dump (with the `[analyze]` extra's packages: transformers, matplotlib)."""
    pytest.importorskip("matplotlib")
    import glob
    import shlex

    line = next(m.group(1) for m in re.finditer(r"`(ps-mcore analyze [^`]*)`", (ROOT / "README.md").read_text())
                if "--tokenizer" in m.group(1))
    words = ["[UNK]", "[BOS]"] + [f"w{i}" for i in range(20)]
    _word_tokenizer(tmp_path / "tok", words)
    dump = tmp_path / "my_rollouts"
    dump.mkdir()
    for step in (1, 2):
        _write_jsonl(dump / f"{step}.jsonl", [{"input": "w1 w2 w3 w4 w5 w6 w7 w8 w9", "output": f"w{k}",
                                               "uid": "q", "step": step} for k in range(4)])
    argv = shlex.split(line)[1:]
    argv = [a.replace("/path/to/tokenizer", str(tmp_path / "tok")) for a in argv]
    monkeypatch.chdir(tmp_path)
    argv = [x for a in argv for x in (sorted(glob.glob(a)) if "*" in a else [a])]  # the shell's glob
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    assert "2 file(s), 8 sequences" in out and (tmp_path / "tree.png").stat().st_size > 5000


@pytest.mark.parametrize("window", [1, 16])
def test_window_counts_the_pairs_of_a_sliding_window_layer(tmp_path, capsys, window):
    """``--window W``: one more column, the attention-FLOP ratio of a layer with a sliding
    window of W, equal to the planner's windowed pairs summed over the micro-batches; the
    trie sweep counts them at every threshold as planning would."""
    rows = _rollouts()
    path = _write_jsonl(tmp_path / "r.jsonl", [{"prompt_ids": r["prompt"], "response_ids": r["response"],
                                                 "uid": r["uid"]} for r in rows])
    rc, out, err = _run(capsys, "analyze", path, "--micro-batch-size", 4, "--window", window)
    assert rc == 0, err
    assert f"attn-FLOP ratio (window {window})" in out
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r["uid"], i)
    order = sorted(range(len(rows)), key=lambda i: (first[rows[i]["uid"]], i))
    pu = pt = 0.0
    for a in range(0, len(order), 4):
        seqs = [rows[i]["prompt"] + rows[i]["response"] for i in order[a : a + 4]]
        st = plan_prefix_tree(seqs, min_prefix_len=8, min_group_size=2).stats(window=window)
        pu, pt = pu + st["attn_pairs_unshared_window"], pt + st["attn_pairs_tree_window"]
    row = [r for r in _table_rows(out, "arbitrary_prefix") if len(r) == 9]
    assert len(row) == 1 and _close(row[0][6], pu / pt), row
    rng = np.random.default_rng(window)
    micro = [(Rollouts("x", [np.asarray(s) for s in random_forest(rng, 8, 60)], None, None, "test"), list(range(8)))]
    micro = [(r, list(range(len(r.sequences)))) for r, _ in micro]
    tries = ModeTries.build(micro, "arbitrary_prefix", window=window)
    for mpl, g in [(1, 2), (4, 2), (2, 3)]:
        got = tries.evaluate(mpl, g)
        st = plan_prefix_tree(micro[0][0].sequences, min_prefix_len=mpl, min_group_size=g).stats(window=window)
        assert got.pairs_tree_window[0] == st["attn_pairs_tree_window"]
        assert got.pairs_unshared_window[0] == st["attn_pairs_unshared_window"]
