"""Which variants a sweep runs by default and which a diagnosis tries: one representative per
knob of the catalogue, plus more values of the numeric knobs. No torch here."""

from __future__ import annotations

import math

from tracer.engines.registry import ENGINES
from tracer.model.knobs import knobs_for, parse_variant
from tracer.model.kv_cache import KNOBS as DECODE_KNOBS

# Values of the numeric knobs tried beyond the sweep's representative one (the model's own is skipped).
EXTRA_VALUES = {"theta": (10_000.0, 500_000.0, 1_000_000.0), "eps": (1e-6, 1e-5, 1e-4, 1e-3)}


def split_variants(variants) -> list[str]:
    """`"theta=10000; kv_repeat=tile"` or a list of such strings -> one string per variant."""
    texts = [variants] if isinstance(variants, str) else list(variants)
    return [part.strip() for text in texts for part in text.split(";") if part.strip()]


def parse_variants(variants) -> tuple[dict, ...]:
    """A sweep's or a diagnosis's variants, each parsed: a string with `;` between variants, a list of
    such strings, or variants parsed already (dicts of knobs, checked again: a request built anew)."""
    items = [variants] if isinstance(variants, (str, dict)) else list(variants)
    if all(isinstance(item, dict) for item in items):
        return tuple(parse_variant(item) for item in items)
    return tuple(parse_variant(text) for text in split_variants(items))


def default_variants(spec, engine: str = "reimpl", decode: bool = False) -> list[str]:
    """One representative variant per knob that applies to this model's family (its classic porting
    mistakes among them) and that `engine` honours, for this model's spec; a knob whose feature the
    model lacks (a window, a soft-cap) has none, and a representative that needs a knob the engine
    lacks is left out, as are the knobs the engine only emulates (number-format regimes: they are
    what a runtime does by design, ranked by `tracer diagnose`). `decode`: the run decodes (`--decode N`),
    so the decode-only knobs (`tracer.model.kv_cache`), which change nothing in one forward, are
    swept too."""
    decode_only = {knob.name for knob in DECODE_KNOBS}
    entry = ENGINES[engine]
    honoured = set(entry.honoured) - set(entry.emulated)
    chosen = []
    for knob in knobs_for(spec.family):
        text = knob.representative(None if decode and knob.name in decode_only else spec)
        if text and text not in chosen and set(parse_variant(text)) <= honoured:
            chosen.append(text)
    return chosen


def diagnosis_variants(spec, decode: bool = False) -> list[str]:
    """The sweep's representative variants plus more values of theta and eps, and the number-format
    regimes (`tracer.ggml.strategies.regime_catalogue`: block-quantized weights with and without their
    activation quantization, KV caches, 16-bit dtypes); `decode`: the decode-only knobs too."""
    from tracer.ggml.strategies import regime_catalogue  # torch: only a diagnosis, which runs models, needs it

    own = {"theta": spec.rope_theta, "eps": spec.rms_norm_eps}
    variants = default_variants(spec, decode=decode)
    seen = [parse_variant(v) for v in variants]
    for knob, values in EXTRA_VALUES.items():
        for value in values:
            if not math.isclose(value, own[knob]) and {knob: value} not in seen:
                variants.append(f"{knob}={value:g}")
                seen.append({knob: value})
    return variants + [v for v in regime_catalogue() if parse_variant(v) not in seen]
