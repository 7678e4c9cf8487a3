"""Traces too large for memory: each point written to disk as it is recorded, read back on demand.

A 2048-token SmolLM2 trace holds ~2.8 GB even with attention matrices cut to their last rows
(`tracer.traces.trace.ATTENTION_ROWS`). `DiskRecorder` writes the reference's points, each to its own
safetensors file the moment the forward produces it, and `SpilledTensors` is a read-only mapping
that loads one point when asked, so a `Trace` built on it makes the diff engine stream: peak
memory is the model and one forward's activations, not the traces. The other runs are compared
with it point by point as they come (`tracer.comparison.diff.ErrorRecorder`): the f64 noise run and the
teacher-forced local run keep nothing, the candidate only the few points the comparison reads again.

Each point file is a safetensors file whose data starts on a 4096-byte boundary, written and read
with O_DIRECT where the system allows it: filling the page cache costs kernel time per byte that a
direct write does not (docs/memory.md has the figures). The reads, which then come from disk, are
made one point ahead in a thread. Where O_DIRECT is refused (no such flag, a file system or
device without it) the files are written and read through the page cache, the same bytes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch

from tracer.core.errors import TracerError
from tracer.files.tensorfile import DTYPES
from tracer.traces.trace import kept

# Past this many tokens a run spills its traces: SmolLM2's trace is ~1.5 MB per token in f32.
SPILL_TOKENS = 256

# O_DIRECT's unit: buffers, file offsets and lengths are multiples of it (4096 covers the block sizes
# of the file systems it is used on).
BLOCK = 4096
# A point is written through a reused buffer of this size: the copy into it is cheap, and a
# buffer the size of the logits (400 MB at 2048 tokens) would be resident for the whole run.
CHUNK = 8 << 20
SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}
T = TypeVar("T")


def _file_name(index: int, point: str) -> str:
    return f"{index:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', point)}.safetensors"


class DiskRecorder:
    """The `record(name, tensor)` callable that writes each point to `folder` at once (batch dropped)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, Path] = {}
        self._buffer: torch.Tensor | None = None

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        path = self.folder / _file_name(len(self.files), name)
        if self._buffer is None:
            self._buffer = _aligned(CHUNK)
        write_point(path, kept(name, tensor), self._buffer)
        self.files[name] = path

    @property
    def tensors(self) -> SpilledTensors:
        return SpilledTensors(self.files)


class SpilledTensors(Mapping):
    """point -> tensor, read from disk on each access; iteration keeps recording order.

    `names`: every point the run recorded, in order, where some were compared as they came and
    not written (`tracer.comparison.diff.ErrorRecorder` with a store); those are listed but not readable.

    Runs read a spilled trace in recording order (the local run, the candidate's comparison), so
    each access starts reading the next point in a background thread while the caller computes:
    at most one point more is resident.
    """

    def __init__(self, files: dict[str, Path], names: list[str] | None = None):
        self.files = dict(files)
        self.names = list(files) if names is None else list(dict.fromkeys(names))
        self._names = set(self.names)
        order = list(self.files)
        self._next = dict(zip(order, order[1:]))
        self._ahead: tuple[str, Future] | None = None

    def __getitem__(self, point: str) -> torch.Tensor:
        if point not in self.files and point in self._names:
            raise KeyError(f"{point} was compared as it was recorded and not kept")
        path = self.files[point]
        ahead, self._ahead = self._ahead, None
        # A plain read, not a memory map: the point leaves resident memory with its last reference.
        tensor = ahead[1].result() if ahead is not None and ahead[0] == point else read_point(path)
        following = self._next.get(point)
        if following is not None:
            self._ahead = following, _reader().submit(read_point, self.files[following])
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, point) -> bool:
        return point in self._names


@cache
def _reader() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-spill")


def _aligned(size: int) -> torch.Tensor:
    """`size` bytes whose address is a multiple of BLOCK (a view into a slightly larger tensor)."""
    raw = torch.empty(size + BLOCK, dtype=torch.uint8)
    start = -raw.data_ptr() % BLOCK
    return raw[start:start + size]


def _round_up(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    """(file descriptor, direct): with O_DIRECT if asked and the system and file system take it."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return os.open(path, flags | flag, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _buffered_if_refused(io: Callable[[bool], T]) -> T:
    """`io(direct=True)`, or `io(direct=False)` where a direct read or write is refused after the
    open succeeded (a device whose blocks are larger than BLOCK)."""
    try:
        return io(True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return io(False)


def write_point(path: Path, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
    """`tensor` as a one-tensor safetensors file ("value"), its data at a BLOCK boundary (the header
    padded with spaces, which the format allows), written through `buffer` (BLOCK-aligned)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    header = json.dumps({"value": {"dtype": SAFETENSORS_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                   "data_offsets": [0, data.numel()]}}).encode()
    header = header.ljust(_round_up(8 + len(header)) - 8)
    head = len(header).to_bytes(8, "little") + header
    _buffered_if_refused(lambda direct: _write(path, head, data, buffer, direct))


def _write(path: Path, head: bytes, data: torch.Tensor, buffer: torch.Tensor, direct: bool) -> None:
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        view = memoryview(buffer.numpy())
        chunk = len(view)
        buffer[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        filled, offset = len(head), 0
        while offset < data.numel() or filled:
            take = min(chunk - filled, data.numel() - offset)
            buffer[filled:filled + take] = data[offset:offset + take]
            filled, offset = filled + take, offset + take
            if filled == chunk or offset == data.numel():
                length = _round_up(filled) if direct else filled  # O_DIRECT writes whole blocks
                written = 0
                while written < length:
                    written += os.write(fd, view[written:length])
                filled = 0
        if direct:
            os.ftruncate(fd, len(head) + data.numel())  # the last block's padding cut off
    finally:
        os.close(fd)


def read_point(path: Path) -> torch.Tensor:
    """The tensor a `write_point` file holds, read into ordinary memory."""
    return _buffered_if_refused(lambda direct: _read(path, direct))


def _read(path: Path, direct: bool) -> torch.Tensor:
    fd, direct = _open(path, os.O_RDONLY, direct)
    try:
        first = _aligned(BLOCK)
        _read_into(fd, first, 0)
        size = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if (8 + size) % BLOCK or 8 + size > BLOCK * 64:
            raise TracerError(f"{path} is not a point file this tracer wrote")
        header = first if 8 + size <= BLOCK else _aligned(8 + size)
        if header is not first:
            _read_into(fd, header, 0)
        entry = json.loads(header[8:8 + size].numpy().tobytes())["value"]
        begin, end = entry["data_offsets"]
        length = end - begin
        data = _aligned(_round_up(length) if direct else length)
        if _read_into(fd, data, 8 + size + begin) < length:
            raise TracerError(f"{path} ends inside its tensor")
    finally:
        os.close(fd)
    return data[:length].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _read_into(fd: int, buffer: torch.Tensor, offset: int) -> int:
    """Fill `buffer` from `offset` on, or up to the end of the file; the bytes read."""
    view, done = memoryview(buffer.numpy()), 0
    with open(fd, "rb", buffering=0, closefd=False) as file:  # unbuffered: reads land in `buffer` itself
        file.seek(offset)
        while done < len(view):
            got = file.readinto(view[done:])
            if not got:
                break
            done += got
    return done


@contextmanager
def spill_folder(spills: bool) -> Iterator[Callable[[str], DiskRecorder | None]]:
    """`sink(side)` -> a recorder for that side: None (in memory) unless the run `spills` (a long
    prompt, a streamed model), else a `DiskRecorder` in a temporary folder that is removed when the
    block ends."""
    if not spills:
        yield lambda side: None
        return
    with tempfile.TemporaryDirectory(prefix="tracer-spill-") as folder:
        yield lambda side: DiskRecorder(Path(folder) / side)
