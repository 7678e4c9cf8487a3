"""The onnx engine on a tiny random Llama: ONNX Runtime on tracer's cached dynamo export.

One export per dtype serves the whole module (a few seconds each on the tiny model). They are kept in
the user's cache, as a user's are: an export is keyed by the model's contents, and the tiny model is
the same every run, so a second run of the suite reuses them rather than adding more. The model has
three layers, so its exports are the two-layer export with layer 1 repeated
(`tracer.engines.onnx_layers`), which every test here runs.
"""

import os
import sys

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tracer import TracerError
from tracer.engines.load import resolve_and_load
from tracer.model.points import all_points

LAYERS = 3  # one layer more than the export traces: the third is layer 1's nodes repeated


@pytest.fixture(scope="module")
def onnx_cache():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("onnx") / "m", rope_theta=500.0, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def engine(onnx_cache, model):
    return resolve_and_load("onnx", model, {})


@pytest.fixture(scope="module")
def reference(model):
    return tracer.record(model, TOKENS, engine="hf")


def test_a_missing_runtime_is_one_line_naming_the_extra(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what find_spec says for a module not installed
    with pytest.raises(TracerError, match=r"^the onnx engine needs onnxruntime, which is not installed: "
                                          r"pip install -e '\.\[onnx\]'$"):
        tracer.record(tiny_llama(), TOKENS, engine="onnx")


def test_every_point_is_recorded_and_matches_transformers(engine, reference):
    candidate = engine.record(TOKENS)
    assert list(candidate.tensors) == all_points(LAYERS) and not candidate.not_recorded
    result = tracer.compare(reference, candidate)
    assert result.verdict == "match"
    assert all(p.recorded for p in result.points)
    worst = max(p.rel_l2 for p in result.points)
    assert 0 < worst < 1e-5  # ORT's own kernels: rounding differs from torch's, within it
    runtime = candidate.meta.runtime
    assert runtime["name"] == "onnxruntime" and runtime["version"] and candidate.meta.ort_opt == "all"


def test_one_export_serves_every_prompt_length(engine, model):
    for length in (1, 3, 20):
        tokens = (TOKENS * 3)[:length]
        result = tracer.compare(tracer.record(model, tokens, engine="hf"), engine.record(tokens))
        assert result.verdict == "match", length
        assert engine.record(tokens)["model.layers.1.self_attn.scores"].shape == (4, length, length)


def test_the_points_are_the_graph_computation_itself_not_copies_beside_it(engine):
    """Each output but the logits feeds another node: it is the value the forward goes on with."""
    import onnx

    graph = onnx.load(str(engine.export_dir / "model.onnx"), load_external_data=False).graph
    consumed = {name for node in graph.node for name in node.input}
    producer = {name: node for node in graph.node for name in node.output}
    outputs = [output.name for output in graph.output]
    assert outputs == all_points(LAYERS)
    for name in outputs[:-1]:
        node = producer[name]
        # scores and probs leave through a slice of their last query rows (all of them here)
        on_path = name in consumed or (node.op_type == "Slice" and node.input[0] in consumed)
        assert on_path, f"{name} ({node.op_type}) feeds nothing in the graph"


def test_the_plain_export_gives_the_recorded_logits(engine):
    """plain.onnx (logits its only output: the model as shipped) computes what model.onnx does,
    although ORT optimizes a graph whose intermediates are outputs differently."""
    recorded = engine.record(TOKENS)["lm_head"]
    assert torch.allclose(engine.logits(TOKENS), recorded, rtol=0, atol=1e-5)
    import onnx

    plain = onnx.load(str(engine.export_dir / "plain.onnx"), load_external_data=False).graph
    assert [output.name for output in plain.output] == ["lm_head"]


def test_the_export_is_cached_per_model_contents_and_dtype(onnx_cache, model, tmp_path, monkeypatch):
    import shutil

    from tracer.engines.onnx import export_path, exported
    from tracer.files import hashes

    path = exported(model, "f32")
    made = (path / "export.json").stat().st_mtime_ns
    assert exported(model, "f32") == path and (path / "export.json").stat().st_mtime_ns == made  # not rebuilt
    assert export_path(model, "f16") != path
    assert not list(path.parent.glob(f".{path.name}.tmp-*"))  # built aside, renamed into place
    hashed = []
    monkeypatch.setattr(hashes, "file_hash", lambda file, real=hashes.file_hash: hashed.append(file.name) or real(file))
    assert export_path(model, "f32") == path and hashed == []  # files not written since: not hashed again
    copy = shutil.copytree(model, tmp_path / "downloaded")  # the same files elsewhere, under another name
    assert export_path(copy, "f32") == path and sorted(hashed) == ["config.json", "model.safetensors"]
    weights = copy / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched, the same bytes
    assert export_path(copy, "f32") == path
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # a re-saved checkpoint with one weight changed, its size and mtime kept
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert export_path(copy, "f32") != path


def test_a_repeated_layer_export_is_the_whole_export_bit_for_bit(engine, model, tmp_path):
    import json

    import numpy as np
    import onnx
    import onnxruntime

    from tracer.engines.onnx import _export

    whole = tmp_path / "whole"
    whole.mkdir()
    _export(model, "f32", whole, repeat=False)
    folders = (engine.export_dir, whole)
    manifests = [json.loads((folder / "export.json").read_text()) for folder in folders]
    assert [m["layers"] for m in manifests] == ["layers 2.. repeat layer 1", "every layer exported"]
    assert manifests[0]["points"] == manifests[1]["points"] == all_points(LAYERS)
    graphs = [onnx.load(str(folder / "model.onnx"), load_external_data=False).graph for folder in folders]
    repeated, exported = ([sorted(n.op_type for n in g.node), sorted(i.name for i in g.initializer)] for g in graphs)
    assert repeated == exported  # the same ops reading the same weights
    feed = {"input_ids": np.array([(TOKENS * 4)[:17]], dtype=np.int64)}
    runs = [onnxruntime.InferenceSession(str(folder / "model.onnx")).run(None, feed) for folder in folders]
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))


def test_layers_the_config_hides_apart_are_found_out_and_exported_whole(onnx_cache, tmp_path, monkeypatch):
    """The check behind the config's: a Qwen2 whose window starts at layer 1, taken for repeatable,
    is found out by its two exported layers (they read different masks) and exported whole."""
    import json

    import numpy as np
    import onnxruntime

    from tests.families import write_tiny_family
    from tracer.engines.onnx import _export

    monkeypatch.setattr("tracer.engines.onnx_layers.repeatable", lambda model: True)
    model = write_tiny_family(tmp_path / "qwen2", "qwen2", num_hidden_layers=3)  # max_window_layers=1
    folder = tmp_path / "export"
    folder.mkdir()
    _export(model, "f32", folder)
    manifest = json.loads((folder / "export.json").read_text())
    assert manifest["layers"] == ("every layer exported (the two layers differ in an op, a constant, "
                                  "a weight or a shared value)")
    assert manifest["points"] == all_points(3)
    tokens = (TOKENS * 4)[:17]
    logits = onnxruntime.InferenceSession(str(folder / "plain.onnx")).run(
        None, {"input_ids": np.array([tokens], dtype=np.int64)})[0]
    reference = tracer.record(model, tokens, engine="hf")["lm_head"]
    assert np.allclose(logits.reshape(reference.shape), reference.numpy(), rtol=0, atol=1e-5)


def test_only_layers_that_are_one_computation_are_repeated(tmp_path):
    from tests.families import write_tiny_family
    from tracer.engines.hf import load
    from tracer.engines.onnx_layers import repeatable
    from tracer.files.sources import ModelSource

    def model(family, **overrides):
        return load(ModelSource(write_tiny_family(tmp_path / family, family, **overrides)), {}).model

    assert repeatable(model("mistral", num_hidden_layers=3))
    assert not repeatable(model("llama", num_hidden_layers=2))  # nothing to repeat
    assert not repeatable(model("gemma2", num_hidden_layers=4))  # sliding window on alternate layers
    assert not repeatable(model("gemma3", num_hidden_layers=3,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"]))


@pytest.mark.parametrize("level", ["disable", "basic", "extended"])
def test_ort_optimization_levels_all_match(onnx_cache, model, reference, level):
    candidate = resolve_and_load("onnx", model, {"ort_opt": level}).record(TOKENS)
    assert candidate.meta.ort_opt == level
    assert tracer.compare(reference, candidate).verdict == "match"


def test_an_f16_export_diverges_at_the_embedding(onnx_cache, model, reference):
    candidate = resolve_and_load("onnx", model, {"dtype": "f16"}).record(TOKENS)
    assert candidate.meta.dtype == "f16" and candidate["model.norm"].dtype == torch.float16
    result = tracer.compare(reference, candidate)
    assert result.first_divergence.point == "model.embed_tokens"
    assert result.logits.argmax_agree > 0.5
    same_dtype = tracer.compare(tracer.record(model, TOKENS, engine="hf", variant="dtype=f16"), candidate)
    assert same_dtype.points[0].rel_l2 == 0  # the same f16 embedding lookup


@pytest.mark.parametrize("variant, message", [
    ("dtype=bf16", r"the onnx engine runs dtype f32 \| f16, not bf16"),
    ("ort_opt=fast", r"bad value 'fast' for knob 'ort_opt'; expected disable \| basic \| extended \| layout \| all"),
    ("theta=10", r"knob 'theta' is not honoured by the onnx engine; engines that honour it: hf, reimpl"),
])
def test_knobs_it_cannot_honour_are_one_line(onnx_cache, model, variant, message):
    with pytest.raises(TracerError, match=message):
        tracer.record(model, TOKENS, engine="onnx", variant=variant)


def test_ort_opt_belongs_to_the_onnx_engine_only(model):
    with pytest.raises(TracerError, match="knob 'ort_opt' is not honoured by the reimpl engine; "
                                          "engines that honour it: onnx"):
        tracer.record(model, TOKENS, engine="reimpl", variant="ort_opt=basic")


def test_run_reports_the_runtime(onnx_cache, model, tmp_path):
    result = tracer.run(model, tokens=TOKENS, candidate="onnx", greedy=3, progress=False, out=tmp_path / "report")
    summary = result.to_dict()
    assert summary["verdict"] == "match" and summary["greedy"]["same_prefix"] == 3
    version = summary["candidate"]["runtime"]["version"]
    assert summary["candidate"]["runtime"]["name"] == "onnxruntime"
    assert f"onnxruntime {version}" in (tmp_path / "report" / "report.html").read_text()
