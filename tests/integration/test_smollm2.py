"""The figures docs/design.md, docs/measured.md and the porting notes quote, on the bundled
SmolLM2-135M-Instruct (f32, CPU)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tracer
from tracer.files.tokenizer import tokenize
from tracer.model.points import all_points, layer_order

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def plain_run(default_model):
    return tracer.run(default_model, PROMPT)


@pytest.fixture(scope="module")
def theta_run(default_model):
    return tracer.run(default_model, PROMPT, variant="theta=10000")


@pytest.fixture(scope="module")
def transformers_thetas(default_model):
    """Plain transformers, no tracer involved: logits and greedy generation with theta 100000 and 10000."""
    from transformers import AutoConfig, LlamaForCausalLM

    ids = torch.tensor([tokenize(default_model, PROMPT)])
    runs = {}
    for theta in (100_000.0, 10_000.0):
        config = AutoConfig.from_pretrained(default_model)
        config.rope_parameters["rope_theta"] = theta
        model = LlamaForCausalLM.from_pretrained(default_model, config=config, attn_implementation="eager").eval()
        with torch.inference_mode():
            logits = model(ids).logits[0]
            generated = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
        runs[theta] = (logits, generated)
    return runs


def test_the_bundled_model_is_the_real_smollm2(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert config["rope_theta"] == 100000 and "rope_parameters" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (30, 576, 9, 3)


def test_no_variant_matches_at_every_point(plain_run):
    assert plain_run.verdict == "match" and plain_run.first_divergence is None
    assert [p.point for p in plain_run.points] == all_points(30)
    assert all(p.recorded for p in plain_run.points)
    assert len(layer_order("llama")) >= 15
    assert plain_run.logits.max_abs <= 1e-4 and plain_run.logits.max_ref == pytest.approx(19.8, abs=0.05)
    assert plain_run.greedy.same_prefix == 20
    assert plain_run.greedy.reference_text.startswith(" Paris.")


def test_theta_10000_diverges_first_at_q_rope(theta_run):
    first = theta_run.first_divergence
    assert theta_run.verdict == "diverged"
    assert first.point == "model.layers.0.self_attn.q_rope"
    assert first.last_agreeing == "model.layers.0.self_attn.v_proj"
    upstream = theta_run.points[: first.index]
    assert [p.point for p in upstream][:2] == ["model.embed_tokens", "model.layers.0.input_layernorm"]
    assert all(p.rel_l2 <= 1e-5 for p in upstream)
    assert first.max_abs > 0.5 and first.rel_l2 > 0.05


def test_theta_10000_logits_and_greedy_are_what_plain_transformers_gives(theta_run, transformers_thetas):
    (ref_logits, ref_greedy), (cand_logits, cand_greedy) = transformers_thetas[100_000.0], transformers_thetas[10_000.0]
    plain_last = float((cand_logits[-1] - ref_logits[-1]).abs().max())
    assert plain_last == pytest.approx(0.787, abs=0.005)
    assert theta_run.logits.max_abs == pytest.approx(plain_last, rel=1e-4)
    assert theta_run.logits.max_abs_all == pytest.approx(1.22, abs=0.01)
    greedy = theta_run.greedy
    assert (greedy.reference, greedy.candidate) == (ref_greedy, cand_greedy)
    # 17 tokens agree, the 18th flips, and 18 of the 20 positions agree overall.
    assert (greedy.same_prefix, greedy.first_flip, greedy.same_positions) == (17, 18, 18)


def test_eager_vs_sdpa_matches(default_model):
    result = tracer.run(default_model, PROMPT, candidate="hf", variant="attn=sdpa", greedy=0)
    assert result.verdict == "match"
    assert 1e-6 <= result.logits.max_abs <= 1e-4  # rounding differs, and only at rounding level
    assert {p.point.rsplit(".", 1)[-1] for p in result.not_recorded} == {"scores", "probs"}


def readme_output() -> list[str]:
    """The lines the README says the main job prints."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## What the main job prints")[1]
    return re.search(r"```\n(.*?)```", section, flags=re.S).group(1).splitlines()


def without_cache_note(lines: list[str]) -> list[str]:
    """The output less what a run with a warm cache adds (the README shows a first run): its note, and
    "from the cache" on the noise floor's line."""
    kept, in_note = [], False
    for line in lines:
        in_note = line.startswith("  note: reference greedy continuation read") or \
            (in_note and line.startswith(" " * 6))
        if not in_note:
            kept.append(line.replace(", from the cache)", ")") if line.startswith("  noise floor: ") else line)
    return kept


def test_cli_main_job_prints_what_the_readme_shows_and_writes_the_report(default_model, tmp_path):
    """The `tracer` command in a child on a 100-column terminal: its output is the README's, line for
    line (the model's cache path and the report folder aside), none wider than 100 columns. The child
    also says whether it imported matplotlib itself: with two cores its drawers
    (tracer.reports.drawers), forked as it starts, draw every figure."""
    out = tmp_path / "tracer-report"  # the default folder, in the child's working directory
    wrapper = ("import sys\nfrom tracer.cli import console_main\n"
               "try:\n    code = console_main()\n"
               "finally:\n    print('MATPLOTLIB', 'matplotlib' in sys.modules, file=sys.stderr)\n"
               "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", wrapper, "run", "--variant", "theta=10000", "--json", "summary.json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=os.environ | {"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    if len(os.sched_getaffinity(0)) >= 2:
        assert "MATPLOTLIB False" in proc.stderr
    printed = proc.stdout.splitlines()
    assert max(len(line) for line in printed + proc.stderr.splitlines()) <= 100
    expected = readme_output()
    assert printed[0].startswith("tracer: hf vs reimpl[theta=10000] on ")  # the model's cache path is this machine's
    assert without_cache_note(printed[1:]) == expected[1:]
    payload = json.loads((tmp_path / "summary.json").read_text())
    assert payload["first_divergence"]["point"] == "model.layers.0.self_attn.q_rope"
    html = (out / "report.html").read_text()
    assert "model.layers.0.self_attn.q_rope" in html and "diverged" in html.lower()
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_far_positions_match_at_every_point(default_model, tmp_path):
    """RoPE at positions 1000..1005: `tracer run --tokens ... --position-offset 1000` matches at every point
    (hf's position_ids, the reimplementation's positions, the f64 noise floor run there too)."""
    from tracer.cli import main

    ids = tokenize(default_model, PROMPT)
    out = tmp_path / "far.json"
    assert main(["run", "--tokens", ",".join(map(str, ids)), "--position-offset", "1000", "--greedy", "0",
                 "--no-report", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["verdict"] == "match" and payload["first_divergence"] is None
    assert [p["point"] for p in payload["points"]] == all_points(30) and all(p["recorded"] for p in payload["points"])
    near = tracer.record(default_model, ids, engine="reimpl", progress=False)
    far = tracer.record(default_model, ids, engine="reimpl", position_offset=1000, progress=False)
    q_rope = "model.layers.0.self_attn.q_rope"
    assert torch.equal(near["model.layers.0.self_attn.q_proj"], far["model.layers.0.self_attn.q_proj"])
    assert (near[q_rope] - far[q_rope]).abs().max() > 0.1  # the rotation is another one 1000 positions on
