"""Every flag of every command, mistyped or given a bad value, is refused in one line of at most 100
columns (exit 2) that names the flag or the value, before any model loads.

A flag that takes a value is an int or a float (given "x"), a choice (given "zzz"), or has its bad value
in BAD below: a new flag fails `test_every_flag_has_a_bad_value` until it has one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_readme import commands, long_flags
from tracer.cli import main

# flag -> a value the command refuses before loading anything
BAD = {
    "--model": "no-such-model", "--prompt": "", "--prompt-file": "no-such-prompt.txt", "--tokens": "1,x",
    "--system": "be brief", "--variant": "zzz=1", "--reference-variant": "zzz=1", "--reference": "jax",
    "--candidate": "jax", "--engine": "jax", "--variants": "zzz=1", "--regime": "zzz=1", "--device": "gpu",
    "--max-memory": "lots", "--offload": "report-here/mine.txt", "--out": "report-here",
    "--json": "no-such-folder/x.json", "--markdown": "no-such-folder/x.md", "--output": "no-such-folder/t.safetensors",
    "--text": "no-such-text.txt",
    "--family": "lama", "--aliases": "none.json", "--shard-layout": "none.json",
}
# what each command needs besides the flag under test, all valid (the traces: written in the test's folder)
NEEDS = {"compare": ["ref.safetensors", "cand.safetensors"], "diagnose": ["ref.safetensors"],
         "quality": ["--tokens", "1,2,3,4,5,6,7,8"], "record": ["-o", "t.safetensors"]}


def value_actions():
    """(command, flag, its argparse action) for every long flag that takes a value."""
    return [(name, action.option_strings[-1], action) for name, parser in commands().items()
            for action in parser._actions  # noqa: SLF001 - argparse keeps its actions there
            if action.option_strings and action.option_strings[-1].startswith("--") and action.nargs != 0
            and action.option_strings[-1] != "--help"]


def bad_value(action) -> str | None:
    if action.choices:
        return "zzz"
    if action.type in (int, float):
        return "x"
    return BAD.get(action.option_strings[-1])


def test_every_flag_has_a_bad_value():
    assert [f"{command} {flag}" for command, flag, action in value_actions() if bad_value(action) is None] == []


def refused(argv, tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report-here").mkdir(exist_ok=True)
    (tmp_path / "report-here" / "mine.txt").write_text("not a report")  # --out: a folder that is not a report
    for name in ("ref.safetensors", "cand.safetensors"):  # traces to compare, a dump of one point
        save_file({"model.norm": torch.ones(2, 3)}, tmp_path / name, metadata={"tokens": "[1, 2]"})
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    # within a terminal's width, the user's own paths aside (this test's folder, resolved)
    assert lines[0].startswith("tracer: error: ") and len(lines[0].replace(str(tmp_path), "DIR")) <= 100, lines[0]
    return lines[0]


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c, f, _ in value_actions()])
def test_a_bad_value_of_every_flag_is_one_line_naming_it(command, flag, tmp_path, monkeypatch, capsys):
    action = dict(((c, f), a) for c, f, a in value_actions())[(command, flag)]
    value = bad_value(action)
    extra = ["--chat"] if flag == "--prompt" else []  # --system alone is refused for want of --chat
    needs = [] if flag in NEEDS.get(command, []) else NEEDS.get(command, [])
    line = refused([command, *needs, *extra, flag, value], tmp_path, monkeypatch, capsys)
    named = (flag, flag.lstrip("-").replace("-", " "), repr(value), repr(value.split("=")[0]), value or "\0")
    assert any(name in line for name in named), line


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c, p in commands().items() for f in long_flags(p)])
def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(command, flag, tmp_path, monkeypatch, capsys):
    line = refused([command, *NEEDS.get(command, []), flag + "x"], tmp_path, monkeypatch, capsys)
    assert line.endswith(f"did you mean {flag}?"), line


def test_a_help_that_points_at_tracer_engines_is_what_tracer_engines_shows(capsys):
    """`--decode` and `--position-offset` send the reader to `tracer engines`' "can" lines: each names
    the flag for exactly the engines whose registry entry takes it."""
    from tracer.engines.registry import registered

    pointing = {flag: action.help for parser in commands().values() for action in parser._actions  # noqa: SLF001
                for flag in action.option_strings if "names " + flag in (action.help or "")}
    assert set(pointing) == {"--decode", "--position-offset"}
    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    blocks = {block.split(": ", 1)[0]: " ".join(block.split()) for block in out.split("\n\n")[2:]}
    for flag, attribute in (("--decode", "decode"), ("--position-offset", "positions")):
        shown = {entry.usage for entry in registered().values() if flag in blocks[entry.usage].split(" can ")[1]}
        assert shown == {entry.usage for entry in registered().values() if getattr(entry, attribute)}
        assert shown  # some engine takes it
