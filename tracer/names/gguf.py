"""GGUF's names: the tensor names of GGUF files, asked of gguf-py's own `TensorNameMap` (the hub llama.cpp's
converter uses) for each point's module path in the family's llama.cpp architecture (`Family.gguf_arch`),
never written here; a dump may name a module's output by the stem of the tensor it holds
(`blk.3.attn_q`), or a block's by `blk.{i}`. Read as [T, H, D] (ggml's order); q and k in GGUF's
interleaved order (the converter permutes their weight rows so that RoPE pairs are adjacent)."""

from __future__ import annotations

import re

from tracer.model.component import Family, family_named, registered, registry_version
from tracer.model.points import BLOCK_OUT, TOP_K_INDEX, folded, known_model_points, layer_point, split_point
from tracer.names.vocabulary import Name, Vocabulary, pattern_regex, register

_CACHE: dict[tuple[str, int], dict[str, str]] = {}
_WEIGHT_SUFFIXES = (".weight", ".bias")


def gguf_names(family: str | None = None) -> dict[str, str]:
    """Folded point -> the GGUF tensor stem of the module whose output it is ("blk.{i}.attn_q"), as
    gguf's `TensorNameMap` names it for the family's llama.cpp architecture (`Family.gguf_arch`)."""
    row = family_named(family)
    key = (row.name, registry_version())
    if key not in _CACHE:
        import gguf  # gguf-py: 0.1 s, for GGUF files only

        arch = next(a for a, text in gguf.MODEL_ARCH_NAMES.items() if text == row.gguf_arch)
        tensor_map = gguf.get_tensor_name_map(arch, 1)
        found = {}
        for point in [*row.model_points(), *(layer_point(0, sub) for sub in row.sub_points())]:
            name = tensor_map.get_name(point)
            if name is not None:
                found[folded(point)] = re.sub(r"^blk\.0\.", "blk.{i}.", name)
        _CACHE[key] = found
    return _CACHE[key]


def _tensor_names(family: Family) -> dict[str, tuple[Name, ...]]:
    """Point -> its GGUF stem as a name, q and k in the converter's interleaved order."""
    points = {**known_model_points(), **family.sub_points()}
    found = {}
    for pattern, stem in gguf_names(family.name).items():
        point = split_point(pattern.replace("{i}", "0"))[1]
        found[point] = (Name(stem, qk_order="interleaved" if points[point].gguf_permuted else "half"),)
    return found


GGUF = register(Vocabulary(
    "gguf", "GGUF tensor names (gguf-py's TensorNameMap), for the modules whose outputs they hold", "THD",
    names={BLOCK_OUT: ("blk.{i}",)}, derived=_tensor_names,
))


def hf_tensor_name(gguf_name: str, family: str | None = None) -> str | None:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (gguf's `TensorNameMap`, read
    backwards for the family's points); None for a tensor no point's module holds."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or "." + suffix not in _WEIGHT_SUFFIXES:
        return None
    for point, pattern in gguf_names(family).items():
        match = pattern_regex(pattern).match(stem)
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


def gguf_family(arch: str | None, experts: bool = False) -> Family | None:
    """The registered family whose llama.cpp architecture `arch` is (the first: Llama for "llama"); with
    `experts` (the file has `{arch}.expert_count`), the first with a router: llama.cpp's converter writes
    Mixtral as "llama" with expert tensors."""
    return next((family for family in registered().values()
                 if family.gguf_arch == arch and (TOP_K_INDEX in family.sub_points()) == experts), None)
