"""`sweep`: the reference once, a row per variant, errors as rows; its report and CLI."""

import json

import pytest

from tests.conftest import TOKENS
from tracer import TracerError, sweep
from tracer.engines.registry import ENGINES
from tracer.model import kv_cache
from tracer.model.config import load_config, read_hf
from tracer.model.knobs import KNOBS, knobs_for
from tracer.pipeline.catalogue import default_variants, split_variants
from tracer.reports.sweep import render_sweep_html, sweep_frame, sweep_markdown

VARIANTS = ["theta=500", "kv_repeat=tile", "mask=where", "layers=3", "theta=500,rope=interleaved"]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    folder = tmp_path_factory.mktemp("sweep")
    model = write_tiny_llama(folder / "m")
    return sweep(model, tokens=TOKENS, variants=VARIANTS, greedy=3, out=folder / "report"), folder


def test_one_row_per_variant_in_order(tiny_sweep):
    result, _ = tiny_sweep
    assert [row.variant for row in result.rows] == VARIANTS
    assert [row.verdict for row in result.rows] == ["diverged", "diverged", "match", "error", "diverged"]
    assert result["theta=500"].first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert result["kv_repeat=tile"].first_divergence.point == "model.layers.0.self_attn.scores"


def test_a_variant_that_fails_to_load_is_a_row_with_its_error(tiny_sweep):
    row = tiny_sweep[0]["layers=3"]
    assert row.error == "missing tensor model.layers.2.input_layernorm.weight (expected shape (64,))"
    assert row.first_divergence is None and row.curve == ()


def test_rows_carry_logits_greedy_and_the_coarse_curve(tiny_sweep):
    result, _ = tiny_sweep
    row = result["theta=500"]
    assert row.greedy.steps == 3 and len(row.greedy.candidate) == 3
    assert result.reference_greedy == row.greedy.reference
    assert row.logits.max_abs > 0
    assert [p["point"] for p in row.curve] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                               "model.norm", "lm_head"]
    assert row.curve[0]["rel_l2"] == 0 and row.curve[1]["diverged"]
    assert result["mask=where"].logits.max_abs < 1e-5


def test_json_has_the_contract_fields(tiny_sweep):
    payload = json.loads(tiny_sweep[0].to_json())
    assert payload["kind"] == "sweep" and payload["reference"]["engine"] == "hf"
    for entry in payload["variants"]:
        assert {"variant", "verdict", "first_divergence", "logits", "greedy", "error"} <= set(entry)


def test_report_folder(tiny_sweep):
    result, folder = tiny_sweep
    report = folder / "report"
    assert sorted(p.name for p in report.iterdir()) == ["sweep.csv", "sweep.html", "sweep.json", "sweep.md",
                                                        "sweep.png"]
    assert (report / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (report / "sweep.html").read_text()
    assert "data:image/png;base64," in html and "http" not in html.split("<body>")[1]
    assert "model.layers.0.self_attn.scores" in html and "missing tensor model.layers.2" in html
    frame = sweep_frame(json.loads((report / "sweep.json").read_text()))
    assert list(frame.index) == VARIANTS and frame.loc["mask=where", "verdict"] == "match"


def test_html_escapes_what_it_is_given():
    summary = {"variants": [{"variant": "<script>x</script>", "verdict": "error", "error": "a & b <i>", "curve": []}],
               "reference": {"label": "<b>hf</b>"}, "candidate": {"engine": "reimpl"}}
    html = render_sweep_html(summary)
    assert "<script>x" not in html and "&lt;script&gt;x" in html and "a &amp; b &lt;i&gt;" in html
    assert "<b>hf</b>" not in html
    # a '|' in an error would split a Markdown table cell
    assert "| a\\|b |" in sweep_markdown({"variants": [{"variant": "v", "verdict": "error", "error": "a|b"}]})


def test_default_sweep_has_one_variant_per_knob(tiny_llama):
    spec = read_hf(load_config(tiny_llama()))
    chosen = default_variants(spec)
    named = {pair.split("=")[0] for text in chosen for pair in text.split(",")}
    # every knob of a Llama that reimpl (the default candidate) honours, but `act` (a Llama's silu has no
    # tanh-GELU mistake to show by default) and the number-format regimes it only emulates (diagnose tries
    # those); runtime-only knobs (ort_opt, threads) are not swept, nor the decode-only ones (a sweep runs no
    # decode step: docs/decode.md), nor the rope scaling mistakes on a model without scaling (docs/positions.md),
    # nor the batch-only ones (a sweep pads nothing: docs/batch.md)
    emulated = set(ENGINES["reimpl"].emulated)
    assert {"weights", "act_quant", "kv_cache"} <= emulated
    honoured = {knob.name for knob in knobs_for("llama") if ENGINES["reimpl"].honours(knob.name)}
    assert named == honoured - {"act", "llama3_factors", "longrope_ctx", "yarn_mscale", "padding_mask",
                                "batch_positions"} - {knob.name for knob in kv_cache.KNOBS} - emulated
    assert not {"ort_opt", "threads"} & named
    assert not {knob.name for knob in KNOBS.values() if knob.families and "llama" not in knob.families} & named
    assert "theta=500000" in chosen  # the tiny model's theta already is 10000
    assert "layers=3" in chosen and "head_dim=8" in chosen


def test_a_runtime_engine_sweeps_only_the_knobs_it_honours(tiny_llama):

    spec = read_hf(load_config(tiny_llama()))
    for engine in ("hf", "mlx", "onnx"):
        chosen = default_variants(spec, engine)
        assert chosen and all(set(pair.split("=")[0] for pair in text.split(",")) <= set(ENGINES[engine].honoured)
                              for text in chosen), engine


def test_variants_split_on_semicolons():
    assert split_variants("theta=1; kv_repeat=tile") == ["theta=1", "kv_repeat=tile"]
    assert split_variants(["a=1,b=2", "c=3;d=4"]) == ["a=1,b=2", "c=3", "d=4"]


def test_a_variant_that_does_not_parse_stops_the_sweep_before_anything_runs(tiny_llama):
    with pytest.raises(TracerError, match="unknown knob 'thetta'"):
        sweep(tiny_llama(), tokens=TOKENS, variants=["theta=500", "thetta=1"])


def test_sweep_on_the_hf_engine(tiny_llama):
    result = sweep(tiny_llama(), tokens=TOKENS, variants=["theta=500", "rope=interleaved"], candidate="hf", greedy=0)
    assert result.rows[0].first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert result.rows[1].verdict == "error" and "engines that honour it: reimpl" in result.rows[1].error


def test_cli_sweep_prints_one_json_object(tiny_llama, capsys, tmp_path):
    from tracer.cli import main

    model = tiny_llama()
    code = main(["sweep", "--model", str(model), "--tokens", "1,2,3,4", "--variants", "theta=500", "mask=none;layers=3",
                 "--greedy", "0", "--json", "-", "--no-report"])
    out, _ = capsys.readouterr()
    assert code == 0
    payload = json.loads(out)
    assert [v["variant"] for v in payload["variants"]] == ["theta=500", "mask=none", "layers=3"]
    assert [v["verdict"] for v in payload["variants"]] == ["diverged", "diverged", "error"]
    code = main(["sweep", "--model", str(model), "--tokens", "1,2,3,4", "--variants", "eps=1e-3",
                 "--greedy", "0", "--out", str(tmp_path / "s")])
    out, _ = capsys.readouterr()
    assert code == 0 and (tmp_path / "s" / "sweep.html").is_file()
    row = next(line for line in out.splitlines() if line.startswith("eps=0.001"))
    assert row.split()[:3] == ["eps=0.001", "diverged", "model.layers.0.input_layernorm"]  # a table, not Markdown
    assert "greedy decoding off: --greedy N decodes N tokens per variant" in out
    assert "| variant |" not in out and "\\|" not in out  # no Markdown on the terminal


def test_a_variant_costs_one_candidate_forward_unless_greedy_is_asked(tiny_llama, monkeypatch):
    from tracer.reimpl.forward import Model

    calls = []
    forward = Model.forward
    monkeypatch.setattr(Model, "forward", lambda self, tokens, record=None, **at: calls.append(len(tokens)) or
                        forward(self, tokens, record, **at))
    model = tiny_llama()
    result = sweep(model, tokens=TOKENS, variants=["theta=500", "eps=1e-3", "kv_repeat=tile"], noise_floor=False,
                   progress=False)
    assert calls == [len(TOKENS)] * 3  # the reference is hf: every reimpl forward is a variant's
    assert all(row.greedy is None for row in result.rows) and result.greedy_steps == 0
    calls.clear()
    result = sweep(model, tokens=TOKENS, variants=["theta=500"], noise_floor=False, greedy=2, progress=False)
    # its recording, then at most one forward per greedy step (checking the reference's continuation)
    assert calls[0] == len(TOKENS) and 2 <= len(calls) <= 3
    assert result.rows[0].greedy.steps == 2
