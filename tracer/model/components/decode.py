"""The cached decode's classic mistakes, as knobs of attention (every family has one): which position
a decode step's token is given, which keys the KV cache keeps, how a sliding layer's ring buffer is
written and masked, and whether the cache starts empty.

They change nothing in one forward without a cache (a sweep, a prefill): they show at the decode
steps of `--decode N` (docs/decode.md), where the reference and the candidate each decode with their
own cache. Hence no sweep runs them by default (`representative` gives no variant on a model) unless it
decodes (`sweep --decode N`: `tracer.pipeline.catalogue.default_variants(..., decode=True)`).
"""

from __future__ import annotations

from tracer.core.errors import TracerError
from tracer.model.knobs import Knob, choice, setting, unswept
from tracer.model.points import CACHE_K, K_ROPE, PROBS, Q_ROPE

DECODE_POSITIONS = Knob(
    "decode_positions", choice("true", "restart", "shifted"), "true | restart | shifted", "true",
    "a decode step's token given a wrong position: restart counts from 0 again after the prompt (positions "
    "taken from the step's own length), shifted one past its true position (the cache's length plus one)",
    unswept("decode_positions=restart"),
    expected=f"decode step 1, layers.0.{Q_ROPE} / {K_ROPE} (with --decode N)", kind="semantic")
CACHE_KEYS = Knob(
    "cache_keys", choice("rotated", "unrotated"), "rotated | unrotated", "rotated",
    "the KV cache keeps the keys before RoPE (the projection's output): the prompt attends to its own rotated "
    "keys, every later step to the cached keys never rotated",
    unswept("cache_keys=unrotated"),
    expected=f"prefill, layers.0.{CACHE_K} (with --decode N)", kind="semantic", after="decode_positions")
RING_INDEX = Knob(
    "ring_index", choice("position", "fill"), "position | fill", "position",
    "a sliding layer's ring buffer written at its fill (the tokens it holds, which stops at the window) instead "
    "of the token's place in the sequence: once full, every step overwrites its last slot, keeping the token a "
    "window back and evicting one still in the window (mlx-lm #1437's offset and fill conflated)",
    unswept("ring_index=fill"),
    expected="the decode step whose token wraps the ring (position = window), the first sliding layer's "
             f"{CACHE_K} (with --decode N past the window)", kind="semantic", after="cache_reset")
WINDOW_MASK = Knob(
    "window_mask", choice("exact", "wide"), "exact | wide", "exact",
    "the sliding-window mask of a cached forward one key too wide (129 keys for a window of 128, mlx-lm #390): "
    "a decoded token attends to the whole ring before its own key overwrites the oldest, a window back",
    unswept("window_mask=wide"),
    expected=f"the first decode step with a key a window back (position = window), the first sliding layer's "
             f"{PROBS}", kind="semantic", after="ring_index")
CACHE_RESET = Knob(
    "cache_reset", choice("cleared", "kept"), "cleared | kept", "cleared",
    "a cache left over from the previous prompt: the decode steps run on the cache the previous request (here "
    "the prompt with every token id one higher) left, not cleared, while the prefill filled a new one (a cache "
    "held on the model object and set once)",
    unswept("cache_reset=kept"),
    expected=f"decode step 1, layers.0.{CACHE_K} (with --decode N)", kind="semantic", after="cache_keys")
CACHE_KNOBS = (DECODE_POSITIONS, CACHE_KEYS, CACHE_RESET)  # every attention's
WINDOW_KNOBS = (RING_INDEX, WINDOW_MASK)  # an attention whose configs may slide a window: its ring buffer
KNOBS = CACHE_KNOBS + WINDOW_KNOBS


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


def fill_slot(written: int, window: int) -> int:
    """ring_index=fill: the slot is the ring's fill, which stops growing at the window: a full ring keeps
    writing its last slot (the correct slot is `tracer.comparison.steps.ring_slot`, written % window)."""
    return min(written, window - 1)


def exact_window(window: int | None) -> int | None:
    return window


def wide_window(window: int | None) -> int | None:
    """window_mask=wide: a cached forward's window one key wider (kv >= q - window); the ring hands its
    whole window over (`KVCache.seen`)."""
    return None if window is None else window + 1


CACHED_WINDOWS = {"exact": exact_window, "wide": wide_window}


def steps(knobs: dict, spec=None) -> dict:
    for knob in WINDOW_KNOBS:
        if spec is not None and spec.sliding_window is None and setting(knobs, knob.name) != knob.default_value:
            raise TracerError(f"{knob.name}={knobs[knob.name]} changes nothing here: this model's config has no "
                              "sliding window")
    return {"decode_start": DECODE_STARTS[setting(knobs, "decode_positions")],
            "cache_unrotated": setting(knobs, "cache_keys") == "unrotated",
            "ring_slot": fill_slot if setting(knobs, "ring_index") == "fill" else None,  # None: the ring's own rule
            "cached_window": CACHED_WINDOWS[setting(knobs, "window_mask")],
            "cache_left_over": setting(knobs, "cache_reset") == "kept",
            "cache_store": None}  # K, V -> what the cache keeps (a regime's kv_cache format: tracer.ggml.strategies)

