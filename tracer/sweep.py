"""`sweep`: the reference recorded once, every variant compared with it, one row per variant.

The question a sweep answers is "what would each of these config mistakes do, and where would it
show?". The reference trace and its greedy continuation are computed once; each variant loads a
candidate (for reimpl, from the config and weights read once), records it and is compared. A
variant that fails to load (`layers=31`, `head_dim=32`) is a row holding its error, not an abort;
a variant that does not parse is an error before anything runs.

A variant costs one candidate forward and its diff. Greedy decoding recomputes the whole sequence
per token (a forward per token and variant), so a sweep decodes none unless asked (`greedy=N`);
the rows' logits (max |diff|, argmax agreement) already say what a variant does to the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tracer.diff import Result, Tolerance, compare
from tracer.engines.base import check_device, environment, is_loaded_model
from tracer.engines.load import load_engine
from tracer.errors import TracerError
from tracer.points import is_coarse
from tracer.variants import check_engine, knobs_for, parse_variant, variant_text

SWEEP_GREEDY = 0


@dataclass
class SweepRow:
    """One variant against the reference. `result` is the full comparison (None on error)."""

    variant: str
    knobs: dict
    verdict: str  # "match" | "diverged" | "error"
    first_divergence: dict | None = None
    logits: dict | None = None
    greedy: dict | None = None
    error: str | None = None
    curve: list[dict] = field(default_factory=list)  # coarse points: point, rel_l2, threshold, diverged
    notes: list[str] = field(default_factory=list)
    seconds: float | None = None
    result: Result | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {
            "variant": self.variant, "knobs": self.knobs, "verdict": self.verdict,
            "first_divergence": self.first_divergence, "logits": self.logits, "greedy": self.greedy,
            "error": self.error, "curve": self.curve, "notes": self.notes, "seconds": self.seconds,
        }


@dataclass
class Sweep:
    """Every variant's row, plus what they were compared against.

    Example:
        >>> sweep = tracer.sweep(variants=["theta=10000", "kv_repeat=tile"])
        >>> [(row.variant, row.first_divergence["point"]) for row in sweep.rows]
        [('theta=10000', 'model.layers.0.self_attn.q_rope'), ('kv_repeat=tile', 'model.layers.0.self_attn.scores')]
        >>> sweep.table()  # one row per variant, a pandas DataFrame
    """

    rows: list[SweepRow]
    reference: dict
    candidate: str
    tolerance: Tolerance
    model: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    greedy_steps: int = SWEEP_GREEDY
    reference_greedy: list[int] | None = None
    environment: dict = field(default_factory=dict)
    command: str | None = None
    timings: dict = field(default_factory=dict)

    def __getitem__(self, variant: str) -> SweepRow:
        for row in self.rows:
            if row.variant == variant:
                return row
        raise KeyError(variant)

    def to_dict(self) -> dict:
        from tracer import __version__

        return {
            "tracer_version": __version__, "kind": "sweep", "model": self.model, "prompt": self.prompt,
            "tokens": self.tokens, "reference": self.reference, "candidate": {"engine": self.candidate},
            "tolerance": self.tolerance.to_dict(), "greedy_steps": self.greedy_steps,
            "reference_greedy": self.reference_greedy, "variants": [row.to_dict() for row in self.rows],
            "environment": self.environment, "command": self.command, "timings": self.timings,
        }

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        """One row per variant: verdict, first divergence, logits max|diff|, greedy agreement."""
        from tracer.reports.sweep import sweep_frame

        return sweep_frame(self.to_dict())

    def plot(self):
        """Every variant's per-layer error curve overlaid, as a matplotlib figure."""
        from tracer.reports.sweep import sweep_figure

        return sweep_figure(self)

    def _repr_html_(self) -> str:
        from tracer.reports import sweep_html

        return sweep_html(self)


def split_variants(variants) -> list[str]:
    """`"theta=10000; kv_repeat=tile"` or a list of such strings -> one string per variant."""
    texts = [variants] if isinstance(variants, str) else list(variants)
    return [part.strip() for text in texts for part in text.split(";") if part.strip()]


def default_variants(spec) -> list[str]:
    """One representative variant per knob that applies to this model's family (its classic porting
    mistakes among them), for this model's spec; a knob whose feature the model lacks (a window, a
    soft-cap) has none."""
    chosen = []
    for knob in knobs_for(spec.family):
        text = knob.representative(spec)
        if text and text not in chosen:
            chosen.append(text)
    return chosen


def sweep(
    model=None,
    prompt: str | None = None,
    *,
    tokens=None,
    variants=None,
    reference: str = "hf",
    reference_variant=None,
    candidate: str = "reimpl",
    atol: float | None = None,
    rtol: float | None = None,
    greedy: int = SWEEP_GREEDY,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    noise_floor: bool = True,
    device: str = "cpu",
    stream: bool = False,
) -> Sweep:
    """Record the reference once and compare every variant of the candidate with it.

    Args:
        model: as in `tracer.run` (None: the bundled SmolLM2-135M-Instruct).
        prompt, tokens: the input, as in `tracer.run` (default prompt "The capital of France is").
        variants: variant strings ("theta=10000,rope=interleaved"), a list of them, or one string
            with `;` between variants; None: one representative value of every knob.
        reference, reference_variant: the reference engine and its knobs (default hf, none).
        candidate: the engine every variant runs on, "reimpl" (default) or "hf".
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        greedy: greedy tokens per variant (default 0: none; each token is a forward per variant).
        out: write the sweep report folder there (sweep.json, sweep.csv, sweep.png, sweep.html).
        noise_floor: judge points against the f64 rounding noise of the reference, measured once
            (as `tracer.run` does); False: against the fixed `Tolerance.rel_l2`.
        device, stream: as in `tracer.run`.

    Returns:
        A `Sweep`: `rows` in the order given, `table()`, `to_dict()`.

    Raises:
        TracerError: a variant that does not parse, an unknown engine, a missing model, a bad
            prompt. A variant that fails to load is a row with its error instead.
    """
    from tracer.api import (
        DEFAULT_PROMPT, _detokenizer, _draft, _noise, _notes, check_tokens, greedy_continuation, greedy_summary,
        resolve_source,
        token_ids,
    )
    from tracer.model import check_prompt

    started = time.perf_counter()
    texts = None if variants is None else split_variants(variants)
    parsed = None if texts is None else [parse_variant(text) for text in texts]
    reference_knobs = parse_variant(reference_variant)
    check_device(device)
    prompt = DEFAULT_PROMPT if prompt is None and tokens is None else prompt
    if tokens is None:
        check_prompt(prompt)  # before loading anything
    tolerance = Tolerance(atol=atol, rtol=rtol)
    source = resolve_source(model, progress)
    ref_engine = load_engine(reference, source, reference_knobs, device=device, stream=stream)
    ids = token_ids(source, None if tokens is not None else prompt, tokens)
    check_tokens(ids, ref_engine)
    ref_trace = ref_engine.record(ids)
    ref_greedy = greedy_continuation(ref_engine, ids, greedy, guess=_draft(ref_engine, ids, greedy)) if greedy else None
    noise, noise_notes = (_noise(source, (reference, ref_engine, reference_knobs), ref_trace, lambda side: None)
                          if noise_floor else (None, []))
    load_candidate = _candidate_loader(candidate, source, device, stream)
    if parsed is None:
        texts = default_variants(load_candidate.spec if hasattr(load_candidate, "spec") else _file_spec(source))
        parsed = [parse_variant(text) for text in texts]
    timings = {"reference_s": time.perf_counter() - started}

    detokenize = _detokenizer(source)
    rows = []
    for text, knobs in zip(texts, parsed):
        row_started = time.perf_counter()
        label = variant_text(knobs)
        try:
            engine = load_candidate(knobs)
            check_tokens(ids, engine)
            cand_trace = engine.record(ids)
            result = compare(ref_trace, cand_trace, tolerance, noise=noise)
            result.notes += noise_notes + _notes(cand_trace)
            cand_greedy = greedy_continuation(engine, ids, greedy, guess=ref_greedy) if ref_greedy is not None else None
            result.greedy = greedy_summary(ref_greedy, cand_greedy, detokenize)
            rows.append(SweepRow(label, knobs, result.verdict, result.first_divergence, result.logits, result.greedy,
                                 curve=_curve(result), notes=result.notes, result=result))
        except TracerError as exc:
            rows.append(SweepRow(label, knobs, "error", error=str(exc)))
        rows[-1].seconds = time.perf_counter() - row_started
    timings["total_s"] = time.perf_counter() - started

    result = Sweep(
        rows=rows, reference={"engine": reference, "variant": reference_knobs, "label": ref_trace.label},
        candidate=candidate, tolerance=tolerance, model=ref_trace.meta.get("model"),
        prompt=prompt if tokens is None else None, tokens=ids, greedy_steps=greedy, reference_greedy=ref_greedy,
        environment=environment(), command=command, timings=timings,
    )
    if out is not None:
        from tracer.reports.sweep import write_sweep_report

        write_sweep_report(result, out)
    return result


class _ReimplFromParts:
    """Builds a reimpl candidate per variant from the config and weights read once (streamed:
    the files opened once, each variant reading its blocks from them)."""

    def __init__(self, source, device: str, stream: bool):
        from tracer.config import load_config, read_hf
        from tracer.model import WeightFiles, read_weights

        self.label = str(source)
        self.config = load_config(source)
        self.weights = WeightFiles(source) if stream else read_weights(source)
        self.spec = read_hf(self.config)
        self.placement = {"device": check_device(device), "stream": stream}

    def __call__(self, knobs: dict):
        from tracer.engines.reimpl import from_parts

        check_engine(knobs, "reimpl")
        return from_parts(self.config, self.weights, knobs, self.label, **self.placement)


def _candidate_loader(candidate: str, source, device: str, stream: bool):
    if candidate == "reimpl" and not is_loaded_model(source):
        return _ReimplFromParts(source, device, stream)
    if candidate.startswith("file:"):
        raise TracerError("a sweep runs variants; a saved trace (file:PATH) cannot be the candidate")
    return lambda knobs: load_engine(candidate, source, knobs, device=device, stream=stream)


def _file_spec(source):
    from tracer.config import load_config, read_hf

    config = source.config.to_dict() if is_loaded_model(source) else load_config(source)
    return read_hf(config)


def _curve(result: Result) -> list[dict]:
    """The per-layer error curve of one variant: the coarse points' rel_l2, for the overlay figure."""
    return [{key: p.to_dict().get(key) for key in ("point", "layer", "rel_l2", "threshold", "diverged")}
            for p in result.points if is_coarse(p.point)]
