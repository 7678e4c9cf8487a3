"""The linter's verdict is part of the suite: `ruff check` with the configuration in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    checked = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                             text=True, cwd=ROOT)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-1000:]
