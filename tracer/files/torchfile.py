"""Reading a file `torch.save` wrote (a zip holding `data.pkl` and one file per storage) without
running its pickle: nothing in the file is executed.

Some runtimes dump only this format (SGLang's dumper, `tracer.traces.sglang_dump`). A pickle is a
program; tracer never runs one (docs/reliability.md). Its opcodes are walked instead
(`pickletools.genops` decodes them, nothing more) by a small machine that builds dicts, lists,
tuples, strings, numbers, booleans, None and tensors. The only names the stream may call are the
ones `torch.save` writes for a tensor (`torch._utils._rebuild_tensor_v2`, an empty
`collections.OrderedDict` for its hooks) and the storage types, read as dtypes; anything else, or an
opcode outside that vocabulary, refuses the file in one line. A tensor is read from its storage file
in the zip with plain reads of the bytes its view spans, never the whole storage: a dump of a slice
of a large buffer (a view `torch.save` writes with its whole storage) costs the slice, and a
compressed storage is decompressed in 1 MiB chunks, the bytes before the view dropped as they come
(`read_torch_refs` reads the structure first, each tensor when asked).
"""

from __future__ import annotations

import pickletools
import zipfile
import zlib
from pathlib import Path

import torch

from tracer.core.errors import TracerError, one_line

STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
ORDERED_DICT = ("collections", "OrderedDict")
_MARK = object()
CHUNK = 1 << 20  # bytes read at a time from a storage


class _Storage:
    """A storage the stream refers to by key: its dtype and element count, its bytes in the zip."""

    def __init__(self, dtype: torch.dtype, key: str, count: int):
        self.dtype, self.key, self.count = dtype, key, count


class TensorRef:
    """A tensor the file holds, not yet read: its storage and view (offset, size, stride), checked
    to lie inside the storage. `load()` reads the bytes the view spans."""

    def __init__(self, path: Path, entry: str, held: _Storage, offset: int, size: tuple, stride: tuple):
        self.path, self.entry, self.dtype = path, entry, held.dtype
        self.offset, self.shape, self.stride = offset, size, stride
        self.count = held.count
        if min((offset, *size, *stride), default=0) < 0:
            raise TracerError(f"its data.pkl rebuilds a tensor with a negative offset, size or stride {size}, {stride}")
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
        if last >= held.count:
            raise TracerError(f"its data.pkl views element {last} of storage {held.key}, which holds {held.count}")
        self.span = last + 1 - offset  # elements from the view's first to its last

    def load(self) -> torch.Tensor:
        """The tensor, reading only the bytes its view spans.

        Raises:
            TracerError: the storage is missing from the archive or shorter than the stream says.
        """
        size = torch.empty((), dtype=self.dtype).element_size()
        try:
            with zipfile.ZipFile(self.path) as archive:
                info = archive.getinfo(self.entry)
                if info.file_size < self.count * size:
                    raise TracerError(f"{self.path}: storage {self.entry} holds {info.file_size} bytes, "
                                      f"not {self.count * size}")
                with archive.open(info) as stream:
                    raw = _read_range(stream, self.offset * size, self.span * size)
        except KeyError:
            raise TracerError(f"{self.path}: storage {self.entry} is missing from the archive") from None
        except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise TracerError(f"{self.path}: cannot read storage {self.entry}: {one_line(exc)}") from None
        flat = torch.frombuffer(raw, dtype=self.dtype) if raw else torch.empty(0, dtype=self.dtype)
        return torch.as_strided(flat, self.shape, self.stride, 0).clone()


def _read_range(stream, start: int, length: int) -> bytearray:
    """`length` bytes from `start` of a zip entry; the bytes before are read and dropped in chunks (a
    compressed entry cannot seek), so memory holds one chunk and the range."""
    while start > 0:
        skipped = len(stream.read(min(start, CHUNK)))
        if not skipped:
            raise EOFError("the storage ends before the tensor's bytes")
        start -= skipped
    raw = bytearray(length)
    view, done = memoryview(raw), 0
    while done < length:
        got = stream.readinto(view[done:done + CHUNK])
        if not got:
            raise EOFError("the storage ends inside the tensor's bytes")
        done += got
    return raw


def read_torch_file(path: str | Path):
    """The object a `torch.save` file holds, built from dicts, lists, tuples, scalars and tensors only.

    Raises:
        TracerError: not a zip written by `torch.save`, or a stream that names anything but a tensor.
    """
    return resolve(read_torch_refs(path))


def resolve(value):
    """`value` with every TensorRef in it read."""
    if isinstance(value, TensorRef):
        return value.load()
    if isinstance(value, dict):
        return {key: resolve(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(item) for item in value)
    return value


def read_torch_refs(path: str | Path):
    """As `read_torch_file`, with each tensor a `TensorRef` to `load()` when wanted.

    Raises:
        TracerError: not a zip written by `torch.save`, or a stream that names anything but a tensor.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise TracerError(f"{path}: not a file torch.save writes (a zip archive): {one_line(exc)}") from None
    with archive:
        pickled = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
        if len(pickled) != 1:
            raise TracerError(f"{path}: not a file torch.save writes (no single data.pkl in the archive)")
        prefix = pickled[0][: -len("data.pkl")]
        try:
            data = archive.read(pickled[0])
        except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
            raise TracerError(f"{path}: cannot read its data.pkl: {one_line(exc)}") from None

    def tensor(held: _Storage, offset, size, stride) -> TensorRef:
        return TensorRef(path, f"{prefix}data/{held.key}", held, int(offset), tuple(map(int, size)),
                         tuple(map(int, stride)))

    try:
        return _walk(data, tensor)
    except TracerError as exc:
        raise TracerError(f"{path}: {exc}") from None
    # a malformed stream: an opcode applied to what it does not fit
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, RuntimeError, OverflowError) as exc:
        raise TracerError(f"{path}: cannot read its data.pkl: {one_line(exc)}") from None


def _walk(data: bytes, tensor):
    """Build the pickled object from `data`'s opcodes, never calling anything it names."""
    stack: list = []
    memo: dict[int, object] = {}

    def pop_mark() -> list:
        index = len(stack) - 1 - stack[::-1].index(_MARK)
        items = stack[index + 1:]
        del stack[index:]
        return items

    for opcode, arg, _ in pickletools.genops(data):
        name = opcode.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            return stack.pop()
        if name == "MARK":
            stack.append(_MARK)
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE"):
            stack.append({} if name == "EMPTY_DICT" else [] if name == "EMPTY_LIST" else ())
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "BININT", "BININT1", "BININT2", "LONG1",
                      "BINFLOAT", "BINBYTES", "SHORT_BINBYTES"):
            stack.append(arg)
        elif name in ("NEWTRUE", "NEWFALSE", "NONE"):
            stack.append({"NEWTRUE": True, "NEWFALSE": False, "NONE": None}[name])
        elif name in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            items = tuple(stack[-count:])
            del stack[-count:]
            stack.append(items)
        elif name == "LIST":
            stack.append(pop_mark())
        elif name == "DICT":
            items = pop_mark()
            stack.append(dict(zip(items[::2], items[1::2])))
        elif name == "APPEND":
            item = stack.pop()
            stack[-1].append(item)
        elif name == "APPENDS":
            items = pop_mark()
            stack[-1].extend(items)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            stack[-1][key] = value
        elif name == "SETITEMS":
            items = pop_mark()
            stack[-1].update(zip(items[::2], items[1::2]))
        elif name == "GLOBAL":
            module, _, attribute = arg.partition(" ")
            stack.append(_global(module, attribute))
        elif name == "STACK_GLOBAL":
            attribute, module = stack.pop(), stack.pop()
            stack.append(_global(module, attribute))
        elif name == "BINPERSID":
            stack.append(_persistent(stack.pop()))
        elif name == "REDUCE":
            arguments, function = stack.pop(), stack.pop()
            stack.append(_reduce(function, arguments, tensor))
        else:
            raise TracerError(f"its data.pkl uses the opcode {name}, which a tensor file does not need: refused")
    raise TracerError("its data.pkl ends without STOP")


def _global(module: str, attribute: str):
    if (module, attribute) in (REBUILD_TENSOR, ORDERED_DICT):
        return (module, attribute)
    if module == "torch" and attribute in STORAGES:
        return STORAGES[attribute]
    raise TracerError(f"its data.pkl names {module}.{attribute}, which is not a tensor: refused (tracer never "
                      "runs code from a file)")


def _persistent(pid) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
        raise TracerError(f"its data.pkl refers to {pid!r}, not a storage")
    _, dtype, key, _location, count = pid
    return _Storage(dtype, str(key), int(count))


def _reduce(function, arguments, tensor):
    if function == ORDERED_DICT and arguments == ():
        return {}
    if function == REBUILD_TENSOR and isinstance(arguments, tuple) and len(arguments) >= 4:
        held, offset, size, stride = arguments[:4]
        if not isinstance(held, _Storage):
            raise TracerError("its data.pkl rebuilds a tensor from something other than a storage")
        if not (isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and len(size) == len(stride)):
            raise TracerError(f"its data.pkl rebuilds a tensor of size {size!r} with strides {stride!r}")
        return tensor(held, offset, size, stride)
    raise TracerError(f"its data.pkl calls {function!r}: refused (only tensors are rebuilt)")
