"""Every mistake a user can make, through the real CLI: one line, exit code 2, nothing written.

Each row builds a bad input on a tiny model, runs `tracer ...` in a fresh process (forked from a
server that has imported tracer, torch and transformers: tests/warm_cli.py) and checks what a user
sees: stderr is exactly one line "tracer: error: <message>" (no traceback), stdout is empty, the
exit code is 2, and the folder the command was told to write into holds nothing new (no report,
no partial trace, no temporary folder). The same message comes from the Python API as a
`TracerError`, and with `--json -` stdout is exactly one JSON object saying it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.warm_cli import Started, run_cli
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.model.knobs import KNOBS

TOKEN_ARG = ",".join(map(str, TOKENS))
ERROR_PREFIX = "tracer: error: "


@dataclass
class Row:
    """One bad input: `make(tmp_path)` returns the CLI arguments and the equivalent API call."""

    name: str
    message: str  # a regex the whole message (after "tracer: error: ") must match
    make: Callable[[Path], tuple[list[str], Callable[[], object] | None]]


ROWS: list[Row] = []


def row(name: str, message: str):
    def register(make):
        ROWS.append(Row(name, message, make))
        return make

    return register


# --- helpers that build bad inputs ------------------------------------------------------------


def model(tmp: Path, name: str = "model", **overrides) -> Path:
    return write_tiny_llama(tmp / name, **overrides)


def edit_config(folder: Path, change: Callable[[dict], None]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit_weights(folder: Path, change: Callable[[dict], None]) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def run_args(tmp: Path, folder: Path, *extra: str, tokens: str | None = TOKEN_ARG) -> list[str]:
    """`tracer run` on `folder`, reference hf, candidate reimpl, report into tmp/report."""
    args = ["run", "--model", str(folder), "--out", str(tmp / "report"), "--greedy", "2"]
    if tokens is not None:
        args += ["--tokens", tokens]
    return args + list(extra)


def api_run(folder: Path, tmp: Path, engines: str = "hf", **kwargs):
    reference = "reimpl" if engines == "reimpl" else "hf"
    kwargs.setdefault("tokens", TOKENS)
    return lambda: tracer.run(folder, reference=reference, greedy=2, out=tmp / "report", progress=False, **kwargs)


def saved_trace(tmp: Path, tokens=TOKENS, name: str = "trace.safetensors") -> Path:
    """A real trace, recorded by the reimpl engine on the tiny model (kept outside `tmp`'s
    snapshot by being made before it)."""
    folder = tmp / "traced-model"
    if not folder.exists():
        write_tiny_llama(folder)
    return tracer.record(folder, list(tokens), engine="reimpl").save(tmp / name)


# --- the table --------------------------------------------------------------------------------


@row("unknown knob", r"unknown knob 'thetaa' \(`tracer variants` lists every knob\); did you mean theta\?")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--variant", "thetaa=10000"), api_run(m, tmp, variant="thetaa=10000")


@row("unknown knob, no close name", r"unknown knob 'zzz' \(`tracer variants` lists every knob\)")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--variant", "zzz=1"), api_run(m, tmp, variant="zzz=1")


@row("knob value typo", r"bad value 'interleave' for knob 'rope'; "
                        r"did you mean interleaved\?")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--variant", "rope=interleave"), api_run(m, tmp, variant="rope=interleave")


@row("floor typo", r"--floor: invalid choice 'full'; choose from cheap, exact")
def _(tmp):
    return run_args(tmp, model(tmp), "--floor", "full"), None


@row("floor and no noise", r"--floor exact and --no-noise: the first measures a floor, the second skips it")
def _(tmp):
    return run_args(tmp, model(tmp), "--floor", "exact", "--no-noise"), None


@row("flag typo", r"unrecognized arguments: --variantt theta=10000; did you mean --variant\?")
def _(tmp):
    return run_args(tmp, model(tmp), "--variantt", "theta=10000"), None


@row("command typo", r"unknown command 'rnu'; did you mean run\?")
def _(tmp):
    return ["rnu"], None


@row("family typo", r"unknown family 'lama'; did you mean llama\?")
def _(tmp):
    return ["variants", "--family", "lama"], None


@row("bad knob value", r"bad value 'abc' for knob 'theta'; expected " + re.escape(KNOBS["theta"].accepted))
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--variant", "theta=abc"), api_run(m, tmp, variant="theta=abc")


@row("malformed variant", r"bad variant 'theta'; expected knob=value, e\.g\. theta=10000")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--variant", "theta"), api_run(m, tmp, variant="theta")


@row("missing model path", r"model path not found: .*/no-such-model")
def _(tmp):
    return run_args(tmp, tmp / "no-such-model"), api_run(tmp / "no-such-model", tmp)


@row("model path is some other file",
     r"not a model \(a folder with config\.json, or a \.gguf file\): .*/notes\.txt")
def _(tmp):
    (tmp / "notes.txt").write_text("hello")
    return run_args(tmp, tmp / "notes.txt"), api_run(tmp / "notes.txt", tmp)


@row("folder without config.json", r"not a model directory \(no config\.json\): .*/empty")
def _(tmp):
    (tmp / "empty").mkdir()
    return run_args(tmp, tmp / "empty"), api_run(tmp / "empty", tmp)


@row("unreadable config.json", r"cannot read .*/config\.json: Permission denied")
def _(tmp):
    if os.geteuid() == 0:
        pytest.skip("root reads files without read permission")
    m = model(tmp)
    (m / "config.json").chmod(0)
    return run_args(tmp, m), api_run(m, tmp)


@row("GGUF that is not GGUF", r"not a GGUF file \(no GGUF magic bytes\): .*/fake\.gguf")
def _(tmp):
    (tmp / "fake.gguf").write_bytes(b"<html>404 not found</html>")
    return run_args(tmp, tmp / "fake.gguf"), api_run(tmp / "fake.gguf", tmp)


@row("GGUF of an unknown version", r"GGUF file .*/future\.gguf is version 9; transformers reads versions 2 and 3")
def _(tmp):
    (tmp / "future.gguf").write_bytes(b"GGUF\x09\x00\x00\x00" + bytes(64))
    return run_args(tmp, tmp / "future.gguf"), api_run(tmp / "future.gguf", tmp)


def both(m: Path, tmp: Path, **kwargs) -> list[Callable[[], object]]:
    """The API call through both loaders: transformers' (reference hf) and ours (reimpl only)."""
    return [api_run(m, tmp, "hf", **kwargs), api_run(m, tmp, "reimpl", **kwargs)]


# The model-file errors: the CLI runs the default reference (hf, transformers' loader); the API
# call goes through both loaders.


@row("config.json not JSON", r"not valid JSON \(line 1, column \d+\): .*/model/config\.json")
def _(tmp):
    m = model(tmp)
    (m / "config.json").write_text('{"hidden_size": 64,')
    return run_args(tmp, m), both(m, tmp)


@row("config.json not an object", r"config\.json is not a JSON object: .*/model/config\.json")
def _(tmp):
    m = model(tmp)
    (m / "config.json").write_text("[64, 4]")
    return run_args(tmp, m), both(m, tmp)


@row("config.json lacks a key", r"config\.json lacks the required key 'hidden_size'")
def _(tmp):
    m = edit_config(model(tmp), lambda c: c.pop("hidden_size"))
    return run_args(tmp, m), both(m, tmp)


@row("config.json key of the wrong type",
     r"config\.json: num_attention_heads must be a positive integer, got \"4\"")
def _(tmp):
    m = edit_config(model(tmp), lambda c: c.update(num_attention_heads="4"))
    return run_args(tmp, m), both(m, tmp)


# A malformed value of a key the readers read: both loaders name it before transformers sees the
# file, as the file spells it (JSON: "2", null, NaN). One row per kind of check; the other values
# of each kind, and the candle reader, are in test_config.py. (key, value written, what it must be)
BAD_CONFIG_VALUES = [
    ("rope_theta", "abc", "a positive finite number"),
    ("rope_theta", 0, "a positive finite number"),
    ("rope_theta", math.nan, "a positive finite number"),  # Python's json module writes and reads NaN
    ("rms_norm_eps", -1e-5, "a positive finite float such as 1e-05"),
    ("rms_norm_eps", 1, "a positive finite float such as 1e-05"),  # transformers' strict config: float only
    ("max_position_embeddings", "x", "a positive integer"),
    ("num_key_value_heads", 3, "a divisor of num_attention_heads (4)"),
    ("num_key_value_heads", "2", "a positive integer"),
    ("head_dim", 0, "an even positive integer (RoPE rotates pairs)"),
    ("tie_word_embeddings", "no", "true or false"),  # bool("no") is True: it read as a tied model
    ("attention_bias", "false", "true or false"),
    ("hidden_act", "zzz", "an activation transformers knows"),  # a typo of one: tests/unit/test_config.py
    ("rope_scaling", "linear", "an object or null"),
]


def bad_value_row(key: str, value, expected: str) -> None:
    written = json.dumps(value)

    @row(f"config.json {key}: {written}",
         rf"config\.json: {key} must be {re.escape(expected)}, got {re.escape(written)}")
    def _(tmp):
        m = edit_config(model(tmp), lambda c: c.update({key: value}))
        return run_args(tmp, m), both(m, tmp)


for bad in BAD_CONFIG_VALUES:
    bad_value_row(*bad)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


@row("config.json rope_parameters.rope_theta: -1.0",
     r"config\.json: rope_parameters\.rope_theta must be a positive finite number, got -1\.0")
def _(tmp):
    m = model(tmp, rope_format="v5", rope_theta=-1.0)
    return run_args(tmp, m), both(m, tmp)


@row("config.json rope_scaling linear without factor",
     r"config\.json: rope_scaling lacks 'factor', which rope_type 'linear' requires")
def _(tmp):
    m = model(tmp, rope_scaling={"rope_type": "linear"})
    return run_args(tmp, m), both(m, tmp)


@row("config.json rope_parameters llama3 without factor",
     r"config\.json: rope_parameters lacks 'factor', which rope_type 'llama3' requires")
def _(tmp):
    m = model(tmp, rope_format="v5", rope_scaling={k: v for k, v in LLAMA3.items() if k != "factor"})
    return run_args(tmp, m), both(m, tmp)


@row("config.json value only candle reads, under config=candle",
     r"config\.json: rope_theta must be a positive finite number, got \"abc\"")
def _(tmp):
    # transformers takes theta from rope_parameters and never reads the top-level key; candle reads only it.
    m = edit_config(model(tmp, rope_format="v5"), lambda c: c.update(rope_theta="abc"))
    return run_args(tmp, m, "--variant", "config=candle"), api_run(m, tmp, variant="config=candle")


@row("truncated safetensors",
     r"cannot read safetensors file .*/model/model\.safetensors: Error while deserializing header: .*")
def _(tmp):
    m = model(tmp)
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) // 2])
    return run_args(tmp, m), both(m, tmp)


@row("garbage safetensors",
     r"cannot read safetensors file .*/model/model\.safetensors: Error while deserializing header: .*")
def _(tmp):
    m = model(tmp)
    (m / "model.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 8)
    return run_args(tmp, m), both(m, tmp)


@row("tensor shape mismatch",
     r"shape mismatch, model\.layers\.1\.self_attn\.q_proj\.weight: file \(60, 64\), model \(64, 64\)")
def _(tmp):
    def shrink(tensors):
        tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:60]

    m = edit_weights(model(tmp), shrink)
    return run_args(tmp, m), both(m, tmp)


@row("missing tensor", r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight\b.*")
def _(tmp):
    m = edit_weights(model(tmp), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    return run_args(tmp, m), both(m, tmp)


@row("token id outside the vocabulary", r"token id 97 is outside the vocabulary \(0\.\.96\)")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, tokens="1,2,97"), both(m, tmp, tokens=[1, 2, 97])


@row("prompt longer than the positions", r"the prompt has 129 tokens; the model has 128 positions")
def _(tmp):
    m = model(tmp)
    ids = [1] * 129
    return run_args(tmp, m, tokens=",".join(map(str, ids))), both(m, tmp, tokens=ids)


@row("negative token id", r"token id -3 is negative")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--tokens=1,-3", tokens=None), api_run(m, tmp, tokens=[1, -3])


@row("token ids that are not integers", r"--tokens takes comma-separated integers, got '1,two'")
def _(tmp):
    return run_args(tmp, model(tmp), tokens="1,two"), None


@row("empty prompt", r"empty prompt")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--prompt", "", tokens=None), lambda: tracer.run(m, "", out=tmp / "report")


@row("whitespace-only prompt", r"the prompt is only whitespace \(' \\n\\t'\); pass token ids to trace whitespace")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--prompt", " \n\t", tokens=None), lambda: tracer.run(m, " \n\t", out=tmp / "report")


@row("missing prompt file", r"cannot read prompt file .*/prompt\.txt: .*No such file or directory.*")
def _(tmp):
    return run_args(tmp, model(tmp), "--prompt-file", str(tmp / "prompt.txt"), tokens=None), None


@row("unknown engine", r"unknown engine 'jax' \(`tracer engines` lists them\)")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--candidate", "jax"), lambda: tracer.run(m, tokens=TOKENS, candidate="jax")


@row("engine typo", r"unknown engine 'llamacp'; did you mean llamacpp\?")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--candidate", "llamacp"), lambda: tracer.run(m, tokens=TOKENS, candidate="llamacp")


@row("a variant beside several candidates",
     r"--variant with 2 candidates: give each its own, e\.g\. 'llamacpp\[kv_cache=f32\]'")
def _(tmp):
    m = model(tmp)
    return (run_args(tmp, m, "--candidate", "hf", "--candidate", "reimpl", "--variant", "theta=1"),
            lambda: tracer.run(m, tokens=TOKENS, candidate=["hf", "reimpl"], variant="theta=1"))


@row("sweep with two candidates",
     r"tracer sweep takes one --candidate; several: tracer run --candidate A --candidate B")
def _(tmp):
    m = model(tmp)
    args = ["sweep", "--model", str(m), "--tokens", TOKEN_ARG, "--candidate", "hf", "--candidate", "reimpl",
            "--out", str(tmp / "report")]
    return args, lambda: tracer.sweep(m, tokens=TOKENS, candidate=["hf", "reimpl"])


@row("reference file that is not a trace", r"cannot read trace .*/notes\.txt: .*")
def _(tmp):
    m = model(tmp)
    (tmp / "notes.txt").write_text("not a trace at all")
    return (run_args(tmp, m, "--reference", f"file:{tmp / 'notes.txt'}"),
            lambda: tracer.run(m, tokens=TOKENS, reference=f"file:{tmp / 'notes.txt'}", out=tmp / "report"))


@row("reference trace on other token ids",
     r"trace .*/trace\.safetensors ran 7 ids 1,17,5,42,8,\.\.\., not 3 ids 1,2,3")
def _(tmp):
    m = model(tmp)
    trace = saved_trace(tmp)
    return (run_args(tmp, m, "--reference", f"file:{trace}", tokens="1,2,3"),
            lambda: tracer.run(m, tokens=[1, 2, 3], reference=f"file:{trace}", out=tmp / "report"))


@row("compare: an argument that is not a trace", r"cannot read trace .*/notes\.txt: .*")
def _(tmp):
    trace = saved_trace(tmp)
    (tmp / "notes.txt").write_text("not a trace at all")
    args = ["compare", str(tmp / "notes.txt"), str(trace), "--out", str(tmp / "report")]
    return args, lambda: tracer.compare_files(tmp / "notes.txt", trace, out=tmp / "report")


@row("compare: a trace file that does not exist", r"trace file not found: .*/nope\.safetensors")
def _(tmp):
    trace = saved_trace(tmp)
    args = ["compare", str(trace), str(tmp / "nope.safetensors"), "--out", str(tmp / "report")]
    return args, lambda: tracer.compare_files(trace, tmp / "nope.safetensors", out=tmp / "report")


@row("compare: traces on different token ids",
     r"the traces ran other token ids: 7 ids 1,17,5,42,8,\.\.\. vs 3 ids 1,2,3")
def _(tmp):
    a, b = saved_trace(tmp), saved_trace(tmp, [1, 2, 3], "other.safetensors")
    args = ["compare", str(a), str(b), "--out", str(tmp / "report")]
    return args, lambda: tracer.compare_files(a, b, out=tmp / "report")


@row("--out is a folder that is not a report", r"refusing to overwrite .*/report: it is not a tracer report folder")
def _(tmp):
    m = model(tmp)
    (tmp / "report").mkdir()
    (tmp / "report" / "thesis.tex").write_text("years of work")
    return run_args(tmp, m, "--greedy", "0"), lambda: tracer.run(m, tokens=TOKENS, greedy=0, out=tmp / "report")


@row("record into a folder that does not exist", r"cannot write trace .*/missing/t\.safetensors: no folder .*/missing")
def _(tmp):
    m = model(tmp)
    args = ["record", "--engine", "reimpl", "--model", str(m), "--tokens", TOKEN_ARG,
            "-o", str(tmp / "missing" / "t.safetensors")]
    return args, lambda: tracer.record(m, TOKENS, engine="reimpl").save(tmp / "missing" / "t.safetensors")



@row("unknown device", r"unknown device 'tpu'; devices: cpu, cuda, cuda:N, mps")
def _(tmp):
    m = model(tmp)
    return run_args(tmp, m, "--device", "tpu"), api_run(m, tmp, device="tpu")


@row("a GPU device on a machine without one", r"device cuda:0: torch .* sees no CUDA GPU here")
def _(tmp):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    m = model(tmp)
    return run_args(tmp, m, "--device", "cuda:0"), api_run(m, tmp, device="cuda:0")


@row("record --stream on the onnx engine",
     r"--stream: only hf and reimpl read weights block by block, not onnx")
def _(tmp):
    m = model(tmp)
    args = ["record", "--engine", "onnx", "--stream", "--model", str(m), "--tokens", TOKEN_ARG,
            "-o", str(tmp / "t.safetensors")]
    return args, lambda: tracer.record(m, TOKENS, engine="onnx", stream=True)


@row("a config value only transformers checks",
     r"transformers cannot read .*/config\.json: Validation error for field 'use_cache': .*expected bool, got str.*")
def _(tmp):
    m = edit_config(model(tmp), lambda c: c.update(use_cache="yes"))
    return run_args(tmp, m), api_run(m, tmp)


@row("a config without model_type",
     r"transformers cannot read .*/config\.json: no model_type \(\"llama\" for a Llama\)")
def _(tmp):
    m = edit_config(model(tmp), lambda c: c.pop("model_type"))
    return run_args(tmp, m), api_run(m, tmp)


ROWS_BY_NAME = {r.name: r for r in ROWS}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder` with size and mtime: a new, removed or rewritten
    entry shows up as a difference."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


def screen_lines(raw: bytes) -> list[str]:
    """stderr as a terminal shows it: a progress bar redrawn with carriage returns and cleared
    at the end (tqdm leave=False) leaves nothing; every other line stays."""
    shown = (line.rsplit("\r", 1)[-1].rstrip() for line in raw.decode().split("\n"))
    return [line for line in shown if line]


@dataclass
class Outcome:
    folder: Path
    api_calls: list
    returncode: int
    stdout: bytes
    stderr: bytes
    before: dict
    after: dict


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome | BaseException]:
    """Every row through the real CLI, a fresh process each, as many at a time as there are cores."""
    prepared = {}
    for case in ROWS:
        folder = tmp_path_factory.mktemp("row")
        try:
            args, api_calls = case.make(folder)
        except pytest.skip.Exception as skipped:
            prepared[case.name] = skipped
            continue
        api_calls = [] if api_calls is None else api_calls if isinstance(api_calls, list) else [api_calls]
        prepared[case.name] = (folder, args, api_calls, snapshot(folder))
    results: dict[str, Outcome | BaseException] = {
        name: item for name, item in prepared.items() if isinstance(item, BaseException)}
    pending = [(name, item) for name, item in prepared.items() if not isinstance(item, BaseException)]
    running: list = []
    while pending or running:
        while pending and len(running) < (os.cpu_count() or 1):
            name, (folder, args, api_calls, before) = pending.pop(0)
            child = Started(args, env={**os.environ, "TRACER_CACHE": str(folder / "cache")})
            running.append((name, folder, api_calls, before, child))
        name, folder, api_calls, before, child = running.pop(0)
        returncode, stdout, stderr = child.finish()
        results[name] = Outcome(folder, api_calls, returncode, stdout, stderr, before, snapshot(folder))
    return results


@pytest.mark.parametrize("name", list(ROWS_BY_NAME))
def test_user_error_is_one_line_exit_2_and_writes_nothing(name, outcomes):
    case, outcome = ROWS_BY_NAME[name], outcomes[name]
    if isinstance(outcome, BaseException):
        raise outcome
    stderr = outcome.stderr.decode()
    assert outcome.returncode == 2, stderr
    assert outcome.stdout == b""
    lines = screen_lines(outcome.stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(ERROR_PREFIX)
    # within a terminal's width, the user's own paths aside (here a test folder's, 40 characters), except
    # where another library's own message is quoted whole
    assert len(lines[0].replace(str(outcome.folder), "DIR")) <= 100 or name in QUOTING, lines[0]
    message = lines[0].removeprefix(ERROR_PREFIX)
    assert re.fullmatch(case.message, message), message
    assert outcome.after == outcome.before  # no report, no partial trace, no temporary folder, nothing

    for api_call in outcome.api_calls:  # the same message from the Python API, and still nothing written
        with pytest.raises(TracerError) as raised:
            api_call()
        assert str(raised.value) == message
        assert snapshot(outcome.folder) == outcome.before


# Rows whose message quotes another library's (safetensors', transformers') in full: cut, it would lose
# what the library found.
QUOTING = {"truncated safetensors", "garbage safetensors", "a config value only transformers checks"}
JSON_ROWS = [r.name for r in ROWS if r.name.startswith(("unknown knob", "missing model path", "truncated safetensors",
                                                         "tensor shape mismatch", "compare:", "empty prompt"))]


@pytest.mark.parametrize("name", JSON_ROWS)
def test_user_error_with_json_is_one_json_object(name, tmp_path, capsys):
    case = ROWS_BY_NAME[name]
    args, _ = case.make(tmp_path)
    before = snapshot(tmp_path)
    assert main([*args, "--json", "-"]) == 2
    out, err = capsys.readouterr()
    payload = json.loads(out)  # exactly one object: json.loads refuses trailing text
    assert payload["verdict"] == "error" and re.fullmatch(case.message, payload["error"])
    assert err.splitlines()[-1] == ERROR_PREFIX + payload["error"]
    assert snapshot(tmp_path) == before


def test_an_error_leaves_a_previous_report_untouched(tmp_path, capsys):
    m = write_tiny_llama(tmp_path / "model")
    report = tmp_path / "report"
    assert main(["run", "--model", str(m), "--tokens", TOKEN_ARG, "--reference", "reimpl", "--greedy", "0",
                 "--out", str(report)]) == 0
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    capsys.readouterr()
    assert main(["run", "--model", str(m), "--tokens", "1,2,500", "--reference", "reimpl", "--out", str(report)]) == 2
    assert capsys.readouterr().err.endswith(f"{ERROR_PREFIX}token id 500 is outside the vocabulary (0..96)\n")
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "report"]  # no temporary sibling


def test_json_file_that_cannot_be_written_is_one_line(tmp_path):
    m = write_tiny_llama(tmp_path / "model")
    target = tmp_path / "missing" / "r.json"
    code, _, stderr = run_cli(["run", "--model", str(m), "--tokens", TOKEN_ARG, "--reference", "reimpl",
                               "--greedy", "0", "--no-report", "--json", str(target)])
    assert code == 2 and b"Traceback" not in stderr
    assert screen_lines(stderr) == [f"{ERROR_PREFIX}--json {target}: no folder {target.parent}"]


def test_user_text_is_escaped_in_the_html_report(tmp_path):
    """A model folder name and a config key come from strangers' files; the page must show them
    as text, never run them."""
    hostile = "<img src=x onerror=alert(1)>"
    m = write_tiny_llama(tmp_path / hostile)
    edit_config(m, lambda c: c.update({"<script>alert(2)</script>": 1}))
    assert main(["run", "--model", str(m), "--tokens", TOKEN_ARG, "--reference", "reimpl", "--greedy", "0",
                 "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<img src=x" not in page and "<script>alert" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page  # shown, escaped
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page


def test_every_module_the_cli_children_start_with_imports():
    """The forkserver skips a preloaded name that does not import without a word (each child would then
    import it itself, every row); so each must import."""
    import importlib

    from tests.warm_cli import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
