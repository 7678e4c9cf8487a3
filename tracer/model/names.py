"""Other runtimes' names for tracer's points, read off the components' declarations, and GGUF's
tensor names from gguf's own `TensorNameMap`.

A port dumps its intermediate tensors under the names its own code uses: candle's llama.rs
field names (`blocks.3.mlp.c_proj`), the ggml graph names llama.cpp's eval callback prints
(`ffn_out-3`), TransformerLens hook names (`blocks.3.hook_mlp_out`), GGUF tensor names for the
modules holding those weights, or HF module paths (MLX's mlx-lm uses the same paths). Each point
declares its names (`tracer.model.component.Name`, with `{i}` for the layer) in the component that
computes it; `aliases()` gathers them over the registered families, and a user mapping file (JSON
`{"their_name_pattern": "our_point_pattern"}`) extends and overrides them. GGUF's names are not
written here: `gguf_names` asks gguf's `TensorNameMap` (the hub llama.cpp's converter uses) for each
point's module path. A name that maps nowhere is listed, never dropped silently; names known to hold
something tracer has no point for are listed with why (`NOT_COMPARABLE`).

Each alias also says how that runtime lays the tensor out, for `tracer.traces.layouts`:
`layout` is the natural order of a per-head tensor ("THD": [T, H, D], "HTD": [H, T, D]) used
when the shape alone is ambiguous (T == H), and `qk_order` is "interleaved" where q/k rows are
in GGUF's order (llama.cpp's converter permutes the q/k weight rows so that RoPE pairs are
adjacent; the activations come out permuted the same way).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tracer.core.errors import TracerError, one_line
from tracer.model.component import Family, family_named, registered, registry_version
from tracer.model.points import (
    FINAL_NORM,
    INPUT_NORM,
    POST_ATTENTION_NORM,
    folded,
    known_model_points,
    known_sub_points,
    layer_point,
    split_point,
)

L = "model.layers.{i}"

# How each runtime lays a per-head tensor out when its name does not say: candle keeps (B, H, T, D);
# ggml's ne order reversed from numpy's gives [T, H, D]; TransformerLens' hooks are [batch, pos, head,
# d_head]; HF's attention works on (B, H, T, D).
RUNTIME_LAYOUTS = {"candle": "HTD", "ggml": "THD", "gguf": "THD", "transformer_lens": "THD", "hf": "HTD",
                   "mlx": "HTD"}


@dataclass(frozen=True)
class Alias:
    """One runtime's name (pattern with `{i}`) for one point."""

    pattern: str
    point: str
    runtime: str
    layout: str | None = None  # "THD" or "HTD" for per-head tensors of this runtime
    qk_order: str = "half"  # "interleaved": q/k rows in GGUF order (llama.cpp)


def _declared(family: Family):
    """(folded point, Name) for every name `family`'s points declare."""
    for point in family.model_points().values():
        yield from ((point.name, name) for name in point.names)
    for sub, point in family.sub_points().items():
        yield from ((layer_point("{i}", sub), name) for name in point.names)


def gguf_names(family: str | None = None) -> dict[str, str]:
    """Folded point -> the GGUF tensor stem of the module whose output it is ("blk.{i}.attn_q"), as
    gguf's `TensorNameMap` names it for the family's llama.cpp architecture (`Family.gguf_arch`)."""
    row = family_named(family)
    key = (row.name, registry_version())
    if key not in _GGUF_CACHE:
        import gguf  # gguf-py: 0.1 s, for GGUF files only

        arch = next(a for a, text in gguf.MODEL_ARCH_NAMES.items() if text == row.gguf_arch)
        tensor_map = gguf.get_tensor_name_map(arch, 1)
        found = {}
        for point in [*row.model_points(), *(layer_point(0, sub) for sub in row.sub_points())]:
            name = tensor_map.get_name(point)
            if name is not None:
                found[folded(point)] = re.sub(r"^blk\.0\.", "blk.{i}.", name)
        _GGUF_CACHE[key] = found
    return _GGUF_CACHE[key]


_GGUF_CACHE: dict[tuple[str, int], dict[str, str]] = {}
_WEIGHT_SUFFIXES = (".weight", ".bias")


def hf_tensor_name(gguf_name: str, family: str | None = None) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (gguf's `TensorNameMap`, read
    backwards for the family's points); None for a tensor no point's module holds."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or "." + suffix not in _WEIGHT_SUFFIXES:
        return None
    for point, pattern in gguf_names(family).items():
        match = _compile(pattern).match(stem)
        if match:
            return (point.replace("{i}", match.group(1)) if match.groups() else point) + "." + suffix
    return None


def gguf_tensor_name(hf_name: str, family: str | None = None) -> str | None:
    """"model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight"; None where GGUF has no such tensor."""
    module, dot, suffix = hf_name.rpartition(".")
    layer, _ = split_point(module)
    stem = gguf_names(family).get(folded(module))
    if not dot or stem is None:
        return None
    return (stem if layer is None else stem.replace("{i}", str(layer))) + "." + suffix


def gguf_block_of(gguf_name: str) -> int | None:
    """The block a GGUF tensor belongs to, by gguf's own name formats (`gguf.TENSOR_NAMES`:
    "blk.{bid}.attn_q"); None outside the blocks."""
    if _BLOCK_RE[0] is None:
        import gguf  # gguf-py: 0.1 s, for GGUF files only

        prefixes = {text.split("{bid}")[0] for text in gguf.TENSOR_NAMES.values() if "{bid}" in text}
        _BLOCK_RE[0] = re.compile("^(?:" + "|".join(map(re.escape, sorted(prefixes))) + r")(\d+)\.")
    match = _BLOCK_RE[0].match(gguf_name)
    return int(match.group(1)) if match else None


_BLOCK_RE: list = [None]


def gguf_family(arch: str | None) -> Family | None:
    """The registered family whose llama.cpp architecture `arch` is (the first: Llama for "llama")."""
    return next((family for family in registered().values() if family.gguf_arch == arch), None)


def aliases() -> list[Alias]:
    """Every registered family's declared names and GGUF names as aliases, the first family's alias
    for a (runtime, name) winning (Llama's, registered first); a name written more than once per
    graph (`writes`) is its dump's alias only where it says `dump`."""
    key = registry_version()
    if _ALIASES[0] != key:
        table: dict[tuple[str, str], Alias] = {}
        for family in registered().values():
            for point, name in _declared(family):
                if name.dump and name.runtime != "mlx":
                    layout = name.layout or RUNTIME_LAYOUTS[name.runtime]
                    table.setdefault((name.runtime, name.pattern),
                                     Alias(name.pattern, point, name.runtime, layout, name.qk_order))
            permuted = {**known_model_points(), **{layer_point("{i}", s): p for s, p in family.sub_points().items()}}
            for point, stem in gguf_names(family.name).items():
                order = "interleaved" if permuted[point].gguf_permuted else "half"
                table.setdefault(("gguf", stem), Alias(stem, point, "gguf", RUNTIME_LAYOUTS["gguf"], order))
        _ALIASES[:] = [key, list(table.values())]
    return _ALIASES[1]


_ALIASES: list = [-1, []]


def ggml_writes() -> dict[str, dict[str, str]]:
    """ggml names written more than once in one llama.cpp graph: which write is which point, by the op
    that wrote it (Qcur-{i}: MUL_MAT and ADD (a bias) are q_proj, ROPE is q_rope). Writes of other ops
    (RESHAPE: a view of the projection, same values) are not points."""
    writes: dict[str, dict[str, str]] = {}
    for family in registered().values():
        for point, name in _declared(family):
            if name.runtime == "ggml" and name.writes:
                for op in name.writes:
                    writes.setdefault(name.pattern, {}).setdefault(op, point)
    return writes


def _tl_normalized(point: str, hook_out: str) -> str:
    # fold_ln (HookedTransformer's default, the bridge's compatibility mode) folds the norm weight into
    # the next matmul, so in TransformerLens 3 nothing before that matmul holds the norm's output.
    return (f"TransformerLens' x / rms before the norm weight, not {point} (which is TransformerLens 4's "
            f"{hook_out}; TransformerLens 3 has none)")


# TransformerLens 4 module -> the point its hook_in repeats (a Llama block, TransformerLens 4.3's names)
_TL_INPUTS = {"ln1": "blocks.{i}.hook_in", "attn": "ln1.hook_out", "attn.q": "ln1.hook_out",
              "attn.k": "ln1.hook_out", "attn.v": "ln1.hook_out", "mlp": "ln2.hook_out",
              "mlp.gate": "ln2.hook_out", "mlp.in": "ln2.hook_out"}

# Names other runtimes record that hold something no point holds: skipped, and said so.
NOT_COMPARABLE = {
    "kq-{i}": "llama.cpp's q·kᵀ before the 1/sqrt(head_dim) scale (tracer's scores are scaled)",
    "norm-{i}": "llama.cpp's RMS-normalized input before the norm weight",
    "ffn_silu-{i}": "llama.cpp's silu(gate) before the product with up",
    "kqv-{i}": "llama.cpp's per-head attention output before the heads are merged (use kqv_out)",
    # TransformerLens 3 and 4
    "blocks.{i}.ln1.hook_normalized": _tl_normalized(INPUT_NORM, "blocks.{i}.ln1.hook_out"),
    "blocks.{i}.ln2.hook_normalized": _tl_normalized(POST_ATTENTION_NORM, "blocks.{i}.ln2.hook_out"),
    "ln_final.hook_normalized": _tl_normalized(FINAL_NORM, "ln_final.hook_out"),
    "blocks.{i}.ln1.hook_scale": "TransformerLens' RMS scale, one number per position",
    "blocks.{i}.ln2.hook_scale": "TransformerLens' RMS scale, one number per position",
    "ln_final.hook_scale": "TransformerLens' RMS scale, one number per position",
    "blocks.{i}.hook_resid_pre": "TransformerLens' block input: the previous block's hook_resid_post (or hook_embed)",
    # TransformerLens 4 (TransformerBridge): module inputs that repeat the point before them, and the rotary tables
    **{f"blocks.{{i}}.{module}.hook_in": f"TransformerLens 4's input of {module}: the same tensor as {before}"
       for module, before in _TL_INPUTS.items()},
    "blocks.{i}.hook_in": "TransformerLens 4's block input (hook_resid_pre): the previous block's output",
    "ln_final.hook_in": "TransformerLens 4's input of ln_final: the last block's output",
    "unembed.hook_in": "TransformerLens 4's input of unembed: the same tensor as ln_final.hook_out",
    "blocks.{i}.attn.hook_cos": "TransformerLens 4's rotary cos table per position, not an activation",
    "blocks.{i}.attn.hook_sin": "TransformerLens 4's rotary sin table per position, not an activation",
    "rotary_emb.hook_cos": "TransformerLens 4's rotary cos table per position, not an activation",
    "rotary_emb.hook_sin": "TransformerLens 4's rotary sin table per position, not an activation",
    "rotary_emb.hook_in": "TransformerLens 4's input of the rotary embedding (read for its dtype and device only)",
}

# Integer tensors holding the token ids (TransformerLens 4 caches them as the embedding's input).
TOKEN_TENSORS = ("tokens", "input_ids", "embed.hook_in")


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{i}"), r"(\d+)") + "$")


_WRITES: list = [-1, []]


def ggml_write(name: str, op: str) -> tuple[bool, str | None]:
    """For a name llama.cpp writes more than once per graph (`ggml_writes`): (True, the point that
    the write of `op` is, or None for a write that is no point). Any other name: (False, None).

    Example:
        >>> ggml_write("Qcur-3", "ROPE"), ggml_write("Qcur-3", "RESHAPE"), ggml_write("l_out-3", "ADD")
        ((True, 'model.layers.3.self_attn.q_rope'), (True, None), (False, None))
    """
    if _WRITES[0] != registry_version():
        _WRITES[:] = [registry_version(), [(_compile(pattern), ops) for pattern, ops in ggml_writes().items()]]
    for regex, ops in _WRITES[1]:
        match = regex.match(name)
        if match:
            point = ops.get(op)
            return True, point.replace("{i}", match.group(1)) if point else None
    return False, None


def is_point(name: str) -> bool:
    """A name of tracer's vocabulary (for any number of layers)."""
    layer, sub = split_point(name)
    return name in known_model_points() if layer is None else sub in known_sub_points()


def _is_point_pattern(pattern: str) -> bool:
    return is_point(pattern.replace("{i}", "0"))


@dataclass(frozen=True)
class Resolved:
    """Where one of their names lands: our point, and the alias that took it there."""

    name: str
    point: str
    alias: Alias


class AliasTable:
    """The built-in aliases, extended (and overridden, entries first) by a user mapping.

    Example:
        >>> table = AliasTable()
        >>> table.resolve("blocks.3.mlp.c_proj").point
        'model.layers.3.mlp.down_proj'
        >>> table.resolve("l_out-3").point
        'model.layers.3'
    """

    def __init__(self, user: dict[str, str | None] | None = None):
        user = user or {}
        self.ignored = {pattern for pattern, point in user.items() if point is None}
        # A user entry inherits the layout hints of a built-in alias with the same name pattern
        # (Qcur-{i} stays in GGUF order whatever point it is sent to).
        builtin = {a.pattern: a for a in aliases()}
        users = [Alias(p, point, "user", builtin[p].layout if p in builtin else None,
                       builtin[p].qk_order if p in builtin else "half")
                 for p, point in user.items() if point is not None]
        self.aliases = [*users, *aliases()]
        self._users = len(users)
        self._compiled = [(_compile(a.pattern), a) for a in self.aliases]
        self._skipped = [(_compile(p), reason) for p, reason in NOT_COMPARABLE.items() if p not in user]
        self._ignored = [_compile(p) for p in self.ignored]

    def resolve(self, name: str) -> Resolved | None:
        """Our point for `name`, or None when no alias matches (see `skip_reason`). A user's entry
        first; then a point's own name (HF module paths, also MLX's mlx-lm: a family whose MLP output is
        the `mlp` module's is not renamed by Llama's `mlp` alias); then the built-in aliases."""
        for index, (regex, alias) in enumerate(self._compiled):
            if index == self._users and is_point(name):
                return Resolved(name, name, Alias(name, name, "hf", "HTD"))
            match = regex.match(name)
            if match:
                point = alias.point.replace("{i}", match.group(1)) if match.groups() else alias.point
                return Resolved(name, point, alias)
        if is_point(name):
            return Resolved(name, name, Alias(name, name, "hf", "HTD"))
        return None

    def skip_reason(self, name: str) -> str | None:
        """Why a known name is not compared (None: not a known name)."""
        if any(regex.match(name) for regex in self._ignored):
            return "ignored by the aliases file"
        return next((reason for regex, reason in self._skipped if regex.match(name)), None)


def load_alias_file(path: str | Path) -> dict[str, str | None]:
    """Read a user mapping: a JSON object {"their_name_pattern": "our_point_pattern" or null}.

    `{i}` stands for the layer index on both sides; null skips the name on purpose.

    Raises:
        TracerError: unreadable file, not an object of strings, a target that is not a point,
            or `{i}` on one side only.
    """
    path = Path(path)
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TracerError(f"cannot read aliases file {path}: {one_line(exc)}") from None
    if not isinstance(mapping, dict):
        raise TracerError(f"aliases file {path}: expected a JSON object {{\"their_name\": \"our_point\"}}")
    for theirs, ours in mapping.items():
        if ours is not None and not isinstance(ours, str):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}; expected a point name or null")
        if ours is None:
            continue
        if not _is_point_pattern(ours):
            raise TracerError(f"aliases file {path}: {theirs!r} maps to {ours!r}, which is not a tracer point "
                              f"(e.g. model.layers.{{i}}.mlp.down_proj; see docs/trace-format.md)")
        if ("{i}" in ours) != ("{i}" in theirs):
            raise TracerError(f"aliases file {path}: {theirs!r} -> {ours!r}: use {{i}} on both sides or neither")
    return mapping


def alias_table(aliases=None) -> AliasTable:
    """An AliasTable from None, a mapping, a path to a mapping file, or an AliasTable."""
    if isinstance(aliases, AliasTable):
        return aliases
    if aliases is None:
        return AliasTable()
    if isinstance(aliases, dict):
        return AliasTable(aliases)
    return AliasTable(load_alias_file(aliases))


@dataclass
class Renamed:
    """A foreign file's tensors under our point names, with what did not make it."""

    tensors: dict  # point -> tensor, in the file's order
    sources: dict[str, dict]  # point -> {"name", "runtime", "layout", "qk_order"}
    unknown: list[str]  # names no alias matches
    skipped: dict[str, str]  # known names without a point -> why
    duplicates: dict[str, list[str]]  # point -> the other names that also mapped to it (not used)


def rename(tensors: dict, table: AliasTable) -> Renamed:
    """Map every name of a foreign file onto a point; the first name to reach a point wins."""
    out = Renamed({}, {}, [], {}, {})
    for name, tensor in tensors.items():
        resolved = table.resolve(name)
        if resolved is None:
            reason = table.skip_reason(name)
            if reason:
                out.skipped[name] = reason
            else:
                out.unknown.append(name)
            continue
        if resolved.point in out.tensors:
            out.duplicates.setdefault(resolved.point, []).append(name)
            continue
        alias = resolved.alias
        out.tensors[resolved.point] = tensor
        out.sources[resolved.point] = {"name": name, "runtime": alias.runtime, "layout": alias.layout,
                                       "qk_order": alias.qk_order}
    return out
