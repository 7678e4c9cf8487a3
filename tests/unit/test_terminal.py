"""What the `tracer` command prints fits a 100-column terminal, reads as aligned tables, and rounds
every number the way the Markdown and HTML reports do."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TOKENS, write_tiny_llama
from tracer.cli import main
from tracer.engines.registry import ENGINES
from tracer.reports import markdown_summary, render_html
from tracer.reports.terminal import command_lines, sweep_summary, table, terminal_summary, wrap

TOKEN_ARG = ",".join(map(str, TOKENS))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("terminal") / "model")


def widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


@pytest.mark.parametrize("args", [
    ["variants"], ["variants", "--family", "gemma2"], ["engines"], ["config"],
    ["run", "--variant", "theta=500", "--greedy", "2"],
    ["sweep", "--greedy", "0"],
    ["sweep", "--variants", "theta=500;layers=9", "--greedy", "2"],
])
def test_every_command_fits_a_100_column_terminal(args, tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    if args[0] in ("run", "sweep"):
        args = [*args, "--model", str(tiny), "--tokens", TOKEN_ARG, "--no-report"]  # the reports: tests of their own
    elif args[0] == "config":
        args = [*args, "--model", str(tiny)]
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() and widest(out) <= 100 and widest(err) <= 100, out


def test_a_narrower_terminal_gets_narrower_lines(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    assert main(["variants"]) == 0
    out = capsys.readouterr().out
    assert 60 < widest(out) <= 72


def test_missing_runtimes_show_the_readme_install_command_within_the_width(capsys, monkeypatch):
    """The install line is split where a shell joins it again (` \\` at a line's end)."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(type(ENGINES["llamacpp"]), "missing_runtime", lambda self: ["x"] if self.extra else [])
    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    assert widest(out) <= 100
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("CMAKE_ARGS="))
    joined = " ".join(line.strip().removesuffix(" \\") for line in lines[start:start + 2])
    assert lines[start].endswith(" \\") and joined == ENGINES["llamacpp"].install
    assert "  runtime  not installed: pip install -e '.[onnx]'" in lines
    assert 'CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8' in ENGINES["llamacpp"].install


def test_variants_is_an_aligned_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    main(["variants"])
    lines = capsys.readouterr().out.splitlines()
    header = lines[0]
    assert header.split() == ["knob", "values", "engines"]
    theta = next(i for i, line in enumerate(lines) if line.startswith("theta "))
    assert lines[theta][header.index("values"):].startswith("a positive number")
    assert lines[theta + 1].startswith(" " * header.index("values") + "default from config.json")
    assert "reproduces rope_theta silently 10000" in " ".join(lines[theta + 1:theta + 3])


def test_helpers_wrap_words_never_break_them():
    assert wrap("  hint: " + "word " * 30, 40)[1].startswith("      word")
    assert wrap("x" * 120, 100) == ["x" * 120]  # a path stays whole
    assert table(("a", "b"), [("1", "one two three four")], width=12) == ["a  b", "1  one two", "   three", "   four"]
    assert command_lines("pip install -e '.[x]'", width=100) == ["pip install -e '.[x]'"]
    assert command_lines("aaa bbb ccc", width=8) == ["aaa \\", "  bbb \\", "  ccc"]


def summary_with(rel_l2: float) -> dict:
    first = {"point": "model.layers.0.self_attn.q_rope", "layer": 0, "max_abs": 0.8293781280517578,
             "max_ref": 10.370426177978516, "rel_l2": rel_l2, "local_rel_l2": rel_l2, "threshold": 2.0296e-06,
             "last_agreeing": "model.layers.0.self_attn.v_proj", "upstream_points": 5, "upstream_max_rel_l2": 0.0,
             "hints": ["exact at position 0 and growing with position"]}
    point = {"point": first["point"], "layer": 0, "shape": [9, 5, 64], "recorded": True, "missing_on": None,
             "max_abs": first["max_abs"], "max_ref": first["max_ref"], "rel_l2": rel_l2, "cosine": 0.9968,
             "diverged": True, "threshold": 2.0296e-06, "local_rel_l2": rel_l2}
    return {"verdict": "diverged", "model": "m", "prompt": "p", "tokens": [1, 2, 3],
            "reference": {"engine": "hf", "variant": {}, "label": "hf"},
            "candidate": {"engine": "reimpl", "variant": {"theta": 10000.0}, "label": "reimpl[theta=10000]"},
            "tolerance": {"criterion": "rel_l2", "rel_l2": 1e-4, "text": "rel_l2 > 1e-04"},
            "first_divergence": first, "points": [point], "command": "tracer run --variant theta=10000",
            "logits": {"max_abs": 0.7872376441955566, "max_ref": 19.79, "rel_l2": 0.0400862992,
                       "max_abs_all": 1.2215633392333984, "argmax_agree": 1.0, "positions": 3}}


def test_one_rounding_rule_on_the_terminal_in_markdown_and_html():
    summary = summary_with(0.08054365099848876)
    outputs = [terminal_summary(summary), markdown_summary(summary), render_html(summary, {})]
    for text in outputs:
        assert "0.0805" in text and "0.081 " not in text and "8.05e-02" not in text
        assert "0.829" in text and "1.22" in text
    assert "0.0401" in outputs[1] and "0.0401" in outputs[2]  # logits rel_l2: the reports' tables
    assert json.loads(json.dumps(summary))["first_divergence"]["rel_l2"] == 0.08054365099848876  # JSON: all digits
    assert "introduced here: local rel_l2 0.0805" in outputs[0] and "inherited 0" in outputs[0]


def test_sweep_says_why_greedy_is_off():
    sweep = {"model": "m", "reference": {"label": "hf"}, "candidate": {"engine": "reimpl"},
             "tolerance": {"text": "rel_l2 > 1e-04"}, "greedy_steps": 0, "timings": {"variants_s": 1.0},
             "variants": [{"variant": "theta=10000", "verdict": "diverged", "greedy": None, "curve": [],
                           "first_divergence": {"point": "model.layers.0.self_attn.q_rope", "rel_l2": 0.0805},
                           "logits": {"max_abs": 0.787}}]}
    text = sweep_summary(sweep)
    row = next(line for line in text.splitlines() if line.startswith("theta=10000"))
    assert row.split() == ["theta=10000", "diverged", "model.layers.0.self_attn.q_rope", "0.0805", "0.787", "off"]
    assert "greedy decoding off: --greedy N decodes N tokens" in text
    sweep["greedy_steps"] = 3
    sweep["variants"][0]["greedy"] = {"same_prefix": 2, "steps": 3}
    text = sweep_summary(sweep)
    row = next(line for line in text.splitlines() if line.startswith("theta=10000"))
    assert row.split()[-1] == "2/3" and "greedy decoding off" not in text
