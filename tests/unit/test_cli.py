"""The CLI on tiny models: JSON contract, report folder, and user errors as one line with exit code 2."""

import json
import subprocess
import sys

import pytest

from tests.conftest import TOKENS
from tracer.cli import main

TOKEN_ARG = ",".join(map(str, TOKENS))


def run_cli(*args):
    """The real console entry point in a fresh process: what a user sees."""
    proc = subprocess.run([sys.executable, "-m", "tracer", *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow  # the console entry point in a fresh process
def test_run_json_stdout_is_one_object_and_report_is_written(tiny_llama, tmp_path):
    model = tiny_llama()
    code, out, err = run_cli("run", "--model", str(model), "--tokens", TOKEN_ARG, "--variant", "theta=500",
                             "--out", str(tmp_path / "report"), "--json", "-", "--greedy", "4")
    assert code == 0, err
    payload = json.loads(out)  # nothing but the JSON object on stdout
    assert payload["verdict"] == "diverged"
    assert payload["first_divergence"]["point"] == "model.layers.0.self_attn.q_rope"
    assert payload["candidate"] == {"engine": "reimpl", "variant": {"theta": 500.0}, "label": "reimpl[theta=500]",
                                    "device": "cpu"}
    assert payload["tokens"] == TOKENS and len(payload["greedy"]["candidate"]) == 4
    assert len(payload["points"]) == 37
    for name in ("summary.json", "points.csv", "curve.png", "report.html"):
        assert (tmp_path / "report" / name).is_file(), name
    assert json.loads((tmp_path / "report" / "summary.json").read_text())["verdict"] == "diverged"
    assert (tmp_path / "report" / "report.html").read_text().count("<th>device</th><td><code>cpu</code>") == 2


def test_run_prints_a_summary_naming_the_first_divergence(tiny_llama, tmp_path, capsys):
    code = main(["run", "--model", str(tiny_llama()), "--tokens", TOKEN_ARG, "--variant", "theta=500",
                 "--out", str(tmp_path / "r"), "--greedy", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "verdict: DIVERGED" in out
    assert "agrees up to model.layers.0.self_attn.v_proj" in out
    assert "first divergence: model.layers.0.self_attn.q_rope" in out


def test_record_then_compare_against_the_saved_trace(tiny_llama, tmp_path, capsys):
    model = tiny_llama()
    saved = tmp_path / "hf.safetensors"
    assert main(["record", "--engine", "hf", "--model", str(model), "--tokens", TOKEN_ARG, "-o", str(saved)]) == 0
    assert capsys.readouterr().out.startswith(f"hf: 37 points on {len(TOKENS)} tokens -> ")
    assert main(["run", "--model", str(model), "--tokens", TOKEN_ARG, "--reference", f"file:{saved}",
                 "--no-report", "--json", "-"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["verdict"] == "match" and payload["greedy"] is None  # a saved trace cannot generate


@pytest.mark.slow  # the console entry point in a fresh process
def test_error_with_json_still_prints_one_json_object(tmp_path):
    code, out, err = run_cli("run", "--model", str(tmp_path / "nope"), "--json", "-")
    assert code == 2 and json.loads(out)["verdict"] == "error"
    assert json.loads(out)["error"].startswith("model path not found")


def test_variants_lists_every_knob(capsys):
    assert main(["variants"]) == 0
    out = capsys.readouterr().out
    for knob in ("theta", "eps", "attn", "dtype"):
        assert f"\n{knob} " in out
