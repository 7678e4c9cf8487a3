"""`tracer compare` and `--fail-on-divergence` on tiny models: exit 0 / 1 / 2, JSON, report, aliases."""

import json
import subprocess
import sys

import pytest

import tracer
from tests.conftest import TOKENS
from tests.dumps import candle_dump, faulty_trace, save_dump
from tracer.cli import main

TOKEN_ARG = ",".join(map(str, TOKENS))


@pytest.fixture
def files(tiny_llama, tmp_path):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    ref_path = reference.save(tmp_path / "hf.safetensors")
    fault = save_dump(candle_dump(faulty_trace(model, TOKENS, layer=0)), tmp_path / "candle.safetensors", TOKENS,
                      runtime="candle")
    return model, ref_path, fault, tmp_path


def test_compare_a_trace_with_itself_is_a_match(files, capsys):
    _, ref, _, tmp = files
    assert main(["compare", str(ref), str(ref), "--json", "-", "--out", str(tmp / "r"), "--fail-on-divergence"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["verdict"] == "match" and payload["tokens"] == TOKENS
    assert all(p["rel_l2"] == 0 for p in payload["points"])
    assert json.loads((tmp / "r" / "summary.json").read_text())["verdict"] == "match"


def test_compare_localizes_a_fault_in_a_candle_dump(files, capsys):
    _, ref, fault, tmp = files
    code = main(["compare", str(ref), str(fault), "--json", "-", "--no-report"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0  # a divergence is a finding, not a failure, unless asked
    assert payload["first_divergence"]["point"] == "model.layers.0.mlp.down_proj"
    assert payload["first_divergence"]["last_agreeing"] == "model.layers.0.mlp.up_proj"
    missing = {p["point"] for p in payload["points"] if p["missing_on"] == "candidate"}
    assert "model.layers.0.self_attn.q_rope" in missing and "model.layers.0.mlp.act" in missing
    assert payload["logits"]["positions"] == 1
    assert any("last position" in note for note in payload["notes"])
    assert any(note.startswith("not in the candidate: 14 points") for note in payload["notes"])


def test_fail_on_divergence_exits_1_from_the_real_entry_point(files):
    _, ref, fault, tmp = files
    proc = subprocess.run([sys.executable, "-m", "tracer", "compare", str(ref), str(fault), "--fail-on-divergence",
                           "--out", str(tmp / "report")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "first divergence: model.layers.0.mlp.down_proj" in proc.stdout
    assert (tmp / "report" / "report.html").is_file()


def test_run_fail_on_divergence(files, capsys):
    model = files[0]
    args = ["run", "--model", str(model), "--tokens", TOKEN_ARG, "--no-report", "--greedy", "0"]
    assert main([*args, "--variant", "theta=500", "--fail-on-divergence"]) == 1
    assert main([*args, "--fail-on-divergence"]) == 0


def test_aliases_file_maps_a_ports_own_names(files, capsys):
    _, ref, _, tmp = files
    reference = tracer.Trace.load(ref)
    dump = {f"layer{i}/out": reference[f"model.layers.{i}"] for i in range(2)}
    path = save_dump(dump, tmp / "port.safetensors", TOKENS)
    (tmp / "aliases.json").write_text(json.dumps({"layer{i}/out": "model.layers.{i}"}))
    assert main(["compare", str(ref), str(path), "--json", "-", "--no-report", "--aliases", str(tmp / "aliases.json"),
                 "--fail-on-divergence"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [p["point"] for p in payload["points"] if p["recorded"]] == ["model.layers.0", "model.layers.1"]
    assert main(["compare", str(ref), str(path), "--json", "-", "--no-report"]) == 2  # nothing compared: not a match
    payload = json.loads(capsys.readouterr().out)
    assert payload["verdict"] == "error"
    assert "share no point to compare" in payload["error"] and "layer0/out" in payload["error"]


@pytest.mark.parametrize("setup, message", [
    (lambda tmp, ref: ["compare", str(ref), str(tmp / "nope.safetensors")], "trace file not found"),
    (lambda tmp, ref: ["compare", str(ref), str(ref), "--aliases", str(tmp / "missing.json")],
     "cannot read aliases file"),
    (lambda tmp, ref: ["compare", str(ref), str(save_dump(candle_dump(tracer.Trace.load(ref)), tmp / "x.safetensors",
                                                            [3, 3, 3]))], "ran other token ids"),
])
def test_user_errors_exit_2_with_one_line(files, capsys, setup, message):
    _, ref, _, tmp = files
    assert main(setup(tmp, ref) + ["--no-report", "--fail-on-divergence"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tracer: error: ") and message in err and err.count("\n") == 1
