"""k-quant block formats (tracer.ggml.kquants): GGUF bytes unpacked into their integer operands and
dequantized as ggml dequantizes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq

from tracer.errors import TracerError
from tracer.ggml import kquants as K

# byte offsets of the f16 super-block scales (d, then dmin) in each block (ggml-common.h)
SCALE_OFFSETS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
RANGES = {  # (quants, scales, mins) as the kernels take them
    "q2_k": ((0, 3), (0, 15), (0, 15)), "q3_k": ((-4, 3), (-32, 31), None), "q4_k": ((0, 15), (0, 63), (0, 63)),
    "q5_k": ((0, 31), (0, 63), (0, 63)), "q6_k": ((0, 63), (-128, 127), None)}


def random_kquant_bytes(kind: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """(rows, blocks * bytes) uint8: every bit random but the f16 scales, which are finite."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, K.KQUANT_TYPES[kind][0]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        raw[..., offset:offset + 2] = rng.normal(0, 0.01, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(K.KQUANT_TYPES))
def test_kquant_blocks_dequantize_as_ggml_does(kind):
    """Every bit pattern (random bytes): the values are the gguf package's dequantization to the
    bit (itself checked against libggml-base's dequantize_row_*), the integer fields span their ranges."""
    raw = random_kquant_bytes(kind, 5, 3)
    blocks = K.from_gguf_bytes(kind, raw, (5, 768))
    expected = gq.dequantize(raw, gguf.GGMLQuantizationType[kind.upper()]).reshape(5, 768)
    assert torch.equal(blocks.values(), torch.from_numpy(expected))
    quants, scales, mins = RANGES[kind]
    assert (int(blocks.q.min()), int(blocks.q.max())) == quants
    assert (int(blocks.scales.min()), int(blocks.scales.max())) == scales
    assert blocks.scales.shape == (5, 3, 256 // blocks.sub_block) and blocks.q.shape == (5, 3, 256)
    assert (mins is None) == (blocks.mins is None) == (blocks.dmin is None)
    if mins:
        assert (int(blocks.mins.min()), int(blocks.mins.max())) == mins


def test_the_kernel_layout_holds_scale_times_quant_per_value_outputs_last():
    raw = random_kquant_bytes("q6_k", 4, 2, seed=1)
    blocks = K.from_gguf_bytes("q6_k", raw, (4, 512))
    layout = blocks.kernel_layout()
    assert layout.weights.shape == (2, 256, 4) and layout.scales.shape == (2, 16, 4)
    row, block, value = 3, 1, 77
    assert layout.weights[block, value, row] == blocks.scales[row, block, value // 16] * blocks.q[row, block, value]
    # Q6_K's quants are kept unsigned: the values subtract the zero at 32
    d = float(blocks.d[row, block])
    assert float(blocks.values()[row, 256 + value]) == np.float32(d * float(blocks.scales[row, block, 4])) * \
        (int(blocks.q[row, block, value]) - 32)


def test_rows_reorder_every_field():
    raw = random_kquant_bytes("q4_k", 6, 1, seed=2)
    blocks = K.from_gguf_bytes("q4_k", raw, (6, 256))
    order = torch.tensor([5, 0, 3])
    picked = blocks.rows(order)
    assert torch.equal(picked.values(), blocks.values()[order])
    assert picked.shape == (3, 256) and picked.kind == "q4_k"


def test_other_types_take_the_simple_formats_and_a_ragged_row_is_refused():
    assert not isinstance(K.from_gguf_bytes("q8_0", np.zeros((2, 34), np.uint8), (2, 32)), K.KBlocks)
    with pytest.raises(TracerError, match="a Q4_K row of 320 values is not a whole number of 256-value super-blocks"):
        K.from_gguf_bytes("q4_k", np.zeros((1, 180), np.uint8), (1, 320))
