"""The audit of a GGUF file's tensors against the reference's weights, before the arithmetic is judged.

A regime that takes a GGUF's tensors as the reference's weights (`weights=gguf`) would repeat any
damage the file holds: the candidate and its reference agree on a corrupted block, and the fault
shows nowhere. So each tensor of the file is first requantized from the reference's weights by
llama.cpp's own quantizer (`tracer.ggml.quantizer`), in the tensor's own type, and compared with
the file's bytes:

- identical: the file is what llama.cpp makes of these weights (a file quantized from them);
- legitimate: another quantization of the same weights, made with an importance matrix or by
  another quantizer version. Every ggml quantizer picks a block's scale (and min), then puts each
  value on the level nearest it. k-quants round last, with the scales they store, and Q8_0's
  quantizer ignores an importance matrix: their quants are nearest for the stored scales. Q4_0,
  Q4_1, Q5_0 and Q5_1 with an importance matrix round with the scale their search found, then
  store the least-squares scale of the rounded quants: nearest for some scale near the stored one;
- damaged: a block whose quants fit no scale (a quant moved, bytes overwritten), a block rounded
  with another scale than its own in a file that rounds at its stored scales (a scale changed), or
  a block whose error is more than any quantization makes (MAX_ERROR_RATIO).

Why not the error alone: measured on SmolLM2 with a realistic importance matrix, a legitimate
Q5_0 block reaches 7.5x the rms error of llama.cpp's plain requantization of it, while three
rewritten quant bytes can give as little as 2x: no threshold on the error separates them. The
nearest-level test does: a legitimate quant is within half a step of its value (the tolerance
covers the f16 rounding of the stored scale), a moved one a step or more (docs/regimes.md, "The
audit", has the figures). The error ratio stays the figure a user reads ("9.5x the error Q5_0
gives here").

Each block's levels are read with ggml's own dequantizer: the block is dequantized as stored, with
every quant set to level `first`, and to `first + 1` (only the bytes that hold quants are written;
scales stay), which gives each value's offset and step under the block's scales without
reimplementing any format. Float types (f16, bf16, f32) are judged per value: a legitimate
conversion is within one unit in the last place of the reference's value.

Streamed: one tensor at a time, its rows in chunks; the file's pages are released after each tensor
(an 8B file is never resident whole), the reference's tensor is read and dropped.

Notation: R rows, C values per row, B blocks, n values per block; r rows of a chunk, b its blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tracer.files.gguffile import GGML_TYPES
from tracer.ggml.quantizer import ggml_quantizer, quantizer_name

CHUNK_VALUES = 1 << 22  # reference values judged at a time: bounded f64 temporaries, whatever the tensor
FLOAT_BLOCK = 32  # float types have no blocks: their errors are told per 32 values
MANTISSA_BITS = {"f16": 10, "bf16": 7, "f32": 23}
MIN_EXPONENT = {"f16": -14, "bf16": -126, "f32": -126}  # of the smallest normal value
# A legitimate quant is within half a step of its value; the slack covers the stored scale's f16
# rounding (quantizers round with the f32 scale: |level| * 2^-11) and float noise in the test itself.
HALF_STEP = 0.5
LEVEL_SLACK = 2.0**-10
ABS_SLACK = 1e-3
# Above this, a block's error (rms, against the reference) over llama.cpp's own quantization of it is
# more than any quantizer makes: measured up to 7.5x (Q5_0 with an importance matrix of SmolLM2's
# activations), so a Q4_0/Q5_0 block whose scale was changed is caught by its error beyond 16x.
MAX_ERROR_RATIO = 16.0
SCALE_RANGE = (0.25, 4.0)  # a rescaling the search may have rounded with, relative to the stored scale
OTHER_WEIGHTS = 0.5  # off in more than this share of tensors: the file was made from other weights
# Q4_0/Q4_1/Q5_0/Q5_1 blocks rounded with another scale than the stored one: 5-6% of them in files
# made with an importance matrix (SmolLM2), none without (every block within 4e-4 of its stored
# scale). At or below this share the file rounds at its stored scales, and such a block was changed.
RESCALED_SHARE = 0.01


@dataclass(frozen=True)
class TensorAudit:
    """One tensor of a GGUF file against llama.cpp's requantization of the reference's weights
    (`tracer.ggml.audit`)."""

    tensor: str  # its GGUF name
    kind: str  # its ggml type ("q5_0", "q4_k", "f16", ...)
    verdict: str  # "identical" | "legitimate" (another quantization) | "damaged" | "unchecked"
    blocks: int  # its blocks (32 values each for float types)
    off_blocks: int = 0  # blocks whose quants no scale explains
    worst_block: int | None = None  # the block furthest off (damaged), in row-major order
    steps_off: float | None = None  # how far that block's worst quant is from its value, in steps of its scale
    # rms error against the reference's weights over the requantization's, in the worst block (damaged: the
    # worst off block); None where the bytes are identical or unchecked
    error_ratio: float | None = None
    why: str | None = None  # unchecked: why

    def to_dict(self) -> dict:
        """Its fields, `kind` as "type" (the GGUF word); the ones that do not apply left out."""
        fields = {"type" if key == "kind" else key: value for key, value in dataclasses.asdict(self).items()}
        return {key: value for key, value in fields.items() if value is not None and (key != "off_blocks" or value)}


@dataclass(frozen=True)
class WeightAudit:
    """A GGUF file's tensors audited before the arithmetic is judged (`tracer.ggml.audit.audit_gguf`):
    each requantized from the reference's weights by llama.cpp's own quantizer and compared with the
    file's bytes. A tensor that differs is another quantization when every block's quants sit on the
    level nearest the reference's values for some scale (an importance matrix, another quantizer
    version), damage where a block's quants fit no scale."""

    file: str
    verdict: str  # "identical" | "legitimate" | "damaged" | "other_weights" | "not_audited"
    quantizer: str | None  # "llama-cpp-python 0.3.36 (ggml 0.25.3)"; None: not audited
    why: str | None = None  # not_audited: why
    tensors: tuple[TensorAudit, ...] = ()
    seconds: float = 0.0
    cached: bool = False  # read from the reference cache: an earlier run audited this file against these weights

    @property
    def damaged(self) -> tuple[str, ...]:
        """The GGUF names of the damaged tensors (none where the whole file is other weights)."""
        return () if self.verdict != "damaged" else tuple(t.tensor for t in self.tensors if t.verdict == "damaged")

    def count(self, verdict: str) -> int:
        return sum(t.verdict == verdict for t in self.tensors)

    def to_dict(self) -> dict:
        legitimate = [t for t in self.tensors if t.verdict == "legitimate" and t.error_ratio is not None]
        worst = max(legitimate, key=lambda t: t.error_ratio, default=None)
        return {
            "file": self.file, "verdict": self.verdict, "quantizer": self.quantizer, "why": self.why,
            "counts": {v: self.count(v) for v in ("identical", "legitimate", "damaged", "unchecked")},
            "damaged": [t.to_dict() for t in self.tensors if t.verdict == "damaged"],
            "legitimate_worst": worst and {"tensor": worst.tensor, "type": worst.kind,
                                           "error_ratio": worst.error_ratio},
            "tensors": {t.tensor: {k: v for k, v in t.to_dict().items() if k != "tensor"} for t in self.tensors},
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_dict(cls, data: dict) -> WeightAudit:
        """The audit `to_dict` wrote (what the reference cache keeps)."""
        tensors = tuple(TensorAudit(tensor=name, **{"kind" if key == "type" else key: value
                                                    for key, value in fields.items()})
                        for name, fields in data["tensors"].items())
        return cls(data["file"], data["verdict"], data["quantizer"], why=data["why"], tensors=tensors,
                   seconds=data["seconds"], cached=data.get("cached", False))


@dataclass(frozen=True)
class Levels:
    """Where a block type keeps its quants, and the levels they mean.

    Attributes:
        fields: byte ranges, within one block, of the fields that hold quants (scales excluded).
        first: the level every value takes with `low` written into those fields.
        low, next: one byte per field: every quant at level `first`, every quant at `first + 1`.
        lo, hi: the lowest and highest level (a value beyond them is clamped there).
        symmetric: level 0 is the value 0 (no min): only the scale may differ from the stored one.
        rescaled: a legitimate quantizer may round with another scale than the one it stores: ggml's
            Q4_0/Q4_1/Q5_0/Q5_1 with an importance matrix search a scale, round, then store the
            least-squares scale of the rounded quants. Elsewhere (Q8_0, whose quantizer ignores an
            importance matrix; k-quants, whose quants are rounded last, with the stored scales) the
            quants are nearest for the scales stored, and a changed scale is off.
    """

    fields: tuple[tuple[int, int], ...]
    first: int
    low: tuple[int, ...]
    next: tuple[int, ...]
    lo: int
    hi: int
    symmetric: bool
    rescaled: bool = False


# ggml-common.h's block layouts; every quant of a field written with the same bit pattern.
LEVELS = {
    "q4_0": Levels(((2, 18),), -8, (0x00,), (0x11,), -8, 7, True, rescaled=True),
    "q4_1": Levels(((4, 20),), 0, (0x00,), (0x11,), 0, 15, False, rescaled=True),
    "q5_0": Levels(((2, 6), (6, 22)), -16, (0x00, 0x00), (0x00, 0x11), -16, 15, True, rescaled=True),
    "q5_1": Levels(((4, 8), (8, 24)), 0, (0x00, 0x00), (0x00, 0x11), 0, 31, False, rescaled=True),
    "q8_0": Levels(((2, 34),), 0, (0x00,), (0x01,), -128, 127, True),
    "q2_k": Levels(((16, 80),), 0, (0x00,), (0x55,), 0, 3, False),
    "q3_k": Levels(((0, 32), (32, 96)), -4, (0x00, 0x00), (0x00, 0x55), -4, 3, True),
    "q4_k": Levels(((16, 144),), 0, (0x00,), (0x11,), 0, 15, False),
    "q5_k": Levels(((16, 48), (48, 176)), 0, (0x00, 0x00), (0x00, 0x11), 0, 31, False),
    "q6_k": Levels(((0, 128), (128, 192)), -32, (0x00, 0x00), (0x11, 0x00), -32, 31, True),
}

NO_LEVELS = Levels((), 0, (), (), 0, 0, False)


@dataclass
class _Tally:
    """What the chunks of one tensor found, gathered as they come."""

    kind: str
    blocks: int = 0
    differs: bool = False
    off: int = 0
    worst: tuple[float, int, float] | None = None  # (error ratio, block, steps off) of the worst off block
    rescaled: int = 0  # blocks rounded with another scale than the stored one
    rescaled_worst: tuple[float, int, float] | None = None
    largest_ratio: float = 0.0  # over every block compared

    def add(self, first_block: int, steps: np.ndarray, off: np.ndarray, rescaled: np.ndarray, ratio: np.ndarray,
            blocks: np.ndarray) -> None:
        self.differs = True
        self.largest_ratio = max(self.largest_ratio, float(np.nan_to_num(ratio, posinf=np.inf).max(initial=0.0)))
        self.off += int(off.sum())
        self.worst = _worse(self.worst, first_block, steps, off, ratio, blocks)
        self.rescaled += int(rescaled.sum())
        self.rescaled_worst = _worse(self.rescaled_worst, first_block, steps, rescaled, ratio, blocks)

    def rescaling_is_off(self) -> None:
        """The file rounds at its stored scales: a block rounded with another scale was changed."""
        self.off += self.rescaled
        candidates = [w for w in (self.worst, self.rescaled_worst) if w is not None]
        self.worst = max(candidates, default=None)
        self.rescaled, self.rescaled_worst = 0, None


def _worse(worst, first_block: int, steps: np.ndarray, chosen: np.ndarray, ratio: np.ndarray, blocks: np.ndarray):
    """`worst` or, if larger, the chosen block of largest error ratio, as (ratio, block, steps)."""
    if not chosen.any():
        return worst
    ranked = np.nan_to_num(np.where(chosen, ratio, -1.0), nan=np.inf)
    index = int(np.argmax(ranked))
    found = (float(ranked[index]), first_block + int(blocks[index]), float(steps[index]))
    return found if worst is None or found[0] > worst[0] else worst


def audit_gguf(path: str | Path, reference: Mapping[str, torch.Tensor], quantizer=None) -> WeightAudit:
    """Every tensor of the GGUF at `path` requantized from `reference` (HF name -> tensor, e.g. a
    model directory's `tracer.files.weights.WeightFiles`) by llama.cpp's quantizer and judged.

    Args:
        path: the GGUF file (another quantization of the reference's model).
        reference: the reference's weights, read one tensor at a time.
        quantizer: a `tracer.ggml.quantizer.GgmlQuantizer` (default: llama-cpp-python's, if installed).

    Returns:
        The `WeightAudit`; "not_audited" in one line where llama.cpp's quantizer is not installed.

    Raises:
        TracerError: the file is not one of this model (a tensor the reference lacks, another shape).

    Example:
        >>> from tracer.files.sources import bundled_gguf
        >>> from tracer.files.weights import WeightFiles
        >>> audit = audit_gguf(bundled_gguf(), WeightFiles(tracer.default_model_path()))  # its own conversion
        >>> audit.verdict, audit.count("identical")
        ('identical', 272)
    """
    from tracer.ggml.strategies import GGUFWeights, check_same_model, reference_tensor  # numba: an audit's only

    started = time.perf_counter()
    path = Path(path)
    weights = GGUFWeights(path)
    check_same_model(weights, reference, path)
    quantizer = quantizer or ggml_quantizer()
    if quantizer is None:
        return WeightAudit(str(path), "not_audited", None,
                           why="llama.cpp's quantizer is not installed (llama-cpp-python): the file's bytes are used "
                               "as they are")
    tallies = {}
    for name, info in weights.names.items():
        tallies[info.name] = _audit_tensor(weights, name, reference_tensor(reference, name, weights.family), quantizer)
        weights.file.release(info.name)
    rescalable = [t for t in tallies.values() if isinstance(t, _Tally) and LEVELS.get(t.kind, NO_LEVELS).rescaled]
    if sum(t.rescaled for t in rescalable) <= RESCALED_SHARE * sum(t.blocks for t in rescalable):
        for tally in rescalable:  # no importance matrix's search: quants are rounded at the stored scales
            tally.rescaling_is_off()
    tensors = [t if isinstance(t, TensorAudit) else _tensor_verdict(name, t) for name, t in tallies.items()]
    return WeightAudit(str(path), _file_verdict(tensors), quantizer_name(quantizer), tensors=tuple(tensors),
                       seconds=time.perf_counter() - started)


def _audit_tensor(weights, name: str, tensor: torch.Tensor, quantizer) -> _Tally | TensorAudit:
    """The tally of one tensor's blocks (a `TensorAudit` at once for a type the audit cannot judge)."""
    from tracer.ggml.strategies import gguf_rows  # numba, for ggml's kernels

    info = weights.names[name]
    kind, values = info.kind, tensor.reshape(-1, info.shape[-1]) if tensor.ndim > 1 else tensor[None]
    block = FLOAT_BLOCK if kind in MANTISSA_BITS else _block_layout(kind)[0]
    count, width = values.shape
    blocks = count * width // block
    if kind not in LEVELS and kind not in MANTISSA_BITS or quantizer.requires_imatrix(kind):
        return _unchecked(weights, name, values, quantizer, blocks)
    order = gguf_rows(weights, name, count)
    raw = weights.file.raw(info.name)  # (R, bytes per row), memory-mapped
    tally = _Tally(kind, blocks=blocks)
    step = max(1, CHUNK_VALUES // width)
    for start in range(0, count, step):
        stop = min(count, start + step)
        x = _rows(values, order, start, stop)  # (r, C) f32, the file's row order
        judged = _judge_chunk(kind, x, np.asarray(raw[start:stop]), quantizer, block)
        if judged is not None:
            tally.add(start * width // block, *judged)
    return tally


def _block_layout(kind: str) -> tuple[int, int]:
    """(values, bytes) of one block of a ggml type (`tracer.files.gguffile.GGML_TYPES`)."""
    return next((size, nbytes) for name, size, nbytes in GGML_TYPES.values() if name == kind)


def _rows(values: torch.Tensor, order: np.ndarray | None, start: int, stop: int) -> np.ndarray:
    chunk = values[start:stop] if order is None else values[torch.from_numpy(order[start:stop])]
    return np.ascontiguousarray(chunk.to(torch.float32).numpy())


def _judge_chunk(kind: str, x: np.ndarray, theirs: np.ndarray, quantizer, block: int):
    """(steps off, off, rescaled, error ratio, block index) for the blocks of the rows whose bytes
    differ from the requantization of `x` (r, C); None where every row is identical."""
    mine = quantizer.quantize(kind, x)
    differ = np.flatnonzero((mine != theirs).any(axis=1))
    if not differ.size:
        return None
    x, mine, theirs = x[differ], mine[differ], theirs[differ]
    exact = x.astype(np.float64)
    stored = quantizer.dequantize(kind, theirs, x.shape).astype(np.float64)
    requantized = quantizer.dequantize(kind, mine, x.shape).astype(np.float64)
    ratio = _error_ratio(exact, stored, requantized, block)
    if kind in MANTISSA_BITS:
        steps = _ulps_off(kind, exact, stored).reshape(-1, block).max(axis=1)  # NaN propagates
        off, rescaled = ~(steps <= 1.0 + ABS_SLACK), np.zeros(len(steps), dtype=bool)
    else:
        steps, off, rescaled = _levels_off(kind, exact, theirs, stored, quantizer, block)
    off |= ~(ratio <= MAX_ERROR_RATIO)  # an error no quantization makes (a rescaled block's changed scale)
    per_row = x.shape[1] // block
    index = (differ[:, None] * per_row + np.arange(per_row)).reshape(-1)  # (b,) block index within the chunk
    return steps, off, rescaled & ~off, ratio, index


def _error_ratio(exact: np.ndarray, stored: np.ndarray, requantized: np.ndarray, block: int) -> np.ndarray:
    """Per block, the rms error of the file's values against the reference over that of llama.cpp's
    requantization; a block the requantization reproduces exactly is measured against the type's
    relative error over these rows (and never against less than f32 rounding)."""
    file_error = ((stored - exact) ** 2).reshape(-1, block).sum(axis=1)
    own_error = ((requantized - exact) ** 2).reshape(-1, block).sum(axis=1)
    energy = (exact ** 2).reshape(-1, block).sum(axis=1)
    relative = own_error.sum() / max(energy.sum(), np.finfo(np.float64).tiny)
    floor = np.maximum(np.maximum(own_error, relative * energy), 2.0**-48 * energy)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(np.where(floor > 0, file_error / floor, np.where(file_error > 0, np.inf, 1.0)))


def _ulps_off(kind: str, exact: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """|stored - exact| in units in the last place of `kind` at the reference's value (an f16
    value beyond its range is inf, as ggml converts it)."""
    _, exponent = np.frexp(exact)
    ulp = np.ldexp(1.0, np.maximum(exponent - 1, MIN_EXPONENT[kind]) - MANTISSA_BITS[kind])
    with np.errstate(invalid="ignore"):
        off = np.abs(stored - exact) / ulp
    overflow = np.isinf(stored) & (np.sign(stored) == np.sign(exact)) & (np.abs(exact) >= 65504.0)
    return np.where(overflow, 0.0, off)


def _levels_off(kind: str, exact: np.ndarray, theirs: np.ndarray, stored: np.ndarray, quantizer, block: int):
    """Per block (b,): how far its worst quant is from the reference's value in steps of its stored
    scale (for a block off at every scale, the least over scales); whether no scale puts every quant
    on the level nearest its value (off); whether another scale than the stored one does (rescaled)."""
    levels = LEVELS[kind]
    low = quantizer.dequantize(kind, _with_quants(theirs, kind, levels.low), exact.shape).astype(np.float64)
    up = quantizer.dequantize(kind, _with_quants(theirs, kind, levels.next), exact.shape).astype(np.float64)
    scale = up - low  # (r, C): each value's step under its block's scales
    judged = scale != 0  # a zero scale: every level is the same value, nothing to judge
    safe = np.where(judged, scale, 1.0)
    wanted = levels.first + (exact - low) / safe  # the reference's value, in levels
    level = levels.first + np.rint((stored - low) / safe)  # the file's quant
    steps = np.where(judged, _beyond(wanted - level, level, levels), 0.0)
    tolerance = HALF_STEP + LEVEL_SLACK * np.abs(level) + ABS_SLACK
    blocked = lambda a: a.reshape(-1, block)  # noqa: E731  (b, n)
    off = ~(blocked(steps <= tolerance).all(axis=1))  # NaN: off
    worst = blocked(steps).max(axis=1)
    rescaled = np.zeros(len(off), dtype=bool)
    if levels.rescaled and off.any():  # rounded with another scale? (an importance matrix's search)
        candidates = np.flatnonzero(off)
        least = _least_distance(blocked(wanted)[candidates], blocked(level)[candidates],
                                blocked(judged)[candidates], levels)
        fits = least <= HALF_STEP + ABS_SLACK
        off[candidates], rescaled[candidates] = ~fits, fits
        worst[candidates[~fits]] = least[~fits]
    return worst, off, rescaled


def _beyond(distance: np.ndarray, level: np.ndarray, levels: Levels) -> np.ndarray:
    """|distance| in steps, 0 for a value beyond the top (bottom) level clamped there."""
    clamped = ((level >= levels.hi) & (distance > 0)) | ((level <= levels.lo) & (distance < 0))
    return np.where(clamped, 0.0, np.abs(distance))


def _with_quants(raw: np.ndarray, kind: str, pattern: tuple[int, ...]) -> np.ndarray:
    """(r, bytes) blocks of `kind` with every quant field filled with `pattern` (scales untouched)."""
    blocks = raw.reshape(raw.shape[0], -1, _block_layout(kind)[1]).copy()  # (r, B, bytes)
    for (begin, end), byte in zip(LEVELS[kind].fields, pattern):
        blocks[..., begin:end] = byte
    return blocks.reshape(raw.shape)


def _least_distance(wanted: np.ndarray, level: np.ndarray, judged: np.ndarray, levels: Levels,
                    iterations: int = 40) -> np.ndarray:
    """Per block (b,): the least, over scales c in SCALE_RANGE (and, with a min, offsets o), of the
    largest distance in steps between a quant and c * wanted + o (a clamped quant at or beyond its
    end counts as 0). Legitimate: at most half a step. The distance is convex in c (a maximum of
    affine functions): a ternary search over log c finds its least value, to (2/3)^40 of the range."""
    low = np.full(len(wanted), np.log(SCALE_RANGE[0]))
    high = np.full(len(wanted), np.log(SCALE_RANGE[1]))

    def worst(log_scale: np.ndarray) -> np.ndarray:
        return _worst_distance(np.exp(log_scale)[:, None] * wanted - level, level, judged, levels)

    least = worst(np.zeros(len(wanted)))  # the stored scale
    for _ in range(iterations):
        first, second = low + (high - low) / 3, high - (high - low) / 3
        at_first, at_second = worst(first), worst(second)
        least = np.fmin(least, np.fmin(at_first, at_second))
        keep_low = at_first <= at_second  # the least value lies in [low, second]
        high, low = np.where(keep_low, second, high), np.where(keep_low, low, first)
    return least


def _worst_distance(shifted: np.ndarray, level: np.ndarray, judged: np.ndarray, levels: Levels) -> np.ndarray:
    """(b,): the least over offsets o (0 for a symmetric type) of the largest distance |s + o| of an
    unclamped quant (s = c * wanted - level), a quant clamped at the top needing s + o >= -d and
    one at the bottom s + o <= d."""
    top, bottom = level >= levels.hi, level <= levels.lo
    rises = np.where(judged & ~top, shifted, -np.inf).max(axis=1)  # max s over quants not clamped at the top
    falls = np.where(judged & ~bottom, shifted, np.inf).min(axis=1)  # min s over quants not clamped at the bottom
    if levels.symmetric:
        return np.maximum(np.maximum(rises, -falls), 0.0)
    return np.maximum((rises - falls) / 2, 0.0)


def _unchecked(weights, name: str, values: torch.Tensor, quantizer, blocks: int) -> TensorAudit:
    """A type the audit has no level layout for (IQ4_NL, IQ4_XS), or one ggml quantizes only with an
    importance matrix: identical or not, but a difference is not judged."""
    from tracer.ggml.strategies import gguf_rows  # numba, for ggml's kernels

    info = weights.names[name]
    kind = info.kind
    if quantizer.requires_imatrix(kind):
        return TensorAudit(info.name, kind, "unchecked", blocks,
                           why=f"ggml quantizes {kind.upper()} only with an importance matrix")
    order = gguf_rows(weights, name, values.shape[0])
    mine = quantizer.quantize(kind, _rows(values, order, 0, values.shape[0]))
    if np.array_equal(mine, np.asarray(weights.file.raw(info.name))):
        return TensorAudit(info.name, kind, "identical", blocks)
    return TensorAudit(info.name, kind, "unchecked", blocks,
                       why=f"differs; the audit has no level layout for {kind.upper()}")


def _tensor_verdict(name: str, tally: _Tally) -> TensorAudit:
    if not tally.differs:
        return TensorAudit(name, tally.kind, "identical", tally.blocks)
    if not tally.off:
        return TensorAudit(name, tally.kind, "legitimate", tally.blocks, error_ratio=tally.largest_ratio)
    ratio, block, steps = tally.worst
    return TensorAudit(name, tally.kind, "damaged", tally.blocks, off_blocks=tally.off, worst_block=block,
                       steps_off=None if np.isnan(steps) else steps, error_ratio=ratio)


def _file_verdict(tensors: list[TensorAudit]) -> str:
    damaged = sum(t.verdict == "damaged" for t in tensors)
    if damaged > OTHER_WEIGHTS * len(tensors):
        return "other_weights"
    if damaged:
        return "damaged"
    return "legitimate" if any(t.verdict in ("legitimate", "unchecked") for t in tensors) else "identical"
