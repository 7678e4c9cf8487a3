"""Every option that takes a path, given a hostile file: truncated, lying metadata, a directory,
empty, garbage. Each is one line on stderr naming the problem and exit code 2, no traceback,
nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY, write_tiny_llama
from tests.tiny_gguf import write_tiny_gguf
from tracer.cli import main

GARBAGE = bytes(range(256)) * 8


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """name -> path of each hostile file, and a sound tiny model beside them."""
    root = tmp_path_factory.mktemp("hostile")
    model = write_tiny_llama(root / "model")
    good = write_tiny_gguf(model, root / "good.gguf")
    files = {"model": model, "good.gguf": good}
    files["empty.gguf"] = root / "empty.gguf"
    files["empty.gguf"].write_bytes(b"")
    files["garbage.gguf"] = root / "garbage.gguf"
    files["garbage.gguf"].write_bytes(GARBAGE)
    files["truncated.gguf"] = root / "truncated.gguf"
    files["truncated.gguf"].write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    for name, override in (("blocks.gguf", {"num_hidden_layers": 1000}), ("shape.gguf", {"intermediate_size": 99})):
        lying = root / f"lying-{name}"  # the config says more than the weights hold
        shutil.copytree(model, lying)
        config = json.loads((lying / "config.json").read_text())
        (lying / "config.json").write_text(json.dumps({**config, **override}))
        files[name] = write_tiny_gguf(lying, root / name)
    files["folder.gguf"] = root / "folder.gguf"
    files["folder.gguf"].mkdir()
    files["empty"] = root / "empty.safetensors"
    files["empty"].write_bytes(b"")
    files["garbage"] = root / "garbage.safetensors"
    files["garbage"].write_bytes(GARBAGE)
    files["folder"] = root / "folder"
    files["folder"].mkdir()
    files["truncated"] = root / "truncated.safetensors"
    files["truncated"].write_bytes((model / "model.safetensors").read_bytes()[:5000])
    files["bad-utf8"] = root / "bad.txt"
    files["bad-utf8"].write_bytes(b"\xff\xfe\xfa")
    files["empty-text"] = root / "empty.txt"
    files["empty-text"].write_text("")
    files["bad-config"] = root / "bad-config"
    shutil.copytree(model, files["bad-config"])
    (files["bad-config"] / "config.json").write_text("{garbage")
    return files


MODEL = ["--tokens", "1,2,3", "--greedy", "0", "--no-report", "--no-noise"]
# (option, hostile file, argv builder, what the one line says)
CASES = [
    ("--model", "empty.gguf", lambda f: ["run", "--model", f, *MODEL], "not a GGUF file"),
    ("--model", "garbage.gguf", lambda f: ["run", "--model", f, *MODEL], "not a GGUF file"),
    ("--model", "truncated.gguf", lambda f: ["run", "--model", f, *MODEL], "is truncated"),
    ("--model", "blocks.gguf", lambda f: ["run", "--model", f, *MODEL],
     "the metadata says llama.block_count=1000, the file has tensors for 2 blocks"),
    ("--model", "shape.gguf", lambda f: ["run", "--model", f, *MODEL],
     f"tensor blk.0.ffn_down.weight has shape ({TINY['hidden_size']}, {TINY['intermediate_size']}), "
     f"the metadata implies ({TINY['hidden_size']}, 99)"),
    ("--model", "folder.gguf", lambda f: ["run", "--model", f, *MODEL], "not a model directory (no config.json)"),
    ("--model", "folder", lambda f: ["run", "--model", f, *MODEL], "not a model directory (no config.json)"),
    ("--model", "garbage", lambda f: ["run", "--model", f, *MODEL], "not a model (a folder with config.json"),
    ("--model", "bad-config", lambda f: ["run", "--model", f, *MODEL], "config.json"),
    ("--prompt-file", "folder", lambda f: ["run", "--prompt-file", f], "cannot read prompt file"),
    ("--prompt-file", "bad-utf8", lambda f: ["run", "--prompt-file", f], "cannot read prompt file"),
    ("--prompt-file", "empty-text", lambda f: ["run", "--prompt-file", f], "empty prompt"),
    ("compare REFERENCE", "empty", lambda f: ["compare", f, f, "--no-report"], "cannot read trace"),
    ("compare REFERENCE", "garbage", lambda f: ["compare", f, f, "--no-report"], "cannot read trace"),
    ("compare REFERENCE", "truncated", lambda f: ["compare", f, f, "--no-report"], "cannot read trace"),
    ("compare REFERENCE", "folder", lambda f: ["compare", f, f, "--no-report"], "folder"),
    ("--aliases", "garbage", lambda f: ["compare", "x", "y", "--aliases", f, "--no-report"], "alias"),
    ("--aliases", "folder", lambda f: ["compare", "x", "y", "--aliases", f, "--no-report"], "alias"),
    ("diagnose TRACE", "garbage", lambda f: ["diagnose", f], "cannot read trace"),
    ("diagnose TRACE", "folder", lambda f: ["diagnose", f], "folder"),
    ("llamacpp:PATH", "folder.gguf", lambda f: ["run", "--candidate", f"llamacpp:{f}", *MODEL],
     "no config.json, not a model directory"),
    ("llamacpp:PATH", "garbage.gguf", lambda f: ["run", "--candidate", f"llamacpp:{f}", *MODEL], "not a GGUF file"),
    ("llamacpp:PATH", "empty.gguf", lambda f: ["run", "--candidate", f"llamacpp:{f}", *MODEL], "not a GGUF file"),
    ("file:PATH", "garbage", lambda f: ["run", "--candidate", f"file:{f}", *MODEL], "cannot read trace"),
    ("file:PATH", "folder", lambda f: ["run", "--candidate", f"file:{f}", *MODEL], "folder"),
    ("--offload", "garbage", lambda f: ["run", "--offload", f, *MODEL], "a file is there, not a folder"),
]


@pytest.mark.parametrize("option, name, argv, message", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_hostile_file_is_one_line_and_exit_2(hostile, option, name, argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    args = argv(str(hostile[name]))
    if "--model" not in args and args[0] == "run":
        args += ["--model", str(hostile["model"])]
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (args, err)
    assert err[0].startswith("tracer: error: ") and message in err[0], err[0]
    assert not [p for p in tmp_path.rglob("*") if "cache" not in p.parts], "something was written"
