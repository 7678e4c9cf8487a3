"""Every example users read runs: the docstring examples of the package (doctest) and the Python
blocks of README.md and docs/explain.md, on the bundled SmolLM2, in a scratch folder."""

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


# The pages whose Python blocks are examples to run as written (docs/explain.md: the triangulation's).
PAGES = ("README.md", "docs/explain.md")


def python_blocks(page: str = "README.md") -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_have_python_examples(page):
    assert python_blocks(page)


@pytest.mark.parametrize(("page", "index"), [(page, i) for page in PAGES for i in range(len(python_blocks(page)))])
def test_python_blocks_run(page, index, default_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = python_blocks(page)[index]
    exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "__example__"})
