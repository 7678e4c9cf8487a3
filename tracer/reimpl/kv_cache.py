"""The KV cache the reimplementation's attention appends to: per layer, the keys (after RoPE) and
values seen so far, with their absolute positions.

As transformers' `DynamicCache.update(k, v, layer_idx)` and mlx-lm's `KVCache.update_and_fetch(k, v)`:
a layer hands its new keys and values, and gets back everything it is to attend to. A forward with a
cache appends; prefilling T tokens then decoding one is the same computation as one forward over T + 1
tokens (tests/unit/test_kv_cache.py). Storage formats, ring buffers for sliding windows and the
cache's contents as points are for later (issue 46); this one keeps what it is given, as given.

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

    @property
    def length(self) -> int:
        """Positions held (by the first layer: every layer holds as many after a whole forward)."""
        return 0 if self.positions[0] is None else int(self.positions[0].shape[0])

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append one layer's new keys and values (1, KV, T, D) at `positions` (T,); return what the
        layer attends to: keys, values (1, KV, S + T, D) and their positions (S + T,)."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer], self.positions[layer] = keys, values, positions
        else:
            self.keys[layer] = torch.cat([self.keys[layer], keys], dim=2)  # (1, KV, S + T, D)
            self.values[layer] = torch.cat([self.values[layer], values], dim=2)  # (1, KV, S + T, D)
            self.positions[layer] = torch.cat([self.positions[layer], positions])  # (S + T,)
        return self.keys[layer], self.values[layer], self.positions[layer]
