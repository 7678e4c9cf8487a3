"""Layout normalization: another runtime's tensor brought to the point's shape before metrics.

tracer's points have one shape each (docs/design.md, "Points"; batch dropped): [T, C] for hidden
states, [T, H·D] for projections and the merged context, [H, T, D] for q/k after RoPE, [H, T, T]
for scores and probabilities. A dump from candle, llama.cpp, TransformerLens or MLX holds the
same values laid out its own way; `align` reconciles each shared point against the side in
tracer's layout (a tracer trace, or a file written with our names) and says what it did:

- a leading batch dimension of 1 is dropped;
- per-head tensors [T, H, D], [H, T, D] and [T, H·D] are converted; when T == H the shape cannot
  tell, and the runtime's own layout (from its alias) is used and named in the notes;
- rows: a side that holds only the last position(s) (candle's logits, llama.cpp's last layer
  from `ffn_inp` on) is compared on those rows of the other side;
- q/k in GGUF's interleaved order (llama.cpp's converter permutes the q/k weight rows so that
  each RoPE pair is adjacent: row 2j is HF's row j, row 2j+1 is HF's row j + D/2) are put back
  in HF's half-split order;
- llama.cpp's attention probabilities over a padded KV cache lose their all-zero key columns;
- dtypes may differ: the metrics up-cast both sides to f64 (said in the notes).

A shape that none of these reconcile is a TracerError naming the point and both shapes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

from tracer.core.errors import TracerError
from tracer.model.points import Q_ROPE, gguf_permuted, is_integer_point, layout_of, split_point
from tracer.traces.trace import Trace

LAYOUT_NAMES = {"THD": "[T, H, D]", "HTD": "[H, T, D]"}
# The most axes a point of each layout (tracer.model.points) may have in a dump, batch included.
MAX_NDIM = {"rows": 2, "merged": 3, "heads": 3, "attention": 3}


def sub_point(point: str) -> str:
    """`self_attn.q_rope` for `model.layers.3.self_attn.q_rope`, "block" for a block output; the
    point itself outside the blocks (how the notes name kinds of points)."""
    layer, sub = split_point(point)
    return point if layer is None else sub or "block"


# --- single-tensor conversions ---------------------------------------------------------------


def drop_batch(x: torch.Tensor, max_ndim: int) -> tuple[torch.Tensor, bool]:
    """Leading dimensions of 1 beyond what the point's layouts can have."""
    dropped = False
    while x.ndim > max_ndim and x.shape[0] == 1:
        x, dropped = x[0], True
    return x, dropped


def from_interleaved(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """GGUF q/k order -> HF half-split order along the last axis, per head of `head_dim`.

    GGUF row 2j holds HF row j and row 2j+1 holds HF row j + D/2 (llama.cpp's convert permutes
    the q/k weights this way), so HF's first half is the even entries and its second half the odd.
    """
    *lead, width = x.shape
    heads = x.reshape(*lead, width // head_dim, head_dim)  # (..., heads, D)
    unpermuted = torch.cat((heads[..., 0::2], heads[..., 1::2]), dim=-1)  # (..., heads, D)
    return unpermuted.reshape(*lead, width)


def to_interleaved(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF half-split order -> GGUF interleaved order (the inverse of `from_interleaved`)."""
    *lead, width = x.shape
    heads = x.reshape(*lead, width // head_dim, 2, head_dim // 2)  # (..., heads, 2, D/2)
    return heads.transpose(-1, -2).reshape(*lead, width)  # (..., heads, D/2, 2) -> (..., width)


def merge_heads(x: torch.Tensor, width: int, hint: str | None) -> tuple[torch.Tensor, str | None, bool]:
    """[T, heads, D] or [heads, T, D] -> [T, heads·D] (`width` = heads·D). Returns the layout read
    and whether the shape alone was ambiguous (T == heads)."""
    if x.ndim != 3:
        return x, None, False
    a, b, d = x.shape
    fits = [layout for layout, heads in (("THD", b), ("HTD", a)) if heads * d == width]
    if not fits:
        return x, None, False
    layout = fits[0] if len(fits) == 1 else (hint or "THD")
    tokens_first = x if layout == "THD" else x.transpose(0, 1)  # (T, heads, D)
    return tokens_first.reshape(tokens_first.shape[0], width), layout, len(fits) > 1


def heads_first(x: torch.Tensor, shape: tuple[int, ...], hint: str | None) -> tuple[torch.Tensor, str | None, bool]:
    """[T, heads, D] or [T, heads·D] -> [heads, T, D] like `shape`. Returns as `merge_heads`."""
    heads, _, dim = shape
    if x.ndim == 2 and x.shape[1] == heads * dim:
        return x.reshape(x.shape[0], heads, dim).transpose(0, 1), "T(HD)", False  # (heads, T, D)
    if x.ndim != 3 or x.shape[2] != dim:
        return x, None, False
    fits = [layout for layout, axis in (("HTD", 0), ("THD", 1)) if x.shape[axis] == heads]
    if not fits:
        return x, None, False
    layout = fits[0] if len(fits) == 1 else (hint or "HTD")
    return (x if layout == "HTD" else x.transpose(0, 1)), layout, len(fits) > 1


def trim_padded_keys(x: torch.Tensor, keys: int) -> tuple[torch.Tensor, bool]:
    """[H, T, n_kv] probabilities over a padded KV cache -> [H, T, keys] when the rest is exactly 0."""
    if x.ndim == 3 and x.shape[2] > keys and not x[..., keys:].any():
        return x[..., :keys], True
    return x, False


# --- one point ---------------------------------------------------------------------------------


class Fixes:
    """What was done to which points, collected so the notes say it once per kind."""

    def __init__(self):
        self.points: dict[str, list[str]] = defaultdict(list)

    def add(self, what: str, point: str) -> None:
        self.points[what].append(point)


def reconcile(point: str, canon: torch.Tensor, other: torch.Tensor, source: dict | None, head_dim: int | None,
              fixes: Fixes, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`other` (a foreign layout) brought to `canon`'s shape; `canon` cut to `other`'s rows if fewer.

    Raises:
        TracerError: the shapes cannot be reconciled (naming the point, both shapes, the source name).
    """
    original = tuple(other.shape)
    source = source or {}
    kind = layout_of(point)
    hint = source.get("layout")
    other, dropped = drop_batch(other, MAX_NDIM[kind])
    if dropped:
        fixes.add(f"batch:{side}", point)
    layout, ambiguous = None, False
    if kind == "merged":
        if other.ndim == 3:
            head_dim = other.shape[2]
        other, layout, ambiguous = merge_heads(other, canon.shape[-1], hint)
    elif kind == "heads" and canon.ndim == 3:
        head_dim = canon.shape[2]
        other, layout, ambiguous = heads_first(other, tuple(canon.shape), hint)
    elif kind == "attention" and canon.ndim == 3:
        other, trimmed = trim_padded_keys(other, canon.shape[2])
        if trimmed:
            fixes.add(f"padded:{side}", point)
    if ambiguous:
        fixes.add(f"ambiguous:{layout}:{side}", point)
    # q and k, whose rows GGUF's converter permutes (the RoPE pairs made adjacent)
    if gguf_permuted(point) and source.get("qk_order") == "interleaved":
        if head_dim is None:
            raise TracerError(f"{point}: cannot un-permute GGUF-ordered q/k without the head size; record "
                              f"{Q_ROPE} in the other trace or write head_dim in the dump's metadata")
        other = from_interleaved(other, head_dim)
        fixes.add(f"interleaved:{side}", point)
    if kind in ("rows", "merged"):
        if other.ndim == canon.ndim - 1 and tuple(other.shape) == tuple(canon.shape[1:]):
            other = other[None]  # one position without its row axis: (1, ...)
        if (other.ndim == canon.ndim and other.ndim >= 2 and other.shape[1:] == canon.shape[1:]
                and 0 < other.shape[0] < canon.shape[0]):
            canon = canon[-other.shape[0]:]
            fixes.add(f"rows:{other.shape[0]}:{side}", point)
    if tuple(other.shape) != tuple(canon.shape):
        name = source.get("name", point)
        origin = f" (from {name!r})" if name != point else ""
        raise TracerError(f"shape mismatch at {point}: cannot reconcile the {side}'s {original}{origin} with "
                          f"the other side's {tuple(canon.shape)}")
    if not other.is_floating_point() and not is_integer_point(point):
        raise TracerError(f"{point}: the {side} holds {other.dtype}, not a floating-point activation")
    if other.dtype != canon.dtype:
        fixes.add(f"dtype:{str(other.dtype).removeprefix('torch.')}:{str(canon.dtype).removeprefix('torch.')}:{side}",
                  point)
    return canon, other


# --- two traces --------------------------------------------------------------------------------


def is_foreign(trace: Trace, point: str) -> bool:
    """A point imported from another runtime's dump (maybe in its layout), not recorded by tracer."""
    return point in (trace.meta.sources or {})


def head_dim_of(*traces: Trace) -> int | None:
    """The head size: written in a dump's metadata, or the last axis of a q/k after RoPE in tracer's layout."""
    for trace in traces:
        if trace.meta.head_dim:
            return int(trace.meta.head_dim)
    for trace in traces:
        for point, tensor in trace.tensors.items():
            if layout_of(point) == "heads" and not is_foreign(trace, point) and tensor.ndim == 3:
                return int(tensor.shape[-1])
    return None


class Overlay(Mapping):
    """`base` with some points replaced; reading a point reads `base` only when it was not replaced."""

    def __init__(self, base: Mapping):
        self.base, self.changed = base, {}

    def __getitem__(self, point):
        return self.changed[point] if point in self.changed else self.base[point]

    def __setitem__(self, point, tensor):
        self.changed[point] = tensor

    def __iter__(self):
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __contains__(self, point) -> bool:
        return point in self.base


def align(reference: Trace, candidate: Trace) -> tuple[Trace, Trace, list[str]]:
    """Both traces with every shared point in one shape, and the notes saying how.

    The side in tracer's layout is the template. Points where neither side was imported under
    another runtime's name are left as they are (`compare_point` checks their shapes).
    """
    fixes = Fixes()
    # Overlays, not copies: a spilled trace's tensors stay on disk until a point is read.
    ref_tensors, cand_tensors = Overlay(reference.tensors), Overlay(candidate.tensors)
    head_dim = head_dim_of(reference, candidate)
    for point in [p for p in reference.points if p in candidate]:
        if not (is_foreign(reference, point) or is_foreign(candidate, point)):
            continue
        if is_foreign(reference, point) and not is_foreign(candidate, point):
            source = reference.meta.sources[point]
            cand, ref = reconcile(point, cand_tensors[point], ref_tensors[point], source, head_dim, fixes, "reference")
        else:
            source = (candidate.meta.sources or {}).get(point)
            ref, cand = reconcile(point, ref_tensors[point], cand_tensors[point], source, head_dim, fixes, "candidate")
        ref_tensors[point], cand_tensors[point] = ref, cand
    notes = [*fix_notes(fixes), *name_notes(reference, "reference"), *name_notes(candidate, "candidate"),
             *missing_notes(reference, candidate)]
    return Trace(ref_tensors, reference.meta), Trace(cand_tensors, candidate.meta), notes


# --- notes -------------------------------------------------------------------------------------


def _some(points: list[str], limit: int = 3) -> str:
    shown = ", ".join(points[:limit])
    return shown + (f" and {len(points) - limit} more" if len(points) > limit else "")


def fix_notes(fixes: Fixes) -> list[str]:
    notes = []
    for what, points in fixes.points.items():
        kind, *args, side = what.split(":")
        if kind == "batch":
            notes.append(f"{side}: dropped a leading batch dimension of 1 at {len(points)} points")
        elif kind == "rows":
            rows = int(args[0])
            where = "the last position" if rows == 1 else f"the last {rows} positions"
            notes.append(f"{side} holds only {where} at {_some(points)}: compared on those rows only")
        elif kind == "interleaved":
            notes.append(f"{side}: q/k un-permuted from GGUF's interleaved order to HF's half-split order "
                         f"before comparing ({len(points)} points: {_some(points, 2)})")
        elif kind == "ambiguous":
            notes.append(f"{side}: T equals the head count, so the shape was ambiguous at {_some(points, 2)}; "
                         f"read as {LAYOUT_NAMES.get(args[0], args[0])}, the runtime's own layout")
        elif kind == "padded":
            notes.append(f"{side}: dropped all-zero padded KV-cache key columns at {_some(points, 2)}")
        elif kind == "dtype":
            notes.append(f"{side} is {args[0]}, the other side {args[1]}, at {len(points)} points: "
                         f"both up-cast to f64 for the metrics")
    return notes


# Modules of transformers' own models (a forward-hook dump names them) whose output is no point of tracer's,
# with what they compute: an aliases file mapping them to a point would compare different things.
HF_MODULES_WITHOUT_POINT = {
    "mlp.act_fn": "transformers' activation module, act(gate_proj) alone; tracer's mlp.act is act(gate_proj)·up_proj",
}


def name_notes(trace: Trace, side: str) -> list[str]:
    """A dump's names that mapped to no point, or to a point another name already took; transformers' own
    modules without a point said as such (no aliases file could map them)."""
    notes = []
    unknown = trace.meta.unknown_names or []
    own = {module: [name for name in unknown if name.endswith("." + module)] for module in HF_MODULES_WITHOUT_POINT}
    for module, names in own.items():
        if names:
            notes.append(f"{side}: {_some(names, 3)} not compared: {HF_MODULES_WITHOUT_POINT[module]}")
    unknown = [name for name in unknown if not any(name in names for names in own.values())]
    if unknown:
        notes.append(f"{side}: {len(unknown)} tensor names match no alias and were not compared: {_some(unknown, 5)} "
                     f"(map them with an aliases file, see docs/trace-format.md)")
    skipped = trace.meta.skipped_names or {}
    for name, reason in list(skipped.items())[:5]:
        notes.append(f"{side}: {name} not compared: {reason}")
    if len(skipped) > 5:
        shown = set(list(skipped.values())[:5])
        others = len(set(skipped.values()) - shown)
        why = f"for {others} more reasons besides these" if others else "for the same reasons"
        notes.append(f"{side}: {len(skipped) - 5} more known names not compared {why} (docs/trace-format.md)")
    return notes + duplicate_notes(trace, side)


def duplicate_notes(trace: Trace, side: str, limit: int = 3) -> list[str]:
    """Names that reach a point another name already gave: one note per point when few; one in all
    when many (a TransformerLens 4 cache names most points two or three times, the same tensor)."""
    differs = trace.meta.differing_names or {}
    used = {point: trace.meta.sources[point]["name"] for point in trace.meta.duplicate_names or {}}
    # a duplicate whose tensor is not the compared one's is said one by one, however many: it may hide a fault
    differing = [f"{side}: {name} gives {point} too, but not {used[point]}'s tensor "
                 f"({'another shape' if diff is None else f'max|diff| {diff:.3g}'}): only {used[point]}'s is compared"
                 for point, names in differs.items() for name, diff in names.items()]
    duplicates = {point: kept for point, names in (trace.meta.duplicate_names or {}).items()
                  if (kept := [name for name in names if name not in differs.get(point, {})])}
    if not duplicates:
        return differing
    if len(duplicates) <= limit:
        return differing + [f"{side}: {point} is given by {used[point]} (compared) and by {', '.join(names)} too"
                            for point, names in duplicates.items()]
    point, names = next(iter(duplicates.items()))
    count = sum(len(names) for names in duplicates.values())
    return differing + [f"{side}: {count} more names for {len(duplicates)} points already named (e.g. "
                        f"{', '.join(names)} for {point}, compared {used[point]}); each point compared once, under "
                        "the first name in the file"]


def missing_notes(reference: Trace, candidate: Trace) -> list[str]:
    """What one side has and the other lacks (beyond points declared unobservable), by kind of point."""
    notes = []
    for side, have, lack in (("candidate", reference, candidate), ("reference", candidate, reference)):
        missing = [p for p in have.points if p not in lack and p not in lack.not_recorded]
        if not missing:
            continue
        kinds: dict[str, int] = defaultdict(int)
        for point in missing:
            kinds[sub_point(point)] += 1
        listed = ", ".join(f"{sub} ×{n}" if n > 1 else sub for sub, n in kinds.items())
        notes.append(f"not in the {side}: {len(missing)} points, compared on the rest ({listed})")
    return notes
