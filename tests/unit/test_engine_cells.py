"""An engine's cells of the engine × family matrix, stated in its entry alone: a runtime difference is
traced, and where a run first diverges at the difference's point the hints say it is the runtime's own
behaviour; a family not in the runtime and one not traced yet are refused in one line each, before
anything loads; `tracer engines` shows every cell. `tests/drifted_engine.py` states them (a made-up
runtime with its RoPE base fixed at 500, and no OLMo-2 model); no file of tracer's names it."""

from __future__ import annotations

from itertools import takewhile

import pytest

import tracer
from tests.conftest import TOKENS
from tests.drifted_engine import DIFFERENCE, ENTRY, RUNTIME_THETA
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.engines.registry import (
    ABSENT,
    DIFFERS,
    MATCH,
    NOT_YET,
    Absent,
    Difference,
    EngineEntry,
    register,
    unregister,
)
from tracer.model.points import Q_ROPE, layer_point


@pytest.fixture(scope="module")
def drifted():
    register(ENTRY)
    yield ENTRY.name
    unregister(ENTRY.name)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cells")
    return {family: write_tiny_family(root / family, family) for family in ("llama", "olmo2", "gemma2")}


def test_the_entry_states_each_cell():
    assert [ENTRY.cell(family) for family in ("llama", "olmo2", "gemma2")] == [DIFFERS, ABSENT, NOT_YET]
    assert EngineEntry("plain", __name__, "every family").cell("olmo2") == MATCH
    assert ENTRY.differences_on("llama") == (DIFFERENCE,) and ENTRY.differences_on("gemma2") == ()
    assert DIFFERENCE.at(layer_point(2, Q_ROPE)) and not DIFFERENCE.at(layer_point(2, "self_attn.k_rope"))


def test_a_family_stated_twice_is_refused():
    with pytest.raises(TracerError, match="^the twice engine states the family olmo2 more than once"):
        EngineEntry("twice", __name__, "", families=("olmo2",), absent=(Absent("olmo2", "none"),))
    with pytest.raises(TracerError, match="^the twice engine states the family llama more than once"):
        EngineEntry("twice", __name__, "", families=("llama",), differences=(DIFFERENCE,))


def test_a_family_may_differ_at_several_points_once_each():
    other = Difference("llama", "self_attn.probs", "a long prompt", "another way")
    entry = EngineEntry("two", __name__, "", families=(), differences=(DIFFERENCE, other))
    assert entry.cell("llama") == DIFFERS and entry.differences_on("llama") == (DIFFERENCE, other)
    assert entry.refusal("gemma2") == "the two engine does not trace gemma2 yet (it traces llama)"
    with pytest.raises(TracerError, match="^the again engine declares two differences on llama at self_attn.q_rope$"):
        EngineEntry("again", __name__, "", differences=(DIFFERENCE, DIFFERENCE))


def test_a_declared_difference_is_the_runtimes_own_behaviour(drifted, models):
    result = tracer.run(models["llama"], tokens=TOKENS, candidate=drifted, greedy=0, progress=False)
    first = result.first_divergence
    assert result.verdict == "diverged" and first.point == layer_point(0, Q_ROPE)
    assert first.hints[0] == ("the drifted runtime's own behaviour on llama, not a porting mistake: its RoPE base "
                              "is 500 whatever rope_theta says (a runtime difference its engine declares; "
                              "`tracer engines`)")


def test_the_same_divergence_in_a_port_gets_no_such_hint(models):
    """The hint comes from the engine's declaration, not from the point: reimpl with the same RoPE base is
    a port's mistake."""
    result = tracer.run(models["llama"], tokens=TOKENS, candidate="reimpl", variant=f"theta={RUNTIME_THETA}",
                        greedy=0, progress=False)
    assert result.first_divergence.point == layer_point(0, Q_ROPE)
    assert not any("runtime's own behaviour" in hint for hint in result.first_divergence.hints)


@pytest.mark.parametrize("family, message", [
    ("olmo2", "the drifted engine cannot trace olmo2: this runtime has no OLMo-2 model"),
    ("gemma2", "the drifted engine does not trace gemma2 yet (it traces llama)"),
])
def test_other_families_are_refused_in_one_line_before_loading(drifted, models, family, message, monkeypatch):
    def must_not_load(*args, **kwargs):
        raise AssertionError("an engine loaded before the refusal")

    monkeypatch.setattr("tracer.pipeline.run.load_engine", must_not_load)
    with pytest.raises(TracerError) as refused:
        tracer.run(models[family], tokens=TOKENS, candidate=drifted, greedy=0, progress=False)
    assert str(refused.value) == message


def test_tracer_engines_shows_every_cell(drifted, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("engine × family"))
    families = header.split()[3:]
    starts = [header.index(f" {family}") + 1 for family in families]  # each family's column
    at = next(i for i in range(lines.index(header), len(lines)) if lines[i].startswith("drifted "))
    row = [lines[at], *takewhile(lambda line: line.startswith(" "), lines[at + 1:])]  # a cell may wrap in its column
    cells = [" ".join(" ".join(line[start:end].split()) for line in row).strip()
             for start, end in zip(starts, [*starts[1:], None])]
    assert cells == [ENTRY.cell(family) for family in families]
    assert "  drifted × llama: differs at self_attn.q_rope: its RoPE base is 500 whatever rope_theta says" in lines
    assert "  the drifted engine cannot trace olmo2: this runtime has no OLMo-2 model" in lines
