"""Where a model runs and how much of it is in memory: `device` and `stream`.

Streaming (`Model(..., stream=True)`, `--stream`) reads each block's weights from the files when
the forward reaches it and lets them go after; it must compute exactly what the loaded model
computes, and hold far less. GPU runs are checked where torch sees a CUDA device.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tracer
from tests.conftest import OWN_PEAK_KB, TOKENS, write_tiny_llama
from tracer.cli import main
from tracer.files.sources import ModelSource, resolve_source
from tracer.pipeline.noise_floor import estimate_noise
from tracer.reimpl.forward import Model
from tracer.traces.trace import TraceRecorder

CUDA = torch.cuda.is_available()


def recorded(llama: Model, tokens=TOKENS) -> dict[str, torch.Tensor]:
    recorder = TraceRecorder()
    llama.forward(torch.tensor(tokens), recorder)
    return recorder.tensors


@pytest.mark.parametrize("variant", [{}, {"theta": 500.0, "dtype": "f64"}, {"dtype": "bf16", "kv_repeat": "tile"}])
@pytest.mark.parametrize("tied", [True, False])
def test_streamed_forward_is_bitwise_the_loaded_one(tmp_path, variant, tied):
    model = write_tiny_llama(tmp_path / "m", tie_word_embeddings=tied, attention_bias=True)
    loaded, streamed = recorded(Model.from_dir(model, variant)), recorded(Model.from_dir(model, variant, stream=True))
    assert list(streamed) == list(loaded)
    for point, tensor in loaded.items():
        assert torch.equal(streamed[point], tensor), point


def test_the_noise_floor_is_the_same_from_streamed_f64_weights(tiny_llama):
    """`estimate_noise` streams its f64 copy; the numbers are those of a fully loaded f64 model."""
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf", progress=False)
    noise = estimate_noise(ModelSource(model), reference, {})
    exact = tracer.Trace(recorded(Model.from_dir(model, {"dtype": "f64"})), tracer.TraceMeta(tokens=TOKENS))
    expected = {p.point: p.rel_l2 for p in tracer.comparison.diff.compare_points(reference, exact, tracer.Tolerance())}
    assert noise == {point: value for point, value in expected.items() if point in noise}
    assert len(noise) == len(reference) and max(noise.values()) > 0


PEAK_CHILD = f"""
import sys, torch
from tracer.reimpl.forward import Model
before = {OWN_PEAK_KB}
llama = Model.from_dir(sys.argv[1], stream=sys.argv[2] == "stream")
llama.forward(torch.arange(64))
print({OWN_PEAK_KB} - before)
"""


@pytest.mark.slow  # a child process measures its peak
def test_streaming_holds_one_block_not_the_model(tmp_path):
    """A 143 MB model (8 blocks of 17 MB): loaded, the process grows by the model; streamed, by
    about a block and the activations."""
    model = write_tiny_llama(tmp_path / "m", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    size_mb = (model / "model.safetensors").stat().st_size / 1e6
    growth_mb = {}
    for mode in ("loaded", "stream"):
        out = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(model), mode], capture_output=True, text=True,
                             check=True)
        growth_mb[mode] = int(out.stdout) / 1e3
    assert growth_mb["loaded"] > 0.9 * size_mb, growth_mb
    assert growth_mb["stream"] < 0.35 * size_mb, (growth_mb, size_mb)


def test_record_stream_from_the_cli_writes_the_same_trace(tiny_llama, tmp_path):
    model = tiny_llama()
    tokens = ",".join(map(str, TOKENS))
    for name, extra in (("loaded", []), ("streamed", ["--stream"])):
        assert main(["record", "--engine", "reimpl", "--model", str(model), "--tokens", tokens,
                     "--variant", "theta=500", "-o", str(tmp_path / f"{name}.safetensors"), *extra]) == 0
    loaded, streamed = (tracer.Trace.load(tmp_path / f"{name}.safetensors") for name in ("loaded", "streamed"))
    assert list(loaded.points) == list(streamed.points)
    assert all(torch.equal(loaded[p], streamed[p]) for p in loaded.points)


def test_run_with_stream_streams_both_sides_and_judges_the_same(tiny_llama):
    model = tiny_llama()
    plain = tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=2, progress=False)
    streamed = tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=2, progress=False, stream=True)
    assert streamed.first_divergence.point == plain.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert [p.rel_l2 for p in streamed.points] == [p.rel_l2 for p in plain.points]
    assert streamed.greedy.reference == plain.greedy.reference
    assert not any("stream" in note for note in (*plain.notes, *streamed.notes))
    assert "--stream" in streamed.command and "--stream" not in plain.command


def test_a_model_past_the_threshold_streams_by_default(tiny_llama, monkeypatch):
    from tracer.pipeline import streamed

    model = tiny_llama()
    size = streamed.f32_bytes(resolve_source(model, False))
    monkeypatch.setattr(streamed, "STREAM_BYTES", size - 1)
    chosen = tracer.run(model, tokens=TOKENS, variant="theta=500", progress=False)
    assert any(note.startswith("weights streamed block by block") for note in chosen.notes)
    assert any("no greedy continuation in a streamed run" in note for note in chosen.notes)
    assert chosen.greedy is None and "--stream" not in chosen.command
    whole = tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=0, progress=False, stream=False)
    assert not any("stream" in note for note in whole.notes) and "--no-stream" in whole.command
    assert [p.rel_l2 for p in whole.points] == [p.rel_l2 for p in chosen.points]
    monkeypatch.setattr(streamed, "STREAM_BYTES", size)
    assert streamed.resolve(None, resolve_source(model, False)) == (False, [])


def test_traces_say_where_they_ran(tiny_llama):
    model = tiny_llama()
    for engine in ("hf", "reimpl"):
        trace = tracer.record(model, TOKENS, engine=engine, device="cpu", progress=False)
        assert trace.meta.device == "cpu"
        assert all(trace[p].device.type == "cpu" for p in trace.points)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_run_localizes_theta_and_keeps_traces_on_the_cpu(tiny_llama, tmp_path):
    model = tiny_llama()
    result = tracer.run(model, tokens=TOKENS, variant="theta=500", greedy=3, progress=False, device="cuda",
                        out=tmp_path / "report")
    assert result.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert "--device cuda" in result.command
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["verdict"] == "diverged"
    same = tracer.run(model, tokens=TOKENS, greedy=3, progress=False, device="cuda")
    assert same.verdict == "match", same.first_divergence
    trace = tracer.record(model, TOKENS, engine="reimpl", device="cuda", stream=True, progress=False)
    assert trace.meta.device.startswith("cuda") and trace["model.embed_tokens"].device.type == "cpu"
