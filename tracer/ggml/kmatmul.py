"""Which of llama.cpp's k-quant matmul paths a tensor takes on an x86 build, and the matmul on it.

`ggml_compute_forward_mul_mat` (ggml-cpu.c) and the repack buffer decide, per tensor and per call:

1. **repacked** (repack.cpp `ggml_repack_get_optimal_repack_type`): a build with REPACK puts every
   weight a MUL_MAT reads (the projections, the output, a tied output's copy of token_embd; not
   token_embd itself, which GET_ROWS reads) in the CPU_REPACK buffer when its type has an x86
   layout: Q4_K as q4_K_8x8 on AVX2, Q2_K as q2_K_8x8 on AVX-512, and its rows are a multiple of
   8. Its matmul (`tensor_traits::forward_mul_mat`) quantizes the activations 4 rows at a time
   (`ggml_quantize_mat_q8_K_4x8`) and runs the gemm on the first T - T % 4 rows (when T > 3), the
   gemv on the rest.
2. **tiled** (tiled/tiled.cpp), for the other k-quants from 8 activation rows (GGML_CPU_TILED_MM=0
   turns it off, GGML_CPU_TILED_MM_FORCE=1 takes it below 8 rows), on AVX/AVX2/AVX-512 VNNI builds.
3. **vec_dot**: `ggml_vec_dot_q*_K_q8_K` per output (llamafile's tinyBLAS takes no k-quant).

The numbers do not depend on the thread count: every path computes each output whole in one
thread, in the same order whatever the chunking (the repacked chunks are cut at multiples of 8
outputs, the tiled windows keep each output's super-blocks in order, the activation rows are
quantized per 256-value block).

The x86 quantizers of the activations: `quantize_row_q8_K` is the reference one
(`quantize_row_q8_K_ref`, ties to even), and `ggml_quantize_mat_q8_K_4x8` takes the same quants
up to their sign (it scales by -127/max when a +max is present, by 127/max otherwise; the
reference by -127/x where x is the first value of largest magnitude): every product and sum
flips sign together with d, so the outputs are the same numbers; `tracer.ggml.quants.quantize_q8_k`
serves both.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from tracer.ggml import ops
from tracer.ggml.floats import F32
from tracer.ggml.kquants import QK_K, KBlocks
from tracer.ggml.quants import ActBlocks

REPACKED = {"q4_k": "AVX2", "q2_k": "AVX512"}  # type -> the build feature its x86 repacked layout needs
GEMM_GROUP = {"q4_k": 64, "q2_k": 128}  # values per FMA step of the repacked gemm
GEMM_ROWS = 4  # activation rows the repacked gemm takes at a time
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch


@dataclass(frozen=True)
class Build:
    """What of a llama.cpp CPU build decides the k-quant paths: its reported features
    (`tracer.ggml.ops.llamacpp_cpu_features`) and the tiled matmul's environment switches."""

    features: frozenset[str]
    tiled: bool = True  # GGML_CPU_TILED_MM unset or not 0
    tiled_forced: bool = False  # GGML_CPU_TILED_MM_FORCE=1

    @property
    def repack(self) -> bool:
        return "REPACK" in self.features

    @property
    def tiled_compiled(self) -> bool:
        return bool({"AVX", "AVX2", "AVX512_VNNI"} & self.features)


def _atoi(text: str) -> int:
    """C's atoi: the leading integer of `text`, 0 if none."""
    digits = text.strip()
    sign = -1 if digits[:1] == "-" else 1
    digits = digits.lstrip("+-")
    number = len(digits) - len(digits.lstrip("0123456789"))
    return sign * int(digits[:number]) if number else 0


@functools.cache
def _features() -> frozenset[str]:
    """The build's features; without llama-cpp-python (a trace made elsewhere), a native build's
    defaults on this CPU, which include the repack buffer (GGML_CPU_REPACK is on by default)."""
    features = ops.llamacpp_cpu_features()
    return features if importlib.util.find_spec("llama_cpp") else features | {"REPACK"}


def this_build() -> Build:
    """This machine's llama.cpp build, and the environment a llama.cpp child would inherit."""
    tiled = os.environ.get("GGML_CPU_TILED_MM")
    forced = os.environ.get("GGML_CPU_TILED_MM_FORCE")
    return Build(_features(), tiled is None or _atoi(tiled) != 0, forced is not None and _atoi(forced) == 1)


def is_repacked(kind: str, rows: int, build: Build) -> bool:
    """Whether a MUL_MAT weight of `kind` with `rows` outputs sits in the CPU_REPACK buffer."""
    return build.repack and REPACKED.get(kind) in build.features and rows % 8 == 0


def paths(kind: str, rows: int, tokens: int, build: Build) -> list[tuple[str, int, int]]:
    """[(path, first token, end token)]: the path ("gemm", "gemv", "tiled", "vec_dot") each run
    of activation rows takes, in order."""
    if is_repacked(kind, rows, build):
        gemm_rows = tokens - tokens % GEMM_ROWS if tokens >= GEMM_ROWS else 0
        runs = [("gemm", 0, gemm_rows), ("gemv", gemm_rows, tokens)]
        return [run for run in runs if run[1] < run[2]]
    if build.tiled and build.tiled_compiled and (tokens >= TILED_MIN_ROWS or build.tiled_forced):
        return [("tiled", 0, tokens)]
    return [("vec_dot", 0, tokens)]


def emulated(features: frozenset[str]) -> bool:
    """Whether a build with these features runs the x86 k-quant code emulated (AVX2 and FMA: its
    vec_dot, tiled and repacked kernels); an AVX-only, ARM or other build takes other kernels."""
    return {"AVX2", "FMA"} <= features


def matmul_kquant(act: ActBlocks, weight: KBlocks, build: Build | None = None) -> torch.Tensor:
    """(T, R): x · Wᵀ as llama.cpp's x86 build computes it for this weight and this many rows."""
    from tracer.ggml import kquant_kernels as kernels  # numba compiles these kernels: loaded by the ops that run them

    build = this_build() if build is None else build
    tokens, rows = act.d.shape[0], weight.shape[0]
    xq = act.q.to(F32).contiguous().numpy()  # (T, B, 256)
    xd = act.d.to(F32).contiguous().numpy()  # (T, B)
    bsums = act.q.reshape(tokens, -1, QK_K // 16, 16).sum(-1).to(torch.int32).numpy()  # (T, B, 16)
    out = torch.empty(tokens, rows, dtype=F32)
    for path, start, end in paths(weight.kind, rows, tokens, build):
        out[start:end] = torch.from_numpy(kernels.kquant_dot(xq[start:end], xd[start:end], bsums[start:end], weight,
                                                             path, GEMM_GROUP.get(weight.kind, 0),
                                                             torch.get_num_threads()))
    return out
