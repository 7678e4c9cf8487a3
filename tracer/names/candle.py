"""candle's names: the fields of candle-transformers 0.11's llama.rs (`wte`, `blocks.{i}.attn.q_proj`,
`blocks.{i}.rms_1`, `ln_f`), which a port dumps its tensors under; a module stands for its output.
candle keeps per-head tensors as (B, H, T, D)."""

from __future__ import annotations

from tracer.model.points import (
    BLOCK_OUT,
    DOWN_PROJ,
    EMBED,
    FINAL_NORM,
    GATE_PROJ,
    INPUT_NORM,
    K_PROJ,
    O_PROJ,
    POST_ATTENTION_NORM,
    Q_PROJ,
    UP_PROJ,
    V_PROJ,
)
from tracer.names.vocabulary import Vocabulary, register

CANDLE = register(Vocabulary(
    "candle", "candle-transformers' llama.rs field names", "HTD",
    names={
        EMBED: ("wte",),
        INPUT_NORM: ("blocks.{i}.rms_1",),
        Q_PROJ: ("blocks.{i}.attn.q_proj",), K_PROJ: ("blocks.{i}.attn.k_proj",), V_PROJ: ("blocks.{i}.attn.v_proj",),
        O_PROJ: ("blocks.{i}.attn.o_proj", "blocks.{i}.attn"),
        POST_ATTENTION_NORM: ("blocks.{i}.rms_2",),
        GATE_PROJ: ("blocks.{i}.mlp.c_fc1",), UP_PROJ: ("blocks.{i}.mlp.c_fc2",),
        DOWN_PROJ: ("blocks.{i}.mlp.c_proj", "blocks.{i}.mlp"),
        BLOCK_OUT: ("blocks.{i}",),
        FINAL_NORM: ("ln_f",),
    },
))
