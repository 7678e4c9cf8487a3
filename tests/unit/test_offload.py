"""A reference larger than memory: the hf engine loaded through accelerate's big-model placement
(`--offload DIR`, `--max-memory`), traced with the same hooks (tracer.engines.offload)."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.engines.offload import parse_max_memory

TOKEN_ARG = ",".join(map(str, TOKENS))
# The tiny model's tensors take 274 kB: a 200 kB cap on the CPU leaves some blocks on disk.
CAP = "cpu=200KB"


def test_a_model_partly_on_disk_gives_the_in_memory_trace_bit_for_bit(tiny_llama, tmp_path):
    model = tiny_llama()
    whole = tracer.record(model, TOKENS, engine="hf", progress=False)
    offloaded = tracer.record(model, TOKENS, engine="hf", offload=tmp_path / "offload", max_memory=CAP,
                              progress=False)
    placement = offloaded.meta.placement
    assert "on disk" in placement and "on cpu" in placement  # measured: 3 modules on disk, 2 on cpu
    assert whole.points == offloaded.points
    assert all(torch.equal(whole[p], offloaded[p]) for p in whole.points)
    assert whole.meta.placement is None


def test_run_with_an_offloaded_reference_matches_and_says_where_it_lived(tiny_llama, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["run", "--model", str(tiny_llama()), "--tokens", TOKEN_ARG, "--greedy", "2", "--offload",
                 str(tmp_path / "offload"), "--max-memory", CAP, "--out", str(out)]) == 0
    assert "meta device" not in capsys.readouterr().err  # accelerate's own line: the notes say it instead
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "match"
    assert any("accelerate placed" in note and "on disk" in note for note in summary["notes"])
    again = tracer.run(tiny_llama(), tokens=TOKENS, greedy=0, offload=tmp_path / "offload", max_memory=CAP,
                       progress=False)
    assert again.command.endswith(f"--offload {tmp_path / 'offload'} --max-memory {CAP} --no-report")


def test_max_memory_specs():
    assert parse_max_memory("cpu=2GiB,0=20GiB") == {"cpu": "2GiB", 0: "20GiB"}
    assert parse_max_memory({"cpu": "1GB"}) == {"cpu": "1GB"}
    for bad in ("cpu", "cpu=lots", "gpu=2GiB", "cpu=2GiB,"):
        with pytest.raises(TracerError, match="expected DEVICE=SIZE"):
            parse_max_memory(bad)


@pytest.mark.parametrize("args, message", [
    (["run", "--max-memory", "cpu=plenty"], "expected DEVICE=SIZE"),
    (["run", "--reference", "reimpl", "--offload", "x"], "the reimpl engine loads its model whole"),
    (["record", "--engine", "reimpl", "-o", "t.safetensors", "--offload", "x"],
     "the reimpl engine loads its model whole"),
    (["run", "--offload", "x", "--device", "cuda"], None),
])
def test_offload_errors_are_one_line_and_exit_2(tiny_llama, args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main([args[0], "--model", str(tiny_llama()), "--tokens", TOKEN_ARG, *args[1:]]
                + (["--no-report"] if args[0] == "run" else []))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    if message:
        assert message in err
