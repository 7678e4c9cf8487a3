"""llama.cpp's matmuls on float weights (f32, f16, bf16) as its x86 CPU backend computes them
with AVX-512 or AVX2 (ggml-cpu.c `ggml_compute_forward_mul_mat`, llamafile/sgemm.cpp, vec.cpp).

mul_mat first converts the activations to the weight type's vec-dot type (f16: F16C's round to
nearest even; bf16: `ggml_compute_fp32_to_bf16`, round to nearest even; f32: as they are: the
caller does that, `tracer.ggml.floats.ROUND`), then multiplies by:

- llamafile's tinyBLAS (`tinyBLAS<16, __m512, __m512, T, T, float>`), when the build has it
  (LLAMAFILE), from 2 activation rows, for weights with a multiple of 4 rows and an inner axis in
  whole vectors (16 values): per output one 16-lane f32 accumulator from 0, one FMA per 16 values
  in order, then `_mm512_reduce_add_ps`. bf16 on a CPU with AVX512-BF16
  (`tinyBLAS<32, __m512, __m512bh, ...>`, an inner axis in whole 32s): one `_mm512_dpbf16_ps`
  per 32 values, whose lane j adds the product of elements 2j+1, then of 2j, each add rounded
  to f32. A bf16 product is exact in f32, so that is the same 16-lane chain over the inner axis
  taken in another order (`dpbf16_order`), and one compiled loop computes both. An AVX2 build:
  `tinyBLAS<8, __m256, ...>`, 8 lanes per step and tinyBLAS' `hsum(__m256)` (`ops.f32_lanes`);
- otherwise every output is one `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` / `ggml_vec_dot_f32`
  (`tracer.ggml.ops`): one activation row, a refused shape, or a build without LLAMAFILE.

Which path a matmul takes is read from the build's feature report (`ops.llamacpp_cpu_features`).
Rows of the weight are outputs, so their order (the q/k rows put back in HF order) changes nothing.

Notation: T tokens (activation rows), R outputs (weight rows), K inner axis, S = K / 16 steps.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from tracer.ggml import kernels, ops
from tracer.ggml.floats import F32
from tracer.ggml.quants import Blocks

LANES = 16  # f32 lanes of an AVX-512 register: the accumulator of AVX512-BF16's chain (the others: `ops.f32_lanes`)
DPBF16_STEP = 32  # bf16 values per `_mm512_dpbf16_ps`: tinyBLAS' KN for bf16 with AVX512-BF16

# weight -> {(order, lanes): its (S, L, R) layout}: transposed once per weight
_LAYOUTS = WeakIdKeyDictionary()


def takes_tinyblas(kind: str, shape: tuple[int, int], tokens: int, features: frozenset[str]) -> bool:
    """Whether llamafile_sgemm takes a (R, K) `kind` weight times `tokens` activation rows on a
    build with `features` (tinyBLAS::matmul refuses K % KN and R % 4; sgemm refuses one row)."""
    rows, inner = shape
    step = DPBF16_STEP if kind == "bf16" and "AVX512_BF16" in features else ops.f32_lanes(features)
    return "LLAMAFILE" in features and tokens >= 2 and inner % step == 0 and rows % 4 == 0


def matmul(x: torch.Tensor, weight: Blocks, features: frozenset[str] | None = None) -> torch.Tensor:
    """x (T, K) f32 already in the weight's vec-dot type, weight (R, K) an f32/f16/bf16 matrix as
    `Blocks` -> (T, R) f32, summed as llama.cpp's build with `features` (default: this one's) sums them."""
    features = ops.llamacpp_cpu_features() if features is None else features
    values = weight.values()  # (R, K) f32
    if not takes_tinyblas(weight.kind, weight.shape, x.shape[0], features):
        return vec_dot(x, values, weight.kind, features)
    order = "dpbf16" if weight.kind == "bf16" and "AVX512_BF16" in features else "lanes"
    width = LANES if order == "dpbf16" else ops.f32_lanes(features)
    layout = _layout(weight, values, order, width)  # (S, L, R)
    columns = x.to(F32)[:, dpbf16_order(x.shape[1])] if order == "dpbf16" else x.to(F32)  # (T, K)
    lanes = columns.contiguous().numpy().reshape(x.shape[0], -1, width)  # (T, S, L)
    return torch.from_numpy(kernels.lane_chains(lanes, layout, torch.get_num_threads()))


def vec_dot(x: torch.Tensor, values: torch.Tensor, kind: str, features: frozenset[str]) -> torch.Tensor:
    """(T, R): one ggml_vec_dot_<kind> per output (`tracer.ggml.ops`), in slices of tokens that
    keep the broadcast (T, R, 64) products near 64 MB."""
    dot = {"f16": lambda a, b: ops.vec_dot_f16(a, b, features), "f32": lambda a, b: ops.vec_dot_f32(a, b, features),
           "bf16": lambda a, b: ops.vec_dot_bf16(a, b, "AVX512_BF16" in features, features)}[kind]
    per_slice = max(1, (1 << 24) // (values.shape[0] * ops.F16_DOT_STEP))
    w = values.to(F32)[None]  # (1, R, K)
    return torch.cat([dot(x[start:start + per_slice, None, :].to(F32), w)
                      for start in range(0, x.shape[0], per_slice)])


def dpbf16_order(inner: int) -> torch.Tensor:
    """The inner axis in the order `_mm512_dpbf16_ps` adds it, as 16 lanes: per 32 values, step 2s
    lane j holds element 2j+1 and step 2s+1 lane j element 2j. (K,) index."""
    pairs = torch.arange(inner).view(inner // DPBF16_STEP, LANES, 2)  # (S/2, 16 lanes, 2 elements)
    return pairs.flip(-1).transpose(1, 2).reshape(-1)  # (S/2, [2j+1, 2j], 16 lanes) flattened


def _layout(weight, values: torch.Tensor, order: str, lanes: int) -> np.ndarray:
    """(S, L, R) f32 of the weight, inner axis in `order` as `lanes` lanes, outputs last (cached per weight)."""
    layouts = _LAYOUTS.setdefault(weight, {})
    if (order, lanes) not in layouts:
        columns = values.to(F32)[:, dpbf16_order(values.shape[1])] if order == "dpbf16" else values.to(F32)
        layouts[order, lanes] = columns.T.contiguous().numpy().reshape(-1, lanes, values.shape[0])  # (S, L, R)
    return layouts[order, lanes]
