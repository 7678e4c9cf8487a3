"""The package's shape: no import cycle among tracer, tracer.hooks and tracer.reports, no import up the
layers, no private name imported across modules, and the commands that need no model start without torch."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# folder -> the package it is installed as (pyproject's package-dir)
PACKAGES = {"tracer": "tracer", "hooks": "tracer.hooks", "reports": "tracer.reports"}


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the three packages, by its installed name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts])
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement, function bodies included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            found += [(sub, []) for sub in submodules]
            if len(submodules) < len(names):
                found.append((base, [n for n in names if f"{base}.{n}" not in known]))
    return [(target, names) for target, names in found if target in known and target != name]


@functools.cache
def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target, _ in imports(name, path, known)} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_real_imports():
    graph = import_graph()
    assert "tracer.pipeline.commands" in graph["tracer.api"]  # `from tracer.pipeline import commands` too
    assert "tracer.engines.base" in graph["tracer.engines.hf"]  # relative and absolute both resolved
    assert "tracer.reports.summary" in graph["tracer.reports.terminal"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_tracer_hooks_and_reports():
    assert cycles(import_graph()) == []


def drawn_layers(design: str) -> list[tuple[str, set[str]]]:
    """The layers, lowest first, as docs/design.md draws them: the first ```text block of its Layout
    section, one floor a line, top floor first, its name then its modules two spaces or more apart (`X.*`:
    the package and every module in it, held as "X" and the prefix "X.")."""
    block = re.search(r"## Layout\n.*?```text\n(.*?)```", design, flags=re.S).group(1)
    layers = []
    for line in block.strip().splitlines():
        name, *members = re.split(r"\s{2,}", line.strip())
        modules = set()
        for member in members:
            modules |= {member[:-2], member[:-1]} if member.endswith(".*") else {member}
        layers.append((name, modules))
    return layers[::-1]


# A module imports from its own layer or a lower one, never a higher one (function-level imports included).
# A name ending in "." is a whole package. A new module gets a place in the drawing.
LAYERS = drawn_layers(DESIGN.read_text())


def test_the_drawing_is_read():
    names = [name for name, _ in LAYERS]
    assert names[0] == "foundation" and names[-1] == "api and cli" and len(names) == len(set(names)) >= 10
    assert layer_of("tracer.files.tensorfile") < layer_of("tracer.traces.trace") < layer_of("tracer.files.sources")
    assert layer_of("tracer.traces") == layer_of("tracer.traces.spill")


def test_the_prose_follows_the_drawing():
    """The numbered floors under the drawing are its layers, lowest first, in its words."""
    section = DESIGN.read_text().split("## Layout\n")[1].split("\n## ")[0]
    assert re.findall(r"^\d+\. \*\*(.+?)\*\*", section, flags=re.M) == [name for name, _ in LAYERS]


def test_below_the_engines_nothing_imports_the_comparison():
    engines = layer_of("tracer.engines")
    below = {name for name in modules() if layer_of(name) < engines and not name.startswith("tracer.comparison")}
    graph = import_graph()
    assert [(name, target) for name in below for target in graph[name] if target.startswith("tracer.comparison")] \
        == []


def layer_of(module: str) -> int | None:
    for index, (_, members) in enumerate(LAYERS):
        if module in members or any(m.endswith(".") and module.startswith(m) for m in members):
            return index
    return None


def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
            for name, targets in graph.items() for target in sorted(targets) if layer_of(target) > layer_of(name)]


def test_no_import_runs_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    # what variants.py did before knobs carried their kind: it asked the engine registry
    assert upward_imports({"tracer.model.knobs": {"tracer.engines.registry", "tracer.model.families"}}) == [
        "tracer.model.knobs (the model) imports tracer.engines.registry (engines)"]


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [(name, target, taken) for name, path in known.items() for target, names in imports(name, path, known)
               for taken in names if taken.startswith("_") and taken != "__version__"]
    assert private == []


def function_level_imports() -> list[tuple[str, int, str, bool]]:
    """(module, line, statement, whether its lines carry a comment) for every import inside a function."""
    found = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    text = lines[node.lineno - 1:node.end_lineno]
                    found.append((name, node.lineno, " ".join(t.strip() for t in text), any("#" in t for t in text)))
    return sorted(set(found))


def test_an_import_inside_a_function_says_what_it_defers():
    """An import is at the top of its module unless it defers something heavy (torch where a module must load
    without it, a runtime, matplotlib, ...), which a comment on its line says; a cycle is no reason (the layer
    test forbids those, function-level imports included)."""
    silent = [f"{name}:{line}: {text}" for name, line, text, commented in function_level_imports() if not commented]
    assert silent == []


def test_the_function_level_import_finder_finds_one():
    assert ("tracer.cli", "from tracer.pipeline import commands") in {
        (name, text.split("  #")[0]) for name, _, text, _ in function_level_imports()}


@pytest.mark.slow  # a fresh process
def test_listing_variants_and_engines_leaves_torch_out():
    code = ("import sys, tracer.cli; tracer.cli.main(['variants']); tracer.cli.main(['engines']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
    assert "kv_repeat" in out and "file:PATH" in out


@pytest.mark.slow  # a fresh process
def test_importing_the_model_leaves_torch_out():
    """The model's declarations hold their forward code (torch imported when first used), yet reading
    them (families, points, knobs, config) and other runtimes' names for them never loads torch."""
    code = ("import sys, tracer.model.families, tracer.names.aliases, tracer.model.config, tracer.model.points as p; "
            "p.all_points(2, 'gemma3'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_documented_functions_are_the_package_attributes():
    import tracer
    import tracer.reports

    for name in ("record", "run", "sweep", "diagnose", "compare", "compare_files", "quality"):
        assert callable(getattr(tracer, name)), name
    assert tracer.sweep.__module__ == tracer.diagnose.__module__ == "tracer.api"  # no module shadows them
    assert tracer.quality.__module__ == "tracer.api"
    for name in tracer.reports.__all__:  # every advertised report function exists
        assert getattr(tracer.reports, name) is not None, name


def test_every_engine_module_and_knob_in_the_registry_exists():
    import importlib.util

    from tracer.engines.registry import ENGINES, engines_honouring
    from tracer.model.knobs import KINDS, KNOBS

    for entry in ENGINES.values():
        assert importlib.util.find_spec(entry.module) is not None, entry.module
        assert set(entry.knobs) <= set(KNOBS), entry.name
        assert set(entry.kinds) <= set(KINDS), entry.name
    assert all(engines_honouring(name) for name in KNOBS)  # every knob has an engine that honours it


def test_the_suites_file_lists_name_existing_test_files():
    """A renamed file would silently leave the quick tier or the longest-first order."""
    from tests.conftest import LONGEST_FILES, SLOW_UNIT_FILES

    tests = Path(__file__).resolve().parents[1]
    names = {p.name for p in tests.rglob("test_*.py")}
    assert set(LONGEST_FILES) | SLOW_UNIT_FILES <= names
    assert SLOW_UNIT_FILES <= {p.name for p in (tests / "unit").glob("test_*.py")}
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
