"""SGLang's dump folder as SGLang writes it today (`tracer.traces.sglang_dump`): a tiny Llama's
forward dumped at TP=2 the way SGLang's own Llama and its dumper write it (fused qkv_proj and
gate_up_proj per rank, RMSNorm and decoder layers handing out tuples, module inputs, explicit dumps
with today's `dims`), read back point by point; the `dims` grammar; malformed files in one line;
memory bounded by the tensor a file's view spans."""

import io
import shutil
import tracemalloc
import zipfile

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.dumps import sglang_llama_dump
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.files.torchfile import read_torch_file
from tracer.traces.sglang_dump import split_of_dims

ALIASES = {"layers.{i}.attn_scores": "model.layers.{i}.self_attn.scores",
           "layers.{i}.attn_probs": "model.layers.{i}.self_attn.probs"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.conftest import write_tiny_llama

    model = write_tiny_llama(tmp_path_factory.mktemp("sglang") / "model")
    return tracer.record(model, TOKENS, engine="reimpl", progress=False)


@pytest.fixture(scope="module")
def dump(reference, tmp_path_factory):
    return sglang_llama_dump(reference, tmp_path_factory.mktemp("dumps") / "dump_20260101_000000_000001")


def test_every_point_of_sglangs_llama_dump_is_compared_and_matches(reference, dump):
    result = tracer.compare_files(reference, dump, aliases=ALIASES)
    assert result.verdict == "match"
    assert {p.point for p in result.points} == set(reference.tensors)  # 37 of 37
    assert max(p.rel_l2 for p in result.points) == 0  # slices put back where they were cut from
    notes = " | ".join(result.notes)
    assert "module inputs left out" in notes
    assert "model.norm's residual read as the output of layer 1, the dump's last" in notes
    assert "declared replicated, but the ranks differ" not in notes


def test_one_percent_in_one_ranks_slice_of_a_fused_projection_is_its_part(reference, dump, tmp_path):
    """1 % on rank 1's k slice inside layer 1's fused qkv_proj output: the first divergence is k_proj
    of layer 1 (not q or v: the per-rank [q, k, v] layout), by rank 1's share of k's norm. The rotary
    outputs come as (T, H/N, D) here, as a backend may hand them out: q's width is the same."""
    def plant(rank, name, tensor):
        if rank == 1 and name == "non_intrusive__model.layers.1.self_attn.qkv_proj.output":
            tensor = tensor.clone()
            tensor[:, 32:48] *= 1.01  # rank 1's [q 32 | k 16 | v 16]: its k
        if ".rotary_emb.output." in name:
            tensor = tensor.reshape(tensor.shape[0], -1, 16)  # (T, H/N·D) -> (T, H/N, D)
        return tensor

    planted = sglang_llama_dump(reference, tmp_path / "planted", edit=plant)
    result = tracer.compare_files(reference, planted, aliases=ALIASES)
    first = result.first_divergence
    assert result.verdict == "diverged" and first.point == "model.layers.1.self_attn.k_proj"
    k = reference["model.layers.1.self_attn.k_proj"].double()
    assert first.rel_l2 == pytest.approx(0.01 * float(k[:, 16:].norm() / k.norm()), rel=1e-3)
    assert [p.point for p in result.points if p.rel_l2 > 0] == ["model.layers.1.self_attn.k_proj"]


@pytest.mark.parametrize("dims, shape, split", [
    ("t h[tp]", (7, 32), "column:1"),
    ("t h[tp:partial]", (7, 64), "row"),
    ("1 h[tp] t s", (1, 2, 7, 7), "column:1"),
    ("t h # tp:replicated", (7, 64), "replicated"),
    ("t (num_heads*head_dim)[tp] # dp:=attn_dp", (7, 32), "column:1"),
    ("t h[tp:sharded]", (7, 32), "column:1"),
    ("t h(tp)", (7, 32), "column:1"),  # SGLang's older forms
    ("t h(tp,partial)", (7, 64), "row"),
    ("t h(tp:partial)", (7, 64), "row"),
    ("t h", (7, 64), "replicated"),
])
def test_sglangs_dims_grammar(dims, shape, split):
    assert split_of_dims(dims, "f.pt", shape) == split


@pytest.mark.parametrize("dims, shape, message", [
    ("t h[tp]", (1, 7, 32), r"dims 't h\[tp\]' name 2 axes; the tensor has 3 \(1, 7, 32\)"),
    ("1 t h[tp]", (2, 7, 32), "say axis 0 is 1; the tensor's is 2"),
    ("s[cp:zigzag] h", (7, 64), r"split cp:zigzag, which tracer does not merge \(tp only\)"),
    ("t h[tp] # tp:replicated", (7, 32), "declare the tensor-parallel split more than once"),
    ("t h[tp:sum]", (7, 32), r"cannot read 'tp:sum' in 'h\[tp:sum\]'"),
    ("t h[tp", (7, 32), r"cannot read 'h\[tp'"),
    ("t h # tp:copied", (7, 64), "cannot read 'tp:copied' after '#'"),
])
def test_a_split_that_cannot_be_read_is_refused_in_one_line(dims, shape, message):
    with pytest.raises(TracerError, match=message) as error:
        split_of_dims(dims, "f.pt", shape)
    assert "\n" not in str(error.value)


def _pickle_zip(path, data: bytes, storages=None):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data)
        for key, raw in (storages or {}).items():
            archive.writestr(f"archive/data/{key}", raw)


def _one_file_dump(folder, value, meta):
    folder.mkdir()
    torch.save({"value": value, "meta": meta}, folder / "step=0___rank=0___dump_index=1___name=x.pt")
    return folder


@pytest.mark.parametrize("meta, message", [
    ({"name": None}, "meta name is None; expected the tensor's name"),
    ({"name": "x", "step": "first"}, "meta step is 'first'; expected a whole number"),
    ({"name": "x", "sglang_parallel_info": [0, 2]}, r"meta sglang_parallel_info is \[0, 2\]; expected a mapping"),
    ({"name": "x", "sglang_parallel_info": {"tp_rank": None, "tp_size": 1.5}}, "meta tp_size is 1.5"),
    ({"name": "x", "dims": "t h[tp]"}, r"dims 't h\[tp\]' name 2 axes; the tensor has 1 \(4,\)"),
    ("meta", "its meta is str, not a mapping"),
    ({"name": "x", "sglang_parallel_info": {"tp_rank": 0, "tp_size": 2, "attn_dp_size": 2}},
     "sglang_parallel_info attn_dp_size is 2; tracer merges tensor-parallel ranks only"),
])
def test_malformed_metadata_is_one_line(tmp_path, meta, message):
    folder = _one_file_dump(tmp_path / "dump", torch.ones(4), meta)
    with pytest.raises(TracerError, match=message) as error:
        tracer.compare_files(folder, folder)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("data, message", [
    (b"\x80\x02}K\x01a.", "cannot read its data.pkl: 'dict' object has no attribute 'append'"),  # APPEND on a dict
    (b"\x80\x02]K\x01K\x02s.", "cannot read its data.pkl: list assignment index out of range"),  # SETITEM on a list
    (b"\x80\x02(K\x01u.", "cannot read its data.pkl"),  # SETITEMS with nothing under the mark
    (b"\x80\x02K\x01", "cannot read its data.pkl"),  # no STOP
])
def test_malformed_pickle_opcodes_are_one_line(tmp_path, data, message, capsys):
    folder = tmp_path / "dump"
    folder.mkdir()
    _pickle_zip(folder / "step=0___rank=0___dump_index=1___name=x.pt", data)
    assert main(["compare", str(folder), str(folder), "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_view_outside_its_storage_is_refused(tmp_path):
    stream = io.BytesIO()
    torch.save(torch.arange(8.0)[2:6], stream)  # a view of 4 of the storage's 8 elements
    with zipfile.ZipFile(stream) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    storage = next(name for name in entries if "/data/" in name)
    with zipfile.ZipFile(tmp_path / "short.pt", "w") as archive:
        for name, raw in entries.items():
            archive.writestr(name, raw[:8] if name == storage else raw)  # 2 of its 8 floats
    with pytest.raises(TracerError, match=r"short.pt: storage .* holds 8 bytes, not 32"):
        read_torch_file(tmp_path / "short.pt")


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_memory_is_bounded_by_the_view_not_its_storage(tmp_path, compression):
    """A (7, 64) slice of a 16 MiB buffer (torch.save writes the whole storage), stored as torch.save
    writes it or deflated: the reader's buffers at their peak hold the slice and a 1 MiB chunk, not
    the 16 MiB (before: the storage read whole, then copied)."""
    buffer = torch.zeros(65_536, 64)
    buffer[1000:1007] = torch.arange(448.0).reshape(7, 64)
    stream = io.BytesIO()
    torch.save({"value": buffer[1000:1007], "meta": {"name": "x"}}, stream)
    with zipfile.ZipFile(stream) as source, zipfile.ZipFile(tmp_path / "x.pt", "w", compression) as target:
        for name in source.namelist():
            target.writestr(name, source.read(name), compresslevel=1 if compression else None)
    tracemalloc.start()
    try:
        value = read_torch_file(tmp_path / "x.pt")["value"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(value, torch.arange(448.0).reshape(7, 64))
    assert peak < 3 << 20, f"reading a 16 MiB storage's (7, 64) view peaked at {peak / 2**20:.1f} MiB"


def test_a_fused_output_whose_widths_the_dump_cannot_give_is_refused(dump, tmp_path):
    """A dump filtered to leave out layer 0's rotary and attention outputs: its qkv_proj cannot be cut
    into q, k, v by anything it holds, so the folder is refused rather than the split guessed."""
    folder = tmp_path / "filtered"
    shutil.copytree(dump, folder)
    for path in folder.glob("*model.layers.0.self_attn.*.pt"):
        if ".rotary_emb.output" in path.name or ".self_attn.attn.output" in path.name:
            path.unlink()
    with pytest.raises(TracerError, match=r"cannot split model.layers.0.self_attn.qkv_proj: no rotary_emb or attn "
                                          r"output of its layer gives q's width"):
        tracer.compare_files(folder, folder, aliases=ALIASES)
