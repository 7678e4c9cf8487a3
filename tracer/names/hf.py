"""transformers' own names that are not points: a module whose output is a point's (the attention
module's output is o_proj's, the MLP module's its last point's), the model output's field, and a path an
earlier transformers gave a point (transformers 4's Mixtral named its sparse block `block_sparse_moe`, the
name its checkpoints still give the experts' weights). HF module paths that are points need no entry: a
point's own name is itself (MLX's mlx-lm uses the same paths)."""

from __future__ import annotations

from tracer.model.points import ATTENTION, DOWN_PROJ, LOGITS, MLP, O_PROJ, layer_point
from tracer.names.vocabulary import Vocabulary, register

MIXTRAL_BLOCK = "block_sparse_moe"  # transformers 4's Mixtral sparse block; its checkpoints' expert weights

HF = register(Vocabulary(
    "hf", "transformers' module paths and output fields (HF's attention works on (B, H, T, D))", "HTD",
    names={O_PROJ: (layer_point("{i}", ATTENTION),), DOWN_PROJ: (layer_point("{i}", MLP),), LOGITS: ("logits",)},
    families={"mixtral": {MLP: (layer_point("{i}", MIXTRAL_BLOCK),)}},
    tokens=("input_ids",),
))
