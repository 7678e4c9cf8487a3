"""Long prompts in bounded memory: attention matrices cut to their last rows, points spilled to disk."""

import errno
import os

import pytest
import torch
from safetensors.torch import load_file

import tracer
from tests.conftest import TOKENS
from tracer.engines.load import resolve_and_load
from tracer.traces.spill import BLOCK, CHUNK, DiskRecorder, _aligned, read_point, write_point
from tracer.traces.trace import ATTENTION_ROWS

LONG = [(7 * i + 3) % 97 for i in range(ATTENTION_ROWS + 22)]


def test_long_attention_matrices_keep_their_last_rows_on_both_engines(tiny_llama):
    model = tiny_llama(max_position_embeddings=512)
    reference = resolve_and_load("hf", model, {}).record(LONG)
    candidate = resolve_and_load("reimpl", model, {}).record(LONG)
    scores = "model.layers.1.self_attn.scores"
    assert reference[scores].shape == candidate[scores].shape == (4, ATTENTION_ROWS, len(LONG))
    assert reference["model.layers.1.self_attn.q_rope"].shape == (4, len(LONG), 16)  # only (H, T, T) points are cut
    probs = candidate["model.layers.0.self_attn.probs"]
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, ATTENTION_ROWS))
    assert probs[:, 0, len(LONG) - ATTENTION_ROWS + 1:].abs().max() == 0  # row 0 is position T-128: causal
    assert tracer.compare(reference, candidate).verdict == "match"


def test_masked_entries_of_cut_matrices_stay_excluded(tiny_llama):
    model = tiny_llama(max_position_embeddings=512)
    reference = resolve_and_load("reimpl", model, {}).record(LONG)
    candidate = resolve_and_load("reimpl", model, {}).record(LONG)
    point = "model.layers.0.self_attn.scores"
    candidate.tensors[point] = candidate[point].clone()
    candidate.tensors[point][:, 0, -1] = 1e6  # the first kept query never sees the last key
    assert tracer.compare(reference, candidate).verdict == "match"


def test_spilled_trace_compares_like_the_in_memory_one(tiny_llama, tmp_path):
    model = tiny_llama()
    engine = resolve_and_load("reimpl", model, {"theta": 500.0})
    in_memory = engine.record([1, 5, 9, 2])
    spilled = engine.record([1, 5, 9, 2], DiskRecorder(tmp_path / "spill"))
    assert spilled.points == in_memory.points and len(list((tmp_path / "spill").iterdir())) == len(in_memory)
    assert all(torch.equal(spilled[p], in_memory[p]) for p in in_memory)
    reference = resolve_and_load("reimpl", model, {}).record([1, 5, 9, 2])
    from_disk, from_memory = tracer.compare(reference, spilled), tracer.compare(reference, in_memory)
    assert from_disk.first_divergence.point == from_memory.first_divergence.point
    assert [p.rel_l2 for p in from_disk.points] == [p.rel_l2 for p in from_memory.points]


def test_aligning_two_native_traces_reads_no_tensor(tiny_llama, tmp_path):
    """A spilled trace stays on disk through `align`: at most a few shapes are looked at (head_dim)."""
    from tracer.traces.layouts import align
    from tracer.traces.spill import SpilledTensors

    class Counting(SpilledTensors):
        reads = 0

        def __getitem__(self, point):
            Counting.reads += 1
            return super().__getitem__(point)

    engine = resolve_and_load("reimpl", tiny_llama(), {})
    spilled = engine.record([1, 5, 9, 2], DiskRecorder(tmp_path / "a"))
    counted = tracer.Trace(Counting(spilled.tensors.files), spilled.meta)
    align(counted, counted)
    assert Counting.reads < len(spilled) / 4


def _long_and_short_runs(model, monkeypatch, **run_args):
    """The same run twice: judged in memory, and as a long run (spilled; the candidate judged as it
    comes). Returns both results and the points each side wrote to disk."""
    written: dict[str, list[str]] = {}
    record_point = DiskRecorder.__call__

    def counting(self, name, tensor):
        written.setdefault(self.folder.name, []).append(name)
        record_point(self, name, tensor)

    in_memory = tracer.run(model, tokens=TOKENS, greedy=0, progress=False, **run_args)
    with monkeypatch.context() as patch:
        for module in ("tracer.traces.spill", "tracer.pipeline.run"):  # where the folder is made, where its note is
            patch.setattr(f"{module}.SPILL_TOKENS", 2)
        patch.setattr(DiskRecorder, "__call__", counting)
        spilled = tracer.run(model, tokens=TOKENS, greedy=0, progress=False, **run_args)
    assert any("written to a temporary folder" in note for note in spilled.notes)
    return in_memory, spilled, written


def _same_findings(a, b):
    """Equal findings, NaN for NaN (repr: a NaN never equals itself)."""
    for field in ("verdict", "first_divergence", "logits", "points", "first_nonfinite", "amplification"):
        assert repr(getattr(a, field)) == repr(getattr(b, field)), field


def test_a_long_runs_candidate_is_judged_as_it_comes_and_writes_only_what_compare_reads(tiny_llama, monkeypatch):
    in_memory, spilled, written = _long_and_short_runs(tiny_llama(), monkeypatch, variant="theta=500")
    _same_findings(in_memory, spilled)
    assert in_memory.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert len(written["reference"]) == len([p for p in in_memory.points if p.recorded])
    # the first divergence (read for its breakdown) and the logits (their summary), nothing else
    assert written["candidate"] == ["model.layers.0.self_attn.q_rope", "lm_head"]


def test_a_long_runs_candidate_keeps_the_points_holding_inf(monkeypatch, tmp_path):
    from tests.unit.test_nonfinite import OVERFLOW_POINT, write_overflowing_model

    model = write_overflowing_model(tmp_path / "model")
    in_memory, spilled, written = _long_and_short_runs(model, monkeypatch, reference="reimpl", variant="dtype=f16")
    _same_findings(in_memory, spilled)
    assert spilled.first_nonfinite["point"] == OVERFLOW_POINT and OVERFLOW_POINT in written["candidate"]
    assert len(written["candidate"]) < len(written["reference"]) / 2


@pytest.mark.slow  # llama.cpp's child
def test_a_long_run_on_an_isolated_engine_finds_what_the_short_one_finds(tiny_llama, monkeypatch, tmp_path):
    """llama.cpp's child writes a long run's points into the spill folder itself, in ggml's names
    (`meta.sources`), and the whole trace is aligned and compared from there."""
    pytest.importorskip("llama_cpp")
    from tests.tiny_gguf import write_tiny_gguf

    model = tiny_llama()
    gguf = write_tiny_gguf(model, tmp_path / "tiny.gguf")
    in_memory, spilled, _ = _long_and_short_runs(model, monkeypatch, candidate=f"llamacpp:{gguf}",
                                                       variant="kv_cache=f32,flash_attn=off")
    _same_findings(in_memory, spilled)
    assert in_memory.verdict == "match"


POINT_TENSORS = {
    "f32 matrix": torch.randn(7, 5),
    "empty": torch.zeros(0, 576),
    "bf16 over two chunks": torch.randn(CHUNK + 4099).to(torch.bfloat16),
    "f16 one byte past a block": torch.randn(2049).half(),
    "i64": torch.arange(-3, 40),
    "bool": torch.tensor([True, False, True]),
}


@pytest.mark.parametrize("name", list(POINT_TENSORS))
def test_a_point_file_is_a_safetensors_file_with_its_data_on_a_block_boundary(name, tmp_path):
    tensor, path = POINT_TENSORS[name], tmp_path / "point.safetensors"
    write_point(path, tensor, _aligned(CHUNK))
    read = read_point(path)
    assert read.dtype == tensor.dtype and read.shape == tensor.shape and torch.equal(read, tensor)
    assert torch.equal(load_file(path)["value"], tensor)  # safetensors itself reads it
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header) % BLOCK == 0 and path.stat().st_size == 8 + header + tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("refusal", ["no O_DIRECT flag", "file system refuses O_DIRECT", "device refuses the writes"])
def test_without_direct_io_the_same_bytes_are_written_and_read(refusal, tmp_path, monkeypatch):
    tensor = POINT_TENSORS["bf16 over two chunks"]
    write_point(tmp_path / "direct.safetensors", tensor, _aligned(CHUNK))
    real_open, real_write, direct_fds = os.open, os.write, set()

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0) and refusal == "file system refuses O_DIRECT":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args)
        (direct_fds.add if flags & getattr(os, "O_DIRECT", 0) else direct_fds.discard)(fd)  # numbers are reused
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    if refusal == "no O_DIRECT flag":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(os, "open", refusing_open)
    if refusal == "device refuses the writes":
        monkeypatch.setattr(os, "write", refusing_write)
    write_point(tmp_path / "buffered.safetensors", tensor, _aligned(CHUNK))
    assert (tmp_path / "buffered.safetensors").read_bytes() == (tmp_path / "direct.safetensors").read_bytes()
    assert torch.equal(read_point(tmp_path / "direct.safetensors"), tensor)


def test_reading_in_order_reads_each_point_once_ahead_of_its_use(tiny_llama, tmp_path, monkeypatch):
    import tracer.traces.spill

    spilled = resolve_and_load("reimpl", tiny_llama(), {}).record([1, 5, 9, 2], DiskRecorder(tmp_path / "spill"))
    tensors = spilled.tensors
    expected = {point: read_point(path) for point, path in tensors.files.items()}
    reads = []
    monkeypatch.setattr(tracer.traces.spill, "read_point", lambda path: reads.append(path) or read_point(path))
    order = list(tensors)
    for n, point in enumerate(order):
        assert torch.equal(tensors[point], expected[point])
        tracer.traces.spill._reader().submit(lambda: None).result()  # the reader thread has done what it was given
        assert reads == [tensors.files[p] for p in order[:n + 2]]  # this point and, already, the next
    backwards = order[::-1]  # out of order each read is its own, and still right
    assert all(torch.equal(tensors[point], expected[point]) for point in backwards)
