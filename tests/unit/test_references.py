"""No stale references: every file path and every dotted `tracer.` name written in backticks in the
README, docs/*.md and the docstrings and comments of tracer/, hooks/ and reports/ exists.

A path (`tracer/config.py`, `tests/unit/test_matrix.py`, `docs/engines.md`, `tests/unit`) names a file
or folder of the repository. A dotted name (`tracer.files.sources`, `tracer.comparison.diff.compare`,
`tracer.traces.trace.TraceMeta.to_dict`) names a module, then a name that module defines, then a
name that class defines. Modules are parsed,
never imported, so the check stays fast and needs no runtime. Only what is wholly a path or a
dotted name (or a call or subscript of one: `tracer.run(model=...)`) is checked: a placeholder
(`tracer/engines/<name>.py`), an expression or a command line is prose, not a reference.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# installed package -> the folder it is in (pyproject's package-dir)
FOLDERS = {"tracer.hooks": "hooks", "tracer.reports": "reports", "tracer": "tracer"}
CODE = ("tracer", "hooks", "reports")

INLINE = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
PATH = re.compile(r"(?:tracer|hooks|reports|tests|docs|bench|notebooks)(?:/[\w.-]+)+/?")
DOTTED = re.compile(r"(tracer(?:\.[A-Za-z_]\w*)+)(?:\(.*\)|\[.*\])?")


def code_text(path: Path) -> str:
    """A module's docstrings and comments, where it says what it refers to in prose."""
    source = path.read_text()
    nodes = [node for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docstrings = [ast.get_docstring(node, clean=False) or "" for node in nodes]
    comments = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    return "\n".join(docstrings + comments)


def texts() -> dict[str, str]:
    """Where each reference is written -> the text it is written in."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {str(page.relative_to(ROOT)): FENCED.sub("", page.read_text()) for page in pages}
    for folder in CODE:
        found |= {str(path.relative_to(ROOT)): code_text(path) for path in sorted((ROOT / folder).rglob("*.py"))}
    return found


def module_file(name: str) -> Path | None:
    """tracer.engines.base -> tracer/engines/base.py (a package: its __init__.py); None if no such module."""
    package = next(p for p in FOLDERS if name == p or name.startswith(p + "."))
    stem = ROOT / FOLDERS[package] / Path(*name[len(package):].lstrip(".").split(".") if name != package else ())
    for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
        if candidate.is_file() and candidate.name != ".py":
            return candidate
    return None


def body_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body defines (functions, classes, assignments, imports) -> their node."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {leaf.id: node for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0]: node for alias in node.names}
    return names


@functools.cache
def module_names(path: Path) -> dict[str, ast.AST]:
    """What a module defines; a module with a `__getattr__` also what its lazy tables (dicts of names
    -> where they live) export."""
    body = ast.parse(path.read_text()).body
    names = body_names(body)
    if "__getattr__" in names:
        for node in body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                names |= {key.value: node for key in node.value.keys if isinstance(key, ast.Constant)}
    return names


def class_names(node: ast.ClassDef) -> set[str]:
    """What a class defines in its body, and what its methods assign to self."""
    assigned = {leaf.attr for leaf in ast.walk(node) if isinstance(leaf, ast.Attribute)
                and isinstance(leaf.ctx, ast.Store) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self"}
    return set(body_names(node.body)) | assigned


def missing_part(name: str) -> str | None:
    """None where `name` exists; else what of it does not."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            break
    else:
        return name
    rest = parts[cut:]
    if not rest:
        return None
    node = module_names(path).get(rest[0])
    if node is None:
        return f"{'.'.join(parts[:cut])} has no {rest[0]}"
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in class_names(node):
        return f"{'.'.join(parts[:cut + 1])} has no {rest[1]}"
    return None  # past a class's own names (an attribute's attribute), prose, not checked


def stale(written: dict[str, str]) -> list[str]:
    found = []
    for where, text in written.items():
        for reference in INLINE.findall(text):
            reference = reference.strip()
            if PATH.fullmatch(reference):
                if not (ROOT / reference).exists():
                    found.append(f"{where}: `{reference}` is not there")
            elif dotted := DOTTED.fullmatch(reference):
                missing = missing_part(dotted.group(1))
                if missing:
                    found.append(f"{where}: `{reference}`: {missing}")
    return found


def test_every_path_and_dotted_name_in_the_docs_and_the_code_exists():
    assert stale(texts()) == []


def test_a_stale_path_or_name_is_found_and_prose_is_not():
    written = {"page": "`tracer/model.py`, `tracer.files.sources.resolve_model`, `tracer.model.load`, "
                       "`tracer.traces.trace.TraceMeta.nonsense`, `tracer.comparison.diff.compare(a, b)`, "
                       "`tracer.hooks.HFEngine`, "
                       "`tracer.model.knobs.KNOBS[name]`, `tests/unit`, "
                       "`tracer/engines/<name>.py`, `tracer run --variant theta=10000`, `docs/design.md`"}
    assert stale(written) == [
        "page: `tracer/model.py` is not there",
        "page: `tracer.model.load`: tracer.model has no load",
        "page: `tracer.traces.trace.TraceMeta.nonsense`: tracer.traces.trace.TraceMeta has no nonsense",
    ]
