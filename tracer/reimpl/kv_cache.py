"""The KV cache the reimplementation's attention appends to: per layer, the keys (after RoPE) and
values seen so far, with their absolute positions.

As transformers' `DynamicCache.update(k, v, layer_idx)` and mlx-lm's `KVCache.update_and_fetch(k, v)`:
a layer hands its new keys and values, and gets back everything it is to attend to. A forward with a
cache appends; prefilling T tokens then decoding one is the same computation as one forward over T + 1
tokens (tests/unit/test_kv_cache.py). What a layer stores may differ from what it attends to with
(`stored_keys`: the `cache_keys=unrotated` knob stores keys before RoPE, as a port that caches the
projection does); the attention records what is stored as the points `cache_k`/`cache_v`. Storage
formats and ring buffers for sliding windows are for later (issue 46).

Notation: KV kv heads, S cached positions, T new ones, D head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per layer: keys (1, KV, S, D) after RoPE, values (1, KV, S, D), and their positions (S,)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.positions: list[torch.Tensor | None] = [None] * num_layers
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
        cache.prefilled = prefilled
        return cache

    def next_position(self) -> int:
        """The absolute position of the token after those held (0 for an empty cache)."""
        return 0 if self.positions[0] is None else int(self.positions[0][-1]) + 1

    def forward_done(self) -> None:
        """Called after each whole forward: the first one's length is the prompt's."""
        self.prefilled = self.prefilled or self.length

    @property
    def length(self) -> int:
        """Positions held (by the first layer: every layer holds as many after a whole forward)."""
        return 0 if self.positions[0] is None else int(self.positions[0].shape[0])

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               stored_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append one layer's new keys and values (1, KV, T, D) at `positions` (T,); return what the
        layer attends to: keys, values (1, KV, S + T, D) and their positions (S + T,). `stored_keys`:
        what is kept for later steps instead of `keys` (the forward itself attends to `keys`)."""
        held = self.keys[layer]
        stored = keys if stored_keys is None else stored_keys
        if held is None:
            self.keys[layer], self.values[layer], self.positions[layer] = stored, values, positions
            return keys, values, positions
        self.keys[layer] = torch.cat([held, stored], dim=2)  # (1, KV, S + T, D)
        self.values[layer] = torch.cat([self.values[layer], values], dim=2)  # (1, KV, S + T, D)
        self.positions[layer] = torch.cat([self.positions[layer], positions])  # (S + T,)
        attended = self.keys[layer] if stored_keys is None else torch.cat([held, keys], dim=2)  # (1, KV, S + T, D)
        return attended, self.values[layer], self.positions[layer]
