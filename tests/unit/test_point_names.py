"""Literal point names appear only where points are declared: the point vocabulary
(`tracer/model/points.py`) and the components (`tracer/model/components/`). Everything else under
`tracer/`, `hooks/` and `reports/` names a point by a constant of the vocabulary or through a
component's declaration, so that a point is named in one place and a slip (a name nothing records)
cannot be typed. Another runtime's name that happens to share a part with a point (candle's
`blocks.{i}.attn.q_proj`) is that runtime's, declared in its vocabulary (`tracer.names`), not ours."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tracer.model.points import known_model_points, known_sub_points
from tracer.names.aliases import vocabularies

ROOT = Path(__file__).resolve().parents[2]
DECLARATIONS = ("tracer/model/points.py", "tracer/model/components/")


def point_pattern() -> re.Pattern:
    """Any registered family's point name (per-layer, or outside the blocks), or the last part of one
    with an underscore (`q_rope`, `o_proj`), as a dotted component of a name-shaped string: a name, a
    pattern (`blocks.{i}.attn.q_rope`), a weight (`lm_head.weight`), an f-string's `.q_rope`."""
    # a one-word point (a mixture of experts' output, "mlp") is also the word every runtime's module paths
    # under it start with ("mlp.act_fn", TransformerLens' "mlp.in"): not scanned, as a leaf without "_" is not
    names = {name for name in (*known_sub_points(), *known_model_points()) if name and "." in name or "_" in name}
    names |= {name.rsplit(".", 1)[-1] for name in names if "_" in name.rsplit(".", 1)[-1]}
    leaves = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(rf"(?:^|[.{{}}])({leaves})(?=$|[.])")


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def runtime_names() -> frozenset[str]:
    """Every name a registered runtime vocabulary writes down (its points' names and those it skips)."""
    return frozenset(name for vocabulary in vocabularies().values() for name in vocabulary.written())


def literal_point_names(source: str, pattern: re.Pattern, theirs: frozenset = frozenset()) -> list[tuple[int, str]]:
    """(line, literal) for every name-shaped string constant of `source` naming a point (docstrings,
    comments and prose, which has spaces, are not names; nor are `theirs`, other runtimes' names)."""
    tree = ast.parse(source)
    skipped = docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped
            and not re.search(r"\s", node.value) and node.value not in theirs and pattern.search(node.value)]


def test_the_scan_sees_a_literal_point_name():
    source = ('"""q_rope in a docstring is prose."""\n'
              'record(f"{prefix}.q_rope", q)\nnames = ("lm_head.capped", "blocks.{i}.mlp.c_proj")\n'
              'message = "the q_rope point in prose"\nkeys = ("scores", "context", "qk_norm")\n')
    assert sorted(literal_point_names(source, point_pattern())) == [(2, ".q_rope"), (3, "lm_head.capped")]


def test_a_runtime_name_is_not_one_of_ours():
    source = 'candle = ("blocks.{i}.attn.q_proj",)\nours = "blocks.{i}.self_attn.q_proj"\n'
    assert literal_point_names(source, point_pattern(), runtime_names()) == [
        (2, "blocks.{i}.self_attn.q_proj")]


def test_point_names_are_written_only_where_points_are_declared():
    pattern, theirs = point_pattern(), runtime_names()
    found = []
    for folder in ("tracer", "hooks", "reports"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(DECLARATIONS):
                found += [f"{relative}:{line}: {literal!r}" for line, literal in
                          literal_point_names(path.read_text(), pattern, theirs)]
    assert found == []
