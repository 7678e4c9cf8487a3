"""Unit tests for tracer.files.weights: reading one file, an indexed set of shards, or all files, and
naming damaged ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tracer.core.errors import TracerError
from tracer.files import weights


def random_tensors(*names: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(3, 4, generator=gen) for name in names}


# --------------------------------------------------------------------------- read_weights


def test_read_weights_single_file(tmp_path):
    tensors = random_tensors("a.weight", "b.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    got = weights.read_weights(tmp_path)
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_read_weights_sharded_with_index(tmp_path):
    tensors = random_tensors("a", "b", "c")
    save_file({"a": tensors["a"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"], "c": tensors["c"]}, tmp_path / "model-00002-of-00002.safetensors")
    # A stray file the index does not name must not be read.
    save_file({"stray": tensors["a"]}, tmp_path / "optimizer.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = weights.read_weights(tmp_path)
    assert sorted(got) == ["a", "b", "c"]
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_read_weights_all_files_without_index(tmp_path):
    tensors = random_tensors("a", "b")
    save_file({"a": tensors["a"]}, tmp_path / "one.safetensors")
    save_file({"b": tensors["b"]}, tmp_path / "two.safetensors")
    assert sorted(weights.read_weights(tmp_path)) == ["a", "b"]


def test_read_weights_duplicate_tensor(tmp_path):
    tensors = random_tensors("a")
    save_file(tensors, tmp_path / "one.safetensors")
    save_file(tensors, tmp_path / "two.safetensors")
    with pytest.raises(TracerError, match="tensor a is in both"):
        weights.read_weights(tmp_path)


def test_read_weights_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(random_tensors("a", "b"), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(TracerError) as err:
        weights.read_weights(tmp_path)
    message = str(err.value)
    assert message.startswith(f"cannot read safetensors file {path}: ")
    assert "\n" not in message


def test_read_weights_garbage_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(TracerError, match=f"^cannot read safetensors file {path}: "):
        weights.read_weights(tmp_path)


def test_read_weights_missing_shard(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TracerError, match="missing shard .*model-00001-of-00002.safetensors"):
        weights.read_weights(tmp_path)


def test_read_weights_index_names_absent_tensor(tmp_path):
    save_file(random_tensors("a"), tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TracerError, match="tensor b listed in .* is not in .*s1.safetensors"):
        weights.read_weights(tmp_path)


def test_read_weights_empty_folder(tmp_path):
    with pytest.raises(TracerError) as err:
        weights.read_weights(tmp_path)
    assert str(err.value) == f"no safetensors file in {tmp_path}"
