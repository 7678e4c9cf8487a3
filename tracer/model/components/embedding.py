"""The token embedding: plain (Llama) or scaled by √hidden in the model's dtype (Gemma)."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import F, torch
from tracer.model.component import Component, Point
from tracer.model.knobs import Knob, choice, fixed, setting
from tracer.model.points import EMBED, WEIGHT


def embed_plain(ids: torch.Tensor, weight: torch.Tensor, spec) -> torch.Tensor:
    """(1, T) -> (1, T, C): rows of the table."""
    return F.embedding(ids, weight)


def embed_scaled(ids: torch.Tensor, weight: torch.Tensor, spec) -> torch.Tensor:
    """Gemma: rows times sqrt(hidden_size), the scale rounded to the model's dtype first (transformers
    builds its buffer in the load dtype: a bf16 Gemma 2 9B multiplies by 60.0, not 59.87)."""
    scale = torch.tensor(spec.hidden_size**0.5, dtype=weight.dtype, device=weight.device)  # 0-dim
    return F.embedding(ids, weight) * scale


def embed_scaled_f32(ids: torch.Tensor, weight: torch.Tensor, spec) -> torch.Tensor:
    """A Gemma port that scales in f32 and casts the product (the same numbers in f32, not in bf16)."""
    return (F.embedding(ids, weight).float() * spec.hidden_size**0.5).to(weight.dtype)


EMBED_SCALE = Knob("embed_scale", choice("model", "drop", "f32"), "model | drop | f32", "model",
                   "Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model's dtype: drop forgets "
                   "it, f32 scales in f32 before the cast (differs in bf16/f16 only)",
                   fixed("embed_scale=drop"),
                   expected=f"{EMBED} (f32: with dtype=bf16 or f16 only, rel_l2 ~2e-3, as large as bf16's own rounding "
                            "there: seen against the fixed bound, --no-noise)", kind="semantic", after="norm_offset")

@dataclass(frozen=True)
class Embedding(Component):
    """Rows of the embedding table."""

    def points(self, family) -> tuple[Point, ...]:
        return (Point(EMBED, "embed", "rows", "embedding", self.what, ""),)

    @property
    def what(self) -> str:
        return "token embeddings"

    def weights(self, spec) -> dict:
        return {EMBED + WEIGHT: (spec.vocab_size, spec.hidden_size)}

    def steps(self, knobs: dict, spec) -> dict:
        return {"embed": embed_plain}

    def forward(self, ids: torch.Tensor, run) -> torch.Tensor:
        """(1, T) ids -> (1, T, C), recorded."""
        h = run.steps.embed(ids, run.weights[EMBED + WEIGHT], run.spec)  # (1, T, C)
        run.record(EMBED, h)
        return h


@dataclass(frozen=True)
class ScaledEmbedding(Embedding):
    """Gemma's: rows × √hidden_size, the scale in the model's dtype."""

    knobs = (EMBED_SCALE,)

    @property
    def what(self) -> str:
        return "token embeddings times sqrt(hidden_size), the scale in the model's dtype"

    def steps(self, knobs: dict, spec) -> dict:
        return {"embed": {"model": embed_scaled, "drop": embed_plain,
                          "f32": embed_scaled_f32}[setting(knobs, "embed_scale")]}
