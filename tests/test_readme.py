"""The README's newcomer lines stay true: CI runs them verbatim (torch first, then the demo,
then the test suite), and the extras they and the analyze line name exist."""

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
    return [line.strip() for line in lines[1:8] if line.startswith("    ")][:3]


def test_readme_starts_with_torch_install_demo_and_test_commands():
    torch_line, install, test = _readme_commands()
    assert torch_line.startswith("pip install torch==")  # before anything can pull a CUDA torch
    assert install.endswith("ps-mcore demo") and "pip install" in install
    assert "pytest" in test


def test_ci_runs_the_readme_commands_verbatim_in_order():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = [ci.index(cmd) for cmd in _readme_commands()]  # ValueError: a line is missing
    assert positions == sorted(positions)


def test_extras_named_in_the_readme_exist_and_analyze_has_its_imports():
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    named = {e for group in re.findall(r"pip install -e '\.\[([a-z,]+)\]'", readme) for e in group.split(",")}
    assert named >= {"megatron", "test", "hf", "verl", "plot", "analyze"}
    assert named <= set(extras)
    # `ps-mcore analyze ... --tokenizer ... --plot` reads parquet, loads a tokenizer, draws a PNG
    needs = {"pyarrow", "transformers", "matplotlib"}
    assert needs <= {re.split(r"[<>=!~ \[]", req)[0] for req in extras["analyze"]}
