"""k-quant block formats (tracer.ggml.kquants): GGUF bytes unpacked into their integer operands and
dequantized as ggml dequantizes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq

from tracer.core.errors import TracerError
from tracer.ggml import kmatmul as KM
from tracer.ggml import kquants as K
from tracer.ggml import quants as Q
from tracer.ggml.floats import fma

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


# --- the matmul paths, against ggml's C loops written out -------------------------------------

f32 = np.float32


def _fma(a, b, c) -> np.float32:
    return f32(float(fma(torch.tensor(f32(a)), torch.tensor(f32(b)), torch.tensor(f32(c)))))


def _hsum8(a) -> np.float32:
    return f32(f32(f32(a[0] + a[4]) + f32(a[2] + a[6])) + f32(f32(a[1] + a[5]) + f32(a[3] + a[7])))


def _operands(w: K.KBlocks, act, row: int, t: int, b: int):
    """A super-block's integers: 8 lane sums of scale*quant*x (lane L: values 4L..4L+3 of every
    32-value chunk), the 16 bsums of the Q8_K row, and d_x."""
    lanes = [0] * 8
    for p in range(256):
        lanes[(p % 32) // 4] += int(w.scales[row, b, p // w.sub_block]) * int(w.q[row, b, p]) * int(act.q[t, b, p])
    bsums = [int(s) for s in act.q[t, b].reshape(16, 16).sum(-1)]
    return lanes, bsums, f32(act.d[t, b])


def _min_sum(w: K.KBlocks, row: int, b: int, bsums: list[int], first: int = 0, count: int | None = None) -> int:
    per = w.sub_block // 16  # bsums per sub-block
    count = 256 // w.sub_block if count is None else count
    return sum(int(w.mins[row, b, s]) * sum(bsums[per * s:per * s + per]) for s in range(first, first + count))


def literal_vec_dot(w: K.KBlocks, act, row: int, t: int) -> np.float32:
    """ggml_vec_dot_q*_K_q8_K (arch/x86/quants.c, AVX2) for one output, one super-block at a time."""
    acc, acc_m, summs = [f32(0)] * 8, [f32(0)] * 4, f32(0)
    for b in range(w.q.shape[1]):
        lanes, bsums, dx = _operands(w, act, row, t, b)
        d, dmin = f32(dx * f32(w.d[row, b])), f32(-dx * f32(w.dmin[row, b])) if w.dmin is not None else None
        if w.kind == "q2_k":  # prod = madd(mins, bsums) in 8 lanes, into acc first
            acc = [_fma(dmin, f32(_min_sum(w, row, b, bsums, 2 * lane, 2)), acc[lane]) for lane in range(8)]
        if w.kind == "q4_k":  # 4 lanes: q8s = hadd(bsums) (32-value sums), madd with the mins
            acc_m = [_fma(dmin, f32(_min_sum(w, row, b, bsums, 2 * k, 2)), acc_m[k]) for k in range(4)]
        if w.kind == "q5_k":
            summs = _fma(dmin, f32(_min_sum(w, row, b, bsums)), summs)
        if w.kind == "q6_k":  # q8sclsub: 32 * madd(bsums, scales), lane L from 16-blocks 2L, 2L+1
            lanes = [lanes[lane] - 32 * sum(int(w.scales[row, b, s]) * bsums[s] for s in (2 * lane, 2 * lane + 1))
                     for lane in range(8)]
        acc = [_fma(d, f32(lanes[lane]), acc[lane]) for lane in range(8)]
    total = _hsum8(acc)
    if w.kind == "q4_k":
        total = f32(total + f32(f32(acc_m[0] + acc_m[2]) + f32(acc_m[1] + acc_m[3])))
    return f32(total + summs) if w.kind == "q5_k" else total


def literal_tiled(w: K.KBlocks, act, row: int, t: int) -> np.float32:
    """tiled_run_microtile (tiled-kernel.cpp, VNNI or AVX2): per super-block s1 = Σ scale*(q - zero)*x,
    s2 = Σ min*bsum; res = f32(s1)*d; res = fnmadd(dmin, f32(s2), res); buf = fma(res, d_x, buf)."""
    buf = f32(0)
    for b in range(w.q.shape[1]):
        lanes, bsums, dx = _operands(w, act, row, t, b)
        s1 = sum(lanes)
        if w.kind == "q6_k":  # its unsigned quants, less 32 per value (zero at 32: the bias of 32)
            s1 -= 32 * sum(int(w.scales[row, b, s]) * bsums[s] for s in range(16))
        res = f32(f32(s1) * f32(w.d[row, b]))
        if w.mins is not None:
            res = _fma(-f32(w.dmin[row, b]), f32(_min_sum(w, row, b, bsums)), res)
        buf = _fma(res, dx, buf)
    return buf


def literal_repacked(w: K.KBlocks, act, row: int, t: int, group: int) -> np.float32:
    """ggml_gemv/gemm_q*_K_8x8_q8_K (arch/x86/repack.cpp): per `group` values (gemv: the super-block)
    acc = fma(f32(Σ scale*q*x), d*d_x, acc), acc_min = fma(f32(Σ min*bsum), dmin*d_x, acc_min)."""
    acc, acc_min = f32(0), f32(0)
    per_block = 256 // w.sub_block
    for b in range(w.q.shape[1]):
        _, bsums, dx = _operands(w, act, row, t, b)
        for g0 in range(0, 256, group):
            s = sum(int(w.scales[row, b, p // w.sub_block]) * int(w.q[row, b, p]) * int(act.q[t, b, p])
                    for p in range(g0, g0 + group))
            m = _min_sum(w, row, b, bsums, g0 * per_block // 256, group * per_block // 256)
            acc = _fma(f32(s), f32(f32(w.d[row, b]) * dx), acc)
            acc_min = _fma(f32(m), f32(f32(w.dmin[row, b]) * dx), acc_min)
    return f32(acc - acc_min)


def _kquant_case(kind: str, rows: int, tokens: int, seed: int):
    weight = K.from_gguf_bytes(kind, random_kquant_bytes(kind, rows, 2, seed=seed), (rows, 512))
    gen = torch.Generator().manual_seed(seed)
    act = Q.quantize_q8_k(torch.randn(tokens, 512, generator=gen) * torch.linspace(0.1, 4, 512))
    return weight, act


X86 = frozenset({"AVX", "AVX2", "FMA", "AVX512", "AVX512_VNNI"})


@pytest.mark.parametrize("kind", list(K.KQUANT_TYPES))
def test_vec_dot_and_tiled_are_ggmls_loops_written_out(kind):
    """Below 8 rows the vec_dot (8 f32 lanes, the mins as each type adds them), the tiled path when
    forced (one f32 step per super-block): the compiled kernels give the literal loops' numbers."""
    weight, act = _kquant_case(kind, 3, 2, seed=11)
    vec_dot = KM.matmul_kquant(act, weight, KM.Build(X86))
    tiled = KM.matmul_kquant(act, weight, KM.Build(X86, tiled_forced=True))
    for t in range(2):
        for row in range(3):
            assert vec_dot[t, row].item() == literal_vec_dot(weight, act, row, t)
            assert tiled[t, row].item() == literal_tiled(weight, act, row, t)
    assert not torch.equal(vec_dot, tiled)  # two orders, two results


@pytest.mark.parametrize("kind", ["q4_k", "q2_k"])
def test_repacked_gemm_and_gemv_are_ggmls_loops_written_out(kind):
    """A repacked weight (rows a multiple of 8) on 5 rows: the gemm on the first 4 (one FMA per 64
    values for Q4_K, 128 for Q2_K), the gemv on the fifth (one per super-block)."""
    weight, act = _kquant_case(kind, 8, 5, seed=12)
    out = KM.matmul_kquant(act, weight, KM.Build(X86 | {"REPACK"}))
    assert KM.paths(kind, 8, 5, KM.Build(X86 | {"REPACK"})) == [("gemm", 0, 4), ("gemv", 4, 5)]
    for row in (0, 7):
        for t in range(4):
            assert out[t, row].item() == literal_repacked(weight, act, row, t, KM.GEMM_GROUP[kind])
        assert out[4, row].item() == literal_repacked(weight, act, row, 4, 256)


# --- which path a tensor takes ----------------------------------------------------------------


def test_each_tensor_takes_llama_cpps_path_for_its_type_rows_and_tokens(monkeypatch):
    avx2 = KM.Build(frozenset({"AVX", "AVX2", "FMA", "REPACK"}))
    avx512 = KM.Build(avx2.features | {"AVX512", "AVX512_VNNI"})
    # Q4_K is repacked on AVX2 when its rows are a multiple of 8: gemm on whole 4-row groups, gemv after
    assert KM.paths("q4_k", 576, 1, avx2) == [("gemv", 0, 1)]
    assert KM.paths("q4_k", 576, 7, avx2) == [("gemm", 0, 4), ("gemv", 4, 7)]
    assert KM.paths("q4_k", 576, 512, avx2) == [("gemm", 0, 512)]
    assert KM.paths("q4_k", 300, 512, avx2) == [("tiled", 0, 512)]  # 300 rows: not repacked
    assert KM.paths("q4_k", 300, 7, avx2) == [("vec_dot", 0, 7)]  # the tiled path from 8 rows
    assert KM.paths("q2_k", 576, 9, avx2) == [("tiled", 0, 9)]  # Q2_K is repacked on AVX-512 only
    assert KM.paths("q2_k", 576, 9, avx512) == [("gemm", 0, 8), ("gemv", 8, 9)]
    assert KM.paths("q6_k", 576, 8, avx512) == [("tiled", 0, 8)]  # never repacked on x86
    assert KM.paths("q4_k", 576, 3, KM.Build(frozenset({"AVX2", "FMA"}))) == [("vec_dot", 0, 3)]  # no REPACK
    # llama.cpp's environment switches for the tiled path, read as C's atoi reads them
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    assert not KM.this_build().tiled
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1x")
    monkeypatch.setenv("GGML_CPU_TILED_MM_FORCE", "1")
    assert KM.this_build().tiled and KM.this_build().tiled_forced
    assert KM.paths("q6_k", 576, 2, KM.Build(avx512.features, tiled_forced=True)) == [("tiled", 0, 2)]


def test_k_quants_are_exact_where_the_build_runs_the_x86_code():
    from tracer.ggml.strategies import implied_regime

    types = {"model.layers.0.mlp.down_proj.weight": "q4_k", "model.layers.1.mlp.down_proj.weight": "q6_k",
             "model.embed_tokens.weight": "q8_0"}
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512dq"}
    assert implied_regime(types, {}, flags, frozenset({"AVX2", "FMA", "AVX512", "REPACK"}))[1] == []
    _, caveats = implied_regime(types, {}, flags, frozenset({"AVX", "REPACK"}))
    assert caveats == [
        f"{kind} weights (1 tensors, e.g. model.layers.{layer}.mlp.down_proj.weight): this llama.cpp build lacks "
        "AVX2 or FMA: its k-quant kernels (the AVX, ARM or scalar ones) are not the x86 AVX2 ones emulated; summed "
        "in the x86 order instead" for kind, layer in (("Q4_K", 0), ("Q6_K", 1))]


# --- against llama.cpp ------------------------------------------------------------------------

# llama.cpp's own quantizer mixes the types as users get them. On the tiny model: Q4_K_M gives Q4_K
# projections (repacked), Q5_K_M Q5_K ones, Q2_K Q2_K (repacked on AVX-512) and Q3_K ones, each
# with a Q6_K token_embd, which is also the tied output: every k-quant type on every path.
FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q2_K")


@pytest.fixture(scope="module")
def kquant_ggufs(tmp_path_factory):
    """file type -> (the tiny k-quant-wide Llama quantized by llama.cpp, a directory converted from it)."""
    from tests.ggml_gguf import sourced_copy
    from tests.quantized_gguf import quantize_gguf, write_kquant_llama

    folder = tmp_path_factory.mktemp("kquants")
    model, f32_gguf = write_kquant_llama(folder)
    files = {}
    for ftype in FILE_TYPES:
        gguf_file = quantize_gguf(f32_gguf, folder / f"tiny-{ftype}.gguf", ftype)
        files[ftype] = gguf_file, sourced_copy(model, gguf_file, folder / f"converted-{ftype}")
    return files


@pytest.mark.parametrize("ftype", FILE_TYPES)
def test_llama_cpp_on_k_quant_ggufs_is_the_regime_to_the_bit(kquant_ggufs, ftype):
    """One token (gemv / vec_dot), 5 (gemm + gemv / vec_dot, one-chunk flash attention) and 70
    (gemm + gemv / tiled, the tiled flash attention): every one of llama.cpp's points equal."""
    pytest.importorskip("llama_cpp")
    from tests.cpu_builds import skip_unless_exact_here, this_cpu_caveats

    skip_unless_exact_here(this_cpu_caveats())
    import tracer
    from tests.conftest import TOKENS
    from tracer.engines import llamacpp
    from tracer.files.sources import ModelSource

    gguf_file, converted = kquant_ggufs[ftype]
    engine = llamacpp.load(ModelSource(converted), {"threads": 2}, argument=str(gguf_file))
    for count in (1, 5, 70):
        tokens = (TOKENS * 10)[:count]
        ours = tracer.record(converted, tokens, engine="reimpl", variant={"preset": "llamacpp", "weights": "gguf"},
                             progress=False)
        result = tracer.compare(ours, engine.record(tokens))
        compared = [p for p in result.points if p.recorded]
        assert result.verdict == "match" and len(compared) == 33
        assert [(p.point, p.rel_l2) for p in compared if p.rel_l2] == [], f"{count} tokens"


def test_the_blas_accumulations_sum_the_same_k_quant_operands(kquant_ggufs):
    """accumulate=f32 / f64 (the fast regime, the noise floor's run): the same Q4_K weights and Q8_K
    activations through torch's BLAS: another order, so close to ggml's but not equal."""
    import tracer
    from tests.conftest import TOKENS

    _, converted = kquant_ggufs["Q4_K_M"]
    runs = {accumulate: tracer.record(converted, TOKENS, engine="reimpl", progress=False,
                                      variant={"preset": "llamacpp", "weights": "gguf", "accumulate": accumulate})
            for accumulate in ("ggml", "f32", "f64")}
    point = "model.layers.0.self_attn.q_proj"  # the first matmul: the same inputs in all three
    for accumulate in ("f32", "f64"):
        difference = runs[accumulate][point] - runs["ggml"][point]
        assert 0 < float(difference.norm() / runs["ggml"][point].norm()) < 1e-6
