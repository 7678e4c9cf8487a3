"""The live runtime engines (mlx, onnx) on the bundled SmolLM2-135M-Instruct, f32, CPU.

MLX's CPU build is slow here (seconds for a 5-token forward): its runs decode few greedy tokens.
The ONNX exports (f32, and f16 for the sweep) are made once into the user's cache; the f32 run is
the README's live-runtime recipe, run as written.
"""

import json

import pytest

import tracer
from tests.readme import run_recipe
from tracer.model.points import all_points, layer_point

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def mlx_run(default_model):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    return tracer.run(default_model, PROMPT, candidate="mlx", greedy=3, progress=False).to_dict()


@pytest.fixture(scope="module")
def onnx_run(default_model, tmp_path_factory):
    """The README's live-runtime recipe, as written, with ./my-model the bundled model."""
    folder = tmp_path_factory.mktemp("recipe")
    run_recipe("A live runtime", folder, {"my-model": default_model})
    return json.loads((folder / "tracer-report" / "summary.json").read_text())


def test_mlx_matches_at_every_point_it_records(mlx_run):
    assert mlx_run["verdict"] == "match"
    recorded = {p["point"] for p in mlx_run["points"] if p["recorded"]}
    assert len(recorded) >= 360
    for i in range(30):
        assert {layer_point(i, "self_attn.q_rope"), layer_point(i, "self_attn.k_rope")} <= recorded
    fused = [p for p in mlx_run["points"] if not p["recorded"]]
    assert {p["point"].rsplit(".", 1)[1] for p in fused} == {"scores", "probs"} and len(fused) == 60
    assert all(p["missing_on"] == "candidate" and not p["diverged"] for p in fused)
    assert mlx_run["logits"]["max_abs"] < 1e-4 and mlx_run["logits"]["max_abs_all"] < 2e-4
    assert max(p["rel_l2"] for p in mlx_run["points"] if p["recorded"]) < 2e-5
    assert mlx_run["candidate"]["runtime"]["name"] == "mlx"
    assert mlx_run["greedy"]["same_prefix"] == 3


def test_mlx_in_bf16_diverges_first_at_the_embedding(default_model):
    pytest.importorskip("mlx_lm")
    result = tracer.run(default_model, PROMPT, candidate="mlx", variant="dtype=bf16", greedy=0, progress=False)
    assert result.first_divergence.point == "model.embed_tokens"


def test_mlx_in_bf16_matches_in_the_bf16_regime(default_model):
    """The same bf16 run compared with tracer's model in bf16 (--regime auto): a correct bf16 port reads
    as correct, and the raw view keeps the f32 divergence at the embedding."""
    pytest.importorskip("mlx_lm")
    result = tracer.run(default_model, PROMPT, candidate="mlx", variant="dtype=bf16", regime="auto", greedy=0,
                        progress=False)
    assert result.regime.variant == {"dtype": "bf16"}
    assert result.verdict == "match"
    assert result.regime.raw.first_divergence.point == "model.embed_tokens"
    assert result.regime.per_op_over == ()  # measured: worst 3.5e-3 at an mlp.act, bound 2e-2


def test_onnx_records_all_513_points_and_matches(onnx_run):
    assert onnx_run["verdict"] == "match"
    assert [p["point"] for p in onnx_run["points"]] == all_points(30)
    assert all(p["recorded"] for p in onnx_run["points"]) and len(onnx_run["points"]) == 513
    assert max(p["rel_l2"] for p in onnx_run["points"]) < 1e-5
    assert onnx_run["logits"]["max_abs_all"] < 1e-4
    assert onnx_run["candidate"]["runtime"]["name"] == "onnxruntime"
    assert onnx_run["greedy"]["same_prefix"] == 20


@pytest.mark.parametrize("engine, variants, expected", [
    ("onnx", ["ort_opt=disable", "dtype=f16"], {"ort_opt=disable": None, "dtype=f16": "model.embed_tokens"}),
    ("mlx", ["dtype=f16", "theta=10000"], {"dtype=f16": "model.embed_tokens", "theta=10000": "error"}),
])
def test_sweep_runs_the_knobs_each_runtime_honours(default_model, engine, variants, expected):
    pytest.importorskip({"onnx": "onnxruntime", "mlx": "mlx_lm"}[engine])
    result = tracer.sweep(default_model, PROMPT, candidate=engine, variants=variants, progress=False)
    found = {row.variant: "error" if row.error else row.first_divergence and row.first_divergence.point
             for row in result.rows}
    assert found == expected
    assert "not honoured by the mlx engine" in (result.rows[-1].error or "") or engine == "onnx"
