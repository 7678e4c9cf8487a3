"""Long prompts in bounded memory: attention matrices cut to their last rows, points spilled to disk."""

import torch

import tracer
from tracer.engines.load import load_engine
from tracer.spill import DiskRecorder
from tracer.trace import ATTENTION_ROWS

LONG = [(7 * i + 3) % 97 for i in range(ATTENTION_ROWS + 22)]


def test_long_attention_matrices_keep_their_last_rows_on_both_engines(tiny_llama):
    model = tiny_llama(max_position_embeddings=512)
    reference = load_engine("hf", model, {}).record(LONG)
    candidate = load_engine("reimpl", model, {}).record(LONG)
    scores = "model.layers.1.self_attn.scores"
    assert reference[scores].shape == candidate[scores].shape == (4, ATTENTION_ROWS, len(LONG))
    assert reference["model.layers.1.self_attn.q_rope"].shape == (4, len(LONG), 16)  # only (H, T, T) points are cut
    probs = candidate["model.layers.0.self_attn.probs"]
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, ATTENTION_ROWS))
    assert probs[:, 0, len(LONG) - ATTENTION_ROWS + 1:].abs().max() == 0  # row 0 is position T-128: causal
    assert tracer.compare(reference, candidate).verdict == "match"


def test_masked_entries_of_cut_matrices_stay_excluded(tiny_llama):
    model = tiny_llama(max_position_embeddings=512)
    reference = load_engine("reimpl", model, {}).record(LONG)
    candidate = load_engine("reimpl", model, {}).record(LONG)
    point = "model.layers.0.self_attn.scores"
    candidate.tensors[point] = candidate[point].clone()
    candidate.tensors[point][:, 0, -1] = 1e6  # the first kept query never sees the last key
    assert tracer.compare(reference, candidate).verdict == "match"


def test_spilled_trace_compares_like_the_in_memory_one(tiny_llama, tmp_path):
    model = tiny_llama()
    engine = load_engine("reimpl", model, {"theta": 500.0})
    in_memory = engine.record([1, 5, 9, 2])
    spilled = engine.record([1, 5, 9, 2], DiskRecorder(tmp_path / "spill"))
    assert spilled.points == in_memory.points and len(list((tmp_path / "spill").iterdir())) == len(in_memory)
    assert all(torch.equal(spilled[p], in_memory[p]) for p in in_memory)
    reference = load_engine("reimpl", model, {}).record([1, 5, 9, 2])
    from_disk, from_memory = tracer.compare(reference, spilled), tracer.compare(reference, in_memory)
    assert from_disk.first_divergence.point == from_memory.first_divergence.point
    assert [p.rel_l2 for p in from_disk.points] == [p.rel_l2 for p in from_memory.points]


def test_aligning_two_native_traces_reads_no_tensor(tiny_llama, tmp_path):
    """A spilled trace stays on disk through `align`: at most a few shapes are looked at (head_dim)."""
    from tracer.layouts import align
    from tracer.spill import SpilledTensors

    class Counting(SpilledTensors):
        reads = 0

        def __getitem__(self, point):
            Counting.reads += 1
            return super().__getitem__(point)

    engine = load_engine("reimpl", tiny_llama(), {})
    spilled = engine.record([1, 5, 9, 2], DiskRecorder(tmp_path / "a"))
    counted = tracer.Trace(Counting(spilled.tensors.files), spilled.meta)
    align(counted, counted)
    assert Counting.reads < len(spilled) / 4
