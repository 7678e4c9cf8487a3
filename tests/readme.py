"""The README's recipes ("Trace your port") as the tests run them: every line of a recipe, as written,
in a scratch folder where the files it names stand for the user's (links to the bundled model)."""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]


def recipes() -> dict[str, list[str]]:
    """Recipe title ("A live runtime", ...) -> its command lines, from README.md."""
    section = (ROOT / "README.md").read_text().split("## Trace your port")[1].split("\n## ")[0]
    found = re.findall(r"\*\*(A [^*]+)\*\*.*?```sh\n(.*?)```", section, flags=re.S)
    return {title: block.strip().splitlines() for title, block in found}


def run_recipe(title: str, folder: Path, files: dict[str, Path]) -> None:
    """Run recipe `title` in `folder`, where `files` (a name the recipe uses -> the file or folder it
    stands for) are linked first. An install line must be the registry's install command for its
    engine; where that runtime is missing the test skips, naming the line."""
    from tracer.cli import main
    from tracer.engines.registry import ENGINES

    for name, target in files.items():
        (folder / name).symlink_to(target)
    for line in recipes()[title]:
        if " pip install " in f" {line}":
            entry = next((e for e in ENGINES.values() if e.install == line), None)
            assert entry is not None, f"{line!r} is no engine's install command (tracer.engines.registry)"
            if entry.missing_runtime():
                pytest.skip(f"the {entry.name} runtime is not installed: {line}")
            continue
        words = shlex.split(line)
        assert words[0] == "tracer", line
        with contextlib.chdir(folder), mock.patch.object(sys, "argv", words):  # the report's command lines
            assert main(words[1:]) == 0, line
