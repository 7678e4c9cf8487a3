"""Every example users read runs: the docstring examples of the package (doctest) and the Python
blocks of README.md, on the bundled SmolLM2, in a scratch folder."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest
import torch

import tracer
from tests.unit.test_structure import modules

ROOT = Path(__file__).resolve().parents[2]


def modules_with_examples() -> list[str]:
    return [name for name, path in modules().items() if ">>>" in path.read_text()]


def test_examples_are_found():
    expected = {"tracer", "tracer.api", "tracer.comparison.result", "tracer.traces.trace"}
    assert expected <= set(modules_with_examples())


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name, default_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples write reports and traces where they stand
    module = importlib.import_module(name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module, name, extraglobs={"tracer": tracer, "torch": torch}) if t.examples]
    assert tests, f"{name} has '>>>' in its source but no doctest was found"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} failing example(s) in {name} (see the output above)"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert readme_python_blocks()


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_blocks_run(index, default_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = readme_python_blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__example__"})
