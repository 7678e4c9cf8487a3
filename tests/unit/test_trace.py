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
    assert loaded.meta.to_dict() == json.loads(json.dumps(trace.meta.to_dict()))
    assert loaded.meta.variant == {"theta": 500.0} and loaded.tokens == TOKENS
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
    assert set(trace.points) == {"lm_head", "model.embed_tokens"} and trace.meta.engine == "file"


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64])
def test_unreadable_trace_is_one_clear_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(TracerError, match=r"^cannot read trace .*bad\.safetensors"):
        Trace.load(path)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TracerError, match="trace file not found"):
        Trace.load(tmp_path / "nope.safetensors")


def _manifest_meta(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["tracer"])["meta"]


def test_meta_keys_tracer_does_not_know_are_kept_and_written_back(tmp_path):
    from safetensors.torch import save_file

    meta = {"engine": "reimpl", "variant": {}, "tokens": [1, 2], "placement": None, "num_layers": 1,
            "newer_key": {"from": "a newer tracer"}}
    manifest = {"format": 1, "points": ["lm_head"], "meta": meta}
    save_file({"lm_head": torch.ones(2, 3)}, str(tmp_path / "old.safetensors"),
              metadata={"tracer": json.dumps(manifest)})
    loaded = Trace.load(tmp_path / "old.safetensors")

    assert loaded.meta.engine == "reimpl" and loaded.meta.num_layers == 1 and loaded.tokens == [1, 2]
    assert loaded.meta.extra == {"newer_key": {"from": "a newer tracer"}}
    resaved = _manifest_meta(loaded.save(tmp_path / "new.safetensors"))
    assert resaved == {key: value for key, value in meta.items() if value is not None}  # None: the key unsaid


def test_a_foreign_dumps_other_metadata_stays_in_extra(tmp_path):
    from safetensors.torch import save_file

    header = {"tokens": "1,2", "runtime": "my-port", "commit": "abc123", "engine": "not tracer's"}
    save_file({"lm_head": torch.ones(2, 3)}, str(tmp_path / "x.safetensors"), metadata=header)
    trace = Trace.load(tmp_path / "x.safetensors")

    assert trace.meta.runtime == "my-port" and trace.tokens == [1, 2] and trace.meta.engine == "file"
    assert trace.meta.extra == {"commit": "abc123"}  # a key named like tracer's own is not taken from a dump
    assert _manifest_meta(trace.save(tmp_path / "saved.safetensors"))["commit"] == "abc123"
    assert Trace.load(tmp_path / "saved.safetensors").meta == trace.meta


def test_trace_meta_to_dict_and_from_dict_round_trip():
    meta = tracer.TraceMeta(engine="hf", variant={"theta": 500.0}, tokens=[3], runtime={"name": "x"},
                            extra={"unknown": [1]})
    assert meta.to_dict() == {"engine": "hf", "variant": {"theta": 500.0}, "tokens": [3], "runtime": {"name": "x"},
                              "unknown": [1]}
    assert tracer.TraceMeta.from_dict(meta.to_dict()) == meta
