"""GGUF k-quant block formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), read from a file's bytes.

A k-quant row is made of super-blocks of 256 values. Each super-block holds an f16 scale `d` (and,
for Q2_K/Q4_K/Q5_K, an f16 `dmin` for the mins), small integer scales (and mins) per sub-block
(16 sub-blocks of 16 values for Q2_K/Q3_K/Q6_K, 8 of 32 for Q4_K/Q5_K), and one small integer
quant per value. ggml's dot kernels multiply the integer quants by Q8_K activations in integers,
scale each sub-block's integer sum by its integer scale, and only then go to floating point with
`d` (ggml-cpu/arch/x86/quants.c `ggml_vec_dot_q*_K_q8_K`, repack.cpp, tiled/): the integers are the
operands, and `KBlocks` keeps them as such.

Value order is the one `dequantize_row_q*_K` (ggml-quants.c) writes; every field below is indexed
by it, so that value p of a super-block has quant q[..., p] and sub-block scale scales[..., p // size].

Notation: R rows (output features), C columns (input features), B = C / 256 super-blocks,
S sub-blocks per super-block (16 or 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tracer.core.errors import TracerError
from tracer.ggml.floats import F32
from tracer.ggml.quants import Blocks
from tracer.ggml.quants import from_gguf_bytes as unpack_simple

QK_K = 256  # values per super-block
# type -> (bytes per super-block, values per sub-block)
KQUANT_TYPES = {"q2_k": (84, 16), "q3_k": (110, 16), "q4_k": (144, 32), "q5_k": (176, 32), "q6_k": (210, 16)}
WITH_MINS = ("q2_k", "q4_k", "q5_k")
# The quant a value of zero has: Q6_K's 6-bit codes are kept unsigned (0..63) because its dot kernels
# multiply them unsigned and subtract 32 * scale * (the activations' block sum) afterwards.
QUANT_ZERO = {"q6_k": 32}


@dataclass
class KBlocks(Blocks):
    """A (R, C) matrix in a k-quant type, as its integer operands.

    Attributes (besides `Blocks`' kind and shape):
        d: (R, B) super-block scale, f32 (the f16 field's value).
        q: (R, B, 256) int16 quants in value order: Q2_K 0..3, Q3_K -4..3 (the 2 low bits minus 4
            where the high bit is clear), Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (zero at 32: `QUANT_ZERO`).
        scales: (R, B, S) int16 sub-block scales: Q2_K 0..15, Q3_K -32..31, Q4_K/Q5_K 0..63, Q6_K -128..127.
        mins: (R, B, S) int16 sub-block mins (Q2_K 0..15, Q4_K/Q5_K 0..63), subtracted; None for the others.
        dmin: (R, B) super-block scale of the mins, f32; None as `mins`.
    """

    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    @property
    def sub_block(self) -> int:
        """Values per sub-block (16 or 32)."""
        return KQUANT_TYPES[self.kind][1]

    def values(self) -> torch.Tensor:
        """(R, C) f32 as `dequantize_row_q*_K` computes it (libggml-base, no contraction): y =
        f32(d*scale) * q, minus f32(dmin*min) where there are mins. The products are exact in f32
        (at most 11 + 8 + 6 bits); only the subtraction of the min rounds."""
        if self._values is None:
            per_value = self.sub_block
            q = (self.q - QUANT_ZERO.get(self.kind, 0)).to(F32)  # (R, B, 256)
            scale = (self.d[..., None] * self.scales.to(F32)).repeat_interleave(per_value, -1)  # (R, B, 256)
            values = scale * q
            if self.mins is not None:
                values = values - (self.dmin[..., None] * self.mins.to(F32)).repeat_interleave(per_value, -1)
            self._values = values.reshape(self.shape)
        return self._values

    def rows(self, index: torch.Tensor) -> KBlocks:
        """The super-blocks of the rows `index` (a permutation or a selection)."""
        def pick(t):
            return None if t is None else t[index]

        return KBlocks(self.kind, (len(index), self.shape[1]), d=pick(self.d), q=pick(self.q),
                       scales=pick(self.scales), mins=pick(self.mins), dmin=pick(self.dmin))

    def to(self, dtype=None, device=None) -> KBlocks:
        """On `device`; `dtype` is ignored: the blocks' format is the point of holding them."""
        if device is None:
            return self
        def move(t):
            return None if t is None else t.to(device)

        return KBlocks(self.kind, self.shape, d=move(self.d), q=move(self.q), scales=move(self.scales),
                       mins=move(self.mins), dmin=move(self.dmin))

    def kernel_layout(self, centred: bool = False) -> KernelLayout:
        """The super-blocks as `tracer.ggml.kquant_kernels` walks them (outputs last), cached.
        `centred`: the quants less their zero (Q6_K's signed -32..31, as the tiled kernel takes
        them; the vec_dot kernel takes them unsigned); the same layout for the other types."""
        centred = centred and self.kind in QUANT_ZERO
        layouts = self._layout if self._layout is not None else {}
        if centred not in layouts:
            quants = self.q.to(torch.int32) - (QUANT_ZERO[self.kind] if centred else 0)
            scaled = quants * self.scales.to(torch.int32).repeat_interleave(self.sub_block, -1)  # (R, B, 256)
            layouts[centred] = KernelLayout(
                weights=scaled.to(F32).permute(1, 2, 0).contiguous().numpy(),  # (B, 256, R)
                d=self.d.T.contiguous().numpy(),  # (B, R)
                dmin=None if self.dmin is None else self.dmin.T.contiguous().numpy(),
                scales=self.scales.to(torch.int32).permute(1, 2, 0).contiguous().numpy(),  # (B, S, R)
                mins=None if self.mins is None else self.mins.to(torch.int32).permute(1, 2, 0).contiguous().numpy(),
                centred=centred)
            self._layout = layouts
        return layouts[centred]


@dataclass(frozen=True)
class KernelLayout:
    """A k-quant matrix laid out for the compiled kernels: outputs on the last axis.

    Attributes:
        weights: (B, 256, R) f32 scale * quant per value (an integer: |x| <= 8064), the weight
            side of every integer product (Q6_K's quant unsigned, or less its zero if `centred`).
        d: (B, R) f32 super-block scales.
        dmin: (B, R) f32 super-block scales of the mins, or None.
        scales: (B, S, R) int32 sub-block scales (Q6_K's correction of its unsigned quants).
        mins: (B, S, R) int32 sub-block mins, or None.
    """

    weights: np.ndarray
    d: np.ndarray
    dmin: np.ndarray | None
    scales: np.ndarray
    mins: np.ndarray | None
    centred: bool = False


# --- unpacking GGUF bytes (ggml-common.h block layouts) ---------------------------------------


def _f16(raw: np.ndarray, offset: int) -> torch.Tensor:
    """(R, B, bytes) uint8 -> (R, B) f32: the little-endian f16 at `offset` of each block."""
    return torch.from_numpy(np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0]
                            .astype(np.float32))


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, B, 12) uint8 -> 8 scales and 8 mins of 6 bits each (`get_scale_min_k4`)."""
    low, high = packed[..., 0:4], packed[..., 4:8]  # j < 4: scale j in low[j], min j in high[j]
    mixed = packed[..., 8:12]  # j >= 4: 4 low bits here, the top 2 bits in low/high's bits 6..7
    scales = np.concatenate((low & 63, (mixed & 0x0F) | ((low >> 6) << 4)), axis=-1)
    mins = np.concatenate((high & 63, (mixed >> 4) | ((high >> 6) << 4)), axis=-1)
    return scales, mins


def _bits(field: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """(R, B, n) uint8 -> (R, B, len(shifts) * n): (field >> shift) & mask for each shift in turn."""
    return np.concatenate([(field >> shift) & mask for shift in shifts], axis=-1)


def _q2_k(raw: np.ndarray) -> dict:
    # scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin
    packed, qs = raw[..., 0:16], raw[..., 16:80]
    q = np.concatenate([_bits(qs[..., 32 * half:32 * half + 32], [0, 2, 4, 6], 3) for half in range(2)], axis=-1)
    return dict(d=_f16(raw, 80), dmin=_f16(raw, 82), q=q, scales=packed & 0x0F, mins=packed >> 4)


def _q3_k(raw: np.ndarray) -> dict:
    # hmask[32], qs[64], scales[12] (6-bit, stored + 32), d
    hmask, qs, packed = raw[..., 0:32], raw[..., 32:96], raw[..., 96:108]
    low = np.concatenate([_bits(qs[..., 32 * half:32 * half + 32], [0, 2, 4, 6], 3) for half in range(2)], axis=-1)
    high = _bits(hmask, list(range(8)), 1)  # value 32*j + l takes bit j of hmask[l]
    q = low.astype(np.int16) - 4 * (1 - high.astype(np.int16))
    words = np.ascontiguousarray(packed).view("<u4")  # (R, B, 3): dequantize_row_q3_K's aux words
    a0, a1, a2 = words[..., 0:1], words[..., 1:2], words[..., 2:3]
    kmask1, kmask2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    aux = np.concatenate(((a0 & kmask2) | (((a2 >> 0) & kmask1) << 4), (a1 & kmask2) | (((a2 >> 2) & kmask1) << 4),
                          ((a0 >> 4) & kmask2) | (((a2 >> 4) & kmask1) << 4),
                          ((a1 >> 4) & kmask2) | (((a2 >> 6) & kmask1) << 4)), axis=-1)
    scales = np.ascontiguousarray(aux).view(np.int8).astype(np.int16) - 32  # (R, B, 16)
    return dict(d=_f16(raw, 108), q=q, scales=scales)


def _q4_k(raw: np.ndarray) -> dict:
    # d, dmin, scales[12], qs[128]: 64-value chunk j = low nibbles of qs[32j:32j+32], then the high ones
    qs = raw[..., 16:144]
    q = np.concatenate([_bits(qs[..., 32 * j:32 * j + 32], [0, 4], 0x0F) for j in range(4)], axis=-1)
    scales, mins = _scale_min_k4(raw[..., 4:16])
    return dict(d=_f16(raw, 0), dmin=_f16(raw, 2), q=q, scales=scales, mins=mins)


def _q5_k(raw: np.ndarray) -> dict:
    # d, dmin, scales[12], qh[32] (bit j of qh[l] is value 32*j + l's fifth bit), qs[128] as Q4_K's
    qh, qs = raw[..., 16:48], raw[..., 48:176]
    low = np.concatenate([_bits(qs[..., 32 * j:32 * j + 32], [0, 4], 0x0F) for j in range(4)], axis=-1)
    scales, mins = _scale_min_k4(raw[..., 4:16])
    return dict(d=_f16(raw, 0), dmin=_f16(raw, 2), q=low | (_bits(qh, list(range(8)), 1) << 4), scales=scales,
                mins=mins)


def _q6_k(raw: np.ndarray) -> dict:
    # ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d; per 128-value half n:
    # values 0..31 / 32..63 low nibbles of ql[64n:64n+32] / ql[64n+32:64n+64], 64..127 their high nibbles;
    # the high bits of value 32*k + l are bits 2k, 2k+1 of qh[32n + l]
    ql, qh = raw[..., 0:128], raw[..., 128:192]
    halves = []
    for n in range(2):
        low = _bits(ql[..., 64 * n:64 * n + 64], [0, 4], 0x0F)  # (R, B, 128): in value order
        halves.append(low | (_bits(qh[..., 32 * n:32 * n + 32], [0, 2, 4, 6], 3) << 4))
    scales = np.ascontiguousarray(raw[..., 192:208]).view(np.int8)
    return dict(d=_f16(raw, 208), q=np.concatenate(halves, axis=-1), scales=scales)


UNPACK = {"q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def from_gguf_bytes(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's bytes ((R, bytes per row) uint8, as `tracer.files.gguffile.GGUFFile.raw` gives
    them) -> `KBlocks` for the k-quants, else `tracer.ggml.quants.from_gguf_bytes`' `Blocks`.

    Raises:
        TracerError: a row that is not a whole number of super-blocks, or a type tracer cannot read.
    """
    if kind not in KQUANT_TYPES:
        return unpack_simple(kind, raw, shape)
    rows, cols = shape
    if cols % QK_K:
        raise TracerError(f"a {kind.upper()} row of {cols} values is not a whole number of {QK_K}-value super-blocks")
    nbytes = KQUANT_TYPES[kind][0]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // QK_K, nbytes)  # (R, B, bytes)
    fields = UNPACK[kind](blocks)

    def integers(name):
        value = fields.get(name)
        return None if value is None else torch.from_numpy(np.ascontiguousarray(value, dtype=np.int16))

    return KBlocks(kind, shape, d=fields["d"], q=integers("q"), scales=integers("scales"), mins=integers("mins"),
                   dmin=fields.get("dmin"))
