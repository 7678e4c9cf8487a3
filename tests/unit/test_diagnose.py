"""diagnose: an observed trace's error fingerprint matched against the variant catalogue."""

import json

import pytest

import tracer
from tests.conftest import TOKENS
from tracer import diagnose
from tracer.cli import main
from tracer.comparison.fingerprint import resemblance
from tracer.model.config import load_config, read_hf
from tracer.model.knobs import parse_variant, variant_text
from tracer.pipeline.catalogue import diagnosis_variants as catalogue

TRIED = ["theta=500", "eps=1e-3", "kv_repeat=tile", "rope=interleaved", "attn=sdpa"]


@pytest.mark.parametrize("observed, best", [
    ("theta=500", "theta=500"),            # the same mistake: an exact fingerprint
    ("theta=700", "theta=500"),            # a nearby value of the same knob
    ("eps=1e-2", "eps=1e-3"),
    ("kv_repeat=tile", "kv_repeat=tile"),
])
def test_the_matching_variant_ranks_first(tiny_llama, observed, best):
    model = tiny_llama()
    trace = tracer.record(model, TOKENS, engine="reimpl", variant=observed)
    result = diagnose(trace, model, variants=TRIED, progress=False)
    best = variant_text(parse_variant(best))  # as the ranking spells it
    assert result.best["variant"] == best
    assert result.ranking[0]["score"] > result.ranking[1]["score"]
    assert [entry["variant"] for entry in result.ranking].count(best) == 1


def test_identical_fingerprints_score_one_and_a_clean_match_scores_low(tiny_llama):
    model = tiny_llama()
    diverged = tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=0)
    assert resemblance(diverged, diverged) == pytest.approx(1.0)
    clean = tracer.run(model, tokens=TOKENS, greedy=0)
    assert resemblance(diverged, clean) < 0.2


def test_catalogue_adds_values_but_never_the_models_own(tiny_llama):
    spec = read_hf(load_config(tiny_llama()))  # theta 10000, eps 1e-5
    variants = catalogue(spec)
    assert "theta=500000" in variants and "eps=1e-06" in variants
    assert "theta=10000" not in variants and "eps=1e-05" not in variants
    assert len(variants) == len(set(variants))


def test_cli_diagnose_json(tiny_llama, tmp_path, capsys):
    model = tiny_llama()
    path = tracer.record(model, TOKENS, engine="reimpl", variant="rope=interleaved").save(tmp_path / "port.safetensors")
    code = main(["diagnose", str(path), "--model", str(model), "--variants", "theta=500;rope=interleaved",
                 "--json", "-"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["ranking"][0]["variant"] == "rope=interleaved"
    assert payload["observed"]["first_divergence"]["point"] == "model.layers.0.self_attn.q_rope"


def test_a_trace_without_token_ids_is_refused(tmp_path):
    import torch

    from tracer import Trace

    path = Trace({"lm_head": torch.ones(2, 3)}).save(tmp_path / "bare.safetensors")
    with pytest.raises(tracer.TracerError, match="carries no token ids"):
        diagnose(path, progress=False)
