"""The public API: `record`, `run`, `sweep`, `diagnose`, `compare_files`, `audit_gguf`, `quality`.

Run first, compare later: `record` turns a model and tokens into a `Trace`; `tracer.compare`
(`tracer.comparison.diff`) turns two traces into a `Result`. Each function here is a façade: it builds
its command's `Request` from its arguments (`tracer.pipeline.request`: every value checked once, before
torch loads) and hands it to the command's composition of the pipeline's stages
(`tracer.pipeline.commands`), which the CLI calls with the `Request` it builds from its flags.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from tracer.arguments import run_command
from tracer.comparison.result import Diagnosis, Result, Sweep, Tolerance, Triangulation
from tracer.core.errors import TracerError
from tracer.files.sources import resolve_source
from tracer.ggml.audit import WeightAudit
from tracer.pipeline import commands
from tracer.pipeline.corpus import Quality
from tracer.pipeline.regime_view import audit_weights
from tracer.pipeline.request import (
    DEFAULT_PROMPT,
    SWEEP_REPORT,
    Inputs,
    Outputs,
    Placement,
    Request,
    Side,
    candidate_sides,
    check_tolerance,
    one_candidate,
    request_of,
    sweep_candidate,
)
from tracer.traces.trace import Trace


def record(model, tokens_or_prompt, engine: str = "hf", variant=None, *, device: str = "cpu", stream: bool = False,
           chat: bool = False, system: str | None = None, offload: str | Path | None = None, max_memory=None,
           position_offset: int = 0, decode: int = 0, batch: int = 1, progress: bool = True) -> Trace | list[Trace]:
    """Record every point of one forward pass (and, with `decode`, of every cached decode step after it).

    Args:
        model: a model directory, a `.gguf` file, None for the bundled SmolLM2, or an already
            loaded transformers model.
        tokens_or_prompt: a prompt (tokenized with the model's tokenizer) or a list of token ids.
        engine: "hf" (transformers, observed), "reimpl" (tracer's own model) or another engine
            of `tracer engines`.
        variant: knobs such as "theta=10000" or {"theta": 10000}; see `tracer variants`.
        device: where the model runs ("cpu", "cuda", "cuda:1", "mps"); the trace is kept on the CPU.
        stream: read each block's weights from the files when it runs (engines that can: hf,
            reimpl), so memory holds one block (for checkpoints larger than memory).
        chat, system: feed the prompt through the model's chat template (with a system message).
        offload, max_memory: load the model through accelerate's big-model placement (engines
            that can: hf): device_map="auto" under `max_memory` ("cpu=2GiB,0=20GiB" or a dict),
            what fits nowhere in the `offload` folder; for models larger than memory.
        position_offset: the first token's absolute position (default 0), on the engines that take
            positions (hf, reimpl, llamacpp): RoPE at far positions, as a decode step deep in a context sees it.
        decode: after the prompt's prefill, decode this many greedy tokens one at a time with the engine's
            own KV cache (engines that decode: hf, reimpl, llamacpp, mlx, candle); the steps are `trace.steps`
            (docs/decode.md).
        batch: run B rows as one left-padded batch with an attention mask (engines: hf, reimpl;
            docs/batch.md): `tokens_or_prompt` a list of B prompts or of B token lists, or one repeated.

    Returns:
        The `Trace`: point name -> tensor in execution order, with metadata; with `batch`, one trace per
        row, each at the row's real positions (its padding cut off).

    Example:
        >>> trace = tracer.record(None, "The capital of France is", engine="reimpl", variant="theta=10000",
        ...                       progress=False)
        >>> trace["model.layers.0.self_attn.q_rope"].shape
        torch.Size([9, 5, 64])
    """
    is_prompt = isinstance(tokens_or_prompt, str) or (
        isinstance(tokens_or_prompt, (list, tuple)) and bool(tokens_or_prompt)
        and all(isinstance(row, str) for row in tokens_or_prompt))
    inputs = Inputs(model, tokens_or_prompt if is_prompt else None, None if is_prompt else tokens_or_prompt,
                    chat=chat, system=system, position_offset=position_offset, decode=decode, batch=batch)
    request = Request(inputs, Placement(device, stream, offload, max_memory), Side.of(engine, variant),
                      progress=progress)
    return commands.record(request)


def run(
    model=None,
    prompt: str | None = DEFAULT_PROMPT,
    *,
    reference: str = "hf",
    candidate: str | list[str] = "reimpl",
    variant=None,
    reference_variant=None,
    atol: float | None = None,
    rtol: float | None = None,
    greedy: int | None = None,
    regime: str | None = None,
    noise_floor: bool | str = True,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    **request,
) -> Result | Triangulation:
    """Trace a reference and a candidate on the same tokens and localize the first divergence.

    The keywords naming the request's input and placement (tokens, max_tokens, chat, system,
    position_offset; device, stream, offload, max_memory) build its `Inputs` and `Placement` once
    (`tracer.pipeline.request.request_of`).

    Args:
        model: as in `record` (None: the bundled SmolLM2-135M-Instruct).
        prompt: the text to run; ignored when `tokens` is given.
        tokens: token ids, for models without a tokenizer.
        reference, candidate: engines ("hf", "reimpl", "file:PATH", ...; see `tracer engines`). Either may carry
            its own knobs as its label writes them: "llamacpp:m.gguf[kv_cache=f32,flash_attn=off]".
            `candidate` a list of two or more: a triangulation, every one of them against one reference run and
            against each other (docs/explain.md, "Triangulation"), each with its knobs in brackets; returns a
            `Triangulation`. Not with `decode`, `batch` or `regime` yet (one line says so).
        variant, reference_variant: knobs for each side, e.g. "theta=10000" (`variant`: a lone candidate's).
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        greedy: greedy tokens to generate on both sides (0: none; default 20, or 0 for prompts
            over 128 tokens, where each step reruns the whole prompt on both sides).
        out: write the report folder there (summary.json, points.csv, curve.png, report.html).
        noise_floor: judge each point against the rounding noise measured by an f64 run of the
            reference model: True or "cheap" (default), a run of the prompt's first quarter, scaled, and the
            exact floor wherever a verdict rests on it; "exact", a run of the whole prompt (docs/floor.md);
            False: against the fixed `Tolerance.rel_l2`.
        max_tokens: keep only the first `max_tokens` tokens of the prompt.
        chat, system: feed the prompt through the model's chat template, as an instruct model
            is used (with a system message); the report shows the templated text.
        device: where both models run ("cpu", "cuda", "cuda:1", "mps"); traces are kept on the CPU.
        stream: a side whose engine can stream (hf, reimpl) reads each block's weights from the
            files when it runs (one block in memory); the others load their whole model, which the
            notes say. None (default): streamed past 2 GiB of f32 weights (`tracer.pipeline.streamed`).
        regime: compare in a number-format regime (`tracer.pipeline.regime_view`): "auto" takes the one the
            candidate's runtime and model file imply (llama.cpp's CPU arithmetic on its GGUF's
            tensor types; a 16-bit dtype), or knobs such as "weights=q4_1,act_quant=q8_1". The
            verdict is then the regime view's; `result.regime` holds the raw f32 view, the
            regime's own cost per point and the per-op errors on the candidate's inputs.
        offload, max_memory: as in `record`, for every side whose engine can take them (hf): a
            reference larger than memory.
        position_offset: the first token's absolute position (default 0), both sides (hf, reimpl).
        decode: after the prompt, each side decodes this many tokens one at a time with its own KV cache,
            the candidate fed the reference's greedy tokens, and every step is compared (hf, reimpl;
            docs/decode.md): `result.steps`, and the first step that diverges is the one `points` show.
        batch: run B rows as one left-padded batch with an attention mask on each side (hf, reimpl;
            docs/batch.md): `prompt` a list of B prompts (or `tokens` a list of B lists), or one repeated
            B times. Each candidate row is compared with the reference's batch-1 run of its prompt at its
            real positions: `result.batch`, and the first row that diverges is the one `points` show.
            No greedy continuation unless `greedy` is given.

    Prompts over 256 tokens are recorded to a temporary folder point by point and compared from
    there (`tracer.traces.spill`), and attention matrices over 128 tokens keep their last 128 query
    rows, so memory stays bounded (SmolLM2 at 2048 tokens: under 4 GB resident).

    Returns:
        A `Result`; `bool(result)` is True when every point is within tolerance. For several candidates a
        `Triangulation`: each one's `Result`, the agreement table and the odd one; `bool()` is True when every
        candidate matches the reference.

    Example:
        >>> result = tracer.run(variant="theta=10000", greedy=0, progress=False)
        >>> result.first_divergence.point
        'model.layers.0.self_attn.q_rope'
    """
    check_tolerance(atol, rtol)
    inputs, placement = request_of("run", model, prompt, request)
    one, several = candidate_sides(candidate, variant)
    asked = Request(inputs, placement, Side.of(reference, reference_variant), one,
                    Outputs(report=None if out is None else str(out)), Tolerance(atol=atol, rtol=rtol), greedy=greedy,
                    noise_floor=noise_floor, regime=regime, command=command, progress=progress, candidates=several)
    if command is None and (model is None or isinstance(model, (str, os.PathLike))):  # a model object has no line
        asked = dataclasses.replace(asked, command=run_command(asked))
    return commands.run(asked)


def sweep(
    model=None,
    prompt: str | None = None,
    *,
    variants=None,
    reference: str = "hf",
    reference_variant=None,
    candidate: str = "reimpl",
    atol: float | None = None,
    rtol: float | None = None,
    greedy: int = 0,
    noise_floor: bool | str = True,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    **request,
) -> Sweep:
    """Record the reference once and compare every variant of the candidate with it.

    Each row is what `tracer.run(..., variant=V)` finds for that variant (the same pipeline:
    noise floor, local errors, long-prompt spilling), at the cost of one candidate forward and
    its diff. A variant that fails to load (`layers=31`) is a row holding its error.

    Args:
        model, prompt, and the keywords of the input and placement (tokens, max_tokens, chat, system,
            position_offset, decode; device, stream, offload, max_memory): as in `tracer.run`. With
            `decode=N` the reference decodes once and every variant decodes N steps with its own cache,
            fed the reference's tokens; a row's `step` is the decode step of its first divergence.
        variants: variant strings ("theta=10000,rope=interleaved"), a list of them, or one string
            with `;` between variants; None: one representative value of every knob (with `decode`, the
            decode-only knobs too: `decode_positions=restart`, `cache_keys=unrotated`).
        reference, reference_variant: the reference engine and its knobs (default hf, none).
        candidate: the engine every variant runs on ("reimpl", "hf", or another engine taking knobs).
        atol, rtol, noise_floor: as in `tracer.run`.
        greedy: greedy tokens per variant (default 0: none; each token is a forward per variant).
        out: write the sweep report folder there (sweep.json, sweep.csv, sweep.png, sweep.html).

    Returns:
        A `Sweep`: `rows` in the order given, `table()`, `to_dict()`.

    Raises:
        TracerError: a variant that does not parse, an unknown engine, a missing model, a bad
            prompt.

    Example:
        >>> sweep = tracer.sweep(variants="theta=10000; eps=1e-3", progress=False)
        >>> [row.first_divergence.point for row in sweep.rows]
        ['model.layers.0.self_attn.q_rope', 'model.layers.0.input_layernorm']
    """
    check_tolerance(atol, rtol)
    given = DEFAULT_PROMPT if prompt is None and request.get("tokens") is None else prompt
    inputs, placement = request_of("sweep", model, given, request)
    request = Request(inputs, placement, Side.of(reference, reference_variant),
                      sweep_candidate(candidate),
                      Outputs(report=None if out is None else str(out), kind=SWEEP_REPORT),
                      Tolerance(atol=atol, rtol=rtol), greedy=greedy, noise_floor=noise_floor, variants=variants,
                      command=command, progress=progress)
    return commands.sweep(request)


def diagnose(trace, model=None, *, variants=None, decode: int = 0, device: str = "cpu", stream: bool | None = None,
             offload: str | Path | None = None, max_memory=None, progress: bool = True) -> Diagnosis:
    """Rank the variant catalogue by how well each reproduces an observed trace's error.

    The observed trace (a port's dump, another runtime's) is compared with the reference; then
    every variant of the catalogue runs on the reimplementation against the same reference, and
    each variant's error fingerprint (`tracer.comparison.fingerprint`) is matched with the observed one.

    Args:
        trace: the observed candidate: a `Trace` or a trace file (any runtime's, see
            docs/trace-format.md); it must carry its token ids.
        model: the model it ran (None: the bundled SmolLM2).
        variants: the variants to try (default: `tracer.pipeline.catalogue.diagnosis_variants`).
        decode: compare the trace's first N decode steps too (a trace recorded with `decode=N`): the
            reference and every variant decode N steps with their own KV cache, fed the trace's tokens,
            and the catalogue gains the decode-only knobs.
        offload, max_memory: as in `tracer.record`, for the hf reference.

    Returns:
        A `Diagnosis`: `observed` (the comparison with the reference) and `ranking`, best first.

    Example:
        >>> observed = tracer.record(None, "The capital of France is", engine="reimpl", variant="eps=1e-4",
        ...                          progress=False)
        >>> tracer.diagnose(observed, variants="theta=10000; eps=1e-4", progress=False).best["variant"]
        'eps=0.0001'
    """
    request = Request(Inputs(model, tokens=None, decode=decode), Placement(device, stream, offload, max_memory),
                      variants=variants, progress=progress)
    return commands.diagnose(request, trace)


def quality(text: str | None = None, model=None, *, text_file: str | Path | None = None, tokens=None,
            reference: str = "hf", candidate: str = "reimpl", variant=None, reference_variant=None,
            ctx: int | None = None, chunks: int | None = None, by_layer: bool = False, device: str = "cpu",
            stream: bool = False, offload: str | Path | None = None, max_memory=None, command: str | None = None,
            progress: bool = True) -> Quality:
    """How much a candidate loses against a reference over a text, in llama-perplexity's terms.

    The text is tokenized and cut as `llama-perplexity --kl-divergence` cuts it (chunks of `ctx`
    tokens, BOS first where the vocabulary adds one, the second half of each chunk scored); both
    engines give every chunk's logits, and the figures are llama-perplexity's, computed as it
    computes them (docs/quality.md): mean KLD with its uncertainty, percentiles, same top p,
    PPL of both sides and their difference, Δp statistics.

    Args:
        text: the text itself; or `text_file`, a UTF-8 file; or `tokens`, token ids.
        model: as in `run` (None: the bundled SmolLM2-135M-Instruct); its tokenizer reads the text.
        reference, candidate: engines that run the model ("hf", "reimpl", "llamacpp:F16.gguf", ...).
        variant, reference_variant: knobs for each side, e.g. "theta=10000".
        ctx: tokens per chunk (llama-perplexity's -c); the text needs 2·ctx tokens. None: 512, halved until
            the text fills two chunks (a note says so).
        chunks: evaluate at most this many chunks (llama-perplexity's --chunks).
        by_layer: also say where the loss is made: each component (embedding, every block, final
            norm, lm_head) of the candidate alone inside the reference's forward (`tracer.pipeline.attribution`).
        device, stream, offload, max_memory: as in `run`.

    Returns:
        A `Quality`: `statistics` (`.kld`, `.same_top`, `.ppl_diff`, ...), `layers`, `to_dict()`,
        `table()` (llama-perplexity's printed table), `markdown()`.

    Raises:
        TracerError: fewer than 2·ctx tokens, a ctx past the model's positions, an engine that cannot
            give logits (a saved trace), an unknown engine or knob.

    Example:
        >>> q = tracer.quality(text="The capital of France is Paris. " * 40, variant="theta=10000", ctx=64,
        ...                    progress=False)  # bundled SmolLM2 against itself with a wrong RoPE base
        >>> q.chunks, round(q.statistics.kld.value, 4), round(q.statistics.same_top.value, 4)
        (4, 0.0346, 0.9355)

        llama.cpp's F16 against its Q4_K_M on `tests/data/porting.txt` at ctx=128 gives llama-perplexity's
        own figures (docs/quality.md).
    """
    text_name = None
    if text_file is not None:
        if text is not None:
            raise TracerError("give a text or a text file, not both")
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TracerError(f"cannot read text file {text_file}: {getattr(exc, 'strerror', None) or exc}") from None
        text_name = Path(text_file).name
    if text is None and tokens is None:
        raise TracerError("give a text (text=, text_file=) or token ids (tokens=)")
    inputs = Inputs(model, prompt=text, tokens=tokens)
    request = Request(inputs, Placement(device, stream, offload, max_memory), Side.of(reference, reference_variant),
                      Side.of(one_candidate(candidate, "quality"), variant), command=command, progress=progress)
    return commands.quality(request, ctx=ctx, chunks=chunks, by_layer=by_layer,
                            text_name=text_name or ("<tokens>" if text is None else "<text>"))


def compare_files(
    reference,
    candidate,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    aliases=None,
    out: str | Path | None = None,
    command: str | None = None,
    shard_layout=None,
) -> Result:
    """Compare two saved traces: tracer's own, or dumps from candle, llama.cpp, MLX, PyTorch, or a
    tensor-parallel run's dumps (one file per rank, or SGLang's dumper directory) merged into one.

    Names are mapped onto points (`tracer.names.aliases`), layouts brought to ours (`tracer.traces.layouts`),
    and only the points both sides have are compared; the Result's `notes` say what was missing
    on each side, which names were not recognized and which layout was assumed.

    Args:
        reference, candidate: paths to safetensors files (docs/trace-format.md) or `Trace`s; a list of
            paths (one per tensor-parallel rank) or an SGLang dumper directory is merged first
            (`tracer.traces.shards`).
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        aliases: a user name mapping: a dict, a JSON file path, or an `AliasTable`.
        out: write the report folder there.
        shard_layout: how the ranks split each point, replacing the defaults and the dumps' own
            declarations: {point, sub-point or pattern with {i}: "column" | "column:AXIS" | "row" |
            "replicated"}, or a JSON file of it.

    Returns:
        A `Result`; `bool(result)` is True when every compared point is within tolerance.

    Raises:
        TracerError: unreadable file, different token ids, shapes that cannot be reconciled.

    Example:
        >>> ref = tracer.record(None, "The capital of France is", engine="reimpl", progress=False)
        >>> cand = tracer.record(None, "The capital of France is", engine="reimpl", variant="theta=10000",
        ...                      progress=False)
        >>> tracer.compare_files(ref, cand).first_divergence.point
        'model.layers.0.self_attn.q_rope'
    """
    check_tolerance(atol, rtol)
    outputs = Outputs(report=None if out is None else str(out))  # the report folder can be written: checked first
    return commands.compare_files(reference, candidate, tolerance=Tolerance(atol=atol, rtol=rtol), aliases=aliases,
                                  outputs=outputs, command=command, shard_layout=shard_layout)


def audit_gguf(gguf: str | Path, model=None, *, progress: bool = True) -> WeightAudit:
    """A GGUF file's tensors against llama.cpp's own requantization of a model's weights: each
    identical, another legitimate quantization (an importance matrix, another quantizer), or
    damaged, with where and how far (`tracer.ggml.audit`; what `run(..., regime="auto")` does
    before it takes a GGUF's tensors, `result.regime.audit`).

    Args:
        gguf: the GGUF file, e.g. one made by llama.cpp's quantizer from this model.
        model: the model whose weights it should hold: a directory, None for the bundled SmolLM2,
            or a loaded transformers model.

    Returns:
        A `WeightAudit`: `verdict`, `damaged` (the GGUF names of damaged tensors), `tensors`.

    Example:
        >>> from tracer.files.sources import bundled_gguf
        >>> audit = tracer.audit_gguf(bundled_gguf(), progress=False)  # the bundled SmolLM2's own Q4_1 file
        >>> audit.verdict, audit.damaged
        ('identical', ())
    """
    return audit_weights({"weights": "gguf", "gguf_file": str(gguf)}, resolve_source(model, progress))
