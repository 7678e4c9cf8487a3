"""tracer's own GGUF header reader (`tracer.files.gguffile`) against gguf-py's, on a file with the
string arrays a real one carries (a vocabulary, merges: a header past the first megabyte the reader
takes at once), whole and cut anywhere in the header."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tracer.core.errors import TracerError
from tracer.files.gguffile import GGUFFile


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"tok{i}" * (i % 61 + 1) for i in range(5000)])  # 4 to 488 bytes, 1.2 MB
    writer.add_token_merges([f"tok{i} tok{i + 1}" for i in range(3000)])
    writer.add_token_scores([float(i) for i in range(5000)])
    writer.add_rope_freq_base(500000.0)
    writer.add_tensor("token_embd.weight", np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_reads_as_gguf_py_reads_it(vocab_gguf):
    ours, theirs = GGUFFile(vocab_gguf), gguf.GGUFReader(vocab_gguf)
    assert ours.fields["llama.rope.freq_base"] == 500000.0 and ours.fields["llama.block_count"] == 1
    assert ours.fields["tokenizer.ggml.tokens"] is None  # string arrays are skipped, not decoded
    assert np.array_equal(ours.fields["tokenizer.ggml.scores"], np.arange(5000, dtype=np.float32))
    assert set(ours.fields) == {key for key in theirs.fields if not key.startswith("GGUF.")}  # not the counts
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert (info.offset, info.nbytes) == (tensor.data_offset, tensor.n_bytes)
        assert np.array_equal(ours.raw(tensor.name).view(np.float32).reshape(tensor.data.shape), tensor.data)


def test_a_header_cut_inside_its_string_arrays_is_one_clear_error(vocab_gguf, tmp_path):
    data = vocab_gguf.read_bytes()
    header_end = GGUFFile(vocab_gguf).tensors["token_embd.weight"].offset
    for cut in (40, 1000, 60_000, (1 << 20) + 3, header_end - 100):
        assert cut < header_end
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(TracerError, match="truncated GGUF header"):
            GGUFFile(tmp_path / "cut.gguf")
