"""The README's "Trace your port" recipes, and every next step tracer prints after them, on a model as
its user has it: a Llama saved by transformers' `save_pretrained` (config.json and weights, no
tokenizer), the GGUF llama.cpp's converter would write of it, and a dump of a port with a fault.

Without a tokenizer the default prompt cannot be read: tracer feeds `DEFAULT_TOKENS`, and the header
and a note say so (the dump is made on those ids, as the user's port would be run on the ids the note
prints). The integration tests run the same recipes on the bundled SmolLM2."""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
from unittest import mock

import pytest

from tests.dumps import candle_dump, faulty_trace, save_dump
from tests.families import write_tiny_family
from tests.readme import run_recipe
from tests.tiny_gguf import write_tiny_gguf
from tracer.cli import main
from tracer.pipeline.request import DEFAULT_TOKENS

FED = f"token ids {','.join(map(str, DEFAULT_TOKENS))} ({len(DEFAULT_TOKENS)} tokens)"
NOTE = f"has no tokenizer.json: fed the default token ids {','.join(map(str, DEFAULT_TOKENS))}"


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """name the recipes use -> the user's file."""
    folder = tmp_path_factory.mktemp("user")
    model = write_tiny_family(folder / "llama", "llama")
    dump = save_dump(candle_dump(faulty_trace(model, list(DEFAULT_TOKENS), layer=1)), folder / "dump.safetensors",
                     DEFAULT_TOKENS, runtime="my-port")
    return {"my-model": model, "my-model.gguf": write_tiny_gguf(model, folder / "llama.gguf"),
            "my-dump.safetensors": dump}


def said(capsys) -> str:
    out = capsys.readouterr().out
    assert FED in out and NOTE in " ".join(out.split()), out  # the header and the note: what was fed
    return out


def test_the_live_runtime_recipe(user_files, tmp_path, capsys):
    run_recipe("A live runtime", tmp_path, {"my-model": user_files["my-model"]})
    assert "verdict: MATCH" in said(capsys)


def test_the_gguf_recipe(user_files, tmp_path, capsys):
    run_recipe("A GGUF", tmp_path, {k: user_files[k] for k in ("my-model", "my-model.gguf")})
    assert "verdict: MATCH" in said(capsys)


def test_the_dump_recipe_and_every_next_step_it_prints(user_files, tmp_path, capsys):
    run_recipe("A dump from your code", tmp_path, user_files)
    out = capsys.readouterr().out
    assert "first divergence: model.layers.1.mlp.down_proj" in out
    assert FED in out  # the compare's header: the ids both files ran
    summary = (tmp_path / "tracer-report" / "summary.md").read_text()
    steps = re.findall(r"^- .*: `(tracer [^`]*)`$", summary.split("\nNext:\n")[1], flags=re.M)
    assert steps == ["tracer diagnose my-dump.safetensors --model my-model"]
    for step in steps:  # as printed, where the report was written
        with contextlib.chdir(tmp_path), mock.patch.object(sys, "argv", shlex.split(step)):
            assert main(shlex.split(step)[1:]) == 0, step
    diagnosis = capsys.readouterr().out
    assert "observed: diverged, first divergence model.layers.1.mlp.down_proj" in diagnosis
    assert "your trace behaves most like" not in diagnosis, diagnosis  # noise in a weight is no planted mistake


def printed_commands(summary: str) -> list[str]:
    """The commands a summary.md tells its reader to run: its Reproduce block and its Next list."""
    reproduce = re.findall(r"Reproduce:\n\n```sh\n(.*?)\n```", summary)
    return reproduce + re.findall(r"^- .*: `(tracer [^`]*)`$", summary.split("\nNext:\n")[-1], flags=re.M)


@pytest.mark.parametrize("extra", [["--decode", "2"], ["--batch", "2"]])
def test_every_command_a_run_prints_runs_as_printed(user_files, tmp_path, extra):
    """A planted mistake on the user's model, decoded or batched: the report's commands (repeat it; every
    planted mistake side by side) run, in the folder the report was written from."""
    (tmp_path / "my-model").symlink_to(user_files["my-model"])
    first = ["tracer", "run", "--model", "my-model", "--variant", "theta=500", *extra]
    with contextlib.chdir(tmp_path), mock.patch.object(sys, "argv", first):
        assert main(first[1:]) == 0
    steps = printed_commands((tmp_path / "tracer-report" / "summary.md").read_text())
    assert steps == [shlex.join(first), "tracer sweep --model my-model"]
    for step in steps[1:]:
        with contextlib.chdir(tmp_path), mock.patch.object(sys, "argv", shlex.split(step)):
            assert main(shlex.split(step)[1:]) == 0, step  # the first is the run itself
