"""The public API: `record`, `run`, `sweep`, `diagnose`, `compare_files`, `quality`. The CLI maps onto these.

Run first, compare later: `record` turns a model and tokens into a `Trace`; `tracer.compare`
(`tracer.comparison.diff`) turns two traces into a `Result`. The other functions compose the two steps of
`tracer.pipeline.run` (prepare the reference once, compare a candidate against it) and add the report
folder.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tracer.comparison.fingerprint import resemblance
from tracer.comparison.result import Diagnosis, Result, Sweep, Tolerance
from tracer.core.errors import TracerError
from tracer.core.progress import stage, with_stages
from tracer.engines.base import at_positions, environment
from tracer.engines.load import load_engine
from tracer.engines.offload import check_offload, offload_for
from tracer.engines.registry import EngineRef
from tracer.files.sources import ModelSource, resolve_source
from tracer.ggml.audit import WeightAudit
from tracer.model.knobs import format_knob_value, parse_variant, variant_text
from tracer.pipeline.catalogue import default_variants, diagnosis_variants, split_variants
from tracer.pipeline.corpus import Quality, measure_quality
from tracer.pipeline.greedy import GREEDY_STEPS
from tracer.pipeline.regime_view import check_regime_decode, check_regime_run, compare_in_regime
from tracer.pipeline.regime_view import resolve as resolve_regime
from tracer.pipeline.request import (
    DEFAULT_CTX,
    DEFAULT_PROMPT,
    SWEEP_REPORT,
    Inputs,
    Outputs,
    Placement,
    Side,
    check_batch,
    check_decode,
    check_family_support,
    check_greedy,
    check_positions,
    check_tolerance,
    regime_knobs,
    request_of,
)
from tracer.pipeline.run import (
    candidate_loader,
    check_tokens,
    compare_candidate,
    config_audit,
    prepared_from_trace,
    prepared_reference,
    sweep_row,
    token_ids,
)
from tracer.traces.trace import Trace


@with_stages("load", "record")
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
    return record_values(inputs, Placement(device, stream, offload, max_memory), Side.of(engine, variant),
                         progress=progress)


@with_stages("load", "record")
def record_values(inputs: Inputs, placement: Placement, side: Side, *,
                  progress: bool = True) -> Trace | list[Trace]:
    """`record` on the request's values (`tracer.pipeline.request`), as the CLI builds them."""
    engine = side.engine
    check_positions(inputs.position_offset, side)
    check_decode(inputs.decode, side)
    check_batch(inputs.batch, side)
    if placement.stream and not side.entry.stream:
        raise TracerError(f"stream is for the engines that read weights block by block (hf, reimpl); "
                          f"the {engine} engine cannot")
    check_offload(placement.accelerate, engine)
    source = resolve_source(inputs.model, progress)
    check_family_support(engine, source)
    runner = load_engine(engine, source, side.variant, device=placement.device, stream=placement.stream,
                         offload=placement.accelerate)
    ids, chat_info = token_ids(source, inputs.text, inputs.tokens, chat=inputs.chat, system=inputs.system)
    check_tokens(ids, runner, inputs.position_offset)
    stage("record")
    if inputs.batch > 1:
        rows = [list(token_ids(source, *((row, None) if isinstance(row, str) else (None, row)), chat=inputs.chat,
                               system=inputs.system)[0]) for row in inputs.rows]
        for row in rows:
            check_tokens(row, runner)
        traces = runner.record_batch(rows)
        return [dataclasses.replace(trace, meta=dataclasses.replace(trace.meta, prompt=text, chat=None))
                if isinstance(text, str) else trace for trace, text in zip(traces, inputs.rows)]
    if inputs.decode:
        trace = runner.decode(ids, inputs.decode, offset=inputs.position_offset)
    else:
        trace = runner.record(ids, **at_positions(inputs.position_offset, len(ids)))
    if inputs.text is not None:
        trace.meta = dataclasses.replace(trace.meta, prompt=inputs.text)
    if chat_info:
        trace.meta = dataclasses.replace(trace.meta, chat=chat_info)
    return trace


@with_stages("load", "reference", "noise floor", "candidate", "greedy", "decode", "batch", "regime", "report")
def run(
    model=None,
    prompt: str | None = DEFAULT_PROMPT,
    *,
    reference: str = "hf",
    candidate: str = "reimpl",
    variant=None,
    reference_variant=None,
    atol: float | None = None,
    rtol: float | None = None,
    greedy: int | None = None,
    regime: str | None = None,
    noise_floor: bool = True,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    **request,
) -> Result:
    """Trace a reference and a candidate on the same tokens and localize the first divergence.

    The keywords naming the request's input and placement (tokens, max_tokens, chat, system,
    position_offset; device, stream, offload, max_memory) build its `Inputs` and `Placement` once
    (`tracer.pipeline.request.request_of`).

    Args:
        model: as in `record` (None: the bundled SmolLM2-135M-Instruct).
        prompt: the text to run; ignored when `tokens` is given.
        tokens: token ids, for models without a tokenizer.
        reference, candidate: engines ("hf", "reimpl", "file:PATH", ...; see `tracer engines`).
        variant, reference_variant: knobs for each side, e.g. "theta=10000".
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        greedy: greedy tokens to generate on both sides (0: none; default 20, or 0 for prompts
            over 128 tokens, where each step reruns the whole prompt on both sides).
        out: write the report folder there (summary.json, points.csv, curve.png, report.html).
        noise_floor: judge each point against the rounding noise measured by an f64 run of the
            reference model (default); False: against the fixed `Tolerance.rel_l2`.
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
        A `Result`; `bool(result)` is True when every point is within tolerance.

    Example:
        >>> result = tracer.run(variant="theta=10000", greedy=0, progress=False)
        >>> result.first_divergence.point
        'model.layers.0.self_attn.q_rope'
    """
    check_tolerance(atol, rtol)
    inputs, placement = request_of("run", model, prompt, request)
    return run_values(inputs, placement, Outputs(report=None if out is None else str(out)),
                      reference=Side.of(reference, reference_variant), candidate=Side.of(candidate, variant),
                      tolerance=Tolerance(atol=atol, rtol=rtol), greedy=greedy, noise_floor=noise_floor, regime=regime,
                      command=command, progress=progress)


@with_stages("load", "reference", "noise floor", "candidate", "greedy", "decode", "batch", "regime", "report")
def run_values(inputs: Inputs, placement: Placement, outputs: Outputs, *, reference: Side, candidate: Side,
               tolerance: Tolerance = Tolerance(), greedy: int | None = None, noise_floor: bool = True,
               regime=None, command: str | None = None, progress: bool = True) -> Result:
    """`run` on the request's values (`tracer.pipeline.request`: each side's engine and knobs parsed and
    checked), as the CLI builds them; the rest is checked here, before torch loads anything."""
    check_positions(inputs.position_offset, reference, candidate)
    check_decode(inputs.decode, reference, candidate)
    check_batch(inputs.batch, reference, candidate)
    check_greedy(greedy)
    regime = regime_knobs(regime)
    if regime is not None:
        check_regime_run(reference.engine, candidate.engine)
        if inputs.batch > 1:
            raise TracerError("--batch with --regime: a regime's own steps run one prompt; run them apart")
    # the rows are compared point by point; a greedy continuation would be the first row's only
    greedy_steps = 0 if inputs.batch > 1 and greedy is None else greedy
    variant = candidate.variant
    with prepared_reference(inputs, placement, reference=reference, tolerance=tolerance, noise_floor=noise_floor,
                            greedy_steps=greedy_steps, progress=progress, candidates=(candidate.engine,),
                            lockstep_with=candidate if regime is None else None) as prepared:
        in_regime = resolve_regime(regime, candidate.engine, variant, prepared.source) if regime is not None else None
        if in_regime is not None:  # before the candidate runs: a decode the regime cannot judge is refused now
            check_regime_decode(in_regime[0], in_regime[1], len(prepared.ids), inputs.decode)
        engine = prepared.lockstep.engine if prepared.lockstep is not None else \
            load_engine(candidate.engine, prepared.source, variant, device=placement.device,
                        stream=prepared.stream, offload=offload_for(candidate.engine, prepared.offload))
        if command is None and not prepared.source.loaded:  # no command line can name a model object
            command = run_command(inputs, placement, outputs, reference=str(reference.engine),
                                  candidate=str(candidate.engine), variant=variant, reference_variant=prepared.variant,
                                  tolerance=tolerance, greedy=greedy, noise_floor=noise_floor, regime=regime)
        result = compare_candidate(prepared, engine, command=command,
                                   notes=stream_notes(prepared.stream, candidate.engine),
                                   config_audit=config_audit(prepared.source, variant))
        if inputs.decode:
            from tracer.pipeline.decode import compare_decoded

            result = compare_decoded(result, prepared, engine, inputs.decode)
        if inputs.batch > 1:
            from tracer.pipeline.batch import compare_batched

            result = compare_batched(result, prepared, engine, inputs, reference)
        if in_regime is not None:
            stage("regime")
            result = compare_in_regime(result, prepared, engine, *in_regime, noise_floor=noise_floor,
                                       decode=inputs.decode)
    if outputs.report is not None:
        from tracer.reports import write_report

        stage("report")
        write_report(result, outputs.report)
    return result


@with_stages("load", "reference", "noise floor", "decode", "candidate", "report")
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
    noise_floor: bool = True,
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
    return sweep_values(inputs, placement, Outputs(report=None if out is None else str(out), kind=SWEEP_REPORT),
                        variants=variants,
                        reference=Side.of(reference, reference_variant), candidate=Side.of(candidate),
                        tolerance=Tolerance(atol=atol, rtol=rtol), greedy=greedy, noise_floor=noise_floor,
                        command=command, progress=progress)


@with_stages("load", "reference", "noise floor", "decode", "candidate", "report")
def sweep_values(inputs: Inputs, placement: Placement, outputs: Outputs, *, variants=None, reference: Side,
                 candidate: Side, tolerance: Tolerance = Tolerance(), greedy: int = 0, noise_floor: bool = True,
                 command: str | None = None, progress: bool = True) -> Sweep:
    """`sweep` on the request's values (`tracer.pipeline.request`), as the CLI builds them; a knob the
    candidate cannot honour is that variant's row's error."""
    check_positions(inputs.position_offset, reference, candidate)
    check_decode(inputs.decode, reference, candidate)
    texts = None if variants is None else split_variants(variants)
    parsed = None if texts is None else [parse_variant(text) for text in texts]  # before anything loads
    check_greedy(greedy)
    with prepared_reference(inputs, placement, reference=reference, tolerance=tolerance, noise_floor=noise_floor,
                            greedy_steps=greedy, progress=progress, candidates=(candidate.engine,)) as prepared:
        load_candidate = candidate_loader(candidate.engine, prepared)
        if parsed is None:
            spec = model_spec(prepared.source)
            parsed = [parse_variant(text) for text in default_variants(spec, candidate.entry.name,
                                                                       decode=bool(inputs.decode))]
        decoded = None
        if inputs.decode:  # the reference decodes once; every variant is fed its tokens
            from tracer.pipeline.decode import reference_decode

            stage("decode")
            decoded = (inputs.decode, reference_decode(prepared, inputs.decode))
        stage("candidate")
        rows = tuple(sweep_row(prepared, load_candidate, knobs, decoded=decoded) for knobs in parsed)
    result = Sweep(
        rows=rows, reference={"engine": str(reference.engine), "variant": prepared.variant,
                              "label": prepared.trace.label},
        candidate={"engine": str(candidate.engine)}, tolerance=prepared.tolerance, model=prepared.trace.meta.model,
        prompt=prepared.prompt, tokens=prepared.ids, chat=prepared.chat, greedy_steps=prepared.greedy_steps,
        reference_greedy=prepared.reference_greedy, environment=environment(), command=command,
        timings={**prepared.timings, "variants_s": sum(row.seconds or 0.0 for row in rows)}, notes=prepared.notes,
    )
    if outputs.report is not None:
        from tracer.reports import write_sweep_report

        stage("report")
        write_sweep_report(result, outputs.report)
    return result


@with_stages("load", "reference", "noise floor", "decode", "candidate")
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
    return diagnose_values(trace, Inputs(model, tokens=None, decode=decode),
                           Placement(device, stream, offload, max_memory), variants=variants, progress=progress)


@with_stages("load", "reference", "noise floor", "decode", "candidate")
def diagnose_values(trace, inputs: Inputs, placement: Placement = Placement(), *, variants=None,
                    progress: bool = True) -> Diagnosis:
    """`diagnose` on the request's values; `inputs` names the model (its prompt is the trace's tokens) and
    the decode steps to compare (`inputs.decode`)."""
    from tracer.engines.file import FileEngine

    observed_trace = load_trace(trace)
    if not observed_trace.tokens:
        raise TracerError("the trace carries no token ids; diagnose needs them to rerun the same input")
    steps = inputs.decode
    if steps and len(observed_trace.steps) < steps:
        raise TracerError(f"--decode {steps}: the trace holds {len(observed_trace.steps)} decode steps (record it "
                          f"with --decode {steps} or more)")
    tried = None if variants is None else [parse_variant(text) for text in split_variants(variants)]
    replay = Inputs(inputs.model, tokens=observed_trace.tokens)
    with prepared_reference(replay, placement, reference=Side.of("hf"), greedy_steps=0, progress=progress) as prepared:
        observed = compare_candidate(prepared, FileEngine(observed_trace))
        decoded = None
        if steps:  # the reference and every variant fed the observed trace's tokens
            from tracer.pipeline.decode import decoded_tokens, reference_decode, with_decoded

            stage("decode")
            started = time.perf_counter()
            observed_steps = dataclasses.replace(observed_trace, steps=observed_trace.steps[:steps])
            decoded = (steps, reference_decode(prepared, steps, forced=decoded_tokens(observed_steps)))
            observed = with_decoded(observed, prepared, *decoded[1], observed_steps, started,
                                    fed="the reference fed the trace's tokens")
        if tried is None:
            tried = [parse_variant(text) for text in diagnosis_variants(model_spec(prepared.source),
                                                                        decode=bool(steps))]
        stage("candidate")
        key = catalogue_key(prepared, placement, tried, steps)
        rows = _CATALOGUE_ROWS.get(key) if key is not None else None
        if rows is None:
            load_candidate = candidate_loader(EngineRef.named("reimpl"), prepared)
            # Without local errors: the observed trace has none (a file cannot rerun a block), so
            # both sides' first divergences are where the total error leaves the floor.
            rows = [sweep_row(prepared, load_candidate, knobs, local=False, decoded=decoded) for knobs in tried]
            _CATALOGUE_ROWS.clear()  # the last catalogue only: its rows hold every point's comparison
            if key is not None:
                _CATALOGUE_ROWS[key] = rows
    ranking = sorted((
        {"variant": row.variant, "score": resemblance(observed, row.result) if row.result is not None else 0.0,
         "verdict": row.verdict, "first_divergence": row.first_divergence and row.first_divergence.point,
         "error": row.error}
        for row in rows), key=lambda entry: entry["score"], reverse=True)
    return Diagnosis(observed, tuple(ranking))


@with_stages("load", "chunks")
def quality(text: str | None = None, model=None, *, text_file: str | Path | None = None, tokens=None,
            reference: str = "hf", candidate: str = "reimpl", variant=None, reference_variant=None,
            ctx: int = DEFAULT_CTX, chunks: int | None = None, by_layer: bool = False, device: str = "cpu",
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
        ctx: tokens per chunk (llama-perplexity's -c, default 512); the text needs 2·ctx tokens.
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
    return quality_values(inputs, Placement(device, stream, offload, max_memory),
                          reference=Side.of(reference, reference_variant), candidate=Side.of(candidate, variant),
                          ctx=ctx, chunks=chunks, by_layer=by_layer, text_name=text_name or ("<tokens>" if text is None
                                                                                    else "<text>"),
                          command=command)


@with_stages("load", "chunks")
def quality_values(inputs: Inputs, placement: Placement = Placement(), *, progress: bool = True,
                   **options) -> Quality:
    """`quality` on the request's values (`tracer.pipeline.request`), as the CLI builds them (`options`:
    `tracer.pipeline.corpus.measure_quality`'s)."""
    return measure_quality(inputs, placement, **options)


# The catalogue's rows for the last model, tokens and placement diagnosed: diagnosing several
# dumps of one prompt (a notebook, a porting CI job) runs the catalogue once per process.
_CATALOGUE_ROWS: dict[tuple, list] = {}


def catalogue_key(prepared, placement: Placement, tried: list[dict], steps: int = 0) -> tuple | None:
    """What the catalogue's rows depend on: the model's files as they are on disk now (size, mtime,
    ctime, inode of each), the tokens, the placement, the variants and the decode steps; None for a
    loaded model."""
    if prepared.source.loaded:
        return None
    from tracer.pipeline.reference_cache import folder_state

    model_dir = prepared.source.directory
    files = json.dumps(folder_state(model_dir), sort_keys=True)
    return (str(model_dir.resolve()), files, tuple(prepared.ids), repr(placement),
            tuple(variant_text(knobs) for knobs in tried), steps)


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

    Names are mapped onto points (`tracer.model.names`), layouts brought to ours (`tracer.traces.layouts`),
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
    from tracer.engines.file import FileEngine
    from tracer.model.names import alias_table

    check_tolerance(atol, rtol)
    Outputs(report=None if out is None else str(out))  # the report folder can be written: checked before reading
    table = alias_table(aliases)  # a bad mapping file is an error even when both traces are tracer's own
    ref_trace, cand_trace = (load_trace(side, table, shard_layout if is_sharded(side) else None)
                             for side in (reference, candidate))
    if shard_layout is not None and not (is_sharded(reference) or is_sharded(candidate)):
        raise TracerError("a shard layout was given, but neither side is a set of tensor-parallel shards")
    prepared = prepared_from_trace(ref_trace, Tolerance(atol=atol, rtol=rtol), cand_trace.tokens)
    result = compare_candidate(prepared, FileEngine(cand_trace), command=command)
    if ref_trace.steps or cand_trace.steps:  # decoded traces (`record --decode N`): every step, by the fixed bound
        from tracer.comparison.steps import compare_steps, with_steps

        result = with_steps(result, compare_steps(ref_trace, cand_trace, prepared.tolerance))
    if result.prompt is None and cand_trace.meta.prompt:
        result = result.with_context(prompt=cand_trace.meta.prompt)
    if out is not None:
        from tracer.reports import write_report

        write_report(result, out)
    return result


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
    from tracer.pipeline.regime_view import audit_weights

    return audit_weights({"weights": "gguf", "gguf_file": str(gguf)}, resolve_source(model, progress))


def is_sharded(trace_or_path) -> bool:
    """Several files, one per rank, or a directory (SGLang's dumper): a tensor-parallel run's shards."""
    if isinstance(trace_or_path, (list, tuple)):
        return len(trace_or_path) > 1 or (len(trace_or_path) == 1 and Path(trace_or_path[0]).is_dir())
    return isinstance(trace_or_path, (str, Path)) and Path(trace_or_path).is_dir()


def load_trace(trace_or_path, aliases=None, shard_layout=None) -> Trace:
    """A Trace as it is; a file read with `Trace.load`, or a dict name -> tensor, with foreign
    names mapped through the aliases; a list of files (one per rank) or an SGLang dumper directory
    merged by `shard_layout` and the dumps' declarations (`tracer.traces.shards`)."""
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, dict):
        from tracer.traces.trace import import_foreign

        return import_foreign(trace_or_path, {}, Path("<dict>"), aliases)
    paths = list(trace_or_path) if isinstance(trace_or_path, (list, tuple)) else [trace_or_path]
    if not paths:
        raise TracerError("no trace file given")
    if len(paths) > 1 or Path(paths[0]).is_dir():
        from tracer.traces.shards import load_shards

        return load_shards(paths, aliases, shard_layout)
    if shard_layout is not None:
        raise TracerError(f"a shard layout was given, but {paths[0]} is one trace, not shards of one")
    return Trace.load(paths[0], aliases)


def model_spec(source: ModelSource):
    """What the hf reader makes of the model's config (for the variants worth trying on it)."""
    from tracer.model.config import read_hf

    return read_hf(source.config())


def stream_notes(stream: bool, candidate: EngineRef) -> tuple[str, ...]:
    """A candidate engine that cannot stream loads its whole model: said."""
    if stream and not candidate.entry.stream:
        return (f"stream: the {candidate} engine loads its whole model (only engines that stream read weights "
                "block by block)",)
    return ()


def run_command(inputs: Inputs, placement: Placement, outputs: Outputs, *, reference: str, candidate: str,
                variant: dict, reference_variant: dict, tolerance: Tolerance, greedy, noise_floor: bool,
                regime) -> str:
    """The `tracer run` line that repeats a Python `run` call on a model path, for the report,
    derived from the CLI's parser: defaults left out."""
    from tracer.arguments import command_line

    knobs = {k: f"{k}={format_knob_value(v)}" for k, v in {**variant}.items()}
    several = len(set(inputs.rows)) > 1  # a batch of different rows: every row on the line
    tokens, prompt = inputs.tokens, inputs.prompt if inputs.prompt != DEFAULT_PROMPT else None
    if several and inputs.tokens is not None:
        tokens = ";".join(",".join(map(str, row)) for row in inputs.rows)
    elif several:
        prompt = list(inputs.rows)
    values = {
        "model": inputs.model,
        "tokens": None if tokens is None else tokens if isinstance(tokens, str) else ",".join(map(str, tokens)),
        "prompt": prompt if inputs.tokens is None else None,
        "chat": inputs.chat, "system": inputs.system,
        "max_tokens": inputs.max_tokens if inputs.tokens is None else None,
        "position_offset": inputs.position_offset, "decode": inputs.decode, "batch": inputs.batch,
        "reference": reference, "candidate": candidate,
        "reference_variant": [",".join(f"{k}={format_knob_value(v)}" for k, v in reference_variant.items())]
        if reference_variant else [],
        "variant": [",".join(knobs.values())] if knobs else [],
        "atol": tolerance.atol, "rtol": tolerance.rtol,
        "greedy": greedy if greedy != GREEDY_STEPS else None, "no_noise": not noise_floor,
        "device": placement.device, "stream": placement.stream, "no_stream": placement.stream is False,
        "regime": None if regime is None else regime if isinstance(regime, str) else variant_text(regime),
        "offload": placement.offload,
        "max_memory": ",".join(f"{d}={size}" for d, size in placement.max_memory.items())
        if placement.max_memory else None,
        "out": outputs.report, "no_report": outputs.report is None,
    }
    return command_line("run", values)
