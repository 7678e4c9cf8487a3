"""A batch of prompts as the engines that take one run it (`--batch B`, docs/batch.md): left-padded to
one length with an attention mask, one forward, and the recording split back into one trace per row
at the row's real positions.

Left padding as transformers' `generate` pads (`padding_side="left"`): row b's real tokens fill the
last T_b columns, the columns before them are padding (token id `PAD_ID`, mask 0). Each row's
positions start at 0 at its first real token (`tracer.model.components.padding.positions_from_mask`).
What a padded column computes is not any prompt's: it is cut off every point (`RowRecorders`), so a
row's trace has the shapes of the same prompt run alone and is compared with that run point by point.

Notation: B rows, T the longest row's tokens, p_b row b's padding (T - T_b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.core.errors import TracerError
from tracer.model.points import layout_of
from tracer.traces.trace import TraceRecorder

PAD_ID = 0  # what a padded column holds: any id embeds, and a padded column is never attended nor compared


@dataclass(frozen=True)
class Padded:
    """A batch left-padded: `ids` (B, T) int64, `mask` (B, T) int64 (1: a real token), `padding` (p_b per row)."""

    ids: torch.Tensor
    mask: torch.Tensor
    padding: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.padding)


def left_padded(rows: list[list[int]]) -> Padded:
    """The rows (token ids each) left-padded to the longest one."""
    if not rows or any(not row for row in rows):
        raise TracerError("a batch needs at least one row, each of at least one token")
    width = max(len(row) for row in rows)
    padding = tuple(width - len(row) for row in rows)
    ids = torch.tensor([[PAD_ID] * pad + list(row) for pad, row in zip(padding, rows)], dtype=torch.int64)  # (B, T)
    mask = torch.tensor([[0] * pad + [1] * len(row) for pad, row in zip(padding, rows)], dtype=torch.int64)  # (B, T)
    return Padded(ids, mask, padding)


class RowRecorders:
    """The `record(name, tensor)` a batched forward feeds: each point (B, ...) is cut into its rows, each
    row at its real positions (padding cut off the token axes: (B, T, X) -> (1, T_b, X); heads (B, H, T, D)
    -> (1, H, T_b, D); attention (B, H, T, T) -> (1, H, T_b, T_b)), and handed to that row's recorder
    (`rows[b]`, in memory)."""

    def __init__(self, padded: Padded):
        self.padding, self.width = padded.padding, padded.ids.shape[1]
        self.rows = [TraceRecorder() for _ in padded.padding]

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        rows, layout = len(self.rows), layout_of(name)
        flattened = tensor.shape[0] == 1 < rows and tensor.dim() == 3 and tensor.shape[1] == rows * self.width
        if flattened and layout == "rows":  # a router's (B·T, E): the batch flattened row by row
            tensor = tensor.view(rows, self.width, -1)  # (B, T, E)
        if tensor.shape[0] != len(self.rows):
            raise TracerError(f"{name} is {tuple(tensor.shape)}, without the batch axis of {len(self.rows)} rows: "
                              "this model's batches are not traced (a layer that flattens the batch away)")
        axes = {"heads": (2,), "attention": (2, 3)}.get(layout, (1,))  # the token axes, batch first
        for row, (pad, recorder) in enumerate(zip(self.padding, self.rows)):
            value = tensor[row:row + 1]
            for axis in axes:
                if value.shape[axis] == self.width:  # logits=last keeps one column, every row's last: real
                    value = value.narrow(axis, pad, self.width - pad)
            recorder(name, value)
