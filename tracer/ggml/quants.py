"""GGUF block formats and ggml's activation quantizers.

Weights: a matrix stored in a GGUF block type is kept here as `Blocks`: per block its scale `d`
and, for Q4_1/Q5_1, its min `m` (both f16 in the file, held as exact f32), and the block's integer
quants `q` as ggml's dot kernels see them (Q4_0: nibble - 8, Q5_0: 5 bits - 16, Q4_1/Q5_1:
unsigned, Q8_0: int8, IQ4_NL: the codebook value its nibble indexes). Quantizing an f32 matrix
is left to the `gguf` package's own reference quantizers (`gguf.quants.quantize`), and the bytes
they write are unpacked like a file's. Other types (k-quants, other i-quants) are held
dequantized (`gguf.quants.dequantize`), and so are f16/bf16 matrices (`held`, their exact
values): their kernels multiply values, not integer quants.

Activations: before a quantized matmul ggml converts each f32 activation row to the weight
type's vec-dot type (`type_traits_cpu[type].vec_dot_type`): Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for
Q4_1/Q5_1, Q8_K for k-quants; the x86 quantizers (ggml-cpu/arch/x86/quants.c) round ties to even
(`_mm256_round_ps`), the portable references (ggml-quants.c `quantize_row_q8_*_ref`) away from zero.

Notation: R rows (output features), C columns (input features), B blocks per row (C / 32 or C / 256),
T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tracer.core.errors import TracerError
from tracer.ggml.floats import F32, fma, round_f16

# The block types ggml's CPU kernels are emulated for, with their block size and bytes per block.
BLOCK_TYPES = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34)}
# The vec-dot (activation) type ggml pairs with each weight type (ggml-cpu.c type_traits_cpu).
# Types held unpacked without being quantizable here (the gguf package has no quantizer for them).
UNPACKED_TYPES = BLOCK_TYPES | {"iq4_nl": (32, 18)}
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int16)  # ggml-common.h kvalues_iq4nl: the codebook a nibble indexes
VEC_DOT_TYPE = {"q4_0": "q8_0", "q4_1": "q8_1", "q5_0": "q8_0", "q5_1": "q8_1", "q8_0": "q8_0",
                "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k",
                "iq4_nl": "q8_0", "iq4_xs": "q8_k", "f16": "f16", "bf16": "bf16", "f32": "f32"}
ACT_BLOCK = {"q8_0": 32, "q8_1": 32, "q8_k": 256}


@dataclass
class Blocks:
    """A (R, C) matrix in a ggml block type.

    Attributes:
        kind: lower-case ggml type name ("q4_1", "q6_k", ...).
        shape: (R, C).
        d: (R, B) block scales, f32 (the f16 field's value); None for types held dequantized.
        q: (R, B, 32) integer quants as the dot kernels use them, int16; None as `d`.
        m: (R, B) block mins (Q4_1, Q5_1), f32; else None.
        held: (R, C) f32 values for types without an unpacked form (k-quants, f16, bf16, ...).
    """

    kind: str
    shape: tuple[int, int]
    d: torch.Tensor | None = None
    q: torch.Tensor | None = None
    m: torch.Tensor | None = None
    held: torch.Tensor | None = None
    _values: torch.Tensor | None = field(default=None, repr=False)
    _layout: tuple | None = field(default=None, repr=False)
    _scaled: torch.Tensor | None = field(default=None, repr=False)

    @property
    def unpacked(self) -> bool:
        return self.q is not None

    @property
    def device(self) -> torch.device:
        return (self.q if self.unpacked else self.held).device

    def values(self) -> torch.Tensor:
        """(R, C) f32: the matrix as ggml dequantizes it (dequantize_row_*: q*d, or fma(q, d, m))."""
        if self._values is None:
            if not self.unpacked:
                self._values = self.held
            else:
                q = self.q.to(F32)  # (R, B, 32)
                scaled = q * self.d[..., None] if self.m is None else fma(q, self.d[..., None], self.m[..., None])
                self._values = scaled.reshape(self.shape)
        return self._values

    def scaled(self, dtype: torch.dtype) -> torch.Tensor:
        """(R, C) d*q without the min, in `dtype` (exact: 11 + 8 bits); the f32 one is cached."""
        if dtype == F32 and self._scaled is not None:
            return self._scaled
        scaled = (self.q.to(dtype) * self.d[..., None].to(dtype)).flatten(-2)
        if dtype == F32:
            self._scaled = scaled
        return scaled

    def kernel_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The unpacked blocks as `tracer.ggml.kernels` walks them, cached: quants (B, 32, R) f32
        (outputs last), scales (B, R) f32, mins (B, R) f32 or None."""
        if self._layout is None:
            quants = self.q.to(F32).permute(1, 2, 0).contiguous().numpy()  # (B, 32, R)
            mins = None if self.m is None else self.m.T.contiguous().numpy()
            self._layout = (quants, self.d.T.contiguous().numpy(), mins)
        return self._layout

    def rows(self, index: torch.Tensor) -> Blocks:
        """The blocks of the rows `index` (a permutation or a selection)."""
        def pick(t):
            return None if t is None else t[index]

        return Blocks(self.kind, (len(index), self.shape[1]), pick(self.d), pick(self.q), pick(self.m), pick(self.held))

    def to(self, dtype=None, device=None) -> Blocks:
        """On `device`; `dtype` is ignored: the blocks' format is the point of holding them."""
        if device is None:
            return self
        def move(t):
            return None if t is None else t.to(device)

        return Blocks(self.kind, self.shape, move(self.d), move(self.q), move(self.m), move(self.held))


# --- unpacking GGUF bytes ---------------------------------------------------------------------


def _f16_field(raw: np.ndarray, offset: int) -> torch.Tensor:
    """(R, B, bytes) uint8 -> (R, B) f32: the little-endian f16 at `offset` of each block."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0]
                            .astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(R, B, 16) uint8 -> (R, B, 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1).astype(np.int16)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(R, B, 4) uint8 -> (R, B, 32): bit j of the little-endian uint32 is element j's 5th bit."""
    word = np.ascontiguousarray(qh).view("<u4")  # (R, B, 1)
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)


UNPACK = {
    "q4_0": lambda raw: (_f16_field(raw, 0), None, _nibbles(raw[..., 2:18]) - 8),
    "q4_1": lambda raw: (_f16_field(raw, 0), _f16_field(raw, 2), _nibbles(raw[..., 4:20])),
    "q5_0": lambda raw: (_f16_field(raw, 0), None, (_nibbles(raw[..., 6:22]) | _fifth_bits(raw[..., 2:6])) - 16),
    "q5_1": lambda raw: (_f16_field(raw, 0), _f16_field(raw, 2), _nibbles(raw[..., 8:24]) | _fifth_bits(raw[..., 4:8])),
    "q8_0": lambda raw: (_f16_field(raw, 0), None, np.ascontiguousarray(raw[..., 2:34]).view(np.int8).astype(np.int16)),
    "iq4_nl": lambda raw: (_f16_field(raw, 0), None, IQ4_NL_VALUES[_nibbles(raw[..., 2:18])]),
}


def from_gguf_bytes(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's bytes ((R, bytes per row) uint8, as `gguf.GGUFReader` gives them) -> Blocks.

    Raises:
        TracerError: a type neither unpacked here nor dequantizable by the gguf package.
    """
    rows, cols = shape
    if kind in UNPACKED_TYPES:
        size, nbytes = UNPACKED_TYPES[kind]
        blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // size, nbytes)  # (R, B, bytes)
        d, m, q = UNPACK[kind](blocks)
        return Blocks(kind, shape, d=d, m=m, q=torch.from_numpy(np.ascontiguousarray(q)))
    return Blocks(kind, shape, held=_dequantize_with_gguf(kind, raw, shape))


def _gguf_type(kind: str):
    import gguf  # gguf-py: 0.1 s, for GGUF files only

    try:
        return gguf.GGMLQuantizationType[kind.upper()]
    except KeyError:
        raise TracerError(f"unknown GGUF tensor type {kind!r}") from None


def _dequantize_with_gguf(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    import gguf.quants  # gguf-py: 0.1 s, for GGUF files only

    values = gguf.quants.dequantize(np.asarray(raw), _gguf_type(kind))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def quantize(weight: torch.Tensor, kind: str) -> Blocks:
    """An f32 (R, C) matrix quantized by the gguf package's reference quantizer into `kind`.

    Raises:
        TracerError: `kind` is not one the gguf package can quantize, or C is not a whole number of blocks.
    """
    import gguf.quants  # gguf-py: 0.1 s, for GGUF files only

    qtype = _gguf_type(kind)
    rows, cols = weight.shape
    size = BLOCK_TYPES.get(kind, (256, 0))[0]
    if cols % size:
        raise TracerError(f"weights={kind}: a row of {cols} values is not a whole number of {size}-value blocks")
    try:
        raw = gguf.quants.quantize(weight.detach().to("cpu", F32).numpy(), qtype)
    except NotImplementedError:
        raise TracerError(f"weights={kind}: the gguf package has no quantizer for {kind.upper()}") from None
    return from_gguf_bytes(kind, raw, (rows, cols))


# --- activations ------------------------------------------------------------------------------


@dataclass
class ActBlocks:
    """Activations (T, C) quantized to Q8_0/Q8_1/Q8_K: `d` (T, B) scale (f16 value; Q8_K: f32),
    `q` (T, B, size) int quants, `s` (T, B) Q8_1's f16 block sum d*sum(q) (else None)."""

    kind: str
    d: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """(T, C) f32: d*q, exact (an int8 times an f16 fits f32)."""
        return (self.q * self.d[..., None]).flatten(-2)


def _blocked(x: torch.Tensor, size: int, kind: str) -> torch.Tensor:
    """(T, C) -> (T, B, size) f32."""
    if x.shape[-1] % size:
        raise TracerError(f"act_quant={kind}: a row of {x.shape[-1]} values is not a whole number of "
                          f"{size}-value blocks")
    return x.to(F32).unflatten(-1, (x.shape[-1] // size, size))


def _quantize_q8(x: torch.Tensor, kind: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, C) -> q (T, B, 32), f32 d = amax/127 (T, B), f32 d*sum(q) (T, B): the x86 quantizer's
    steps per block (`tracer.ggml.kernels.quantize_q8`, compiled)."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    blocks = _blocked(x, 32, kind)  # (T, B, 32)
    q, d, sums = kernels.quantize_q8(blocks.detach().cpu().numpy(), rounding == "away", torch.get_num_threads())
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(sums)


def quantize_q8_0(x: torch.Tensor, rounding: str = "even") -> ActBlocks:
    """quantize_row_q8_0 (x86): d = amax/127 stored f16, q = round(x * (127/amax)) in f32."""
    q, d, _ = _quantize_q8(x, "q8_0", rounding)
    return ActBlocks("q8_0", round_f16(d), q)


def quantize_q8_1(x: torch.Tensor, rounding: str = "even") -> ActBlocks:
    """quantize_row_q8_1 (x86): as Q8_0, plus s = f16(d * sum(q)) with d the f32 scale before rounding."""
    q, d, sums = _quantize_q8(x, "q8_1", rounding)
    return ActBlocks("q8_1", round_f16(d), q, s=round_f16(sums))


def quantize_q8_k(x: torch.Tensor, rounding: str = "even") -> ActBlocks:
    """quantize_row_q8_K_ref, which the x86 build runs too (`quantize_row_q8_K`): iscale = -127/max
    with max the first value of largest magnitude, q = min(127, nearest_int(iscale * x)), d =
    1/iscale kept in f32 (compiled: `tracer.ggml.kernels.quantize_q8_k`). `nearest_int` (the f32
    sum with 1.5·2^23) rounds ties to even in the reference and on x86 alike: `rounding` does not
    apply to Q8_K."""
    from tracer.ggml import kernels  # numba compiles these kernels: loaded by the ops that run them

    blocks = _blocked(x, 256, "q8_k")  # (T, B, 256)
    q, d = kernels.quantize_q8_k(blocks.detach().cpu().numpy(), torch.get_num_threads())
    return ActBlocks("q8_k", torch.from_numpy(d), torch.from_numpy(q))


ACT_QUANTIZERS = {"q8_0": quantize_q8_0, "q8_1": quantize_q8_1, "q8_k": quantize_q8_k}


def quantize_activations(x: torch.Tensor, kind: str, rounding: str = "even") -> ActBlocks:
    """(T, C) f32 -> ActBlocks of `kind` ("q8_0", "q8_1", "q8_k")."""
    return ACT_QUANTIZERS[kind](x, rounding)
