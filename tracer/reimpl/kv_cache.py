"""The KV cache the reimplementation's attention appends to: per layer, the keys (after RoPE) and
values seen so far, with their absolute positions; on a sliding-window layer a ring buffer of the
window's slots, as runtimes keep it.

As transformers' `DynamicCache.update(k, v, layer_idx)` and mlx-lm's `KVCache.update_and_fetch(k, v)`:
a layer hands its new keys and values, and gets back everything it is to attend to. A forward with a
cache appends; prefilling T tokens then decoding one is the same computation as one forward over T + 1
tokens (tests/unit/test_positions.py). What a layer stores may differ from what it attends to with
(`stored_keys`: the `cache_keys=unrotated` knob stores keys before RoPE, as a port that caches the
projection does); the attention records what is stored as the points `cache_k`/`cache_v`.

A sliding layer of window W (mlx-lm's `RotatingKVCache(max_size=W)`, llama.cpp's SWA cache) keeps a ring
of W slots: the n-th token the layer's cache takes (n counted from 0, whatever its position) goes to
slot `n % W` (`tracer.comparison.steps.ring_slot`), overwriting the token W before it, the one no later
query sees. A step attends, as transformers' `DynamicSlidingWindowLayer` hands over, to the last W - 1
held keys in position order and its own: for one decoded token exactly the window's W keys. The points
`cache_k`/`cache_v` of a sliding layer are the ring in slot order (`tracer.comparison.steps.ring_slots`
lays out any cache kept in position order by the same rule: transformers' keeps W - 1 keys so).

Notation: KV kv heads, S cached positions, T new ones, D head dim, W a sliding layer's window.
"""

from __future__ import annotations

from typing import Callable

import torch

from tracer.comparison.steps import ring_slot


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
