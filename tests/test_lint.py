"""The code passes ruff's lint and format checks (pyproject.toml's ``[tool.ruff]``), as the test suite
sees it: the same command that runs the tests runs these checks. Skipped where ruff is not installed
(the ``test`` extra installs it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("rollplex", "tests")


def _ruff() -> str:
    """The ruff executable: the one the ``ruff`` package ships, else one on PATH; skips the test if none."""
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        found = shutil.which("ruff")
    else:
        found = str(find_ruff_bin())
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return found


@pytest.mark.parametrize("command", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff(command):
    result = subprocess.run(
        [_ruff(), *command, *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"
