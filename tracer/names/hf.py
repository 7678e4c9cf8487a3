"""transformers' own names that are not points: a module whose output is a point's (the attention
module's output is o_proj's, the MLP module's its last point's) and the model output's field. HF module
paths that are points need no entry: a point's own name is itself (MLX's mlx-lm uses the same paths)."""

from __future__ import annotations

from tracer.model.points import ATTENTION, DOWN_PROJ, LOGITS, MLP, O_PROJ, layer_point
from tracer.names.vocabulary import Vocabulary, register

HF = register(Vocabulary(
    "hf", "transformers' module paths and output fields (HF's attention works on (B, H, T, D))", "HTD",
    names={O_PROJ: (layer_point("{i}", ATTENTION),), DOWN_PROJ: (layer_point("{i}", MLP),), LOGITS: ("logits",)},
    tokens=("input_ids",),
))
