"""The alias table: every registered runtime vocabulary (`tracer.names.vocabulary`) gathered into one
table of names -> points, which maps a foreign dump's tensors onto points (`rename`).

A port dumps its intermediate tensors under the names its own code uses: candle's llama.rs field
names (`blocks.3.mlp.c_proj`), the ggml graph names llama.cpp's eval callback prints (`ffn_out-3`),
TransformerLens hook names (`blocks.3.hook_mlp_out`), GGUF tensor names for the modules holding those
weights, or HF module paths (MLX's mlx-lm uses the same paths). Each runtime declares its names in its
own vocabulary module (`tracer.names.candle`, ...; the built-in ones are registered here); `aliases()`
gathers them over the registered families, and a user mapping file (JSON
`{"their_name_pattern": "our_point_pattern"}`) extends and overrides them. A name that maps nowhere is
listed, never dropped silently; names known to hold something tracer has no point for are listed with
why (each vocabulary's `skipped`).

Each alias also says how that runtime lays the tensor out, for `tracer.traces.layouts`:
`layout` is the natural order of a per-head tensor ("THD": [T, H, D], "HTD": [H, T, D]) used
when the shape alone is ambiguous (T == H), and `qk_order` is "interleaved" where q/k rows are
in GGUF's order (llama.cpp's converter permutes the q/k weight rows so that RoPE pairs are
adjacent; the activations come out permuted the same way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tracer.core.errors import TracerError, one_line
from tracer.model.component import family_named
from tracer.model.component import registered as families
from tracer.model.points import known_model_points, known_sub_points, model_point_records, split_point, sub_points
from tracer.names import candle, gguf, hf, llamacpp, mlx, transformer_lens  # noqa: F401  (registers the built-ins)
from tracer.names.hf import HF
from tracer.names.vocabulary import Vocabulary, pattern_regex, per_family, registered

# Integer tensors holding the token ids, in tracer's own dump format; each vocabulary adds its runtime's.
TOKENS = "tokens"


@dataclass(frozen=True)
class Alias:
    """One runtime's name (pattern with `{i}`) for one point."""

    pattern: str
    point: str
    runtime: str
    layout: str | None = None  # "THD" or "HTD" for per-head tensors of this runtime
    qk_order: str = "half"  # "interleaved": q/k rows in GGUF order (llama.cpp)


def vocabularies() -> dict[str, Vocabulary]:
    """Every registered vocabulary (the built-ins registered by importing this module), by runtime."""
    return registered()


def aliases(family: str | None = None) -> list[Alias]:
    """Every registered vocabulary's names as aliases, in `family`'s graph; None: over every registered
    family, the first family's alias for a (runtime, name) winning (Llama's, registered first). A name
    written more than once per graph (`Name.writes`) is its dump's alias only where it says `dump`."""
    return per_family(_ALIASES, family, lambda: _gathered(family))


_ALIASES: dict = {}


def _gathered(family: str | None) -> list[Alias]:
    table: dict[tuple[str, str], Alias] = {}
    for row in [family_named(family)] if family else families().values():
        for vocabulary in registered().values():
            if not vocabulary.aliases:
                continue
            for point, names in vocabulary.patterns(row).items():
                for name in names:
                    if name.dump:
                        table.setdefault((vocabulary.runtime, name.pattern),
                                         Alias(name.pattern, point, vocabulary.runtime,
                                               name.layout or vocabulary.layout, name.qk_order))
    return list(table.values())


def skipped_names() -> dict[str, str]:
    """Names other runtimes record that hold something no point holds -> why: skipped, and said so."""
    return {name: why for vocabulary in registered().values() for name, why in vocabulary.skipped.items()}


def token_names() -> tuple[str, ...]:
    """Names of the integer tensors a dump may hold its token ids in, tracer's own first."""
    return (TOKENS, *(name for vocabulary in registered().values() for name in vocabulary.tokens))


def is_point(name: str) -> bool:
    """A name of tracer's vocabulary (for any number of layers)."""
    layer, sub = split_point(name)
    return name in known_model_points() if layer is None else sub in known_sub_points()


def _is_point_pattern(pattern: str) -> bool:
    return is_point(pattern.replace("{i}", "0"))


@dataclass(frozen=True)
class Resolved:
    """Where one of their names lands: our point, and the alias that took it there."""

    name: str
    point: str
    alias: Alias


class AliasTable:
    """The registered vocabularies' aliases (in `family`'s graph; None: every family's), extended (and
    overridden, entries first) by a user mapping.

    Example:
        >>> table = AliasTable()
        >>> table.resolve("blocks.3.mlp.c_proj").point
        'model.layers.3.mlp.down_proj'
        >>> table.resolve("l_out-3").point
        'model.layers.3'
    """

    def __init__(self, user: dict[str, str | None] | None = None, family: str | None = None):
        user = user or {}
        self.family = family
        self.ignored = {pattern for pattern, point in user.items() if point is None}
        # A user entry inherits the layout hints of a built-in alias with the same name pattern
        # (Qcur-{i} stays in GGUF order whatever point it is sent to).
        builtin = {a.pattern: a for a in aliases(family)}
        users = [Alias(p, point, "user", builtin[p].layout if p in builtin else None,
                       builtin[p].qk_order if p in builtin else "half")
                 for p, point in user.items() if point is not None]
        self.aliases = [*users, *aliases(family)]
        self._users = len(users)
        self._compiled = [(pattern_regex(a.pattern), a) for a in self.aliases]
        self._skipped = [(pattern_regex(p), reason) for p, reason in skipped_names().items() if p not in user]
        self._ignored = [pattern_regex(p) for p in self.ignored]

    def resolve(self, name: str) -> Resolved | None:
        """Our point for `name`, or None when no alias matches (see `skip_reason`). A user's entry
        first; then a point's own name (HF module paths, also MLX's mlx-lm: a family whose MLP output is
        the `mlp` module's is not renamed by Llama's `mlp` alias); then the built-in aliases."""
        for index, (regex, alias) in enumerate(self._compiled):
            if index == self._users and self._own_point(name):
                return Resolved(name, name, Alias(name, name, HF.runtime, HF.layout))
            match = regex.match(name)
            if match:
                point = alias.point.replace("{i}", match.group(1)) if match.groups() else alias.point
                return Resolved(name, point, alias)
        if is_point(name):
            return Resolved(name, name, Alias(name, name, HF.runtime, HF.layout))
        return None

    def _own_point(self, name: str) -> bool:
        """A point's own name, before the built-in aliases: a point of the table's family; without a family,
        a point no built-in alias also names (`model.layers.3.mlp` is a mixture of experts' MLP output, and
        transformers' dense MLP module, whose output is down_proj's: dense unless the family says otherwise)."""
        layer, sub = split_point(name)
        if self.family is not None:
            return name in model_point_records(self.family) if layer is None else sub in sub_points(self.family)
        return is_point(name) and not any(regex.match(name) for regex, _ in self._compiled[self._users:])

    def skip_reason(self, name: str) -> str | None:
        """Why a known name is not compared (None: not a known name)."""
        if any(regex.match(name) for regex in self._ignored):
            return "ignored by the aliases file"
        return next((reason for regex, reason in self._skipped if regex.match(name)), None)


def load_alias_file(path: str | Path) -> dict[str, str | None]:
    """Read a user mapping: a JSON object {"their_name_pattern": "our_point_pattern" or null}.

    `{i}` stands for the layer index on both sides; null skips the name on purpose.

    Raises:
        TracerError: unreadable file, not an object of strings, a target that is not a point,
            or `{i}` on one side only.
    """
    path = Path(path)
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TracerError(f"cannot read aliases file {path}: {one_line(exc)}") from None
    if not isinstance(mapping, dict):
        raise TracerError(f"aliases file {path}: expected a JSON object {{\"their_name\": \"our_point\"}}")
    for theirs, ours in mapping.items():
        if ours is not None and not isinstance(ours, str):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}; expected a point name or null")
        if ours is None:
            continue
        if not _is_point_pattern(ours):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}, which is not a tracer point "
                              f"(e.g. model.layers.{{i}}.mlp.down_proj; see docs/trace-format.md)")
        if ("{i}" in ours) != ("{i}" in theirs):
            raise TracerError(f"aliases file {path}: {theirs!r} -> {ours!r}: use {{i}} on both sides or neither")
    return mapping


def alias_table(aliases=None) -> AliasTable:
    """An AliasTable from None, a mapping, a path to a mapping file, or an AliasTable."""
    if isinstance(aliases, AliasTable):
        return aliases
    if aliases is None:
        return AliasTable()
    if isinstance(aliases, dict):
        return AliasTable(aliases)
    return AliasTable(load_alias_file(aliases))


@dataclass
class Renamed:
    """A foreign file's tensors under our point names, with what did not make it."""

    tensors: dict  # point -> tensor, in the file's order
    sources: dict[str, dict]  # point -> {"name", "runtime", "layout", "qk_order"}
    unknown: list[str]  # names no alias matches
    skipped: dict[str, str]  # known names without a point -> why
    duplicates: dict[str, list[str]]  # point -> the other names that also mapped to it (not used)
    # point -> {a duplicate whose tensor is not the compared one's: max|diff| to it, or None (another shape)}
    differing: dict[str, dict[str, float | None]] = field(default_factory=dict)


def rename(tensors: dict, table: AliasTable) -> Renamed:
    """Map every name of a foreign file onto a point; the first name to reach a point wins."""
    out = Renamed({}, {}, [], {}, {})
    for name, tensor in tensors.items():
        resolved = table.resolve(name)
        if resolved is None:
            reason = table.skip_reason(name)
            if reason:
                out.skipped[name] = reason
            else:
                out.unknown.append(name)
            continue
        if resolved.point in out.tensors:
            out.duplicates.setdefault(resolved.point, []).append(name)
            kept = out.tensors[resolved.point]
            # one point, one tensor in a correct forward (a module and the child that returns its output);
            # where a dump's two differ, the one not compared could hide a fault: measured, said
            if kept.shape != tensor.shape:
                out.differing.setdefault(resolved.point, {})[name] = None
            elif not kept.equal(tensor):
                difference = (tensor.double() - kept.double()).abs().max()
                out.differing.setdefault(resolved.point, {})[name] = float(difference)
            continue
        alias = resolved.alias
        out.tensors[resolved.point] = tensor
        out.sources[resolved.point] = {"name": name, "runtime": alias.runtime, "layout": alias.layout,
                                       "qk_order": alias.qk_order}
    return out
