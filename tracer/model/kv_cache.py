"""The KV cache, in one room: what a cache is (`Cache`), the reimplementation's (`KVCache`), the ring
rule of a sliding layer (`ring_slot`), the slot layout every cache point is compared in (`ring_slots`,
`SlotLayout`), and the cached decode's classic mistakes (knobs of attention) with their steps.

As transformers' `DynamicCache.update(k, v, layer_idx)` and mlx-lm's `KVCache.update_and_fetch(k, v)`:
a layer hands its new keys and values, and gets back everything it is to attend to. A forward with a
cache appends; prefilling T tokens then decoding one is the same computation as one forward over T + 1
tokens (tests/unit/test_positions.py). What a layer stores may differ from what it attends to with
(`stored_keys`: the `cache_keys=unrotated` knob stores keys before RoPE, as a port that caches the
projection does); the attention records what is stored as the points `cache_k`/`cache_v`.

A sliding layer of window W (mlx-lm's `RotatingKVCache(max_size=W)`, llama.cpp's SWA cache) keeps a ring
of W slots: the n-th token the layer's cache takes (n counted from 0, whatever its position) goes to
slot `n % W` (`ring_slot`), overwriting the token W before it, the one no later query sees. A step
attends, as transformers' `DynamicSlidingWindowLayer` hands over, to the last W - 1 held keys in
position order and its own: for one decoded token exactly the window's W keys.

The layout every cache point is compared in: a sliding layer's cache is the ring in slot order, any other
cache every token in position order. Each engine reads its runtime's cache into it:

- reimpl: `KVCache`, as it is (a ring on a sliding layer);
- hf: transformers' `DynamicCache`, which keeps W - 1 keys and the step's own on a sliding layer, in
  position order: laid out by `ring_slots`;
- mlx: mlx-lm's `KVCache`, its filled slots; a `RotatingKVCache` on a sliding layer in temporal order,
  then `ring_slots` (its own slots are not the rule's after a prompt longer than W);
- candle: llama.rs' keys and values concatenated step by step, every token (Llama only: no window);
- llamacpp: the first S cells of llama.cpp's unified cache, filled in order from a cleared cache; on a
  sliding layer (Gemma 2/3 GGUFs) its SWA cache's, in order too until its cells wrap (which cell holds
  which position is then its cell table, not the tensor: not compared).

A ring and a cache that keeps every token (a port without the window, or one that keeps the whole
sequence and masks it) are two layouts of the same keys: where one comparison meets both, the whole one
is laid out as the ring (`SlotLayout`, which every comparison pairs its points through), and the
attention over more keys is read at the other side's last keys, so storage alone is no difference and
attending past the window is one, at the probabilities. Caches that are neither are not compared, and
the result's notes say why.

The cached decode's mistakes (the knobs below) change nothing in one forward without a cache (a sweep, a
prefill): they show at the decode steps of `--decode N` (docs/decode.md), where the reference and the
candidate each decode with their own cache. Hence no sweep runs them by default (`representative`
gives no variant on a model) unless it decodes (`sweep --decode N`:
`tracer.pipeline.catalogue.default_variants(..., decode=True)`).

Notation: KV kv heads, S cached positions, T new ones, D head dim, W a sliding layer's window.
"""

from __future__ import annotations

from typing import Callable, Protocol

from tracer.core.errors import TracerError
from tracer.core.lazy import torch
from tracer.model.knobs import Knob, choice, setting, unswept
from tracer.model.points import CACHE_K, CACHE_POINTS, K_ROPE, PROBS, Q_ROPE, layout_of, split_point


class Cache(Protocol):
    """What attention and the decode steps ask of a cache (transformers' `Cache`, mlx-lm's `KVCache`)."""

    prefilled: int  # positions the first forward (the prompt's prefill) left in it

    def update(self, layer: int, keys, values, positions, stored_keys=None) -> tuple:
        """Append one layer's keys and values at `positions`; return what the layer attends to."""

    def next_position(self) -> int:
        """The absolute position of the token after those held."""

    def forward_done(self) -> None:
        """Called after each whole forward."""

    @property
    def length(self) -> int:
        """Tokens taken."""


# --- the ring rule and the slot layout ---------------------------------------------------------


def ring_slot(written: int, window: int) -> int:
    """The ring's slot of the `written`-th token (0-based) a sliding layer's cache takes: how every cache
    of a sliding layer is compared (the reimplementation's ring writes there; a cache kept otherwise is
    laid out so by `ring_slots`)."""
    return written % window


def ring_slots(held: torch.Tensor, written: int, window: int) -> torch.Tensor:
    """A sliding layer's keys or values (KV, S, D) in position order, the last of them the `written`-th
    token its cache took (1-based count), laid out as the ring of `window` slots keeps them
    (`ring_slot`): (KV, min(written, window), D), slot order. How a cache kept in position order
    (transformers' last W - 1 keys and the step's own, mlx-lm's rotating cache in temporal order, a
    cache that keeps every token) is compared with a ring."""
    count = min(written, window)
    slots = torch.tensor([ring_slot(n, window) for n in range(written - count, written)])  # (count,) distinct
    ring = torch.empty_like(held[:, -count:])  # (KV, count, D)
    ring[:, slots] = held[:, -count:]
    return ring


SIDES = ("reference", "candidate")


class SlotLayout:
    """Two traces' cache points, and their attention over a cache, read in one layout for one comparison
    (`tracer.comparison.diff.compare` pairs every point through `pair`), and what was done, for the
    result's notes.

    A cache point is (KV, S, D). Where one side keeps a ring of W slots (a sliding window's) and the
    other every token its cache took, in position order (a port without the window, or one that keeps
    the whole sequence and masks it), the whole cache is laid out as the ring (`ring_slots`): storage
    alone is no difference. An attention point of a forward after a cache is (H, T, S) over the keys it
    attends to, in position order on every side; the side that attends to more keys is read at the
    other's last S, the same positions, so attending past the window shows where it does, at the
    probabilities. Two caches that are neither (another number of slots, other heads) are not compared,
    and a note says why.

    Args:
        written: the tokens each side's cache took up to and including the compared forward (None: the
            traces do not say; a forward without a cache took its own tokens only).
        rows: the compared forward's own tokens (None: not said).
    """

    def __init__(self, written: int | None, rows: int | None):
        self.written, self.rows = written, rows
        self.done: dict[str, list[str]] = {}  # the note saying what was done -> its points
        self.unpaired: dict[str, list[str]] = {}  # why a point is not compared -> its points

    def pair(self, point: str, reference: torch.Tensor, candidate: torch.Tensor) -> tuple | str:
        """Both sides' tensors of `point` in one layout (as they are where nothing applies:
        `compare_point` then says the mismatch), or why they cannot be compared (one line)."""
        if reference.shape == candidate.shape:
            return reference, candidate
        sub = split_point(point)[1]
        if sub in CACHE_POINTS:
            paired = self._slots(reference, candidate)
        elif layout_of(point) == "attention" and (self.written is None or self.rows is None or
                                                  self.rows < self.written):
            paired = self._keys(reference, candidate)
        else:
            return reference, candidate
        if isinstance(paired, str):
            _said(self.unpaired, paired, point)
            return paired
        *tensors, done = paired
        _said(self.done, done, point)
        return tuple(tensors)

    def _slots(self, reference: torch.Tensor, candidate: torch.Tensor) -> tuple | str:
        """A cache point of both sides, (KV, S, D) each: the side that keeps every token laid out as the
        other's ring, or why not."""
        if reference.ndim != 3 or candidate.ndim != 3 or reference.shape[::2] != candidate.shape[::2]:
            return f"the caches hold other heads or head sizes: reference {tuple(reference.shape)}, candidate " \
                   f"{tuple(candidate.shape)}"
        tensors = dict(zip(SIDES, (reference, candidate)))
        slots = {side: tensor.shape[1] for side, tensor in tensors.items()}
        held = f"the reference's cache holds {slots['reference']} slots and the candidate's {slots['candidate']}"
        if self.written is None:
            return f"{held}, and the traces do not say how many tokens they took"
        ring, whole = sorted(SIDES, key=slots.get)
        if slots[whole] != self.written:
            return f"{held} after {self.written} tokens: neither keeps every token"
        tensors[whole] = ring_slots(tensors[whole], self.written, slots[ring])  # (KV, W, D) in the ring's slots
        return tensors["reference"], tensors["candidate"], \
            f"the {whole} keeps every token ({self.written}) where the {ring} keeps a ring of {slots[ring]} " \
            "slots (a sliding window's): compared on the ring's slots"

    def _keys(self, reference: torch.Tensor, candidate: torch.Tensor) -> tuple | str:
        """An attention point of both sides, (H, T, S) each over keys in position order: the side over
        more keys read at the other's last S, or why not."""
        if reference.ndim != candidate.ndim or reference.shape[:-1] != candidate.shape[:-1]:
            return f"other attention shapes: reference {tuple(reference.shape)}, candidate {tuple(candidate.shape)}"
        keys = dict(zip(SIDES, (reference.shape[-1], candidate.shape[-1])))
        fewer, more = sorted(SIDES, key=keys.get)
        shared = keys[fewer]
        said = f"the {more} attends to {keys[more]} keys where the {fewer} attends to {shared}: compared on the " \
               f"last {shared} (the same positions)"
        return reference[..., -shared:], candidate[..., -shared:], said  # (H, T, shared) each

    def notes(self) -> list[str]:
        """One line per kind of layout done, and per reason a point was not compared."""
        return [*(f"{_where(points)}: {done}" for done, points in self.done.items()),
                *(f"{_where(points)} not compared: {why}" for why, points in self.unpaired.items())]


def _said(table: dict[str, list[str]], note: str, point: str) -> None:
    """`point` under `note`, once (the first divergence is paired again to explain it)."""
    points = table.setdefault(note, [])
    if point not in points:
        points.append(point)


def _where(points: list[str]) -> str:
    """`self_attn.cache_k, self_attn.cache_v of layers 0, 2`: points named by their sub-points and layers."""
    subs = list(dict.fromkeys(split_point(point)[1] or point for point in points))
    layers = sorted({layer for layer in (split_point(point)[0] for point in points) if layer is not None})
    at = f" of layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}" if layers else ""
    return ", ".join(subs) + at


class KVCache:
    """Per layer: keys (1, KV, S, D) after RoPE, values (1, KV, S, D), and their positions (S,); a
    sliding layer (`windows[i]`) holds S <= W slots in slot order."""

    def __init__(self, num_layers: int, windows: list[int | None] | None = None,
                 slot: Callable[[int, int], int] = ring_slot, seen: list[int | None] | None = None):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: list[torch.Tensor | None] = [None] * num_layers
        self.written = [0] * num_layers  # tokens each layer's cache took
        self.windows = list(windows or [None] * num_layers)
        self.slot = slot  # a ring's slot of its n-th token (`ring_index=fill` gets it wrong)
        # keys a query sees on a sliding layer, itself included: its window (`window_mask=wide`: one more)
        self.seen = list(seen or self.windows)
        self.prefilled = 0  # positions the first forward (the prompt's prefill) left in it

    @classmethod
    def holding(cls, keys: list[torch.Tensor], values: list[torch.Tensor], start: int, prefilled: int) -> KVCache:
        """A cache that already holds, per layer, `keys` and `values` (KV, S, D) at positions start..start+S-1,
        the first `prefilled` of them the prompt's: another run's cache contents (the reference's, for a
        decode step rerun on them: `tracer.reimpl.forced_runs.teacher_forced_points`)."""
        cache = cls(len(keys))
        for layer, (k, v) in enumerate(zip(keys, values)):
            cache.keys[layer], cache.values[layer] = k[None], v[None]  # (1, KV, S, D)
            cache.positions[layer] = torch.arange(start, start + k.shape[1], device=k.device)  # (S,)
            cache.written[layer] = k.shape[1]
        cache.prefilled = prefilled
        return cache

    def next_position(self) -> int:
        """The absolute position of the token after those held (0 for an empty cache)."""
        return 0 if self.positions[0] is None else int(self.positions[0].max()) + 1

    def forward_done(self) -> None:
        """Called after each whole forward: the first one's length is the prompt's."""
        self.prefilled = self.prefilled or self.length

    @property
    def length(self) -> int:
        """Tokens taken (by the first layer: every layer takes as many in a whole forward)."""
        return self.written[0]

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               stored_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append one layer's new keys and values (1, KV, T, D) at `positions` (T,); return what the
        layer attends to: keys, values (1, KV, S', D) and their positions (S',) in position order.
        `stored_keys`: what is kept for later steps instead of `keys` (the forward itself attends to `keys`)."""
        stored = keys if stored_keys is None else stored_keys
        if self.windows[layer] is not None:
            return self._ring(layer, keys, values, positions, stored)
        held = self.keys[layer]
        self.written[layer] += positions.shape[0]
        if held is None:
            self.keys[layer], self.values[layer], self.positions[layer] = stored, values, positions
            return keys, values, positions
        self.keys[layer] = torch.cat([held, stored], dim=2)  # (1, KV, S + T, D)
        self.values[layer] = torch.cat([self.values[layer], values], dim=2)  # (1, KV, S + T, D)
        self.positions[layer] = torch.cat([self.positions[layer], positions])  # (S + T,)
        attended = self.keys[layer] if stored_keys is None else torch.cat([held, keys], dim=2)  # (1, KV, S + T, D)
        return attended, self.values[layer], self.positions[layer]

    def _ring(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sliding layer: attend to the last W - 1 held keys in position order and the new ones (the last
        `seen - 1`: a wider mask reads the whole ring before writing), then write each new token into its
        slot of the ring."""
        window, held = self.windows[layer], self.keys[layer]
        if held is None:
            attended = keys, values, positions
        else:
            order = torch.argsort(self.positions[layer])  # (S,) the held slots in position order
            order = order[max(0, len(order) - (self.seen[layer] - 1)):]  # (≤ W - 1,) the last W - 1 of them
            attended = (torch.cat([held[:, :, order], keys], dim=2),  # (1, KV, ≤ W - 1 + T, D) in position order
                        torch.cat([self.values[layer][:, :, order], values], dim=2),
                        torch.cat([self.positions[layer][order], positions]))  # (≤ W - 1 + T,)
        # each new token's slot; where a prefill longer than the ring writes a slot twice, the later one stays
        count = positions.shape[0]
        slots = [self.slot(self.written[layer] + t, window) for t in range(count)]
        last = {slot: t for t, slot in enumerate(slots)}  # slot -> the new token left in it
        filled = 0 if held is None else held.shape[2]
        size = max(filled, max(slots) + 1)  # a ring grows one slot per token until it is full
        into, taken = torch.tensor(list(last)), torch.tensor(list(last.values()))  # (U,) each
        ring = []
        for old, new in ((held, stored), (self.values[layer], values)):
            part = new.new_empty((*new.shape[:2], size, new.shape[3]))  # (1, KV, size, D), a tensor of its own:
            if filled:  # the points recorded at earlier steps keep what they held
                part[:, :, :filled] = old
            part[:, :, into] = new[:, :, taken]
            ring.append(part)
        ring_positions = positions.new_empty(size)  # (size,)
        if filled:
            ring_positions[:filled] = self.positions[layer]
        ring_positions[into] = positions[taken]
        self.keys[layer], self.values[layer], self.positions[layer] = *ring, ring_positions
        self.written[layer] += count
        return attended


# --- the cached decode's mistakes (knobs of attention) --------------------------------------------

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
    writing its last slot (the correct slot is `ring_slot`, written % window)."""
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


def decode_is_forward(steps) -> bool:
    """Whether a cached decode with these `steps` computes what a forward over the whole sequence computes (no
    cache knob set, the cache keeping what it is given): the two then differ by rounding alone."""
    if "decode_start" not in steps:
        return False
    return (steps.decode_start is true_start and not steps.cache_unrotated and steps.ring_slot is None
            and steps.cached_window is exact_window and not steps.cache_left_over and steps.cache_store is None)
