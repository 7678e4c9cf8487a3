"""GGUF block formats, ggml's activation quantizers and the quantized dot products
(tracer.ggml.quants, tracer.ggml.vecdot), on small literal and random tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq

from tracer.core.errors import TracerError
from tracer.ggml import quants as Q
from tracer.ggml import vecdot as V
from tracer.ggml.floats import F32, _fma_via_f64, round_f16


def _random(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.linspace(0.1, 3, cols)


@pytest.mark.parametrize("kind", list(Q.BLOCK_TYPES))
def test_unpacked_blocks_dequantize_as_the_gguf_package_does(kind):
    weight = _random(6, 96)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    raw = gq.quantize(weight.numpy(), qtype)
    blocks = Q.from_gguf_bytes(kind, raw, (6, 96))
    assert torch.equal(blocks.values(), torch.from_numpy(gq.dequantize(raw, qtype)).reshape(6, 96))
    assert blocks.d.shape == (6, 3) and blocks.q.shape == (6, 3, 32)
    low, high = {"q4_0": (-8, 7), "q4_1": (0, 15), "q5_0": (-16, 15), "q5_1": (0, 31), "q8_0": (-127, 127)}[kind]
    assert int(blocks.q.min()) >= low and int(blocks.q.max()) <= high
    assert int(blocks.q.min()) == low or int(blocks.q.max()) == high  # the range is used
    assert torch.equal(Q.quantize(weight, kind).values(), blocks.values())


def test_quantize_refuses_what_the_gguf_package_cannot_quantize():
    with pytest.raises(TracerError, match="the gguf package has no quantizer for Q4_K"):
        Q.quantize(_random(2, 256), "q4_k")
    with pytest.raises(TracerError, match="a row of 40 values is not a whole number of 32-value blocks"):
        Q.quantize(_random(2, 40), "q8_0")


def test_q8_0_activations_round_ties_to_even_on_x86_and_away_in_the_reference():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # amax 127: the scale is 1, x*id is x
    even, away = Q.quantize_q8_0(x, "even"), Q.quantize_q8_0(x, "away")
    assert even.d.item() == 1.0
    assert even.q[0, 0, :4].tolist() == [127.0, 2.0, -4.0, 0.0]
    assert away.q[0, 0, :4].tolist() == [127.0, 3.0, -4.0, 1.0]
    assert Q.quantize_q8_0(torch.zeros(1, 32)).q.abs().sum() == 0  # an all-zero block stays zero


def test_q8_1_carries_the_f16_block_sum_of_d_times_the_quants():
    x = _random(3, 64, seed=1)
    act = Q.quantize_q8_1(x)
    d32 = x.reshape(3, 2, 32).abs().amax(-1) / 127.0
    assert torch.equal(act.s, round_f16(d32 * act.q.sum(-1)))
    assert torch.equal(act.d, round_f16(d32))
    assert float((act.values() - x).abs().max()) <= float(act.d.max()) / 2 * 1.0001


def test_q8_k_scales_by_the_first_value_of_largest_magnitude():
    x = torch.zeros(1, 256)
    x[0, 5], x[0, 9], x[0, 10] = -2.0, 2.0, 1.0
    act = Q.quantize_q8_k(x)
    # iscale = -127/max with max = -2 (the first of the two largest): 63.5, d = 1/63.5; had +2 been
    # taken, d and every quant would change sign
    assert act.d.item() == pytest.approx(2 / 127)
    assert act.q[0, 0, [5, 9, 10]].tolist() == [-127.0, 127.0, 64.0]  # 63.5 rounds to even


# --- dot products -----------------------------------------------------------------------------


def _literal_vec_dot(weight: Q.Blocks, act: Q.ActBlocks, row: int, token: int) -> float:
    """ggml_vec_dot_q*_q8_* (arch/x86/quants.c, AVX2) written out scalar, one block at a time."""
    f32 = np.float32
    acc, summs = [f32(0)] * 8, f32(0)
    for b in range(weight.q.shape[1]):
        d = f32(weight.d[row, b].item()) * f32(act.d[token, b].item())
        for lane in range(8):
            products = sum(int(weight.q[row, b, 4 * lane + k]) * int(act.q[token, b, 4 * lane + k]) for k in range(4))
            acc[lane] = f32(_fma_via_f64(torch.tensor([d]), torch.tensor([float(products)]),
                                         torch.tensor([acc[lane]])).item())
        if weight.m is not None:
            summs = f32(_fma_via_f64(weight.m[row, b:b + 1], act.s[token, b:b + 1], torch.tensor([summs])).item())
    pairs = [acc[i] + acc[i + 4] for i in range(4)]
    total = (pairs[0] + pairs[2]) + (pairs[1] + pairs[3])
    return float(total + summs if weight.m is not None else total)


@pytest.mark.parametrize("kind", list(Q.BLOCK_TYPES))
def test_matmul_ggml_is_the_x86_vec_dot_written_out(kind):
    weight, x = Q.quantize(_random(5, 128, seed=2), kind), _random(3, 128, seed=3) * 7
    act = Q.quantize_activations(x, Q.VEC_DOT_TYPE[kind])
    out = V.matmul_ggml(act, weight)
    literal = torch.tensor([[_literal_vec_dot(weight, act, r, t) for r in range(5)] for t in range(3)])
    assert torch.equal(out, literal)
    exact = V.matmul_f64(act, weight)
    assert float((out - exact).norm() / exact.norm()) < 1e-6


def test_the_lane_order_and_the_separate_min_sum_are_what_ggml_rounds():
    weight, x = Q.quantize(_random(64, 512, seed=4), "q4_1"), _random(16, 512, seed=5)
    act = Q.quantize_q8_1(x)
    ggml, exact, blas = V.matmul_ggml(act, weight), V.matmul_f64(act, weight), V.matmul_blas(act, weight, F32)
    assert not torch.equal(ggml, exact) and not torch.equal(ggml, blas)  # three orders, three results
    assert float((ggml - exact).norm() / exact.norm()) < 3e-7
    # the min term uses the f16 block sum s, not the exact sum of the quantized values
    plain = (act.values().to(torch.float64) @ weight.values().to(torch.float64).T).to(F32)
    assert not torch.equal(plain, exact)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_compiled_dot_products_cross_their_tiles_in_ggml_order(kind):
    """ROW_TILE + 8 outputs and 11 tokens: a whole tile of outputs and a short one, tokens in tiles
    of 4 and padded."""
    from tracer.ggml import kernels

    rows = kernels.ROW_TILE + 8
    assert 11 % kernels.TOKEN_TILE
    weight, x = Q.quantize(_random(rows, 64, seed=6), kind), _random(11, 64, seed=7) * 3
    act = Q.quantize_activations(x, Q.VEC_DOT_TYPE[kind])
    out = V.matmul_ggml(act, weight)
    picks = [(t, r) for t in (0, 3, 4, 10) for r in (0, rows - 9, rows - 8, rows - 1)]
    assert [float(out[t, r]) for t, r in picks] == [_literal_vec_dot(weight, act, r, t) for t, r in picks]


@pytest.mark.slow  # a fresh process
def test_the_compiled_kernels_leave_torchs_thread_count_as_it_was():
    """numba's OpenMP pool, started by the first kernel, sets OpenMP's process-wide thread count to
    every core; torch reads its count from there. In a fresh process asking for one thread."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np, torch\nfrom tracer.ggml import kernels\n"
            "before = torch.get_num_threads()\n"
            "kernels.quantize_q8(np.ones((2, 1, 32), np.float32), False, torch.get_num_threads())\n"
            "print(before, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]


def test_the_compiled_kernels_are_cached_by_their_sources_content_not_their_place(tmp_path, monkeypatch):
    """A new clone or virtual environment of the same tracer finds the kernels compiled; an edit to any
    module they compile in (a constant, an inlined function) compiles them again."""
    import shutil

    from numba.core import config

    from tracer.ggml import candle_kernels, kernel_cache, kernels, kquant_kernels

    folder = kernel_cache.cache_folder()
    assert folder.name == f"tracer-kernels-{kernel_cache.DIGEST}"
    for kernel in (kernels._vec_dot_blocks, kquant_kernels._kquant_dot, candle_kernels._quantize):
        assert kernel._cache._cache_path == str(folder)
    copy = tmp_path / "elsewhere" / "ggml"
    shutil.copytree(kernel_cache.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kernel_cache.kernels_digest(copy) == kernel_cache.kernels_digest() == kernel_cache.DIGEST
    (copy / "kquants.py").write_text((copy / "kquants.py").read_text().replace("QK_K = 256", "QK_K = 255"))
    assert kernel_cache.kernels_digest(copy) != kernel_cache.kernels_digest()
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "numba"))  # NUMBA_CACHE_DIR, numba's own setting
    assert kernel_cache.cache_folder().parent == tmp_path / "numba"
    foreign = tmp_path / "foreign.py"
    foreign.write_text("def f():\n    return 1\n")
    assert kernel_cache.ContentLocator.from_function(test_q8_k_scales_by_the_first_value_of_largest_magnitude,
                                                     str(foreign)) is None
