"""GGUF files quantized as users make them: llama.cpp's own quantizer (`llama_model_quantize`,
through llama-cpp-python's binding), which picks each tensor's type as `llama-quantize` does
(Q4_K_M mixes Q4_K, Q6_K and fallbacks such as Q5_0 where a row is not a multiple of 256), and
takes an importance matrix (`imatrix`: tensor name -> one weight per input column).

The quantizer runs in a child process (`python -m tests.quantized_gguf`), as every native runtime
does in the suite: a native crash fails the test instead of hanging its worker. What it writes is
kept in tracer's cache (`<cache>/quantized/`, a `tracer.files.convert.cached_build` entry, sealed
and checked like a conversion) where the source is large, keyed by the source file's contents, the
type, the importance matrix and llama-cpp-python's version: the same file quantized again is linked
from there (the bundled SmolLM2 to Q4_K_M is ~4 s of llama.cpp's quantizer, and three test files
ask for it). A tiny model's file is quantized each time, in well under a second: kept, the tiny
models whose bytes differ from run to run (a random `imatrix`, a seed) would pile up entries.

`write_kquant_llama` writes a tiny random Llama whose widths are multiples of 256, so that
k-quant types apply to every projection (a 64-wide model gets only fallbacks).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

# Widths that k-quants take whole (super-blocks of 256 values): every projection's input is 256 or 512 wide.
KQUANT_TINY = dict(vocab_size=288, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def quantize_gguf(source: Path, target: Path, ftype: str, *, imatrix: dict[str, np.ndarray] | None = None,
                  requantize: bool = True, timeout: float = 300) -> Path:
    """`source` (a GGUF) quantized by llama.cpp to `ftype` ("Q4_K_M", "Q6_K", "F16", "BF16", ...) at
    `target`. `requantize` lets llama.cpp start from an already quantized file (the bundled Q4_1
    SmolLM2), dequantizing it to f32 first, as `llama-quantize --allow-requantize` does.

    Raises:
        RuntimeError: the quantizer failed (its output in the message).
    """
    from tracer.files.convert import cache_root, cached_build

    source, target = Path(source), Path(target)
    matrix = None if imatrix is None else {name: np.asarray(values, np.float32) for name, values in imatrix.items()}

    def build(folder: Path, made: Path) -> None:
        command = [sys.executable, "-m", "tests.quantized_gguf", str(source), str(made), ftype,
                   "1" if requantize else "0"]
        if matrix is not None:
            np.savez(folder / f"{made.stem}.imatrix.npz", **matrix)
            command.append(str(folder / f"{made.stem}.imatrix.npz"))
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=Path(__file__).resolve().parents[1])
        if done.returncode != 0 or not made.is_file():
            raise RuntimeError(f"llama_model_quantize {source.name} -> {ftype} failed ({done.returncode}): "
                               f"{done.stderr[-2000:]}")

    if source.stat().st_size < KEPT_FROM_BYTES:  # a tiny model's: made again, in well under a second
        build(target.parent, target)
        return target
    key = _key(source, ftype, matrix, requantize, cache_root())
    built = cached_build(cache_root() / "quantized" / key, lambda folder: build(folder, folder / QUANTIZED),
                         progress=False)
    try:  # the same bytes under the test's name: a file a test writes in place would fail the entry's hash
        os.link(built / QUANTIZED, target)  # check and be made again, never be used damaged
    except OSError:  # another file system
        shutil.copyfile(built / QUANTIZED, target)
    return target


QUANTIZED = "model.gguf"
KEPT_FROM_BYTES = 16 << 20  # sources from this size on (SmolLM2's) are quantized once into the cache


def _key(source: Path, ftype: str, matrix: dict[str, np.ndarray] | None, requantize: bool, cache: Path) -> str:
    """What a quantized file depends on: the source's bytes, the type, the matrix, llama.cpp's version."""
    from tracer.files.hashes import content_hashes

    digest = hashlib.sha256()
    digest.update(content_hashes(source.parent, [source.name], cache)[source.name].encode())
    digest.update(f"{ftype}|{requantize}|{importlib.metadata.version('llama_cpp_python')}".encode())
    for name, values in sorted((matrix or {}).items()):
        digest.update(name.encode() + values.tobytes())
    return f"{source.stem.lower()}-{ftype.lower()}-{digest.hexdigest()[:12]}"


def write_kquant_llama(folder: Path, *, seed: int = 0, dtype: str = "f32") -> tuple[Path, Path]:
    """(a tiny random Llama directory with k-quant-sized widths, the same model as an `dtype` GGUF)."""
    from tests.conftest import write_tiny_llama
    from tests.tiny_gguf import write_tiny_gguf

    model = write_tiny_llama(folder / "kquant-model", seed=seed, **KQUANT_TINY)
    return model, write_tiny_gguf(model, folder / f"kquant-{dtype}.gguf", dtype=dtype)


def _quantize_here(source: str, target: str, ftype: str, requantize: str, matrix_file: str | None = None) -> int:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = requantize == "1"
    params.nthread = 1
    keep = []  # the buffers the C structs point into, alive until the call returns
    if matrix_file:
        loaded = np.load(matrix_file)
        entries = (llama_cpp.llama_model_imatrix_data * (len(loaded.files) + 1))()  # null-name terminated
        for slot, name in zip(entries, loaded.files):
            values = np.ascontiguousarray(loaded[name], dtype=np.float32)
            keep += [values, name.encode()]
            slot.name, slot.size = keep[-1], values.size
            slot.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        params.imatrix = entries
    return llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))


if __name__ == "__main__":
    sys.exit(_quantize_here(*sys.argv[1:]))
