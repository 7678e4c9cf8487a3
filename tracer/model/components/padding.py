"""A left-padded batch's classic mistakes, as knobs of attention (every family has one): the padding
mask dropped, and positions counted from the padded sequence's start instead of each row's first
real token.

They change nothing in a forward of one prompt (nothing is padded): they show in `--batch B` with
prompts of different lengths (docs/batch.md), on the rows that are padded. Hence no sweep runs them
by default (`representative` gives no variant on a model).
"""

from __future__ import annotations

from tracer.core.lazy import torch
from tracer.model.knobs import Knob, choice, setting, unswept
from tracer.model.points import PROBS, Q_ROPE

PADDING_MASK = Knob(
    "padding_mask", choice("keep", "drop"), "keep | drop", "keep",
    "a left-padded batch's attention mask dropped: the real tokens of a padded row attend to its padding too "
    "(causal masking only)", unswept("padding_mask=drop"),
    expected=f"layers.0.{PROBS} of the first padded row (with --batch B and prompts of different lengths)",
    kind="semantic", after="cache_keys")
BATCH_POSITIONS = Knob(
    "batch_positions", choice("mask", "arange"), "mask | arange", "mask",
    "a left-padded row's positions counted from the padded sequence's start (0..T-1) instead of from its first "
    "real token (transformers' generate: attention_mask.cumsum(-1) - 1)", unswept("batch_positions=arange"),
    expected=f"layers.0.{Q_ROPE} of the first padded row (with --batch B and prompts of different lengths)",
    kind="semantic", after="padding_mask")
KNOBS = (PADDING_MASK, BATCH_POSITIONS)


def mask_kept(real):
    """The keys attention may see: the real tokens (B, S) bool."""
    return real


def mask_dropped(real):
    """No padding mask: causal masking alone, every padded key visible to the queries after it."""
    return None


def positions_from_mask(real):
    """(B, T) int64: each row's positions from 0 at its first real token, padding at 0 (transformers'
    generate: `attention_mask.long().cumsum(-1) - 1`, then `masked_fill(attention_mask == 0, 0)`)."""
    return (real.long().cumsum(-1) - 1).masked_fill(~real, 0)


def positions_of_sequence(real):
    """(B, T) int64: 0..T-1 on every row, the padding counted (a port that ignores the mask)."""
    return torch.arange(real.shape[-1]).expand(real.shape)  # (B, T)


def steps(knobs: dict) -> dict:
    return {"padding_mask": mask_dropped if setting(knobs, "padding_mask") == "drop" else mask_kept,
            "batch_positions": positions_of_sequence if setting(knobs, "batch_positions") == "arange"
            else positions_from_mask}
