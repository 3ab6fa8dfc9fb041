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


def test_ci_builds_in_its_own_directory_and_leaves_a_users_venv_alone():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "rm -rf .ci/.venv" in ci and "python3 -m venv .ci/.venv" in ci
    assert not re.search(r"rm -rf \.?/?\.venv\b", ci)
    assert "/.ci/.venv/" in (ROOT / ".gitignore").read_text().splitlines()
    assert 'PY312="$(.ci/find-python312)"' in ci


def _find_python312(tmp_path, **env):
    """Run .ci/find-python312 with a PATH holding only tmp_path/bin and ``cat`` (no system
    python3.12, pyenv or uv) and HOME = tmp_path."""
    import shutil
    import subprocess

    tools = tmp_path / "tools"
    if not tools.exists():
        tools.mkdir()
        (tools / "cat").symlink_to(shutil.which("cat"))
    full = {"PATH": f"{tmp_path / 'bin'}:{tools}", "HOME": str(tmp_path), **env}
    return subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "find-python312")],
                          capture_output=True, text=True, env=full, timeout=60)


def _fake_python(path: Path, version_ok: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {0 if version_ok else 1}\n")  # answers the version check
    path.chmod(0o755)
    return path


def test_ci_finds_a_python312_the_usual_ways_or_says_how_to_get_one(tmp_path):
    import shutil

    if shutil.which("bash") is None or shutil.which("cat") is None:
        pytest.skip("needs bash")
    nothing = _find_python312(tmp_path)  # empty HOME, no python3.12, pyenv or uv on PATH
    assert nothing.returncode == 1 and nothing.stdout == ""
    assert "No Python 3.12 interpreter found" in nothing.stderr and "PY312=" in nothing.stderr
    pyenv = _fake_python(tmp_path / ".pyenv" / "versions" / "3.12.7" / "bin" / "python3.12", True)
    assert _find_python312(tmp_path).stdout.strip() == str(pyenv)
    on_path = _fake_python(tmp_path / "bin" / "python3.12", True)
    assert _find_python312(tmp_path).stdout.strip() == str(on_path)  # PATH before pyenv
    explicit = _fake_python(tmp_path / "py" / "python", True)
    assert _find_python312(tmp_path, PY312=str(explicit)).stdout.strip() == str(explicit)
    wrong = _fake_python(tmp_path / "py" / "python3.11", False)
    bad = _find_python312(tmp_path, PY312=str(wrong))
    assert bad.returncode == 1 and f"PY312={wrong} is not a Python 3.12 interpreter" in bad.stderr
