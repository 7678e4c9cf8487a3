"""What a run measures on the reference side besides its trace, kept between runs
(`tracer.pipeline.reference_cache`), and the reuse of work across a diagnosis's variants."""

import json
import os
import shutil
import time

import pytest

import tracer
from tests.conftest import TOKENS
from tracer.files.weights import read_weights
from tracer.ggml.strategies import QuantizedWeights
from tracer.pipeline import reference_cache

FROM_CACHE = "read from the cache"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "reference"


def run(model, **kwargs):
    return tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=4, progress=False, **kwargs)


def test_a_second_run_reads_the_noise_floor_and_greedy_from_the_cache_and_reports_the_same(tiny_llama, cache):
    model = tiny_llama()
    first, second = run(model), run(model)
    assert not any(FROM_CACHE in note for note in first.notes) and len(list(cache.iterdir())) == 1
    assert any(FROM_CACHE in note for note in second.notes)
    assert "noise_s" in first.timings and "noise_s" not in second.timings
    assert [p.noise for p in second.points] == [p.noise for p in first.points]
    assert all(p.noise is not None for p in second.points if p.recorded)
    assert second.greedy == first.greedy and second.first_divergence == first.first_divergence


def test_a_model_file_written_since_or_other_tokens_measure_again(tiny_llama, cache):
    model = tiny_llama()
    run(model)
    config = model / "config.json"
    config.write_text(config.read_text())  # the same bytes, written again: its ctime moves
    assert not any(FROM_CACHE in note for note in run(model).notes)
    other = tracer.run(model, tokens=TOKENS[:-1], variant="theta=500", greedy=4, progress=False)
    assert not any(FROM_CACHE in note for note in other.notes)
    assert len(list(cache.iterdir())) == 2  # the entry of the config as it was is removed: no run can read it


def test_a_store_removes_the_entries_no_run_can_read_and_keeps_the_rest(tiny_llama, cache):
    kept, rewritten, deleted, unused = (tiny_llama(name) for name in ("kept", "rewritten", "deleted", "unused"))
    for model in (kept, rewritten, deleted, unused):
        run(model)
    entry_of = {json.loads(path.read_text())["key"]["model"]: path for path in cache.iterdir()}
    assert len(entry_of) == 4
    weights = rewritten / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    shutil.rmtree(deleted)
    old = time.time() - (reference_cache.UNUSED_DAYS + 1) * 86400
    os.utime(entry_of[str(unused.resolve())], (old, old))
    assert any(FROM_CACHE in note for note in run(kept).notes)  # a read removes nothing
    assert len(list(cache.iterdir())) == 4
    run(tiny_llama("new"))  # a store: the rewritten, the deleted and the unused model's entries go
    left = sorted(path.name for path in cache.iterdir())
    assert len(left) == 2 and entry_of[str(kept.resolve())].name in left
    assert any(FROM_CACHE in note for note in run(kept).notes)


def test_a_read_keeps_an_entry_in_use(tiny_llama, cache):
    model = tiny_llama()
    run(model)
    (entry,) = cache.iterdir()
    old = time.time() - (reference_cache.UNUSED_DAYS + 1) * 86400
    os.utime(entry, (old, old))
    assert any(FROM_CACHE in note for note in run(model).notes)
    run(tiny_llama("other"))  # a store prunes: the entry read a moment ago stays
    assert entry.exists()


def test_a_damaged_entry_is_measured_again(tiny_llama, cache):
    model = tiny_llama()
    first = run(model)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    again = run(model)
    assert not any(FROM_CACHE in note for note in again.notes)
    assert [p.noise for p in again.points] == [p.noise for p in first.points]


def test_a_second_diagnosis_of_the_same_tokens_reuses_the_catalogues_rows(tiny_llama, cache):
    from tracer.pipeline import commands

    model = tiny_llama()
    variants = "theta=500; eps=1e-3; weights=q8_0"
    first = tracer.diagnose(tracer.record(model, TOKENS, engine="reimpl", variant="theta=500"), model,
                            variants=variants, progress=False)
    rows = next(iter(commands._CATALOGUE_ROWS.values()))
    second = tracer.diagnose(tracer.record(model, TOKENS, engine="reimpl", variant="eps=1e-3"), model,
                             variants=variants, progress=False)
    assert next(iter(commands._CATALOGUE_ROWS.values())) is rows  # not run again
    assert (first.best["variant"], second.best["variant"]) == ("theta=500", "eps=0.001")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: the rows are the old model's
    tracer.diagnose(tracer.record(model, TOKENS, engine="reimpl", variant="eps=1e-3"), model, variants=variants,
                    progress=False)
    assert next(iter(commands._CATALOGUE_ROWS.values())) is not rows


def test_two_weight_formats_of_one_kind_share_the_quantized_blocks(tiny_llama):
    weights = read_weights(tiny_llama())
    name = "model.layers.0.self_attn.q_proj.weight"
    one, other = QuantizedWeights(weights, "q8_0"), QuantizedWeights(weights, "q8_0")
    assert one[name] is other[name] and QuantizedWeights(weights, "q4_0")[name] is not one[name]
    assert one["model.norm.weight"] is weights["model.norm.weight"]
