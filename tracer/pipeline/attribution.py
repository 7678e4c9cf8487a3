"""Where the loss is made: each component of the candidate alone inside the reference's forward.

`tracer quality` measures how far a candidate's next-token distributions are from the
reference's over a text (`tracer.comparison.perplexity`). This module says where that KL divergence comes
from. Both sides are emulated by tracer's reimplementation (`tracer.reimpl.forward`): the reference on its
own weights in f32 arithmetic, the candidate in its own regime (a llama.cpp GGUF: llama.cpp's CPU
arithmetic on that file's tensors, `preset=llamacpp,weights=gguf`; a reimpl or hf variant: its
knobs). Then, for each component c (the embedding, every block, the final norm, lm_head), the
reference runs with c alone replaced by the candidate's: c is fed the reference's own input, its
output goes on through the reference's other components, and the final distributions are
compared with the reference's. Component c's share is that mean KL divergence over the
candidate's whole (measured) one. Both are the exact divergence (`tracer.comparison.perplexity.exact_kld`:
the whole vocabulary in f64), not llama-perplexity's 16-bit one, whose storage alone gives
identical logits a KLD of ~1e-7 to 1e-6: a component the candidate leaves unchanged then has a
share of exactly 0.

The candidate's components on the reference's inputs come from `tracer.reimpl.forced_runs`'s
teacher-forced run; the reference's continuation from block i+1 is the reimplementation's own
blocks. Cost per chunk: a reference forward, a teacher-forced candidate forward, a whole
candidate forward (the emulation's own total), and for the replaced runs L(L-1)/2 reference
blocks plus L+3 lm_heads on the scored half of the positions, and L+5 exact KLDs over the
vocabulary: on SmolLM2 (30 layers, 128 tokens) 25 plain forwards' time (30 in llama.cpp's regime).

The shares need not add up to 1: errors of several components compound or cancel downstream,
and the KL divergence is not additive. For small errors it is about quadratic in the logit error
(KLD ≈ ½ Var_p(δ)), so independent errors add in KLD to first order and the sum of shares is
near 1; the sum is reported as measured. Two checks come with the shares: the emulated
candidate's whole KLD against the measured one (is the emulation the candidate?), and the floor,
the KLD of the emulated reference from the real one (shares below it are not resolved).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tracer.comparison.perplexity import ExactKL, scored_rows, scored_slice
from tracer.core.errors import TracerError
from tracer.engines.registry import ENGINES, EngineRef, registered
from tracer.files.sources import ModelSource
from tracer.files.weights import read_weights
from tracer.model.knobs import KNOBS, variant_text
from tracer.model.points import EMBED, FINAL_LOGITS, FINAL_NORM, LOGITS, layer_of, layer_point
from tracer.pipeline.regime_view import runtime_regime
from tracer.reimpl.forced_runs import teacher_forced_points
from tracer.reimpl.forward import Model
from tracer.traces.trace import Trace, TraceMeta

REIMPL = ENGINES["reimpl"]


# --- what each side is emulated as ---------------------------------------------------------------


@dataclass(frozen=True)
class Emulation:
    """How tracer's reimplementation stands in for one side: its knobs, the GGUF file whose tensors
    it runs (None: the model directory's weights), and what of it is not exact."""

    knobs: dict
    gguf: Path | None = None
    caveats: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        weights = f" on {self.gguf.name}" if self.gguf else ""
        return (variant_text(self.knobs) or "no knobs") + weights


def emulation(engine: EngineRef, variant: dict, source: ModelSource, *, role: str) -> Emulation:
    """The reimplementation's stand-in for `engine` with `variant`. A candidate on a GGUF runtime
    (llamacpp, candle) runs in that runtime's regime on the file's own tensors; a reference on its
    file's tensors with transformers' ops (it is the yardstick; the floor says how close). Knobs the
    reimplementation does not honour (threads) are left out; an engine with no emulation is refused."""
    entry, argument = engine.entry, engine.argument
    knobs = {k: v for k, v in variant.items() if REIMPL.honours(k)}
    if entry.noise_floor:  # tracer's own model measures it: the reimplementation is it
        return Emulation(knobs)
    if entry.regime is None:
        able = ", ".join(e.name for e in registered().values() if e.noise_floor or e.regime)
        raise TracerError(f"--by-layer emulates each side with tracer's reimplementation; the {entry.name} engine "
                          f"has no emulation (use {able})")
    from tracer.engines.llamacpp import gguf_of  # its ctypes structures take 0.1 s: a llama.cpp side's only
    from tracer.ggml.strategies import GGUFWeights  # numba, for ggml's kernels: a regime's only

    path = gguf_of(source, argument)
    plain = {k: v for k, v in knobs.items() if KNOBS[k].kind != "regime"}  # theta, eps, ...
    if role == "reference":
        return Emulation({**plain, "weights": "gguf"}, path)
    implied, caveats = runtime_regime(entry.regime, GGUFWeights(path), variant)
    return Emulation({**implied, **plain}, path, tuple(caveats))


def emulated_model(source: ModelSource, emulated: Emulation, weights, device) -> Model:
    """The reimplementation running `emulated` (`weights`: the directory's, read once for both sides)."""
    config = dict(source.config())
    if emulated.gguf is not None:  # weights=gguf reads the file named here
        config["tracer_source"] = {"gguf_file": str(emulated.gguf)}
    return Model.from_config(config, weights, emulated.knobs, device=device)


def check_alike(reference: Model, candidate: Model) -> None:
    """The component swap needs the same shapes at every component's boundary."""
    for name in ("num_hidden_layers", "hidden_size", "vocab_size"):
        ours, theirs = getattr(reference.spec, name), getattr(candidate.spec, name)
        if ours != theirs:
            raise TracerError(f"--by-layer swaps components between the two sides, whose {name} differ "
                              f"({ours} vs {theirs})")


# --- the replaced runs -----------------------------------------------------------------------------


class Kept:
    """A recorder keeping only the named points (batch dimension dropped, on the run's device)."""

    def __init__(self, names):
        self.names, self.tensors = set(names), {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            self.tensors[name] = tensor.detach()[0]


def components(model: Model) -> list[str]:
    """The points whose producers are swapped one at a time, in execution order."""
    names = [EMBED, *(layer_point(i, "") for i in range(model.spec.num_hidden_layers)), FINAL_NORM, LOGITS]
    return names + ([FINAL_LOGITS] if model.spec.final_logit_softcapping is not None else [])


def run_on(model: Model, point: str, value: torch.Tensor, positions, rows: slice) -> torch.Tensor:
    """The reference's forward continued after `point`, whose output is `value` (T, ...): the
    logits of the positions `rows` (the blocks run on every position, the head on those only;
    `positions`: `Model.positions` of the chunk's tokens)."""
    h = value[None].to(model.steps.dtype)  # (1, T, C) or (1, T, V)
    if point == FINAL_LOGITS:
        return h[0, rows]
    if point == LOGITS:
        return model.head_step(FINAL_LOGITS, h[:, rows])[0]  # capped where the config caps (else as is)
    if point == FINAL_NORM:
        return model.head_step(FINAL_LOGITS, model.head_step(LOGITS, h[:, rows]))[0]  # (R, V)
    start = 0 if point == EMBED else layer_of(point) + 1
    for i in range(start, model.spec.num_hidden_layers):
        h = model.block(i, h, positions)  # (1, T, C)
    return model.head(h[:, rows])[0]  # (R, V)


class ReplacedRuns:
    """One chunk's runs: the reference's logits of the scored `rows` (`baseline`), the candidate's
    own (T, V), and, one at a time (`swapped`), the reference's with one component alone the
    candidate's."""

    @torch.inference_mode()
    def __init__(self, reference: Model, candidate: Model, tokens: list[int], rows: slice):
        ids = torch.tensor(tokens)
        self.reference, self.names, self.rows = reference, components(reference), rows
        kept = Kept(self.names)
        reference.forward(ids, kept)
        self.candidate_logits = candidate.forward(ids)  # (T, V)
        self.forced = Kept(self.names)  # the candidate's components, each on the reference's input
        teacher_forced_points(candidate, Trace(kept.tensors, TraceMeta(tokens=list(tokens))), self.forced)
        self.positions = reference.positions(count=len(tokens))
        # The reference's own logits of those rows, computed as the replaced runs' are (the head on
        # the rows alone: a matmul of other shapes may round otherwise), so an unchanged component
        # gives exactly the same numbers.
        last = layer_point(reference.spec.num_hidden_layers - 1, "")
        self.baseline = run_on(reference, last, kept.tensors[last], self.positions, rows)  # (R, V)

    @torch.inference_mode()
    def swapped(self):
        """(component, (R, V) logits of the rows asked for) in execution order, each computed when asked for."""
        for name in self.names:
            yield name, run_on(self.reference, name, self.forced.tensors[name], self.positions, self.rows)


# --- the value -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """One component swapped alone: the KLD it causes, its share of the candidate's, and how often
    the top token still agrees."""

    component: str
    kld: float
    share: float
    same_top: float

    def to_dict(self) -> dict:
        return {"component": self.component, "kld": self.kld, "share": self.share, "same_top": self.same_top}


@dataclass(frozen=True)
class Attribution:
    """Where the candidate's KL divergence is made (module docstring).

    Attributes:
        shares: per component, in execution order.
        total_kld: the candidate's measured mean exact KLD (the real engines), the shares' denominator.
        emulated_kld: the emulated candidate's whole mean exact KLD from the emulated reference.
        floor_kld: the emulated reference's mean exact KLD from the real reference.
        sum_of_shares: the shares added (1 only when the components' losses add).
        reference, candidate: how each side is emulated (`Emulation.text`).
        caveats: what of the candidate's emulation is not exact.
        seconds: the attribution's own time.
    """

    shares: tuple[Share, ...]
    total_kld: float
    emulated_kld: float
    floor_kld: float
    sum_of_shares: float
    reference: str
    candidate: str
    caveats: tuple[str, ...] = ()
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"shares": [s.to_dict() for s in self.shares], "total_kld": self.total_kld,
                "emulated_kld": self.emulated_kld, "floor_kld": self.floor_kld,
                "sum_of_shares": self.sum_of_shares, "reference": self.reference, "candidate": self.candidate,
                "caveats": list(self.caveats), "seconds": self.seconds}


class Attributor:
    """Accumulates the replaced runs chunk by chunk; `result` turns them into an `Attribution`."""

    def __init__(self, source: ModelSource, reference: Emulation, candidate: Emulation, device="cpu"):
        started = time.perf_counter()
        weights = dict(source.module.state_dict()) if source.loaded else read_weights(source.directory)
        self.emulations = (reference, candidate)
        self.reference = emulated_model(source, reference, weights, device)
        self.candidate = emulated_model(source, candidate, weights, device)
        check_alike(self.reference, self.candidate)
        self.names = components(self.reference)
        self.kld: dict[str, list[np.ndarray]] = {name: [] for name in (*self.names, WHOLE, FLOOR)}
        self.same_top: dict[str, list[np.ndarray]] = {name: [] for name in self.names}
        self.seconds = time.perf_counter() - started

    def add(self, tokens: list[int], n_ctx: int, reference_rows: np.ndarray) -> None:
        """One chunk; `reference_rows`: the real reference's scored (N, V) logits."""
        started = time.perf_counter()
        runs = ReplacedRuns(self.reference, self.candidate, tokens, scored_slice(n_ctx))
        ours = runs.baseline.float().cpu().numpy()  # (R, V)
        self.kld[FLOOR].append(ExactKL(reference_rows)(ours))
        from_ours = ExactKL(ours)
        self.kld[WHOLE].append(from_ours(_rows(runs.candidate_logits, n_ctx)))
        top = ours.argmax(axis=1)
        for name, logits in runs.swapped():
            rows = logits.float().cpu().numpy()  # (R, V): the scored rows only
            self.kld[name].append(from_ours(rows))
            self.same_top[name].append(rows.argmax(axis=1) == top)
        self.seconds += time.perf_counter() - started

    def result(self, total_kld: float) -> Attribution:
        """The shares of `total_kld`, the candidate's measured mean exact KLD."""
        def mean(values: list[np.ndarray]) -> float:
            return float(np.concatenate(values).mean())

        shares = tuple(Share(name, mean(self.kld[name]), mean(self.kld[name]) / total_kld if total_kld else math.nan,
                             mean(self.same_top[name])) for name in self.names)
        reference, candidate = self.emulations
        return Attribution(
            shares=shares, total_kld=total_kld, emulated_kld=mean(self.kld[WHOLE]), floor_kld=mean(self.kld[FLOOR]),
            sum_of_shares=sum(s.share for s in shares), reference=reference.text, candidate=candidate.text,
            caveats=candidate.caveats, seconds=self.seconds)


WHOLE, FLOOR = "<whole candidate>", "<reference emulated>"  # the two checks' keys


def _rows(logits: torch.Tensor, n_ctx: int) -> np.ndarray:
    return scored_rows(logits, n_ctx).float().cpu().numpy()
