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

from dataclasses import dataclass, field

import numpy as np

from tracer.comparison.perplexity import (
    MIN_CTX,
    STATISTICS_MIN_COUNT,
    ChunkLine,
    Estimate,
    Statistics,
    TokenFigures,
    exact_kld,
    scored_rows,
    scored_targets,
    stored_log_probs,
    token_figures,
)
from tracer.core.errors import TracerError
from tracer.core.progress import detail
from tracer.engines.load import LoadTarget, load_engine
from tracer.files.sources import ModelSource
from tracer.files.tokenizer import TOKENIZER_FILE, tokenize_plain
from tracer.model.knobs import side_label, variant_text
from tracer.pipeline.request import Inputs, Request, Side, whole_number
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
        from tracer.reports.quality import perplexity_table  # jinja2, for Markdown: loaded when a report is asked

        return perplexity_table(self.to_dict())

    def markdown(self) -> str:
        from tracer.reports.quality import quality_markdown  # jinja2, for Markdown: loaded when a report is asked

        return quality_markdown(self.to_dict())

    def __str__(self) -> str:
        from tracer.reports.quality import quality_text  # jinja2, for Markdown: loaded when a report is asked

        return quality_text(self.to_dict())


def text_tokens(source: ModelSource, inputs: Inputs) -> tuple[list[int], int | None]:
    """(token ids, the BOS each chunk starts with): the text tokenized as llama-perplexity does; ids
    given as they are, with the BOS the model's tokenizer adds (none without a tokenizer)."""
    folder = source.directory
    has_tokenizer = folder is not None and (folder / TOKENIZER_FILE).is_file()
    if inputs.tokens is not None:
        return list(inputs.tokens), tokenize_plain(folder, "a")[1] if has_tokenizer else None
    if folder is None:
        raise TracerError("this loaded model has no tokenizer folder; pass token ids instead of a text")
    return tokenize_plain(folder, inputs.prompt)


def check_quality(request: Request, ctx: int, chunks: int | None) -> None:
    """What a quality request cannot ask, refused before its model resolves: an engine that cannot run an
    unrecorded forward (a saved trace), a chunk size or count out of range, a chat template or a
    truncation (quality reads a plain text)."""
    for side in request.sides:
        if not side.entry.logits:
            raise TracerError(f"the {side.entry.name} engine cannot give logits (a saved trace holds one forward); "
                              "quality needs an engine that runs the model")
    whole_number(ctx, "-c/--ctx", minimum=MIN_CTX)
    whole_number(chunks, "--chunks", minimum=1)
    if request.inputs.chat or request.inputs.max_tokens is not None:
        raise TracerError("quality reads a plain text: no chat template, no truncation")


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


def load_side(side: Side, role: str, target: LoadTarget, windows: list[list[int]], ctx: int):
    """One side's engine, loaded and checked against the chunks (positions, vocabulary)."""
    engine = load_engine(side.engine, side.variant, target)
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


def side_summary(side: Side) -> dict:
    engine = str(side.engine)
    return {"engine": engine, "variant": variant_text(side.variant), "label": side_label(engine, side.variant)}


def quality_notes(tokens: int, ctx: int, chunks: int, scored: int, bos: int | None, inputs: Inputs) -> list[str]:
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
