"""A decoder block: the family's attention and MLP, each a residual branch, with the block's norms
around them: before each (Llama's pre-norm), before and after each (Gemma's sandwich), or after each
(OLMo-2's post-norm, before the residual add). The block composes its points in execution order from
its parts' (`points`), so the order, what each point is computed from and how hf observes the
residual stream are read off it, never written per family.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.core.lazy import torch
from tracer.model.component import Component, Point
from tracer.model.points import (
    BLOCK_INPUT,
    BLOCK_OUT,
    INPUT_NORM,
    MLP,
    POST_ATTENTION_NORM,
    POST_FF_NORM,
    PRE_FF_NORM,
    RESID_MID,
    WEIGHT,
)

# Norm positions around a block's two sublayers: (before, after) the attention, (before, after) the MLP.
PRE_NORM = ((INPUT_NORM, None), (POST_ATTENTION_NORM, None))
SANDWICH = ((INPUT_NORM, POST_ATTENTION_NORM), (PRE_FF_NORM, POST_FF_NORM))
POST_NORM = ((None, POST_ATTENTION_NORM), (None, POST_FF_NORM))

# A block norm -> its label; what it is before and after its sublayer.
_NORMS = {
    INPUT_NORM: ("in_norm", "RMSNorm before attention", None),
    POST_ATTENTION_NORM: ("post_norm", "RMSNorm before the MLP", "RMSNorm of the attention output, before the "
                                                                 "residual add"),
    PRE_FF_NORM: ("pre_ff_norm", "RMSNorm before the MLP (Gemma)", None),
    POST_FF_NORM: ("post_ff_norm", None, "RMSNorm of the MLP output, before the residual add"),
}


@dataclass(frozen=True)
class Block(Component):
    """One decoder block; `placement`: its norms (PRE_NORM, SANDWICH, POST_NORM)."""

    placement: tuple = PRE_NORM

    def norms(self) -> tuple[str, ...]:
        return tuple(name for pair in self.placement for name in pair if name)

    def _norm(self, name: str, source: str, before: bool) -> Point:
        label, what_before, what_after = _NORMS[name]
        return Point(name, label, "rows", "norm", what_before if before else what_after, source)

    def points(self, family) -> tuple[Point, ...]:
        """The block's points in execution order (transformers' modeling_<family>.py, op by op)."""
        attention, mlp = family.attention, family.mlp
        (attn_pre, attn_post), (mlp_pre, mlp_post) = self.placement
        order = [self._norm(attn_pre, BLOCK_INPUT, True)] if attn_pre else []
        order += attention.points(attn_pre or BLOCK_INPUT)
        # A post-norm (Gemma's sandwich, OLMo-2) normalizes the attention output before the residual add.
        order += [self._norm(attn_post, attention.output, False)] if attn_post else []
        order.append(Point(RESID_MID, "resid_mid", "rows", "residual", "after the attention residual add",
                           attn_post or attention.output, f"input:{mlp_pre or MLP}"))
        order += [self._norm(mlp_pre, RESID_MID, True)] if mlp_pre else []
        order += mlp.points(mlp_pre or RESID_MID)
        order += [self._norm(mlp_post, mlp.output, False)] if mlp_post else []
        order.append(Point(BLOCK_OUT, "block out", "rows", "block", "block output (after the MLP residual add)",
                           mlp_post or mlp.output))
        return tuple(order)

    def weights(self, spec) -> dict:
        return {name + WEIGHT: (spec.hidden_size,) for name in self.norms()}

    def forward(self, x: torch.Tensor, run, family) -> torch.Tensor:
        """x (1, T, C) -> (1, T, C): the attention branch, the residual add, the MLP branch, the add."""
        (attn_pre, attn_post), (mlp_pre, mlp_post) = self.placement
        h = x + self._branch(x, run, attn_pre, attn_post, family.attention.forward)
        run.record(RESID_MID, h)
        out = h + self._branch(h, run, mlp_pre, mlp_post, family.mlp.forward)
        run.record(BLOCK_OUT, out)
        return out

    @staticmethod
    def _branch(x: torch.Tensor, run, before: str | None, after: str | None, sublayer) -> torch.Tensor:
        """One residual branch (1, T, C) -> (1, T, C): the norm before it and after it, where there is one."""
        x = _norm_point(x, run, before)
        return _norm_point(sublayer(x, run), run, after)


def _norm_point(x: torch.Tensor, run, name: str | None) -> torch.Tensor:
    """The block's norm `name` applied and recorded; no norm there (None): x itself."""
    if name is None:
        return x
    x = run.steps.norm(x, run.weights[name + WEIGHT], run.spec.rms_norm_eps)
    run.record(name, x)
    return x
