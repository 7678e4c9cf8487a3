"""A GGUF file's tensors, read lazily: header parsed once, each tensor's bytes memory-mapped.

`gguf.GGUFReader` builds a numpy view for every metadata item, which for a 49,152-token
vocabulary takes tens of seconds; tracer needs a few numbers and the tensor table, so the header
is walked here with `struct` (GGUF v2/v3 layout, little-endian) and values it does not need are
skipped. Tensor bytes come from `numpy.memmap`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracer.core.errors import TracerError
from tracer.model.config import DEFAULT_ROPE_THETA, LlamaSpec
from tracer.model.families import expected_shapes
from tracer.model.points import EMBED, WEIGHT
from tracer.names.gguf import gguf_block_of, gguf_family, gguf_tensor_name

# GGUF metadata value types: id -> struct format (None: string, array handled apart).
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# ggml type id -> (name, block size, bytes per block) for the types tracer reads.
GGML_TYPES = {0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22),
              7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 10: ("q2_k", 256, 84), 11: ("q3_k", 256, 110),
              12: ("q4_k", 256, 144), 13: ("q5_k", 256, 176), 14: ("q6_k", 256, 210), 20: ("iq4_nl", 32, 18),
              23: ("iq4_xs", 256, 136), 30: ("bf16", 1, 2)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str
    shape: tuple[int, ...]  # row-major (numpy) order: ggml's ne reversed
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """Metadata (`fields`: key -> scalar or string; arrays of non-strings kept, string arrays skipped)
    and `tensors` (name -> TensorInfo) of a GGUF file; `raw(name)` gives (rows, bytes per row) uint8."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._data = handle.read(1 << 20)
            self._handle, self._pos = handle, 0
            self.fields, self.tensors = self._parse()
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    # header walking: self._data holds the file's first bytes, read further as needed
    def _need(self, size: int) -> bytes:
        while self._pos + size > len(self._data):
            more = self._handle.read(1 << 22)
            if not more:
                raise TracerError(f"truncated GGUF header: {self.path}")
            self._data += more
        chunk = self._data[self._pos:self._pos + size]
        self._pos += size
        return chunk

    def _unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self._need(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._need(self._unpack("Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("I"), self._unpack("Q")
            if item in SCALARS:
                size = struct.calcsize(SCALARS[item])
                return np.frombuffer(self._need(size * count), dtype="<" + SCALARS[item]).copy()
            if item == STRING:  # a vocabulary, merges: tracer needs none of it, so nothing is decoded
                self._skip_strings(count)
            else:
                for _ in range(count):
                    self._value(item)
            return None
        raise TracerError(f"unknown GGUF metadata type {kind} in {self.path}")

    def _skip_strings(self, count: int) -> None:
        """Past `count` strings (each a u64 length, then its bytes) without a call per string: a
        vocabulary and its merges are 100,000 of them (52 ms an open of SmolLM2's file before, 20 ms now)."""
        length = _U64.unpack_from
        pos = self._pos
        for _ in range(count):
            if pos + 8 > len(self._data):
                self._pos = pos
                self._need(8)  # reads on
                self._pos = pos
            pos += 8 + length(self._data, pos)[0]
        self._pos = pos
        self._need(0)  # the last string's bytes are there, or the header is truncated

    def _parse(self):
        if self._need(4) != b"GGUF":
            raise TracerError(f"not a GGUF file: {self.path}")
        version = self._unpack("I")
        if version not in (2, 3):
            raise TracerError(f"GGUF version {version} is not supported: {self.path}")
        n_tensors, n_fields = self._unpack("Q"), self._unpack("Q")
        fields = {}
        for _ in range(n_fields):
            key = self._string()
            fields[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
            type_id, offset = self._unpack("I"), self._unpack("Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        tensors = {}
        for name, dims, type_id, offset in infos:
            if type_id not in GGML_TYPES:
                raise TracerError(f"{self.path}: tensor {name} has ggml type {type_id}, which tracer cannot read")
            kind, block, size = GGML_TYPES[type_id]
            shape = tuple(int(d) for d in reversed(dims))
            nbytes = int(np.prod(shape)) // block * size
            tensors[name] = TensorInfo(name, kind, shape, start + offset, nbytes)
        return fields, tensors

    def raw(self, name: str) -> np.ndarray:
        """(rows, bytes per row) uint8 view of a tensor (rows: the product of all but the last dim)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return self._map[info.offset:info.offset + info.nbytes].reshape(rows, -1)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's resident memory (they stay in the page cache):
        a whole-file pass, such as the audit of an 8B file, holds one tensor at a time."""
        mapping = getattr(self._map, "_mmap", None)  # numpy.memmap's own mmap object
        info = self.tensors[name]
        page = mmap.PAGESIZE
        begin = info.offset // page * page
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED, begin, min(len(mapping), info.offset + info.nbytes) - begin)

    def number(self, key: str):
        value = self.fields.get(key)
        return value.item() if isinstance(value, np.generic) else value


def check_consistent(path: str | Path) -> None:
    """Refuse, in one line, a GGUF whose metadata and tensors disagree, before a converter spends
    minutes on it: a block count its tensors do not have, a tensor whose shape the hyperparameters
    contradict (named, with both shapes), tensors that run past the end of a truncated file."""
    try:
        gguf = GGUFFile(path)
    except TracerError as exc:
        if "which tracer cannot read" in str(exc):
            return  # a type tracer's reader lacks: the converter judges such a file itself
        raise
    size = Path(path).stat().st_size
    end = max((info.offset + info.nbytes for info in gguf.tensors.values()), default=0)
    if end > size:
        raise TracerError(f"{path} is truncated: its tensors end at byte {end:,}, the file has {size:,}")
    arch = gguf.fields.get("general.architecture")
    blocks = {block for name in gguf.tensors if (block := gguf_block_of(name)) is not None}
    count = gguf.number(f"{arch}.block_count")
    if count is not None and blocks and count != max(blocks) + 1:
        raise TracerError(f"{path}: the metadata says {arch}.block_count={count}, the file has tensors for "
                          f"{max(blocks) + 1} blocks")
    hyper = _hyperparameters(gguf, arch)
    family = gguf_family(arch)
    if hyper is None or family is None or hyper["Dv"] != hyper["D"]:
        return  # nothing to check against, or not a family tracer traces (the converter says so)
    embedding = gguf.tensors.get(gguf_tensor_name(EMBED + WEIGHT, family.name))
    spec = LlamaSpec(vocab_size=embedding.shape[0] if embedding else 1, hidden_size=hyper["E"],
                     intermediate_size=hyper["F"], num_hidden_layers=max(blocks, default=-1) + 1,
                     num_attention_heads=hyper["H"], num_key_value_heads=hyper["KV"], head_dim=hyper["D"],
                     rope_theta=DEFAULT_ROPE_THETA, rms_norm_eps=1e-6, max_position_embeddings=1, family=family.name)
    implied = {gguf_tensor_name(name, family.name): shape for name, shape in expected_shapes(spec).items()}
    for name, info in gguf.tensors.items():
        expected = implied.get(name)
        if expected is not None and expected != info.shape:
            raise TracerError(f"{path}: tensor {name} has shape {info.shape}, the metadata implies {expected}")


def _hyperparameters(gguf: GGUFFile, arch) -> dict | None:
    number = lambda key: gguf.number(f"{arch}.{key}")  # noqa: E731
    embed, heads, ff = number("embedding_length"), number("attention.head_count"), number("feed_forward_length")
    if not (isinstance(embed, int) and isinstance(heads, int) and isinstance(ff, int) and heads > 0):
        return None  # per-layer arrays (some architectures) or missing keys: nothing to check against
    kv = number("attention.head_count_kv")
    head = number("attention.key_length") or embed // heads
    return {"E": embed, "H": heads, "KV": kv if isinstance(kv, int) else heads, "D": head,
            "Dv": number("attention.value_length") or head, "F": ff}
