"""mlx-lm's names: its module paths are HF's (`model.layers.3.self_attn.q_proj`), so a point's own name is
its module's; these are the points mlx-lm gives otherwise, as a call of one of its modules (relative to a
layer): its RoPE module, called twice per layer (queries, then keys), and the context, the input of
o_proj. The mlx engine reads them (`tracer.engines.mlx.layer_calls`); a dump of mlx-lm's modules uses
HF's paths, so they map no dump's tensors."""

from __future__ import annotations

from tracer.model.points import CONTEXT, K_ROPE, O_PROJ, Q_ROPE
from tracer.names.vocabulary import Name, Vocabulary, register

ROPE_MODULE = "self_attn.rope"  # mlx-lm's `Attention.rope` (transformers has no such module)

MLX = register(Vocabulary(
    "mlx", "mlx-lm's module calls where they are not HF's module outputs", "HTD",
    names={Q_ROPE: (Name(ROPE_MODULE, call=0),), K_ROPE: (Name(ROPE_MODULE, call=1),),
           CONTEXT: (Name(O_PROJ, side="input"),)},
    aliases=False,
))
