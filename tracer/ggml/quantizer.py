"""llama.cpp's own quantizer and dequantizers, called through ctypes.

`llama_model_quantize` (what `llama-quantize` runs) hands each tensor's f32 rows to ggml's
`ggml_quantize_chunk(type, src, dst, start, nrows, n_per_row, imatrix)`, and ggml dequantizes a
row with its type's `to_float` (`ggml_get_type_traits`). Both live in the `libggml-base` that
llama-cpp-python ships; this module loads that library alone (no llama.cpp model, no backend) and
calls them on numpy buffers, so that "what llama.cpp's quantizer makes of these weights" is
llama.cpp's own answer, not a rewrite (the gguf package's Python quantizers have no k-quants and
are not llama.cpp's code).

ctypes releases the GIL for the call, so the rows of a large tensor are quantized in chunks on
several threads (`llama_model_quantize` splits them the same way; every row is quantized alone,
so the bytes do not depend on the split).

Notation: R rows, C values per row (ggml's n_per_row).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tracer.core.versions import installed_version
from tracer.files.gguffile import GGML_TYPES

TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}
CHUNK_VALUES = 1 << 20  # values per ggml_quantize_chunk call: ~4 MB of f32 rows per thread


class _TypeTraits(ctypes.Structure):
    """ggml.h `struct ggml_type_traits` (ggml 0.25)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class GgmlQuantizer:
    """ggml's quantize and dequantize functions from one `libggml-base` shared library.

    Example:
        >>> quantizer = ggml_quantizer()  # None without llama-cpp-python
        >>> rows = np.linspace(-1, 1, 64, dtype=np.float32)[None]  # (1, 64)
        >>> raw = quantizer.quantize("q8_0", rows)  # (R, bytes per row): two blocks of 2 + 32 bytes
        >>> raw.shape, bool(abs(quantizer.dequantize("q8_0", raw, rows.shape) - rows).max() < 1 / 254)
        ((1, 68), True)
    """

    def __init__(self, library: Path):
        self.library = library
        self.lib = ctypes.CDLL(str(library))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        self.lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self.lib.ggml_version.restype = ctypes.c_char_p
        self.version = self.lib.ggml_version().decode()
        self.threads = max(1, min(8, os.cpu_count() or 1))

    def requires_imatrix(self, kind: str) -> bool:
        """Whether ggml refuses to quantize `kind` without an importance matrix (IQ2/IQ1 types)."""
        return bool(self.lib.ggml_quantize_requires_imatrix(TYPE_IDS[kind]))

    def quantize(self, kind: str, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """(R, C) f32 -> (R, bytes per row) uint8: `ggml_quantize_chunk` on every row, as
        `llama_model_quantize` calls it (`imatrix`: one weight per column, or None)."""
        _, block, size = GGML_TYPES[TYPE_IDS[kind]]
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        count, width = rows.shape
        if width % block:
            raise ValueError(f"{kind}: a row of {width} values is not a whole number of {block}-value blocks")
        if imatrix is None and self.requires_imatrix(kind):
            raise ValueError(f"ggml quantizes {kind} only with an importance matrix")
        weights = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
        out = np.empty((count, width // block * size), dtype=np.uint8)
        step = max(1, CHUNK_VALUES // width)

        def chunk(start: int) -> None:
            stop = min(count, start + step)
            self.lib.ggml_quantize_chunk(TYPE_IDS[kind], rows[start:stop].ctypes.data, out[start:stop].ctypes.data,
                                         0, stop - start, width, None if weights is None else weights.ctypes.data)

        starts = range(0, count, step)
        if len(starts) == 1 or self.threads == 1:
            for start in starts:
                chunk(start)
        else:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(chunk, starts))
        return out

    def dequantize(self, kind: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """(R, bytes per row) uint8 -> (R, C) f32, by the type's `to_float` (f32 rows are copied)."""
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        if kind == "f32":
            return raw.view(np.float32).reshape(shape).copy()
        out = np.empty(shape, dtype=np.float32)
        to_float = _TO_FLOAT(self.lib.ggml_get_type_traits(TYPE_IDS[kind]).contents.to_float)
        to_float(raw.ctypes.data, out.ctypes.data, out.size)
        return out


def library_path() -> Path | None:
    """The `libggml-base` llama-cpp-python ships (its `lib` folder), or None where it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
            if (Path(folder) / "lib" / name).is_file():
                return Path(folder) / "lib" / name
    return None


@functools.cache
def ggml_quantizer() -> GgmlQuantizer | None:
    """llama.cpp's quantizer, or None without llama-cpp-python (a candle user's setup)."""
    path = library_path()
    return None if path is None else GgmlQuantizer(path)


def quantizer_name(quantizer: GgmlQuantizer) -> str:
    """"llama.cpp 0.3.36 (ggml 0.9.4)": the package and the library, as reports name them."""
    installed = installed_version("llama_cpp_python")
    package = "llama-cpp-python" if installed is None else f"llama-cpp-python {installed}"
    return f"{package} (ggml {quantizer.version})"
