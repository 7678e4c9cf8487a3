"""SGLang's dumper output (`sglang.srt.debug_utils.dumper`): one directory, one `.pt` file per dumped
tensor and rank, read as one trace per tensor-parallel rank (`tracer.traces.shards` merges them).

Each file is named by its tags (`step=0___rank=1___dump_index=7___name=...___layer_id=3.pt`) and holds
`{"value": tensor, "meta": {...}}`: the tags again, `dims` where the dump declared them and the
parallel layout (`sglang_parallel_info`: `tp_rank`, `tp_size`). What becomes of it:

- the non-intrusive dumper names a module's output `non_intrusive__{module}.output`, each tensor of
  a tuple output `.output.0`, `.output.1`, and its inputs `.inputs.N`. A module named as
  transformers' is its point (`model.layers.3.self_attn.o_proj`); SGLang's Llama modules that are not
  (`OUTPUTS`) are read by what SGLang's `models/llama.py` returns: an RMSNorm with a residual hands out
  (normed, residual), a decoder layer (mlp output, residual), so a tuple is taken at the element that
  is the point. Fused projections (`qkv_proj`, `gate_up_proj`) are split back into their parts on
  each rank, by the layout SGLang's parallel linears write (`FUSED`). Module inputs (the outputs of
  the modules before) are left out and counted in the notes;
- other names are the `name` tag, prefixed with `layers.{layer_id}.` where the dump gave a layer the
  name lacks, mapped through the aliases (`{"layers.{i}.attn_out": "model.layers.{i}.self_attn.o_proj"}`);
  names that map to no point are listed, as for any dump;
- `dims` declare a tensor's split (`split_of_dims`, SGLang's comparator grammar: `t h[tp]` a column
  split of h, `h[tp:partial]` partial sums, `1` an axis of size 1, `# tp:replicated`; the older
  `h(tp)`, `h(tp,partial)`, `h(tp:partial)` read the same). A split it cannot read refuses the dump;
- the dump's first forward (its lowest `step`) is compared; the notes say which steps were left out.
  Only its tensors are read, each for the bytes its view spans (`tracer.files.torchfile`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tracer.core.errors import TracerError
from tracer.files.torchfile import TensorRef, read_torch_refs
from tracer.model.points import (
    BLOCK_OUT,
    CONTEXT,
    DOWN_PROJ,
    FINAL_NORM,
    GATE_PROJ,
    GATE_UP_PROJ,
    INPUT_NORM,
    K_PROJ,
    K_ROPE,
    LOGITS,
    MLP_ACT,
    POST_ATTENTION_NORM,
    Q_PROJ,
    Q_ROPE,
    QKV_PROJ,
    RESID_MID,
    UP_PROJ,
    V_PROJ,
    layer_point,
    split_point,
)
from tracer.traces.trace import Trace, import_foreign

NON_INTRUSIVE = "non_intrusive__"
# `{module}.output`, `{module}.output.{element}` (a tuple's index, or a field the dumper's plugin took:
# `next_token_logits`), `{module}.inputs.{index or keyword}`; the root module's have no `{module}.`
_MODULE_VALUE = re.compile(r"^(?:(?P<module>.+)\.)?(?P<side>output|inputs)(?:\.(?P<element>[^.]+))?$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(\d+)(?:\.(.+))?$")
_DIM = re.compile(r"^(?P<name>[A-Za-z_]\w*|\([^)]*\))(?:\[(?P<bracket>[^\]]*)\]|\((?P<paren>[^)]*)\))?$")
SQUEEZE = "1"  # a `dims` axis of size 1
AXES = ("tp", "cp", "ep", "sp", "recompute_pseudo")  # SGLang's ParallelAxis
QUALIFIERS = ("partial", "natural", "zigzag", "sharded")
UNMERGED = ("pp_size", "attn_dp_size", "attn_cp_size")  # parallelisms whose ranks are not a tp split

# SGLang's Llama modules whose output is not named as the point (models/llama.py, SGLang 0.5):
# (module with {i} for the layer, element of a tuple output or None) -> point. {i-1}: the layer
# before, {last}: the dump's last layer.
OUTPUTS = {
    # from layer 1 on, RMSNorm(hidden, residual) adds first and hands out (normed, residual): the
    # residual is the stream entering the layer, the block before's output
    (layer_point("{i}", INPUT_NORM), "0"): layer_point("{i}", INPUT_NORM),
    (layer_point("{i}", INPUT_NORM), "1"): layer_point("{i-1}", BLOCK_OUT),
    (layer_point("{i}", "self_attn.rotary_emb"), "0"): layer_point("{i}", Q_ROPE),  # (q, k), (T, H/N·D) each
    (layer_point("{i}", "self_attn.rotary_emb"), "1"): layer_point("{i}", K_ROPE),
    (layer_point("{i}", "self_attn.attn"), None): layer_point("{i}", CONTEXT),  # RadixAttention: (T, H/N·D)
    (layer_point("{i}", POST_ATTENTION_NORM), "0"): layer_point("{i}", POST_ATTENTION_NORM),
    (layer_point("{i}", POST_ATTENTION_NORM), "1"): layer_point("{i}", RESID_MID),
    (layer_point("{i}", "mlp.act_fn"), None): layer_point("{i}", MLP_ACT),  # SiluAndMul
    # the decoder layer hands out (mlp output, residual); its own output is their sum, which the
    # next layer's input norm (or the final norm) hands out as its residual
    (layer_point("{i}", BLOCK_OUT), "0"): layer_point("{i}", DOWN_PROJ),
    (layer_point("{i}", BLOCK_OUT), "1"): layer_point("{i}", RESID_MID),
    (FINAL_NORM, "0"): FINAL_NORM,
    (FINAL_NORM, "1"): layer_point("{last}", BLOCK_OUT),
    ("model", None): FINAL_NORM,
    # LogitsProcessorOutput's next_token_logits: the last position's, gathered over the vocabulary
    ("logits_processor", "next_token_logits"): LOGITS,
    ("", "next_token_logits"): LOGITS,
}
# Fused column-parallel projections -> their parts, in the order each rank's output holds its
# slices: QKVParallelLinear [q, k, v] (widths H/N·D, KV/N·D, KV/N·D), MergedColumnParallelLinear
# [gate, up] (I/N each).
FUSED = {QKV_PROJ: (Q_PROJ, K_PROJ, V_PROJ), GATE_UP_PROJ: (GATE_PROJ, UP_PROJ)}


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


def split_of_dims(dims, where: str, shape: tuple[int, ...]) -> str:
    """SGLang's `dims` text for a tensor of `shape` as a shard layout: "t h[tp]" -> "column:1",
    "t h[tp:partial]" -> "row", no `tp` (or `# tp:replicated`) -> "replicated".

    Raises:
        TracerError: text the grammar does not hold, a split tracer does not merge (cp, ep, sp, a
            zigzag order), or axes that do not match the tensor's.
    """
    if not isinstance(dims, str):
        raise TracerError(f"{where}: dims is {dims!r}; expected text such as 't h[tp]'")
    axes_text, _, comment = dims.partition("#")
    tokens = axes_text.split()
    if len(tokens) != len(shape):
        raise TracerError(f"{where}: dims {dims!r} name {len(tokens)} axes; the tensor has {len(shape)} {tuple(shape)}")
    kinds = []
    for axis, token in enumerate(tokens):
        if token == SQUEEZE:
            if shape[axis] != 1:
                raise TracerError(f"{where}: dims {dims!r} say axis {axis} is 1; the tensor's is {shape[axis]}")
            continue
        for name, qualifiers in _modifiers(token, dims, where).items():
            if name != "tp" or qualifiers & {"zigzag"}:
                said = name + "".join(f":{q}" for q in sorted(qualifiers))
                raise TracerError(f"{where}: dims {dims!r} split {said}, which tracer does not merge (tp only)")
            kinds.append("row" if "partial" in qualifiers else f"column:{axis}")
    replicated = _replicated(comment, dims, where)
    if len(kinds) > 1 or (kinds and "tp" in replicated):
        raise TracerError(f"{where}: dims {dims!r} declare the tensor-parallel split more than once")
    return kinds[0] if kinds else "replicated"


def _modifiers(token: str, dims: str, where: str) -> dict[str, set[str]]:
    """`h[tp]`, `h[tp:partial]`, `(a*b)[tp]`, `s[cp:zigzag,tp]`, and the older `h(tp)`,
    `h(tp,partial)`, `h(tp:partial)` -> {axis: its qualifiers}."""
    match = _DIM.match(token)
    if match is None:
        raise TracerError(f"{where}: dims {dims!r}: cannot read {token!r}")
    bracket, paren = match.group("bracket"), match.group("paren")
    text = bracket if bracket is not None else paren or ""
    found: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, _, said = item.partition(":")
        qualifiers = {q.strip() for q in said.split("+") if q.strip()}
        if paren is not None and item in QUALIFIERS and found:  # the oldest form: h(tp,partial)
            axis, qualifiers = next(reversed(found)), {item}
        if axis not in AXES or not qualifiers <= set(QUALIFIERS):
            raise TracerError(f"{where}: dims {dims!r}: cannot read {item!r} in {token!r}")
        found.setdefault(axis, set()).update(qualifiers - {"sharded"})
    return found


def _replicated(comment: str, dims: str, where: str) -> set[str]:
    """The axes `# tp:replicated` declares; `dp:=group` (which data-parallel group) is read and
    needs nothing here."""
    axes = set()
    for token in comment.split():
        axis, _, what = token.partition(":")
        if what == "replicated" and axis in AXES:
            axes.add(axis)
        elif not (axis == "dp" and what.startswith("=")):
            raise TracerError(f"{where}: dims {dims!r}: cannot read {token!r} after '#'")
    return axes


@dataclass
class _Record:
    """One file of the first forward: its value (not read yet), name, rank and declared dims."""

    value: TensorRef
    name: str
    element: str | None  # the element of a module's tuple output, None for a lone tensor
    rank: int
    size: int | None
    dims: str | None
    path: Path


def sglang_ranks(directory: Path, aliases=None) -> list[RankDump]:
    """One RankDump per tensor-parallel rank of the dump's first forward."""
    metas = [(path, *_read(path)) for path in sorted(directory.glob("*.pt"))]
    if not metas:
        raise TracerError(f"{directory}: no tensor in the SGLang dump")
    first = min(_whole(meta, "step", path, 0) for path, _, meta in metas)
    left_steps = sorted({_whole(meta, "step", path, 0) for path, _, meta in metas} - {first})
    records, inputs, others = [], 0, []
    for path, value, meta in sorted(metas, key=lambda item: _whole(item[2], "dump_index", item[0], 0)):
        if _whole(meta, "step", path, 0) != first:
            continue
        name = _name(meta, path)
        match = _MODULE_VALUE.match(name.removeprefix(NON_INTRUSIVE)) if name.startswith(NON_INTRUSIVE) else None
        if match is not None and match.group("side") == "inputs":
            inputs += 1
            continue
        if not isinstance(value, TensorRef):
            others.append(name)
            continue
        parallel = meta.get("sglang_parallel_info") or {}
        if not isinstance(parallel, dict):
            raise TracerError(f"{path}: meta sglang_parallel_info is {parallel!r}; expected a mapping")
        for key in UNMERGED:  # ranks that hold other layers, other requests or other tokens
            if (_whole(parallel, key, path, 1) or 1) > 1:
                raise TracerError(f"{path}: sglang_parallel_info {key} is {parallel[key]}; tracer merges "
                                  "tensor-parallel ranks only")
        rank = _whole(parallel, "tp_rank", path, _whole(meta, "rank", path, 0))
        size = _whole(parallel, "tp_size", path, None)
        module, element = (match.group("module") or "", match.group("element")) if match else (name, None)
        if match is None and meta.get("layer_id") is not None:
            layer = _whole(meta, "layer_id", path, None)
            module = module if f"layers.{layer}." in f"{module}." else f"layers.{layer}.{module}"
        records.append(_Record(value, module, element, rank, size, meta.get("dims"), path))
    if not records:
        raise TracerError(f"{directory}: no tensor in the SGLang dump's step {first}")
    notes = []
    if left_steps:
        notes.append(f"SGLang dump: step {first} compared, steps {', '.join(map(str, left_steps))} left out")
    if inputs:
        notes.append(f"SGLang dump: {inputs} module inputs left out (each is the output of a module before it)")
    if others:
        notes.append(f"SGLang dump: {len(others)} values that are not tensors left out, e.g. {others[0]}")
    by_rank: dict[int, list[_Record]] = defaultdict(list)
    for record in records:
        by_rank[record.rank].append(record)
    last = max((int(m.group(1)) for r in records if (m := _LAYER_MODULE.match(r.name))), default=None)
    if last is not None and any(r.name == FINAL_NORM and r.element == "1" for r in records):
        notes.append(f"SGLang dump: model.norm's residual read as the output of layer {last}, the dump's last")
    return [_rank_dump(rank, by_rank[rank], last, notes, directory, aliases) for rank in sorted(by_rank)]


def _rank_dump(rank: int, records: list[_Record], last: int | None, notes: list[str], directory: Path,
               aliases) -> RankDump:
    read = [(record, _point_name(record.name, record.element, last), record.value.load()) for record in records]
    named = {name: tensor for _, name, tensor in read if name is not None}
    tensors: dict[str, torch.Tensor] = {}
    dims: dict[str, str] = {}
    again: dict[str, list[str]] = defaultdict(list)  # name -> the dump's other names for it

    def put(name: str, tensor: torch.Tensor, said: str) -> None:
        if name in tensors:
            again[name].append(said)
        else:
            tensors[name] = tensor

    for record, name, tensor in read:  # in the dump's order, a fused output's parts where it stood
        said = record.name if record.element is None else f"{record.name}.output.{record.element}"
        if name is None:
            for part, piece in _split_fused(record, tensor, named).items():
                put(part, piece, said)
            continue
        put(name, tensor, said)
        if record.dims is not None:
            dims[name] = split_of_dims(record.dims, str(record.path), tuple(tensor.shape))
    trace = import_foreign(tensors, {"runtime": "sglang"}, directory, aliases)
    sources = trace.meta.sources or {}
    declared = {point: dims[source["name"]] for point, source in sources.items() if source["name"] in dims}
    point_of = {source["name"]: point for point, source in sources.items()}
    duplicates = dict(trace.meta.duplicate_names or {})
    for name, others in again.items():
        duplicates.setdefault(point_of.get(name, name), []).extend(others)
    trace.meta = _with_notes(replace(trace.meta, duplicate_names=duplicates or None), notes)
    size = {record.size for record in records} - {None}
    return RankDump(trace, rank, size.pop() if len(size) == 1 else None, declared, f"{directory} rank {rank}")


def _point_name(module: str, element: str | None, last: int | None) -> str | None:
    """The name a module's output (or one element of its tuple) is read under; None for a fused
    projection, split afterwards."""
    match = _LAYER_MODULE.match(module)
    pattern = layer_point("{i}", match.group(2) or "") if match else module
    if match and pattern in (layer_point("{i}", fused) for fused in FUSED) and element is None:
        return None
    point = OUTPUTS.get((pattern, element))
    if point is None:
        return module if element is None else f"{module}.output.{element}"
    layer = int(match.group(1)) if match else None
    if "{i-1}" in point and not layer:
        return f"{module}.output.{element}"
    if "{last}" in point and last is None:
        return f"{module}.output.{element}"
    return point.replace("{i-1}", str((layer or 0) - 1)).replace("{i}", str(layer)).replace("{last}", str(last))


def _split_fused(record: _Record, tensor: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's fused projection output split into its parts along the last axis, by the widths its
    parallel linear lays out: gate and up halves; q's width the rank's rotary q (or attention
    output), k and v what is left, halved.

    Raises:
        TracerError: the dump holds nothing that gives the widths, or they do not add up.
    """
    layer, sub = split_point(record.name)
    width = tensor.shape[-1]
    if sub == GATE_UP_PROJ:
        if width % 2:
            raise TracerError(f"{record.path}: {record.name} is {width} wide; gate and up halves need an even width")
        widths = [width // 2] * 2
    else:
        tokens = tensor.numel() // width

        def width_of(point: str) -> int | None:  # per token, whatever the layout: (T, H/N·D), (T, H/N, D), ...
            return tensors[point].numel() // tokens if point in tensors else None

        q = next((w for p in (layer_point(layer, Q_ROPE), layer_point(layer, CONTEXT)) if (w := width_of(p))), None)
        if q is None:
            raise TracerError(f"{record.path}: cannot split {record.name}: no rotary_emb or attn output of "
                              "its layer gives q's width")
        if (width - q) % 2 or width <= q:
            raise TracerError(f"{record.path}: {record.name} is {width} wide; q is {q}, which leaves no k, v "
                              "of equal width")
        widths = [q, (width - q) // 2, (width - q) // 2]
        k = width_of(layer_point(layer, K_ROPE))
        if k is not None and k != widths[1]:
            raise TracerError(f"{record.path}: {record.name} splits into q, k, v of {widths}, but rotary k is "
                              f"{k} wide")
    parts = tensor.split(widths, dim=-1)  # (T, W) -> (T, w) per part
    return {layer_point(layer, part): piece.contiguous() for part, piece in zip(FUSED[sub], parts)}


def _read(path: Path) -> tuple[object, dict]:
    """A dump file's value (not read yet) and its meta (older dumps hold the bare tensor; their tags
    are the file name's), read without running the file's pickle (`tracer.files.torchfile`)."""
    loaded = read_torch_refs(path)
    tags = dict(part.split("=", 1) for part in path.stem.split("___") if "=" in part)
    if isinstance(loaded, dict) and "value" in loaded:
        meta = loaded.get("meta") or {}
        if not isinstance(meta, dict):
            raise TracerError(f"{path}: its meta is {type(meta).__name__}, not a mapping")
        return loaded["value"], {**tags, **meta}
    return loaded, tags


def _name(meta: dict, path: Path) -> str:
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise TracerError(f"{path}: meta name is {name!r}; expected the tensor's name")
    return name


def _whole(meta: dict, key: str, path: Path, default):
    """`meta[key]` as a whole number (a tag from the file name is text), `default` where absent."""
    value = meta.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
        raise TracerError(f"{path}: meta {key} is {value!r}; expected a whole number")
    return int(value)


def _with_notes(meta, notes: list[str]):
    return replace(meta, notes=[*(meta.notes or []), *notes]) if notes else meta
