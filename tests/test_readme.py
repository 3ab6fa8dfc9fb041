"""The README's two newcomer lines stay true: each pins torch (pip never picks a CUDA build by
itself), CI runs the test line verbatim, and the extras they and the analyze line name exist."""

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line.strip() for line in lines[1:6] if line.startswith("    ")]


def test_readme_starts_with_demo_and_test_commands_that_pin_torch():
    demo, test = _readme_commands()
    assert demo.startswith("pip install torch==") and demo.endswith("ps-mcore demo")
    assert test.startswith("pip install torch==") and "pytest" in test


def test_ci_runs_the_readme_test_command_verbatim():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _readme_commands()[1] in ci


def test_extras_named_in_the_readme_exist_and_analyze_has_its_imports():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    named = {e for group in re.findall(r"-e '\.\[([a-z,]+)\]'", readme) for e in group.split(",")}
    assert named >= {"megatron", "test", "hf", "verl", "plot", "analyze"}
    assert named <= set(extras)
    # `ps-mcore analyze ... --tokenizer ... --plot` reads parquet, loads a tokenizer, draws a PNG
    needs = {"pyarrow", "transformers", "matplotlib"}
    assert needs <= {re.split(r"[<>=!~ \[]", req)[0] for req in extras["analyze"]}
