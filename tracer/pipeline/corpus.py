"""`tracer quality`: how much a candidate loses over a corpus, with llama-perplexity's figures.

The text is tokenized as llama-perplexity tokenizes it (`tracer.files.tokenizer.tokenize_plain`), cut
into its chunks (`tracer.comparison.perplexity.chunk_tokens`), and each chunk runs through the reference
engine and the candidate engine, both loaded once, as unrecorded forwards (`Engine.logits`: no
point is recorded, every position's logits come back). The reference's scored rows are stored
as llama-perplexity stores its base (16 bits per vocabulary entry) and the candidate's are
scored against them; only each chunk's small per-token figures are kept, so memory does not grow
with the text. `by_layer` adds where the loss is made (`tracer.pipeline.attribution`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tracer.comparison.perplexity import (
    MIN_CTX,
    STATISTICS_MIN_COUNT,
    ChunkLine,
    Estimate,
    Statistics,
    TokenFigures,
    chunk_tokens,
    exact_kld,
    mean_and_uncertainty,
    scored_rows,
    scored_targets,
    stored_log_probs,
    token_figures,
)
from tracer.core.errors import TracerError
from tracer.core.progress import detail, stage
from tracer.engines.base import environment
from tracer.engines.load import load_engine
from tracer.engines.offload import check_offload, offload_for
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource, resolve_source
from tracer.model.knobs import side_label, variant_text
from tracer.pipeline.request import DEFAULT_CTX, Inputs, Placement, Side, check_family_support, whole_number
from tracer.pipeline.run import check_tokens


@dataclass(frozen=True)
class Quality:
    """What a candidate loses against a reference over a text, in llama-perplexity's terms.

    Attributes:
        reference, candidate: {"engine", "variant", "label"} of each side.
        model: the model the engines ran (its directory, or the GGUF files the engines name).
        text: where the text came from (a file name, "<text>", or "<tokens>").
        tokens: how many tokens the text has; `bos` the id put at each chunk's start (None: none).
        ctx: the chunk size (-c); `chunks` how many chunks were evaluated.
        statistics: llama-perplexity's final statistics (`tracer.comparison.perplexity.Statistics`).
        exact_kld: the mean KLD over the whole vocabulary in f64 from both sides' f32 logits, without
            llama-perplexity's 16-bit storage of the base and its -16 cutoff (`perplexity.exact_kld`).
        lines: its running line after each chunk (`ChunkLine`).
        layers: where the loss is made (`tracer.pipeline.attribution.Attribution`), when asked for.
        timings: seconds per stage; `notes`: what the figures rest on.

    Example:
        >>> q = tracer.quality(text="The capital of France is Paris. " * 40, variant="theta=10000", ctx=64,
        ...                    progress=False)
        >>> q.statistics.kld.value > 0, q.statistics.ppl_diff.value > 0  # a wrong RoPE base loses
        (True, True)
    """

    reference: dict
    candidate: dict
    model: str | None
    text: str | None
    tokens: int
    bos: int | None
    ctx: int
    chunks: int
    statistics: Statistics
    exact_kld: Estimate
    lines: tuple[ChunkLine, ...]
    layers: object | None = None  # tracer.pipeline.attribution.Attribution
    timings: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    command: str | None = None
    environment: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form (`--json`): every field, the statistics as llama-perplexity's names."""
        return {"reference": self.reference, "candidate": self.candidate, "model": self.model, "text": self.text,
                "tokens": self.tokens, "bos": self.bos, "ctx": self.ctx, "chunks": self.chunks,
                "scored": self.statistics.count, "statistics": self.statistics.to_dict(),
                "exact_kld": self.exact_kld.to_dict(),
                "lines": [line.to_dict() for line in self.lines],
                "layers": None if self.layers is None else self.layers.to_dict(),
                "timings": self.timings, "notes": list(self.notes), "command": self.command,
                "environment": self.environment}

    def table(self) -> str:
        """llama-perplexity's printed statistics, line for line."""
        from tracer.reports.quality import perplexity_table

        return perplexity_table(self.to_dict())

    def markdown(self) -> str:
        from tracer.reports.quality import quality_markdown

        return quality_markdown(self.to_dict())

    def __str__(self) -> str:
        from tracer.reports.quality import quality_text

        return quality_text(self.to_dict())


def text_tokens(source: ModelSource, inputs: Inputs) -> tuple[list[int], int | None]:
    """(token ids, the BOS each chunk starts with): the text tokenized as llama-perplexity does; ids
    given as they are, with the BOS the model's tokenizer adds (none without a tokenizer)."""
    from tracer.files.tokenizer import TOKENIZER_FILE, tokenize_plain

    folder = source.directory
    has_tokenizer = folder is not None and (folder / TOKENIZER_FILE).is_file()
    if inputs.tokens is not None:
        return list(inputs.tokens), tokenize_plain(folder, "a")[1] if has_tokenizer else None
    if folder is None:
        raise TracerError("this loaded model has no tokenizer folder; pass token ids instead of a text")
    return tokenize_plain(folder, inputs.prompt)


def check_logits(engine: EngineRef) -> None:
    """An engine that cannot run an unrecorded forward (a saved trace) is refused before loading."""
    entry = engine.entry
    if not entry.logits:
        raise TracerError(f"the {entry.name} engine cannot give logits (a saved trace holds one forward); "
                          "quality needs an engine that runs the model")


def chunk_logits(engine, tokens: list[int], role: str) -> np.ndarray:
    """(T, V) f32 logits of one chunk; an engine giving fewer rows is refused in one line."""
    logits = engine.logits(tokens)
    if logits is None or logits.shape[0] != len(tokens):
        rows = "none" if logits is None else f"{logits.shape[0]} rows"
        raise TracerError(f"the {role} engine ({engine.name}) gave {rows} of logits for {len(tokens)} tokens; "
                          "quality needs every position's")
    return logits.float().cpu().numpy()


def check_context(engine, ctx: int, role: str) -> None:
    if engine.max_positions is not None and ctx > engine.max_positions:
        raise TracerError(f"-c {ctx} is more than the model's {engine.max_positions} positions ({role} engine "
                          f"{engine.name})")


def measure_quality(inputs: Inputs, placement: Placement, *, reference: Side, candidate: Side,
                    ctx: int = DEFAULT_CTX, chunks: int | None = None, by_layer: bool = False,
                    text_name: str | None = None, command: str | None = None) -> Quality:
    """`tracer.quality` on the request's values (`tracer.pipeline.request`: each side's engine and knobs
    parsed and checked), as the CLI and the API build them; the rest is checked before an engine loads."""
    started = time.perf_counter()
    for side in (reference, candidate):
        check_logits(side.engine)
    check_offload(placement.accelerate, reference.engine, candidate.engine)
    whole_number(ctx, "-c/--ctx", minimum=MIN_CTX)
    whole_number(chunks, "--chunks", minimum=1)
    if inputs.chat or inputs.max_tokens is not None:
        raise TracerError("quality reads a plain text: no chat template, no truncation")
    source = resolve_source(inputs.model, progress=False)
    for side in (reference, candidate):
        check_family_support(side.engine, source)
    ids, bos = text_tokens(source, inputs)
    windows = chunk_tokens(ids, ctx, bos, chunks)
    engines = {role: load_side(side, role, source, placement, windows, ctx)
               for role, side in (("reference", reference), ("candidate", candidate))}
    attributor = None
    if by_layer:
        from tracer.pipeline.attribution import Attributor, emulation

        attributor = Attributor(source, emulation(reference.engine, reference.variant, source, role="reference"),
                                emulation(candidate.engine, candidate.variant, source, role="candidate"),
                                placement.device)
    layers_s = attributor.seconds if attributor else 0.0
    timings = {"load_s": time.perf_counter() - started - layers_s}
    stage("chunks")
    started = time.perf_counter()
    figures, exact, lines = score_chunks(engines, ids, windows, ctx, attributor)
    statistics = Statistics.of(figures)
    exact_mean = mean_and_uncertainty(exact.sum(), (exact * exact).sum(), len(exact))
    layers = None
    if attributor is not None:
        layers = attributor.result(exact_mean.value)
        timings["layers_s"] = attributor.seconds
    timings["chunks_s"] = time.perf_counter() - started - (attributor.seconds - layers_s if attributor else 0.0)
    return Quality(
        reference=_side(reference), candidate=_side(candidate),
        model=source.name, text=text_name, tokens=len(ids), bos=bos, ctx=ctx, chunks=len(windows),
        statistics=statistics, exact_kld=exact_mean, lines=tuple(lines), layers=layers, timings=timings,
        notes=tuple(_notes(len(ids), ctx, len(windows), statistics.count, bos, inputs)), command=command,
        environment=environment())


def load_side(side: Side, role: str, source: ModelSource, placement: Placement, windows: list[list[int]],
              ctx: int):
    """One side's engine, loaded and checked against the chunks (positions, vocabulary)."""
    engine = load_engine(side.engine, source, side.variant, device=placement.device, stream=placement.stream,
                         offload=offload_for(side.engine, placement.accelerate))
    check_context(engine, ctx, role)
    for window in windows:
        check_tokens(window, engine)
    return engine


def score_chunks(engines: dict, ids: list[int], windows: list[list[int]], ctx: int, attributor=None):
    """Every chunk through both engines: (the scored tokens' figures, their exact KLDs (N,) f64,
    llama-perplexity's running line after each chunk); `attributor` takes each chunk too."""
    figures, exact, lines = [], [], []
    for number, window in enumerate(windows):
        detail(f"chunk {number + 1}/{len(windows)}")
        reference_rows = scored_rows(chunk_logits(engines["reference"], window, "reference"), ctx)  # (N, V)
        candidate_rows = scored_rows(chunk_logits(engines["candidate"], window, "candidate"), ctx)  # (N, V)
        figures.append(token_figures(candidate_rows, stored_log_probs(reference_rows),
                                     scored_targets(ids, ctx, number)))
        exact.append(exact_kld(reference_rows, candidate_rows))
        lines.append(ChunkLine.after(number + 1, TokenFigures.concatenate(figures)))
        if attributor is not None:
            attributor.add(window, ctx, reference_rows)
    return TokenFigures.concatenate(figures), np.concatenate(exact), lines


def _side(side: Side) -> dict:
    engine = str(side.engine)
    return {"engine": engine, "variant": variant_text(side.variant), "label": side_label(engine, side.variant)}


def _notes(tokens: int, ctx: int, chunks: int, scored: int, bos: int | None, inputs: Inputs) -> list[str]:
    notes = []
    dropped = tokens - chunks * ctx
    if dropped:
        notes.append(f"the last {dropped} tokens fill no whole chunk of {ctx}: not evaluated (as llama-perplexity)")
    if scored < STATISTICS_MIN_COUNT:
        notes.append(f"{scored} scored tokens: llama-perplexity prints no final statistics under "
                     f"{STATISTICS_MIN_COUNT}; these figures are uncertain")
    if inputs.tokens is not None:
        notes.append("token ids given: used as they are" + (f", BOS {bos} at each chunk's start" if bos is not None
                                                            else ", no BOS put at chunk starts"))
    return notes
