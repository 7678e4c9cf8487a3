"""Each runtime owns its vocabulary: its names for the points live in its vocabulary (`tracer/names/`) and
its switches in its engine's entry (`EngineEntry.switches`), never in the model layer (`tracer/model/`),
which states what a model computes in transformers' terms. The scan reads the model layer's string
constants for any name a runtime's vocabulary writes down, any runtime switch, and any runtime's or runtime
engine's key other than a knob's value (the reimplementation's emulation of a runtime: `ops=ggml`,
`preset=candle`), as tests/unit/test_point_names.py does for point names. The vocabularies and switches
themselves: every name keyed by a point some family has, a family's own names resolved for that family, a
switch joining the catalogue with its engine and leaving with it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_point_names import docstrings
from tracer.core.errors import TracerError
from tracer.engines.registry import EngineEntry, register, registered, unregister
from tracer.model.families import FAMILIES
from tracer.model.knobs import KNOBS, Knob, choice, fixed, parse_variant
from tracer.model.points import (
    INPUT_NORM,
    POST_ATTENTION_NORM,
    PRE_FF_NORM,
    known_model_points,
    known_sub_points,
    layer_point,
)
from tracer.names.aliases import AliasTable, vocabularies
from tracer.names.hf import HF
from tracer.names.vocabulary import Vocabulary, pattern_regex
from tracer.names.vocabulary import register as register_vocabulary
from tracer.names.vocabulary import unregister as unregister_vocabulary

ROOT = Path(__file__).resolve().parents[2]
MODEL_LAYER = ROOT / "tracer" / "model"


def ours(name: str) -> bool:
    """A point's own name (a sub-point, a model point, or a layer's): transformers' module path, not a runtime's."""
    return name in known_sub_points() or name in known_model_points() or name.startswith(layer_point("{i}", ""))


def runtime_vocabulary() -> dict[str, str]:
    """Every name a runtime's vocabulary writes down that is not also transformers' (hf's vocabulary is
    transformers' own names) -> the runtime."""
    transformers = HF.written()
    return {name: vocabulary.runtime for vocabulary in vocabularies().values() if vocabulary is not HF
            for name in vocabulary.written()
            if not ours(name) and name not in transformers and layer_point("{i}", name) not in transformers}


def switch_names() -> set[str]:
    return {switch.name for entry in registered().values() for switch in entry.switches}


def runtime_keys() -> set[str]:
    """Runtimes' keys (vocabularies', runtime engines') that are no knob's value."""
    values = {value for knob in KNOBS.values() for value in (knob.values or ())}
    keys = {vocabulary.runtime for vocabulary in vocabularies().values() if vocabulary is not HF}
    keys |= {entry.name for entry in registered().values() if entry.extra}
    return keys - values


def constants(source: str) -> list[tuple[int, str]]:
    """(line, text) of every name-shaped string constant (no whitespace; not a docstring), an f-string read
    with `{i}` for each of its fields."""
    tree = ast.parse(source)
    skipped, inside = docstrings(tree), set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside |= {id(value) for value in node.values}
            text = "".join(value.value if isinstance(value, ast.Constant) else "{i}" for value in node.values)
            found.append((node.lineno, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            found.append((node.lineno, node.value))
    return sorted((line, text) for line, text in found if not re.search(r"\s", text))


def runtime_literals(source: str) -> list[tuple[int, str, str]]:
    """(line, literal, whose) for every constant of `source` that is a runtime's name, switch or key."""
    names = [(pattern_regex(name), name, runtime) for name, runtime in runtime_vocabulary().items()]
    switches, keys = switch_names(), runtime_keys()
    found = []
    for line, text in constants(source):
        named = text.replace("{i}", "0")
        whose = next((f"{runtime}'s {name!r}" for regex, name, runtime in names if regex.match(named)), None)
        if whose is None and text.split("=")[0] in switches:
            whose = f"the switch {text.split('=')[0]!r}"
        if whose is None and text in keys:
            whose = "a runtime's key"
        if whose:
            found.append((line, text, whose))
    return found


def test_the_scan_sees_a_runtime_name_a_switch_and_a_key():
    source = ('"""candle\'s wte in a docstring is prose."""\n'
              'a = ("candle", "wte")\nb = f"blocks.{i}.attn.hook_z"\nc = "Qcur-{i}"\nd = "threads=1"\n'
              'e = "transformer_lens"\nf = ("config=candle", "ggml", "self_attn.o_proj", "output", "mlp")\n')
    assert [(line, text) for line, text, _ in runtime_literals(source)] == [
        (2, "wte"), (3, "blocks.{i}.attn.hook_z"), (4, "Qcur-{i}"), (5, "threads=1"), (6, "transformer_lens")]


def test_no_runtime_name_or_switch_is_written_in_the_model_layer():
    found = [f"{path.relative_to(ROOT)}:{line}: {text!r} ({whose})" for path in sorted(MODEL_LAYER.rglob("*.py"))
             for line, text, whose in runtime_literals(path.read_text())]
    assert found == []


def test_every_vocabulary_names_points_of_registered_families():
    """A name keyed by a point no family has, or a family no one registered, would map nothing, silently."""
    for vocabulary in vocabularies().values():
        assert set(vocabulary.families) <= set(FAMILIES), vocabulary.runtime
        for table in (vocabulary.names, *vocabulary.families.values()):
            unknown = [point for point in table if not (point in known_sub_points() or point in known_model_points())]
            assert unknown == [], (vocabulary.runtime, unknown)


@pytest.fixture
def toy_vocabulary():
    """A runtime naming Llama's norms one way, and Gemma 2's (a sandwich: the post-attention norm comes
    after the attention) another: `mid` is Llama's post-attention norm, Gemma 2's pre-MLP norm."""
    register_vocabulary(Vocabulary(
        "toy", "a made-up runtime", "THD", names={INPUT_NORM: ("in-{i}",), POST_ATTENTION_NORM: ("mid-{i}",)},
        families={"gemma2": {POST_ATTENTION_NORM: ("post-{i}",), PRE_FF_NORM: ("mid-{i}",)}}))
    yield
    unregister_vocabulary("toy")


def test_a_family_states_its_own_names_and_keeps_the_shared_ones(toy_vocabulary):
    gemma2, llama = AliasTable(family="gemma2"), AliasTable(family="llama")
    assert gemma2.resolve("mid-3").point == layer_point(3, PRE_FF_NORM)
    assert gemma2.resolve("post-3").point == layer_point(3, POST_ATTENTION_NORM)
    assert gemma2.resolve("in-3").point == layer_point(3, INPUT_NORM)  # shared: stated once, for every family
    assert llama.resolve("mid-3").point == layer_point(3, POST_ATTENTION_NORM) and llama.resolve("post-3") is None
    # a dump of unknown family: every family's names, the first registered family's (Llama's) where they differ
    assert AliasTable().resolve("mid-3").point == layer_point(3, POST_ATTENTION_NORM)
    assert AliasTable().resolve("post-3").point == layer_point(3, POST_ATTENTION_NORM)


def test_a_vocabulary_with_an_unknown_layout_is_refused():
    with pytest.raises(TracerError, match="layout 'TDH'"):
        Vocabulary("bad", "", "TDH")


SWITCH = Knob("toy_switch", choice("on", "off"), "on | off", "on", "a made-up runtime's switch", fixed(""),
              kind="runtime")


def test_a_switch_joins_the_catalogue_with_its_engine_and_leaves_with_it():
    assert "toy_switch" not in KNOBS
    register(EngineEntry("switched", __name__, "a made-up engine", switches=(SWITCH,)))
    try:
        assert KNOBS["toy_switch"] is SWITCH and parse_variant("toy_switch=off") == {"toy_switch": "off"}
        assert registered()["switched"].honoured == ("toy_switch",)
        with pytest.raises(TracerError, match="two knobs are named 'toy_switch'"):
            register(EngineEntry("clashing", __name__, "", switches=(Knob("toy_switch", str, "", "", "", fixed("")),)))
    finally:
        unregister("switched")
    assert "toy_switch" not in KNOBS and "clashing" not in registered()
    with pytest.raises(TracerError, match="unknown knob 'toy_switch'"):
        parse_variant("toy_switch=off")


def test_the_runtime_switches_are_their_engines_own():
    assert switch_names() == {"threads", "n_ubatch", "ort_opt"}
    assert {name for name, knob in KNOBS.items() if knob.kind == "runtime"} == switch_names()
