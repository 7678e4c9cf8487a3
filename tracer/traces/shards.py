"""A tensor-parallel run's traces, one per rank, merged into the one trace of the whole model.

A runtime that splits the model over N GPUs (vLLM, SGLang, Megatron-style tensor parallelism) dumps
one file per rank, and each rank holds only its part of a point: a column-parallel projection
(q/k/v, gate/up) its slice of the output features, an attention its slice of the heads, a
row-parallel projection (o_proj, down_proj) a partial sum that an all-reduce would add up. How a
point is split is declared, never inferred from the numbers:

- **column**: concatenated in rank order along the split axis: the last axis of a `(T, X)` point,
  the heads axis of a per-head point (`(H, T, D)`, `(T, H, D)`, a cache's `(KV, S, D)`), or an axis
  the dump names (SGLang's `dims` such as `t h(tp) d`, or `column:AXIS`);
- **row**: partial sums, added (in f64) (SGLang's `partial` modifier);
- **replicated**: every rank holds the whole tensor; rank 0's is taken, and ranks that differ are
  said with their figure (a row-parallel output whose all-reduce is missing reads so).

The default is what vLLM's and SGLang's modules hand out: the column-parallel projections and the
attention's per-head points split, everything else replicated (`RowParallelLinear` all-reduces its
output; the vocabulary-parallel embedding and lm_head gather theirs). A dump's own declarations
(safetensors metadata `tp_layout`, SGLang's `dims`) and the user's (`--shard-layout FILE`) replace
it point by point. Ranks are put in order by their `tp_rank` (metadata, or SGLang's parallel info);
files without one are taken in the order given, and the notes say so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tracer.core.errors import TracerError, one_line
from tracer.model.points import (
    CACHE_K,
    CACHE_V,
    CONTEXT,
    GATE_PROJ,
    K_NORM,
    K_PROJ,
    K_ROPE,
    MLP_ACT,
    PROBS,
    Q_NORM,
    Q_PROJ,
    Q_ROPE,
    SCORES,
    UP_PROJ,
    V_PROJ,
    layout_of,
    split_point,
)
from tracer.traces.sglang_dump import is_sglang_dump, sglang_ranks
from tracer.traces.trace import Trace, TraceMeta

COLUMN, ROW, REPLICATED = "column", "row", "replicated"
LAYOUTS = (COLUMN, ROW, REPLICATED)
# vLLM's / SGLang's module outputs: the per-rank slices of the column-parallel layers and of attention.
COLUMN_SPLIT = frozenset({Q_PROJ, K_PROJ, V_PROJ, Q_NORM, K_NORM, Q_ROPE, K_ROPE, SCORES, PROBS, CONTEXT, CACHE_K,
                          CACHE_V, GATE_PROJ, UP_PROJ, MLP_ACT})


@dataclass(frozen=True)
class Split:
    """How one point is split over the ranks: `kind` one of LAYOUTS; `axis` the column split's axis in
    the dump's own tensor (None: the point's natural one, `split_axis`)."""

    kind: str
    axis: int | None = None

    def __str__(self) -> str:
        return self.kind if self.axis is None else f"{self.kind}:{self.axis}"


@dataclass
class Shard:
    """One rank's trace and what its file declares: `rank` (None: not said) and point -> Split."""

    trace: Trace
    rank: int | None = None
    size: int | None = None  # the tensor-parallel size it declares
    declared: dict[str, Split] = field(default_factory=dict)
    origin: str = ""  # the file or directory, for messages


def parse_split(text: str, where: str) -> Split:
    """"column", "column:1", "row" or "replicated" (what `tp_layout` and `--shard-layout` values say)."""
    kind, _, axis = str(text).partition(":")
    if kind not in LAYOUTS or (axis and (kind != COLUMN or not re.fullmatch(r"-?\d+", axis))):
        raise TracerError(f"{where}: shard layout {text!r}; expected column, column:AXIS, row or replicated")
    return Split(kind, int(axis) if axis else None)


def read_layouts(value, where: str) -> dict[str, Split]:
    """A layout table: {point or sub-point ("self_attn.o_proj") or pattern with {i}: layout}, given as
    a dict, a JSON text (a dump's metadata) or a JSON file path (`--shard-layout`)."""
    if value is None:
        return {}
    if isinstance(value, (str, Path)) and not str(value).lstrip().startswith("{"):
        path = Path(value)
        try:
            value, where = path.read_text(), str(path)
        except OSError as exc:
            raise TracerError(f"cannot read shard layout file {path}: {one_line(exc)}") from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise TracerError(f"{where}: shard layouts are not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise TracerError(f"{where}: shard layouts must be a JSON object {{point: column | row | replicated}}")
    return {str(key): parse_split(text, f"{where}, {key}") for key, text in value.items()}


def declared_split(point: str, table: dict[str, Split]) -> Split | None:
    """The table's entry for `point`: by its full name, a `{i}` pattern, or its sub-point."""
    if point in table:
        return table[point]
    layer, sub = split_point(point)
    for key, split in table.items():
        if "{i}" in key and layer is not None and key.replace("{i}", str(layer)) == point:
            return split
    return table.get(sub) if layer is not None and sub else None


def default_split(point: str) -> Split:
    layer, sub = split_point(point)
    return Split(COLUMN if layer is not None and sub in COLUMN_SPLIT else REPLICATED)


def split_axis(point: str, tensor: torch.Tensor, tokens: int | None, hint: str | None) -> int:
    """The axis a column-parallel point is split along in the dump's `tensor`: the last axis of a
    `(T, X)` point, the heads axis of a per-head one; a leading batch axis of 1 is skipped. A per-head
    tensor whose shape cannot tell heads from tokens (H/N == T) is read in its runtime's layout
    (`hint`: THD or HTD) or, without one, in tracer's (heads first)."""
    kind, ndim = layout_of(point), tensor.ndim
    if kind == "rows" or ndim <= 2:
        return ndim - 1
    if kind == "merged":  # (T, H/N·D) with a batch axis, or (T, H/N, D) with or without one
        batched_rows = ndim == 3 and tensor.shape[0] == 1 and tokens != 1
        return ndim - 1 if batched_rows else ndim - 2
    lead = ndim - 3  # (H/N, T, ·) or (T, H/N, D) after any batch axis
    first, second = tensor.shape[lead] == tokens, tensor.shape[lead + 1] == tokens
    if second and not first:
        return lead
    if first and not second:
        return lead + 1
    return lead + (1 if hint == "THD" else 0)


def order(shards: list[Shard]) -> tuple[list[Shard], list[str]]:
    """The shards in rank order, and what the notes say about it."""
    ranks = [shard.rank for shard in shards]
    if any(shard.size not in (None, len(shards)) for shard in shards):
        said = ", ".join(f"{s.origin}: {s.size}" for s in shards if s.size is not None)
        raise TracerError(f"{len(shards)} shards were given, but they declare tensor-parallel sizes {said}")
    if all(rank is None for rank in ranks):
        return shards, [f"{len(shards)} shards taken in the order given (none declares its tp_rank)"]
    if any(rank is None for rank in ranks) or sorted(ranks) != list(range(len(shards))):
        said = ", ".join(f"{s.origin}: {'none' if s.rank is None else s.rank}" for s in shards)
        raise TracerError(f"the shards' tp_rank must be 0..{len(shards) - 1}, one each; they say {said}")
    return sorted(shards, key=lambda shard: shard.rank), []


def merge_shards(shards: list[Shard], layouts: dict[str, Split] | None = None) -> Trace:
    """One trace from the ranks' traces: each point merged by its declared split (the user's
    `layouts`, else the dumps' own, else `default_split`)."""
    if len(shards) < 2:
        raise TracerError("a sharded trace needs two ranks or more")
    shards, notes = order(shards)
    if any(shard.trace.steps for shard in shards):
        raise TracerError("decoded traces (with steps) are not merged from shards yet: give each step's prefill")
    first = shards[0].trace
    tokens = first.tokens
    for shard in shards[1:]:
        if shard.trace.tokens is not None and tokens is not None and list(shard.trace.tokens) != list(tokens):
            raise TracerError(f"the shards ran different token ids: {shards[0].origin} {list(tokens)}, "
                              f"{shard.origin} {list(shard.trace.tokens)}")
        tokens = tokens if tokens is not None else shard.trace.tokens
    points = [p for p in first.tensors if all(p in shard.trace.tensors for shard in shards)]
    partial = sorted({p for shard in shards for p in shard.trace.tensors} - set(points))
    if partial:
        notes.append(f"{len(partial)} points held by some ranks only were left out, e.g. {partial[0]}")
    user = layouts or {}
    merged, used, unequal = {}, {}, []
    for point in points:
        split = declared_split(point, user) or _declared_by_dumps(point, shards) or default_split(point)
        parts = [shard.trace.tensors[point] for shard in shards]
        merged[point] = _merge(point, parts, split, len(tokens) if tokens else None,
                               (first.meta.sources or {}).get(point, {}).get("layout"), unequal)
        used.setdefault(str(split), []).append(point)
    unused = sorted(key for key in user if not any(declared_split(p, {key: user[key]}) for p in points))
    if unused:
        notes.append(f"shard layouts that name no point of the shards: {', '.join(unused)}")
    notes.append(f"{len(shards)} tensor-parallel shards merged: " + "; ".join(
        f"{kind} {len(ps)} points (e.g. {ps[0]})" for kind, ps in used.items()))
    notes += unequal
    return Trace(merged, _merged_meta(shards, tokens, notes))


def _declared_by_dumps(point: str, shards: list[Shard]) -> Split | None:
    declared = {str(s): s for shard in shards if (s := declared_split(point, shard.declared)) is not None}
    if len(declared) > 1:
        raise TracerError(f"the shards declare {point} split differently: {', '.join(sorted(declared))}")
    return next(iter(declared.values()), None)


def _merge(point: str, parts: list[torch.Tensor], split: Split, tokens: int | None, hint: str | None,
           unequal: list[str]) -> torch.Tensor:
    shapes = {tuple(part.shape) for part in parts}
    if split.kind == COLUMN:
        axis = split.axis if split.axis is not None else split_axis(point, parts[0], tokens, hint)
        if not -parts[0].ndim <= axis < parts[0].ndim:
            raise TracerError(f"{point}: column split along axis {axis} of a {parts[0].ndim}-axis tensor")
        others = {shape[:axis % parts[0].ndim] + shape[axis % parts[0].ndim + 1:] for shape in shapes}
        if len(others) > 1:
            raise TracerError(f"{point}: the ranks' slices {sorted(shapes)} differ off the split axis {axis}")
        return torch.cat(parts, dim=axis)
    if len(shapes) > 1:
        raise TracerError(f"{point}: declared {split.kind} but the ranks hold shapes {sorted(shapes)}")
    if split.kind == ROW:
        total = torch.stack([part.double() for part in parts]).sum(dim=0)  # (N, ...) -> (...)
        return total.to(torch.promote_types(parts[0].dtype, torch.float32))
    base = parts[0].double()
    scale = float(base.norm()) or 1.0
    worst = max(float((part.double() - base).norm()) / scale for part in parts[1:])
    if worst > 0:
        unequal.append(f"{point}: declared replicated, but the ranks differ from rank 0 by rel_l2 up to {worst:.3g} "
                       "(rank 0's taken; a row-parallel output not all-reduced reads so)")
    return parts[0]


def _merged_meta(shards: list[Shard], tokens, notes: list[str]) -> TraceMeta:
    meta = shards[0].trace.meta.to_dict()
    meta.update(tokens=list(tokens) if tokens is not None else None,
                file=", ".join(shard.origin for shard in shards), notes=[*(meta.get("notes") or []), *notes])
    return TraceMeta.from_dict(meta)


def load_shards(sources, aliases=None, layouts=None) -> Trace:
    """The merged trace of a tensor-parallel run: `sources` one safetensors file per rank (their
    metadata may say `tp_rank`, `tp_size`, `tp_layout`), or one SGLang dumper directory holding every
    rank (`tracer.traces.sglang_dump`). `layouts`: the user's table (`read_layouts`)."""
    paths = [Path(source) for source in sources]
    if len(paths) == 1 and is_sglang_dump(paths[0]):
        shards = [Shard(dump.trace, dump.rank, dump.size, {point: parse_split(text, dump.origin)
                                                           for point, text in dump.declared.items()}, dump.origin)
                  for dump in sglang_ranks(paths[0], aliases)]
        return merge_shards(shards, read_layouts(layouts, "--shard-layout"))
    directories = [str(path) for path in paths if path.is_dir()]
    if directories:
        raise TracerError(f"{directories[0]} is a directory: shards are one trace file per rank, or one SGLang "
                          "dumper directory alone")
    return merge_shards([file_shard(path, aliases) for path in paths], read_layouts(layouts, "--shard-layout"))


def file_shard(path: Path, aliases=None) -> Shard:
    """One rank's safetensors trace; its metadata keys `tp_rank`, `tp_size`, `tp_layout` read and
    taken out of the trace's `extra`."""
    trace = Trace.load(path, aliases)
    extra = dict(trace.meta.extra or {})
    rank, size = (_whole(extra.pop(key, None), key, path) for key in ("tp_rank", "tp_size"))
    declared = read_layouts(extra.pop("tp_layout", None), f"{path}: metadata tp_layout")
    trace.meta = replace(trace.meta, extra=extra)
    return Shard(trace, rank, size, declared, str(path))


def _whole(text, key: str, where) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = -1
    if value < 0:
        raise TracerError(f"{where}: metadata {key} is {text!r}; expected a whole number")
    return value
