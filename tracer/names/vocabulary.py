"""A runtime's names for tracer's points, as data: one `Vocabulary` per runtime or dump format, keyed by
point, the way gguf-py's `TensorNameMap` keeps every source's names in one table keyed by tensor.

A vocabulary states a runtime's names once: for every family (`names`: point -> its names), and where
one family's graph names a point otherwise (`families`: family -> point -> its names, replacing those
points' names for that family). A point is a model point (`model.norm`) or a sub-point, named for every
layer with `{i}` in the pattern (`blocks.{i}.attn.q_proj`). Names the runtime writes that hold nothing
tracer has a point for are listed with why (`skipped`), never dropped silently. Registering one
(`register`) is all a runtime's names need: the alias table (`tracer.names.aliases`) reads every
registered vocabulary, and an engine reads its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar

from tracer.core.errors import TracerError
from tracer.model.component import Family, registry_version
from tracer.model.points import layer_point

LAYOUTS = ("THD", "HTD")  # a per-head tensor [T, H, D] or [H, T, D]
QK_ORDERS = ("half", "interleaved")


@dataclass(frozen=True)
class Name:
    """One name of one point in a runtime.

    Attributes:
        pattern: the name, `{i}` for the layer.
        layout: how this name's per-head tensor is laid out ("THD", "HTD"); None: its vocabulary's layout.
        qk_order: "interleaved" where q/k come in GGUF's permuted order (llama.cpp's graph).
        writes: a name written more than once per graph: the ops whose write of it is this point,
            e.g. ("ROPE",) (llama.cpp's `Qcur-{i}`: the matmul, a view of it, the RoPE).
        dump: a dump keeping one tensor per name keeps this point under it (False: another write of the
            same name is the one a dump keeps).
        call: which call of a module gives the point (mlx-lm's RoPE module: queries 0, keys 1).
        side: "output" or "input" of that call; "input[1]" its second argument; "output*", "output*.sum",
            "output*.sum+": what the runtime's code then does with the output, the operand it is multiplied by,
            that product's sum, the operand added to that sum (mlx-lm's MoE blocks, `tracer.engines.mlx.Following`).
        unindexed: the runtime writes the name without its layer (`pattern` less its "-{i}": llama.cpp's
            `cb(cur, "ffn_post_norm", -1)` inside a layer); its engine reads the layer off the nodes around
            it (a dump of such names, one tensor per name, matches no pattern: said unknown).
    """

    pattern: str
    layout: str | None = None
    qk_order: str = "half"
    writes: tuple[str, ...] = ()
    dump: bool = True
    call: int = 0
    side: str = "output"
    unindexed: bool = False


# point -> its names: a bare string is a `Name` with nothing more to say
Names = Mapping[str, tuple["str | Name", ...]]


@dataclass(frozen=True)
class Vocabulary:
    """One runtime's (or dump format's) names for tracer's points.

    Attributes:
        runtime: the key a trace's sources name it by ("candle", "ggml", "transformer_lens", ...).
        what: one line, whose names these are.
        layout: how its per-head tensors are laid out when their shape cannot tell (T == H).
        names: point -> its names, in every family that has the point.
        families: family -> point -> its names where that family's graph differs: they replace the
            point's `names` for that family (`()`: the point has no name there) and win over a name
            another point of `names` has.
        skipped: names it writes that hold no point -> why (said, never dropped silently).
        tokens: names of the integer tensors that hold the token ids.
        derived: names read off another table rather than written here: family -> point -> names
            (GGUF's, from gguf-py's `TensorNameMap`).
        aliases: its names map a dump's tensors onto points (False: only its engine reads them, e.g.
            mlx-lm's module calls, relative to a layer).
    """

    runtime: str
    what: str
    layout: str
    names: Names = field(default_factory=dict)
    families: Mapping[str, Names] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)
    tokens: tuple[str, ...] = ()
    derived: Callable[[Family], Mapping[str, tuple[Name, ...]]] | None = None
    aliases: bool = True

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise TracerError(f"vocabulary {self.runtime!r}: layout {self.layout!r}; expected THD or HTD")
        bad = [name.pattern for table in (self.names, *self.families.values()) for names in table.values()
               for name in map(named, names) if name.layout not in (None, *LAYOUTS) or name.qk_order not in QK_ORDERS]
        if bad:
            raise TracerError(f"vocabulary {self.runtime!r}: {bad[0]!r} has an unknown layout or q/k order")

    def for_family(self, family: Family) -> dict[str, tuple[Name, ...]]:
        """Point (a model point, or a sub-point) -> its names in `family`, for the points it has:
        the family's own names first where it states them, then the names every family shares."""
        own = self.families.get(family.name, {})
        derived = self.derived(family) if self.derived else {}
        found = {}
        for point in [*family.model_points(), *family.sub_points()]:
            names = own[point] if point in own else self.names.get(point, ())
            names = (*map(named, names), *derived.get(point, ()))
            if names:
                found[point] = names
        return found

    def written(self) -> set[str]:
        """Every name written in it (not `derived`): its points' in every family, and those it skips."""
        names = {named(name).pattern for table in (self.names, *self.families.values())
                 for each in table.values() for name in each}
        return names | set(self.skipped)

    def patterns(self, family: Family) -> dict[str, tuple[Name, ...]]:
        """`for_family` keyed by folded point (`model.layers.{i}.self_attn.q_proj`, `model.norm`), the points
        the family states its own names for first (where two points share a name, theirs wins)."""
        found, own, subs = self.for_family(family), self.families.get(family.name, {}), family.sub_points()
        order = [*(point for point in found if point in own), *(point for point in found if point not in own)]
        return {layer_point("{i}", point) if point in subs else point: found[point] for point in order}


def named(name: str | Name) -> Name:
    return name if isinstance(name, Name) else Name(name)


def pattern_regex(pattern: str) -> re.Pattern:
    """A name pattern as a regular expression, `{i}` capturing the layer: "Qcur-{i}" matches "Qcur-3"."""
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


# --- the registry -------------------------------------------------------------------------------------

_REGISTRY: dict[str, Vocabulary] = {}
_VERSION = [0]  # changes with every registration: what is read off the registry is cached per version


def register(vocabulary: Vocabulary) -> Vocabulary:
    """Add a runtime's vocabulary (or replace one of the same runtime); returns it."""
    _REGISTRY[vocabulary.runtime] = vocabulary
    _VERSION[0] += 1
    return vocabulary


def unregister(runtime: str) -> None:
    """Remove a vocabulary (a test's made-up one, when the test is done)."""
    if _REGISTRY.pop(runtime, None) is not None:
        _VERSION[0] += 1


def registered() -> dict[str, Vocabulary]:
    """runtime -> vocabulary, in registration order."""
    return dict(_REGISTRY)


T = TypeVar("T")
_STATE = ("registries",)  # the cache's own key: no family is named by a tuple


def per_family(cache: dict, family: str | None, build: Callable[[], T]) -> T:
    """`build()` once per family while neither the families nor the vocabularies change (what is read off
    them is cached in `cache`, emptied when either registry changes)."""
    state = (registry_version(), _VERSION[0])
    if cache.get(_STATE) != state:
        cache.clear()
        cache[_STATE] = state
    if family not in cache:
        cache[family] = build()
    return cache[family]
