"""The README's two commands stay true: CI runs the test command exactly as written."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(python3 -m venv[^\n]*)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands():
    main_job, tests = readme_commands()
    assert main_job.endswith("tracer run --variant theta=10000")
    assert "pip install -q torch==2.13.0" in main_job.split("&&")[2]  # the CPU build before anything pulls torch
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    assert readme_commands()[1] in (ROOT / ".ci" / "run").read_text().splitlines()
