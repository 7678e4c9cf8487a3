"""A run's request is checked in one place (`tracer.pipeline.request`) before torch is imported or anything
is written: every bad value is one line on stderr, exit code 2, no traceback, no file; and the
reproduction command is derived from the parser. The argument surface is also searched by
hypothesis: any value of any flag either passes the checks or is refused that way."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.arguments import build_parser, command_line
from tracer.core.errors import TracerError
from tracer.engines.registry import parse_engine
from tracer.pipeline.request import Inputs, Outputs, Placement, Request, Side, regime_knobs, request_of

ROOT = Path(__file__).resolve().parents[2]

# argv (with {tmp}: a scratch folder holding `file` (a file), `folder/` (an empty folder) and `full/` (a folder
# with a file of the user's)
# -> what the one line says.
REFUSED = [
    (["run", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["run", "--max-tokens", "-3"], "--max-tokens must be at least 1, got -3"),
    (["sweep", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["run", "--greedy", "-1"], "--greedy must be at least 0, got -1"),
    (["sweep", "--greedy", "-2"], "--greedy must be at least 0"),
    (["run", "--out", "{tmp}/file/report"], "is a file, not a folder"),
    (["run", "--out", "{tmp}/file"], "a file is there, not a folder"),
    (["run", "--json", "{tmp}/missing/result.json"], "no folder"),
    (["run", "--json", "{tmp}/folder"], "a folder is there, not a file"),
    (["record", "-o", "{tmp}/missing/trace.safetensors"], "no folder"),
    (["record", "-o", "{tmp}/folder"], "a folder is there, not a file"),
    (["sweep", "--out", "{tmp}/file"], "a file is there, not a folder"),
    (["run", "--out", "{tmp}/full"], "refusing to overwrite {tmp}/full: it is not a tracer report folder"),
    (["sweep", "--out", "{tmp}/full"], "it is not a tracer sweep folder"),
    (["config", "--json", "{tmp}/missing/audit.json"], "no folder"),
    (["diagnose", "{tmp}/file", "--json", "{tmp}/folder"], "a folder is there, not a file"),
    (["run", "--regime", "theta=10000"], "theta=10000 is not one (a porting mistake goes in --variant)"),
    (["run", "--regime", "preset=candle"], "preset=candle is not one"),
    (["run", "--regime", ""], "--regime needs 'auto' or knobs"),
    (["run", "--max-memory", "cpu=1GiB,cpu=2GiB"], "device cpu is given twice"),
    (["run", "--max-memory", "0=1GiB,0=2GiB"], "device 0 is given twice"),
    (["run", "--candidate", "llamacpp:"], "nothing after the colon"),
    (["run", "--candidate", "file:"], "nothing after the colon"),
    (["run", "--candidate", "llamacpp", "--variant", "threads=100000"], "bad value '100000' for knob 'threads'"),
    (["run", "--candidate", "mlx", "--variant", "attn=sdpa"], "not honoured by the mlx engine"),
    (["run", "--reference-variant", "rope=interleaved"], "not honoured by the hf engine"),
    (["record", "--engine", "onnx", "--variant", "rope=interleaved", "-o", "{tmp}/t.safetensors"],
     "not honoured by the onnx engine"),
    (["run", "--atol", "nan"], "--atol takes a finite number >= 0, got nan"),
    (["run", "--rtol", "-1"], "--rtol takes a finite number >= 0"),
    (["compare", "{tmp}/file", "{tmp}/file", "--atol", "inf"], "--atol takes a finite number >= 0"),
    (["run", "--tokens", "1,-2"], "token id -2 is negative"),
    (["run", "--tokens", ","], "empty token list"),
    (["run", "--tokens", "1,x"], "--tokens takes comma-separated integers"),
    (["run", "--prompt", "   "], "the prompt is only whitespace"),
    (["run", "--system", "be brief"], "a system message needs the chat template"),
    (["run", "--tokens", "1,2", "--chat"], "chat templates apply to a prompt, not to token ids"),
    (["run", "--device", "gpu"], "unknown device 'gpu'"),
    (["run", "--device", "cuda:x"], "unknown device 'cuda:x'"),
    (["run", "--model", ""], "--model is empty"),
    (["run", "--model", "{tmp}/folder"], "not a model directory (no config.json)"),
    (["run", "--model", "{tmp}/nothing-here"], "model path not found"),
    (["run", "--model", "{tmp}/file"], "not a model (a folder with config.json"),
    (["run", "--offload", "{tmp}/file"], "--offload {tmp}/file: a file is there, not a folder"),
    (["run", "--prompt-file", "{tmp}/folder"], "cannot read prompt file"),
    (["run", "--variant", "theta=1,theta=2"], "knob 'theta' is given twice"),
]

CHILD = """
import contextlib, io, json, sys
from tracer.cli import main
cases, results = json.loads(sys.argv[1]), []
for argv in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def scratch(tmp_path):
    (tmp_path / "file").write_text("not a model\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine\n")
    return tmp_path


@pytest.mark.slow  # a fresh process
def test_every_bad_argument_is_one_line_exit_2_before_torch_with_nothing_written(scratch):
    cases = [[arg.replace("{tmp}", str(scratch)) for arg in argv] for argv, _ in REFUSED]
    before = sorted(p.relative_to(scratch) for p in scratch.rglob("*"))
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], cwd=scratch, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    reply = json.loads(child.stdout)
    for (argv, message), (code, err) in zip(REFUSED, reply["results"]):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (argv, err)
        assert lines[0].startswith("tracer: error: ") and message.replace("{tmp}", str(scratch)) in lines[0], \
            (argv, lines[0])
    assert reply["torch"] is False  # every refusal above came before torch was imported
    assert sorted(p.relative_to(scratch) for p in scratch.rglob("*")) == before  # and nothing was written


def test_the_values_check_themselves_for_the_api_too(tmp_path):
    with pytest.raises(TracerError, match="--max-tokens must be at least 1"):
        Inputs(None, "hi", max_tokens=0)
    with pytest.raises(TracerError, match="whole number"):
        Inputs(None, "hi", max_tokens=2.5)
    with pytest.raises(TracerError, match="token ids are integers"):
        Inputs(None, tokens=[1, True])
    assert Inputs(None, tokens="3, 4").tokens == (3, 4)
    with pytest.raises(TracerError, match="given twice"):
        Placement(max_memory="cpu=1GiB, cpu=1GiB")
    assert Placement(max_memory="0=1GiB,cpu=2GiB").accelerate.max_memory == {0: "1GiB", "cpu": "2GiB"}
    assert Placement().accelerate is None
    with pytest.raises(TracerError, match="no folder"):
        Outputs(json=str(tmp_path / "a" / "b.json"))
    Outputs(report=str(tmp_path / "new" / "deeper"), json="-")  # a folder that can be made is fine
    assert not (tmp_path / "new").exists()  # and checking made nothing
    # what a non-root user meets (tests run as root)
    with mock.patch("tracer.pipeline.request.os.access", return_value=False):
        with pytest.raises(TracerError, match=f"--out {tmp_path}/r: {tmp_path} cannot be written"):
            Outputs(report=f"{tmp_path}/r")
    assert regime_knobs("preset=llamacpp,weights=q8_0") == {"preset": "llamacpp", "weights": "q8_0"}
    assert regime_knobs("dtype=bf16") == {"dtype": "bf16"}


def test_api_refuses_the_same_values_in_one_line(tmp_path):
    import tracer

    for kwargs, message in [(dict(max_tokens=0), "--max-tokens must be at least 1"),
                            (dict(greedy=-1), "--greedy must be at least 0"),
                            (dict(regime="theta=10000"), "is not one"),
                            (dict(out=tmp_path / "file" / "x"), "is a file")]:
        (tmp_path / "file").write_text("")
        with pytest.raises(TracerError, match=message):
            tracer.run(tokens=[1, 2], progress=False, **kwargs)


def test_the_reproduction_command_is_derived_from_the_parser():
    line = command_line("run", {"model": "m", "variant": ["theta=1"], "greedy": 3, "stream": True, "device": "cpu",
                                "out": "tracer-report", "no_report": False, "max_memory": "cpu=1GiB"})
    assert line == "tracer run --model m --variant theta=1 --greedy 3 --stream --max-memory cpu=1GiB"
    args = build_parser().parse_args(line.split()[1:])  # and the parser reads it back
    assert (args.model, args.variant, args.greedy, args.stream, args.max_memory) == \
        ("m", ["theta=1"], 3, True, "cpu=1GiB")


def test_shared_flags_are_declared_once_and_mean_the_same_everywhere():
    subs: dict = {}
    build_parser(subs)
    helps: dict[str, set] = {}
    for parser in subs.values():
        for action in parser._actions:
            for flag in action.option_strings:
                helps.setdefault(flag, set()).add(action.help)
    assert {flag for flag, texts in helps.items() if len(texts) > 1} <= {"--variants", "--json", "--out", "--model",
                                                                       "--greedy", "--candidate"}


# ------------------------------------------------------------------ the whole argument surface, searched

HOSTILE = ["0", "-1", "-3", "1", "2", "1e999", "nan", "-inf", "", " ", "-", "x", "a=b", "theta=10000", "preset=candle",
           "weights=q8_0", "auto", "cpu=1GiB,cpu=2GiB", "0=1GiB", "cpu", "cuda:9", "mps", "llamacpp:", "file:",
           "file:nothing", "mlx", "hf", "reimpl", "1,2,3", "1,-2", "threads=100000", "dtype=bf16", "/", ".",
           "missing/x.json", "é", "\x00"]


def _flags(command: str) -> list:
    subs: dict = {}
    build_parser(subs)
    return [action for action in subs[command]._actions if action.option_strings and action.dest != "help"]


def argv_for(command: str):
    """A strategy: `command` with a random subset of its flags, each with a hostile or random value."""
    value = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=6), st.integers(-5, 5).map(str))
    flags = _flags(command)

    def build(choices):
        argv = [command]
        for action, (use, text) in zip(flags, choices):
            if not use:
                continue
            argv += [action.option_strings[-1]] + ([] if action.nargs == 0 else [text])
        return argv + (["-o", "out.safetensors"] if command == "record" and "-o" not in argv
                       and "--output" not in argv else [])

    return st.lists(st.tuples(st.booleans(), value), min_size=len(flags), max_size=len(flags)).map(build)


class Reached(Exception):
    """The checks passed and the run would start: where the property test stops."""


@settings(max_examples=40, deadline=None, derandomize=True)
@given(argv=st.one_of(argv_for("run"), argv_for("sweep"), argv_for("record"), argv_for("quality")))
def test_any_value_of_any_flag_passes_the_checks_or_is_one_line_exit_2_with_nothing_written(argv):
    from tracer.cli import main

    def reached(*args, **kwargs):
        raise Reached

    # every value checked, the request is resolved: the model, the device and the placement come next
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder), \
            mock.patch.object(Request, "resolved", reached):
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                code = main(argv)
        except Reached:
            code = None
        if code is not None:
            lines = err.getvalue().strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("tracer: error: "), (argv, err.getvalue())
            written = os.listdir(folder)
            # --json FILE gets the error as JSON (the contract); nothing else is written
            assert all(name == argv[argv.index("--json") + 1] for name in written) if "--json" in argv else not written


def test_a_gpu_cap_for_a_gpu_that_is_not_here_is_one_line_before_accelerate(tiny_llama, capsys):
    import torch

    from tracer.cli import main

    gpu = torch.cuda.device_count()  # the first index this machine lacks
    code = main(["run", "--model", str(tiny_llama()), "--tokens", "1,2,3", "--no-report",
                 "--max-memory", f"{gpu}=1GiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"tracer: error: --max-memory {gpu}=...: there is no GPU {gpu} here "
                                 f"(torch sees {gpu} CUDA GPUs)"]


def test_an_engine_argument_is_parsed_once_into_a_value_that_says_its_regime():
    llamacpp = parse_engine("llamacpp")
    assert (llamacpp.name, llamacpp.argument, llamacpp.regime) == ("llamacpp", None, "ggml")
    assert parse_engine(llamacpp) is llamacpp  # a parsed value passes through, never parsed again
    assert parse_engine("candle").regime is None  # llama.rs on the model directory: f32
    assert parse_engine("candle:model.gguf").regime == "candle"  # quantized_llama.rs on the file
    assert [parse_engine(name).regime for name in ("hf", "reimpl", "mlx", "onnx")] == [None] * 4
    assert str(parse_engine("file:trace.safetensors")) == "file:trace.safetensors"


def test_a_side_is_its_engine_and_its_knobs_checked_once():
    side = Side.of("reimpl", "theta=10000")
    assert (side.engine.name, side.variant) == ("reimpl", {"theta": 10000.0})
    with pytest.raises(TracerError, match="knob 'rope' is not honoured by the hf engine"):
        Side.of("hf", "rope=interleaved")
    with pytest.raises(TracerError, match="is a saved trace; knobs"):
        Side.of("file:trace.safetensors", "theta=10000")


def test_the_api_keywords_of_the_input_and_placement_build_them_once():
    inputs, placement = request_of("run", None, "hello", {"tokens": [1, 2], "device": "cpu", "position_offset": 3})
    assert (inputs.tokens, inputs.position_offset, placement.device) == ((1, 2), 3, "cpu")
    with pytest.raises(TypeError, match=r"run\(\) got an unexpected keyword argument 'devices'"):
        request_of("run", None, "hello", {"devices": "cpu"})


# ------------------------------------------------------------------ resolved and checked once

# What a run resolves and checks before anything loads, by the module that defines it; each check
# is keyed by what it was asked about (an engine's name, or one key for the run's single resolution).
WATCHED = {
    "resolve_source": ("tracer.files.sources", lambda *args: "model"),
    "check_device": ("tracer.engines.load", lambda *args: "device"),
    "check_offload": ("tracer.engines.offload", lambda *args: "offload"),
    "check_family_support": ("tracer.engines.load", lambda *args: "families"),
    "parse_engine": ("tracer.engines.registry", lambda engine: str(engine)),
    "check_runtime": ("tracer.engines.registry", lambda entry: entry.name),
    "check_engine": ("tracer.engines.registry", lambda variant, engine: getattr(engine, "name", engine)),
}


def count_calls(monkeypatch) -> dict[str, dict[str, int]]:
    """Wrap every watched function wherever tracer's modules hold it (imported by name or not) so that each
    call is counted under its key; returns the live counts."""
    import importlib

    counts: dict[str, dict[str, int]] = {name: {} for name in WATCHED}
    for name, (home, key) in WATCHED.items():
        original = getattr(importlib.import_module(home), name)

        def counted(*args, _name=name, _original=original, _key=key, **kwargs):
            asked = _key(*args, **kwargs)
            counts[_name][asked] = counts[_name].get(asked, 0) + 1
            return _original(*args, **kwargs)

        holders = [module for module_name, module in list(sys.modules.items())
                   if module_name.startswith("tracer") and getattr(module, name, None) is original]
        assert holders, name  # a renamed function would count nothing here
        for module in holders:
            monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.parametrize("asked", [{}, {"decode": 2}, {"batch": 2}, {"regime": "dtype=bf16", "variant": "dtype=bf16"}])
def test_one_run_resolves_the_model_and_checks_each_engine_once(tiny_llama, asked):
    import tracer
    import tracer.pipeline.commands  # noqa: F401 - every module a run uses, imported before the wrapping

    model = tiny_llama()
    with pytest.MonkeyPatch.context() as patch:
        counts = count_calls(patch)
        result = tracer.run(model, tokens=[1, 17, 5, 42], greedy=2, progress=False, **asked)
    assert result.verdict in ("match", "diverged")
    once = {"model": 1}, {"device": 1}, {"offload": 1}, {"families": 1}
    assert (counts["resolve_source"], counts["check_device"], counts["check_offload"],
            counts["check_family_support"]) == once
    assert counts["parse_engine"] == counts["check_runtime"] == {"hf": 1, "reimpl": 1}
    # the regime's own knobs are checked once more, against the reimplementation that runs them
    assert counts["check_engine"] == ({"hf": 1, "reimpl": 2} if "regime" in asked else {"hf": 1, "reimpl": 1})
