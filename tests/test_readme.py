"""The README's two newcomer commands stay true: CI runs the second one verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line.strip() for line in lines[1:8] if line.startswith("    ")][:2]


def test_readme_starts_with_install_and_test_commands():
    install, test = _readme_commands()
    assert install.endswith("ps-mcore demo") and "pip install" in install
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _readme_commands()[1] in ci
