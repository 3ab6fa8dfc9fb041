"""Every Python snippet in README.md and docs/*.md either runs as written on the CPU, checking
its own result (each asserts something about it), or opens with a ``# needs: ...`` line saying
what it needs (a GPU, transformer-engine, your model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _snippets() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", m.group(1)))
    return found


SNIPPETS = _snippets()
RUNNABLE = [(where, code) for where, code in SNIPPETS if not code.startswith("# needs:")]


def test_snippets_are_found_and_every_skipped_one_says_what_it_needs():
    assert len(SNIPPETS) >= 5 and RUNNABLE
    for where, code in SNIPPETS:
        first = code.splitlines()[0]
        if first.startswith("# needs:"):
            assert len(first) > len("# needs: ") + 10, f"{where}: say what the snippet needs"


def test_every_runnable_snippet_checks_its_result():
    """A snippet that only runs shows nothing wrong when its result is wrong."""
    for where, code in RUNNABLE:
        assert re.search(r"^\s*(assert |torch\.testing\.assert_close\()", code, re.M), (
            f"{where}: assert something about the snippet's result")


@pytest.mark.parametrize("where,code", RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_snippet_runs_as_written_on_cpu(where, code):
    if "transformers" in code:
        pytest.importorskip("transformers")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}  # CPU, this checkout
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, f"{where} failed:\n{code}\n{out.stderr[-3000:]}"
