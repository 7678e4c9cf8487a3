"""The cached decode's classic mistakes, as knobs of attention (every family has one): which position
a decode step's token is given, and which keys the KV cache keeps.

They change nothing in one forward without a cache (a sweep, a prefill): they show at the decode
steps of `--decode N` (docs/decode.md), where the reference and the candidate each decode with their
own cache. Hence no sweep runs them by default (`representative` gives no variant on a model) unless it
decodes (`sweep --decode N`: `tracer.pipeline.catalogue.default_variants(..., decode=True)`).
"""

from __future__ import annotations

from tracer.model.knobs import Knob, choice, setting, when
from tracer.model.points import CACHE_K, K_ROPE, Q_ROPE


def _decode_only(text: str):
    """The knob's value for `tracer variants` and the engine checks; no sweep variant on a model: a
    sweep records one uncached forward, where the knob changes nothing."""
    return when(lambda spec: False, text)


DECODE_POSITIONS = Knob(
    "decode_positions", choice("true", "restart", "shifted"), "true | restart | shifted", "true",
    "a decode step's token given a wrong position: restart counts from 0 again after the prompt (positions "
    "taken from the step's own length), shifted one past its true position (the cache's length plus one)",
    _decode_only("decode_positions=restart"),
    expected=f"decode step 1, layers.0.{Q_ROPE} / {K_ROPE} (with --decode N)", kind="semantic")
CACHE_KEYS = Knob(
    "cache_keys", choice("rotated", "unrotated"), "rotated | unrotated", "rotated",
    "the KV cache keeps the keys before RoPE (the projection's output): the prompt attends to its own rotated "
    "keys, every later step to the cached keys never rotated",
    _decode_only("cache_keys=unrotated"),
    expected=f"prefill, layers.0.{CACHE_K} (with --decode N)", kind="semantic", after="decode_positions")
KNOBS = (DECODE_POSITIONS, CACHE_KEYS)


def true_start(cache) -> int:
    """The first position of a forward's tokens: after what the cache holds."""
    return cache.next_position()


def restarted_start(cache) -> int:
    """Counting from 0 again once the prompt is in the cache (positions of the step, not of the sequence)."""
    return cache.length - cache.prefilled if cache.prefilled else cache.next_position()


def shifted_start(cache) -> int:
    """One past the true position on decode steps (`past_length + 1`)."""
    return cache.next_position() + (1 if cache.prefilled else 0)


DECODE_STARTS = {"true": true_start, "restart": restarted_start, "shifted": shifted_start}


def steps(knobs: dict) -> dict:
    return {"decode_start": DECODE_STARTS[setting(knobs, "decode_positions")],
            "cache_unrotated": setting(knobs, "cache_keys") == "unrotated"}
