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


def from_cache(result) -> bool:
    """Both the greedy continuation and the noise floor read from the cache (the header says each)."""
    greedy = any(FROM_CACHE in note for note in result.notes)
    assert greedy == result.floor.from_cache
    return greedy


def entries(cache, model) -> list:
    """The cache's entries of `model` (one per measurement: its floor, its greedy continuation)."""
    return [path for path in cache.iterdir()
            if json.loads(path.read_text().split("\n")[0])["model"] == str(model.resolve())]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache whose every store prunes (a process prunes at most once in PRUNE_EVERY_S)."""
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(reference_cache, "PRUNE_EVERY_S", 0.0)
    return tmp_path / "cache" / "reference"


def run(model, **kwargs):
    return tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=4, progress=False, **kwargs)


def test_a_second_run_reads_the_noise_floor_and_greedy_from_the_cache_and_reports_the_same(tiny_llama, cache):
    model = tiny_llama()
    first, second = run(model), run(model)
    assert not from_cache(first) and len(list(cache.iterdir())) == 2  # the floor's entry, the greedy one's
    assert from_cache(second) and "from the cache" in second.floor.text()
    assert "noise_s" in first.timings and "noise_s" not in second.timings
    assert [p.noise for p in second.points] == [p.noise for p in first.points]
    assert all(p.noise is not None for p in second.points if p.recorded)
    assert second.greedy == first.greedy and second.first_divergence == first.first_divergence


def test_a_second_decode_reads_its_step_floors_from_the_cache_and_judges_every_step_the_same(tiny_llama, cache,
                                                                                             monkeypatch):
    """A decode's step floors (its uncached and f64 forwards over the decoded tokens) are kept: the same decode
    run again makes neither run, and every step reads as before; another number of steps measures its own."""
    from tracer.pipeline import decode

    model = tiny_llama()

    def decoded(steps):
        return tracer.run(model, tokens=TOKENS, variant="decode_positions=restart", decode=steps, greedy=0,
                          progress=False)

    first = decoded(3)
    kept = [json.loads(path.read_text().split("\n")[1]) for path in entries(cache, model)]
    assert [key["context"]["steps"] for key in kept if key["context"].get("measure") == "step floors"] == [3]
    f64_runs = []
    real = decode.load_engine
    monkeypatch.setattr(decode, "load_engine", lambda *args: f64_runs.append(args) or real(*args))
    second = decoded(3)
    assert f64_runs == [] and second.steps == first.steps and len(first.steps) == 4
    assert first.verdict == "diverged" and first.step == 1  # the restarted position, found at its step
    decoded(2)
    assert len(f64_runs) == 1


def test_a_model_file_written_since_or_other_tokens_measure_again(tiny_llama, cache):
    model = tiny_llama()
    run(model)
    config = model / "config.json"
    config.write_text(config.read_text())  # the same bytes, written again: its ctime moves
    assert not from_cache(run(model))
    other = tracer.run(model, tokens=TOKENS[:-1], variant="theta=500", greedy=4, progress=False)
    assert not from_cache(other)
    assert len(list(cache.iterdir())) == 4  # the entries of the config as it was are removed: no run can read them


def test_a_store_removes_the_entries_no_run_can_read_and_keeps_the_rest(tiny_llama, cache):
    kept, rewritten, deleted, unused = (tiny_llama(name) for name in ("kept", "rewritten", "deleted", "unused"))
    for model in (kept, rewritten, deleted, unused):
        run(model)
    entry_of = {model: entries(cache, model) for model in (kept, rewritten, deleted, unused)}
    assert [len(paths) for paths in entry_of.values()] == [2] * 4
    weights = rewritten / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    shutil.rmtree(deleted)
    old = time.time() - (reference_cache.UNUSED_DAYS + 1) * 86400
    for path in entry_of[unused]:
        os.utime(path, (old, old))
    assert from_cache(run(kept))  # a read removes nothing
    assert len(list(cache.iterdir())) == 8
    run(tiny_llama("new"))  # a store: the rewritten, the deleted and the unused model's entries go
    left = sorted(path.name for path in cache.iterdir())
    assert len(left) == 4 and all(path.name in left for path in entry_of[kept])
    assert from_cache(run(kept))


def test_a_read_keeps_an_entry_in_use(tiny_llama, cache):
    model = tiny_llama()
    run(model)
    old = time.time() - (reference_cache.UNUSED_DAYS + 1) * 86400
    for entry in cache.iterdir():
        os.utime(entry, (old, old))
    assert from_cache(run(model))
    run(tiny_llama("other"))  # a store prunes: the entries read a moment ago stay
    assert len(entries(cache, model)) == 2


def test_the_code_in_a_key_is_its_content_not_its_place(tmp_path):
    """Another checkout of the same tracer reads the same entries; an edit, even one that keeps the
    file's size and time, or a renamed file, does not."""
    source = tmp_path / "one" / "pkg"
    (source / "sub").mkdir(parents=True)
    (source / "a.py").write_text("x = 1\n")
    (source / "sub" / "b.py").write_text("y = 2\n")
    copy = tmp_path / "two" / "pkg"
    shutil.copytree(source, copy)
    digest = reference_cache.code_digest([("pkg", source)])
    assert reference_cache.code_digest([("pkg", copy)]) == digest
    stat = (copy / "a.py").stat()
    (copy / "a.py").write_text("x = 2\n")
    os.utime(copy / "a.py", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert reference_cache.code_digest([("pkg", copy)]) != digest
    (copy / "a.py").write_text("x = 1\n")
    (copy / "sub" / "b.py").rename(copy / "sub" / "c.py")
    assert reference_cache.code_digest([("pkg", copy)]) != digest
    (copy / "sub" / "c.py").rename(copy / "sub" / "b.py")
    assert reference_cache.code_digest([("pkg", copy)]) == digest


def test_a_damaged_entry_is_measured_again(tiny_llama, cache):
    model = tiny_llama()
    first = run(model)
    for entry in cache.iterdir():
        entry.write_text("{not json")
    again = run(model)
    assert not from_cache(again)
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


def test_a_later_process_reads_the_catalogues_rows_from_the_cache_and_ranks_the_same(tiny_llama, cache,
                                                                                     monkeypatch):
    from tracer.pipeline import commands

    model = tiny_llama()
    variants = "theta=500; eps=1e-3; rope=interleaved"
    observed = tracer.record(model, TOKENS, engine="reimpl", variant="theta=700")
    first = tracer.diagnose(observed, model, variants=variants, progress=False)
    commands._CATALOGUE_ROWS.clear()  # what a new process starts with

    def must_not_run(*args, **kwargs):
        raise AssertionError("a catalogue row ran again")

    monkeypatch.setattr(commands, "sweep_row", must_not_run)
    again = tracer.diagnose(observed, model, variants=variants, progress=False)
    assert again.ranking == first.ranking and again.best["variant"] == "theta=500"
    assert 0.5 < first.best["score"] < 1 and first.ranking[-1]["score"] < first.best["score"]
    with pytest.raises(AssertionError, match="ran again"):  # another catalogue is another entry
        tracer.diagnose(observed, model, variants="theta=500; eps=1e-3", progress=False)


def test_two_weight_formats_of_one_kind_share_the_quantized_blocks(tiny_llama):
    weights = read_weights(tiny_llama())
    name = "model.layers.0.self_attn.q_proj.weight"
    one, other = QuantizedWeights(weights, "q8_0"), QuantizedWeights(weights, "q8_0")
    assert one[name] is other[name] and QuantizedWeights(weights, "q4_0")[name] is not one[name]
    assert one["model.norm.weight"] is weights["model.norm.weight"]


def test_a_store_reads_each_entrys_first_line_and_removes_the_earlier_formats(tiny_llama, cache):
    """An entry's first line names its model folder and files, all a store's pruning reads; an entry in the
    earlier one-line format, which no run reads any more, is removed."""
    model = tiny_llama()
    cache.mkdir(parents=True)
    old = cache / ("0" * 40 + ".json")
    old.write_text(json.dumps({"key": {"model": str(model.resolve()), "files": {}}, "measured": {"noise": {}}}))
    run(model)
    assert not old.exists()
    for path in entries(cache, model):
        header, key, measured = (json.loads(line) for line in path.read_text().split("\n"))
        assert header == {"model": key["model"], "files": key["files"]} and key["format"] == 2
        assert set(measured) in ({"greedy"}, {"noise", "complete", "through"})


def test_a_process_that_stores_again_and_again_prunes_at_most_once_a_minute(tmp_path, monkeypatch):
    """Each prune reads every entry's first line: a notebook's or a sweep's stores share one a minute."""
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    clock = [1000.0]
    monkeypatch.setattr(reference_cache.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(reference_cache, "_pruned", {})
    (tmp_path / "gone").mkdir()

    def store(name):
        model = tmp_path / name
        model.mkdir(exist_ok=True)
        key = reference_cache.entry_key(model, TOKENS, measure=name)
        reference_cache.store((key, {"value": 1}))
        return reference_cache.entry_path(key)

    doomed = store("gone")
    shutil.rmtree(tmp_path / "gone")  # its entry can never be read again
    clock[0] += reference_cache.PRUNE_EVERY_S / 2
    kept = store("a")
    assert doomed.exists() and kept.exists()  # pruned a moment ago: not again yet
    clock[0] += reference_cache.PRUNE_EVERY_S
    store("b")
    assert not doomed.exists() and kept.exists()
