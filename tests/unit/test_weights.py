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


# --------------------------------------------------------------------------- conversion buffers


def test_a_conversion_buffer_is_reused_only_once_nobody_holds_it():
    """A unit's conversions go into the buffers of the unit before: never into one still read
    (held, a view of it, or a parameter made from it), and with the bits `Tensor.to` gives."""
    buffers = weights.ConversionBuffers()
    stored = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    first = buffers.converted(stored, torch.float32, "cpu")
    assert torch.equal(first, stored.to(torch.float32))
    second = buffers.converted(stored * 2, torch.float32, "cpu")  # `first` is still held
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, stored.to(torch.float32))
    parameter, row = torch.nn.Parameter(first, requires_grad=False), second[1]
    del first, second
    third = buffers.converted(stored, torch.float64, "cpu")  # another dtype: its own buffer
    assert third.dtype == torch.float64 and torch.equal(third, stored.to(torch.float64))
    held = {parameter.data_ptr(), row.untyped_storage().data_ptr()}
    assert buffers.take((6, 4), torch.float32, "cpu").data_ptr() not in held  # both still read: a third one
    del parameter, row
    assert buffers.take((6, 4), torch.float32, "cpu").data_ptr() in held  # now one of the two is reused
