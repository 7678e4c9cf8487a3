import json

import pytest
import torch
from safetensors import safe_open

import tracer
from tests.conftest import TOKENS
from tracer import Trace, TracerError


def test_save_load_round_trip_keeps_order_tensors_and_meta(tiny_llama, tmp_path):
    trace = tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="theta=500")
    path = trace.save(tmp_path / "t.safetensors")
    loaded = Trace.load(path)

    assert loaded.points == trace.points  # execution order survives safetensors' sorted keys
    assert loaded.meta == json.loads(json.dumps(trace.meta))
    assert loaded.meta["variant"] == {"theta": 500.0} and loaded.tokens == TOKENS
    for point in trace:
        assert torch.equal(loaded[point], trace[point])
    assert loaded.label == "reimpl[theta=500]"


def test_saved_file_is_plain_safetensors_with_a_json_manifest(tiny_llama, tmp_path):
    path = tracer.record(tiny_llama(), TOKENS, engine="reimpl").save(tmp_path / "t.safetensors")
    with safe_open(str(path), framework="pt") as f:
        manifest = json.loads(f.metadata()["tracer"])
        assert "model.layers.1.self_attn.q_rope" in f.keys()
    assert manifest["points"][0] == "model.embed_tokens" and manifest["meta"]["engine"] == "reimpl"
    assert not (tmp_path / "t.safetensors.partial").exists()


def test_a_foreign_safetensors_file_loads_with_its_own_names(tmp_path):
    from safetensors.torch import save_file

    save_file({"lm_head": torch.ones(2, 3), "model.embed_tokens": torch.zeros(2, 4)}, str(tmp_path / "x.safetensors"))
    trace = Trace.load(tmp_path / "x.safetensors")
    assert set(trace.points) == {"lm_head", "model.embed_tokens"} and trace.meta["engine"] == "file"


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64])
def test_unreadable_trace_is_one_clear_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(TracerError, match=r"^cannot read trace .*bad\.safetensors"):
        Trace.load(path)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TracerError, match="trace file not found"):
        Trace.load(tmp_path / "nope.safetensors")
