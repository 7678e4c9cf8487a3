"""SGLang's dumper output (`sglang.srt.debug_utils.dumper`): one directory, one `.pt` file per dumped
tensor and rank, read as one trace per tensor-parallel rank (`tracer.traces.shards` merges them).

Each file is named by its tags (`step=0___rank=1___dump_index=7___name=...___layer_id=3.pt`) and holds
`{"value": tensor, "meta": {...}}`: the tags again, `dims` where the dump declared them (`t h(tp) d`:
the heads split over the tensor-parallel ranks; `h(tp,partial)`: partial sums) and the parallel
layout (`sglang_parallel_info`: `tp_rank`, `tp_size`). What becomes of it:

- the tensor's name is its `name` tag, prefixed with `layers.{layer_id}.` where the dump gave a layer
  and the name does not hold it; the non-intrusive dumper's module names lose their
  `non_intrusive__` prefix and `.output` suffix (`model.layers.3.self_attn.o_proj`: tracer's point
  names where the runtime's modules are named as transformers' are). Other names map through the
  aliases (`{"layers.{i}.attn_out": "model.layers.{i}.self_attn.o_proj"}`), and names that map to no
  point are listed, as for any dump;
- `dims` declare each tensor's split: an axis marked `tp` is a column split along that axis,
  `partial` a row-parallel partial sum, no `tp` a replicated tensor;
- the dump's first forward (its lowest `step`) is compared; the notes say which steps were left out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tracer.core.errors import TracerError
from tracer.files.torchfile import read_torch_file
from tracer.traces.trace import Trace, import_foreign

NON_INTRUSIVE = "non_intrusive__"
_DIM = re.compile(r"^(?P<name>[A-Za-z_]\w*)(?:\((?P<modifiers>[^)]*)\))?$")


def is_sglang_dump(path: Path) -> bool:
    """A directory of `.pt` files named by `key=value` tags joined with `___`."""
    return path.is_dir() and any("___" in p.name and "=" in p.name for p in path.glob("*.pt"))


@dataclass
class RankDump:
    """One tensor-parallel rank of the dump: its trace, rank and size, and the split its `dims`
    declare per point ("column:AXIS", "row" or "replicated", as `tracer.traces.shards` reads them)."""

    trace: Trace
    rank: int
    size: int | None
    declared: dict[str, str]
    origin: str


def split_of_dims(dims: str, where: str) -> str:
    """SGLang's `dims` text ("t h(tp) d", "t h(tp,partial)") as a shard layout ("column:1", "row")."""
    tokens = str(dims).split("#")[0].split()
    kinds = []
    for axis, token in enumerate(tokens):
        match = _DIM.match(token)
        if match is None:
            raise TracerError(f"{where}: dims {dims!r}: cannot read {token!r}")
        modifiers = {m.strip() for m in (match.group("modifiers") or "").split(",") if m.strip()}
        if "partial" in modifiers:
            kinds.append("row")
        elif "tp" in modifiers:
            kinds.append(f"column:{axis}")
    if len(kinds) > 1:
        raise TracerError(f"{where}: dims {dims!r} split more than one axis over the tensor-parallel ranks")
    return kinds[0] if kinds else "replicated"


def tensor_name(meta: dict) -> str:
    name = str(meta["name"])
    if name.startswith(NON_INTRUSIVE):
        name = name.removeprefix(NON_INTRUSIVE).removesuffix(".output")
    layer = meta.get("layer_id")
    if layer is not None and f"layers.{layer}." not in f"{name}.":
        name = f"layers.{layer}.{name}"
    return name


def sglang_ranks(directory: Path, aliases=None) -> list[RankDump]:
    """One Shard per tensor-parallel rank of the dump's first forward."""
    by_rank: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    declared: dict[int, dict[str, str]] = defaultdict(dict)
    sizes, steps = {}, set()
    records = [(path, *_read(path)) for path in sorted(directory.glob("*.pt"))]
    first = min((int(meta.get("step", 0)) for _, _, meta in records), default=0)
    for path, value, meta in records:
        steps.add(int(meta.get("step", 0)))
        if int(meta.get("step", 0)) != first or not isinstance(value, torch.Tensor):
            continue
        parallel = meta.get("sglang_parallel_info") or {}
        rank = int(parallel.get("tp_rank", meta.get("rank", 0)))
        sizes[rank] = parallel.get("tp_size")
        name = tensor_name(meta)
        by_rank[rank][name] = value
        if meta.get("dims") is not None:
            declared[rank][name] = split_of_dims(meta["dims"], str(path))
    if not by_rank:
        raise TracerError(f"{directory}: no tensor in the SGLang dump")
    left = sorted(steps - {first})
    shards = []
    for rank, tensors in sorted(by_rank.items()):
        trace = import_foreign(tensors, {"runtime": "sglang"}, directory, aliases)
        names = (trace.meta.sources or {})
        points = {point: declared[rank][source["name"]] for point, source in names.items()
                  if source["name"] in declared[rank]}
        notes = [f"SGLang dump: step {first} compared, steps {', '.join(map(str, left))} left out"] if left else []
        trace.meta = _with_notes(trace.meta, notes)
        size = sizes.get(rank)
        shards.append(RankDump(trace, rank, None if size is None else int(size), points, f"{directory} rank {rank}"))
    return shards


def _read(path: Path) -> tuple[object, dict]:
    """A dump file's value and its meta (older dumps hold the bare tensor; their tags are the name's),
    read without running the file's pickle (`tracer.files.torchfile`)."""
    loaded = read_torch_file(path)
    tags = dict(part.split("=", 1) for part in path.stem.split("___") if "=" in part)
    if isinstance(loaded, dict) and "value" in loaded:
        return loaded["value"], {**tags, **(loaded.get("meta") or {})}
    return loaded, tags


def _with_notes(meta, notes: list[str]):
    return replace(meta, notes=[*(meta.notes or []), *notes]) if notes else meta
