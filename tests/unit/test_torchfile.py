"""`tracer.files.torchfile`: files `torch.save` writes read without running their pickle: tensors and
plain containers come back equal; a stream naming anything else is refused and never runs."""

import os

import pytest
import torch

from tracer.core.errors import TracerError
from tracer.files.torchfile import read_torch_file


def test_tensors_and_plain_values_come_back_equal(tmp_path):
    base = torch.randn(4, 6)
    saved = {
        "value": base[:, 1:5],  # a strided view: offset and strides rebuilt
        "bf16": torch.randn(3, 2).to(torch.bfloat16), "f16": torch.randn(5).half(), "f64": torch.randn(2).double(),
        "ids": torch.tensor([1, 2, 3]), "mask": torch.tensor([True, False]), "shared": base,  # same storage twice
        "meta": {"name": "x", "layer_id": 3, "dims": "t h(tp)", "parallel": {"tp_rank": 1, "tp_size": 2},
                 "scale": 1.5, "none": None, "flags": [True, False], "pair": (1, "a")},
    }
    torch.save(saved, tmp_path / "dump.pt")
    read = read_torch_file(tmp_path / "dump.pt")
    assert read.keys() == saved.keys() and read["meta"] == saved["meta"]
    for name in ("value", "bf16", "f16", "f64", "ids", "mask", "shared"):
        assert read[name].dtype == saved[name].dtype and torch.equal(read[name], saved[name]), name


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a hostile file does: a call hidden in the pickle
        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_would_run_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "EXECUTED"
    torch.save({"value": torch.ones(2), "meta": Planted(marker)}, tmp_path / "hostile.pt")
    with pytest.raises(TracerError, match=r"hostile.pt: its data.pkl names (posix|os)\.system, which is not a tensor"):
        read_torch_file(tmp_path / "hostile.pt")
    assert not marker.exists()


def test_a_file_that_is_no_torch_zip_is_one_line(tmp_path):
    (tmp_path / "plain.pt").write_bytes(b"\x80\x02}q\x00.")  # a bare pickle, not torch.save's zip
    with pytest.raises(TracerError, match="plain.pt: not a file torch.save writes"):
        read_torch_file(tmp_path / "plain.pt")
