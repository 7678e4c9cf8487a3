"""The Python API: `record`, `compare`, `run`. The CLI is a thin map over these.

Run first, compare later: `record` turns a model and tokens into a `Trace`, `compare` turns two
traces into a `Result`, `run` does both for a reference and a candidate engine on the same
tokens, adds greedy continuations, and writes the report folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tracer.diff import Result, Tolerance, compare
from tracer.engines import environment, is_loaded_model, load_engine
from tracer.errors import TracerError
from tracer.model import check_prompt
from tracer.trace import Trace
from tracer.variants import parse_variant

DEFAULT_PROMPT = "The capital of France is"
GREEDY_STEPS = 20


def resolve_source(model, progress: bool = True):
    """A loaded transformers model as it is; a path (None: the bundled default) as its HF directory."""
    if is_loaded_model(model):
        return model
    from tracer.model import resolve_model

    return resolve_model(model, progress=progress)


def token_ids(source, prompt: str | None = None, tokens=None) -> list[int]:
    """The ids to run: given directly, or the prompt tokenized with the model's tokenizer.json."""
    if tokens is not None:
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        if not ids:
            raise TracerError("empty token list")
        return ids
    if prompt is None:
        raise TracerError("give a prompt or token ids")
    from tracer.model import tokenize

    model_dir = source if not is_loaded_model(source) else source.config.to_dict().get("_name_or_path")
    if not model_dir or not Path(model_dir, "config.json").is_file():
        raise TracerError("this loaded model has no tokenizer folder; pass token ids instead of a prompt")
    return tokenize(model_dir, prompt)


def check_tokens(ids: list[int], engine) -> None:
    """Ids the model cannot embed, or more positions than it has, are the user's error, said plainly."""
    if engine.vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise TracerError(f"token id {bad[0]} is outside the vocabulary (0..{engine.vocab_size - 1})")
    if engine.max_positions is not None and len(ids) > engine.max_positions:
        raise TracerError(f"the prompt has {len(ids)} tokens; the model has {engine.max_positions} positions")


def record(model, tokens_or_prompt, engine: str = "hf", variant=None, *, progress: bool = True) -> Trace:
    """Record every point of one forward pass.

    Args:
        model: a model directory, a `.gguf` file, None for the bundled SmolLM2, or an already
            loaded transformers `LlamaForCausalLM`.
        tokens_or_prompt: a prompt (tokenized with the model's tokenizer) or a list of token ids.
        engine: "hf" (transformers, observed) or "reimpl" (tracer's own Llama).
        variant: knobs such as "theta=10000" or {"theta": 10000}; see `tracer variants`.

    Returns:
        The `Trace`: point name -> tensor in execution order, with metadata.

    Example:
        >>> trace = tracer.record(None, "The capital of France is", engine="reimpl", variant="theta=10000")
    """
    is_prompt = isinstance(tokens_or_prompt, str)
    if is_prompt:
        check_prompt(tokens_or_prompt)  # before loading anything: a bad prompt fails in no time
    source = resolve_source(model, progress)
    runner = load_engine(engine, source, parse_variant(variant))
    ids = token_ids(source, tokens_or_prompt if is_prompt else None, None if is_prompt else tokens_or_prompt)
    check_tokens(ids, runner)
    trace = runner.record(ids)
    if is_prompt:
        trace.meta["prompt"] = tokens_or_prompt
    return trace


def greedy_continuation(engine, tokens: list[int], steps: int) -> list[int] | None:
    """`steps` greedy tokens, recomputing the whole sequence each step (no cache on either side)."""
    if engine.max_positions is not None:
        steps = min(steps, engine.max_positions - len(tokens))
    ids = list(tokens)
    for _ in range(steps):
        logits = engine.logits(ids)
        if logits is None:
            return None
        ids.append(int(logits[-1].argmax()))
    return ids[len(tokens):]


def greedy_summary(reference: list[int] | None, candidate: list[int] | None, detokenize) -> dict | None:
    if reference is None or candidate is None:
        return None
    same = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), min(len(reference), len(candidate)))
    return {
        "reference": reference, "candidate": candidate, "steps": len(reference),
        "same_prefix": same,  # tokens before the first flip
        "first_flip": same + 1 if same < len(reference) else None,  # 1-based step of the first differing token
        "same_positions": sum(a == b for a, b in zip(reference, candidate)),
        "reference_text": detokenize(reference), "candidate_text": detokenize(candidate),
    }


def run(
    model=None,
    prompt: str | None = DEFAULT_PROMPT,
    *,
    tokens=None,
    reference: str = "hf",
    candidate: str = "reimpl",
    variant=None,
    reference_variant=None,
    atol: float | None = None,
    rtol: float | None = None,
    greedy: int = GREEDY_STEPS,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
) -> Result:
    """Trace a reference and a candidate on the same tokens and localize the first divergence.

    Args:
        model: as in `record` (None: the bundled SmolLM2-135M-Instruct).
        prompt: the text to run; ignored when `tokens` is given.
        tokens: token ids, for models without a tokenizer.
        reference, candidate: engines, "hf", "reimpl" or "file:PATH".
        variant, reference_variant: knobs for each side, e.g. "theta=10000".
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        greedy: greedy tokens to generate on both sides (0: none).
        out: write the report folder there (summary.json, points.csv, curve.png, report.html).

    Returns:
        A `Result`; `bool(result)` is True when every point is within tolerance.

    Example:
        >>> result = tracer.run(variant="theta=10000", out="tracer-report")
        >>> result.first_divergence["point"]
        'model.layers.0.self_attn.q_rope'
    """
    reference_variant, variant = parse_variant(reference_variant), parse_variant(variant)
    if tokens is None and prompt is not None:
        check_prompt(prompt)  # before loading anything: a bad prompt fails in no time
    timings = {}
    started = time.perf_counter()
    source = resolve_source(model, progress)
    ref_engine = load_engine(reference, source, reference_variant)
    cand_engine = load_engine(candidate, source, variant)
    timings["load_s"] = time.perf_counter() - started
    ids = token_ids(source, None if tokens is not None else prompt, tokens)
    for engine in (ref_engine, cand_engine):
        check_tokens(ids, engine)

    started = time.perf_counter()
    ref_trace = ref_engine.record(ids)
    timings["reference_s"] = time.perf_counter() - started
    started = time.perf_counter()
    cand_trace = cand_engine.record(ids)
    timings["candidate_s"] = time.perf_counter() - started

    result = compare(ref_trace, cand_trace, Tolerance(atol=atol, rtol=rtol))
    detokenize = _detokenizer(source)
    started = time.perf_counter()
    ref_greedy = greedy_continuation(ref_engine, ids, greedy) if greedy else None
    cand_greedy = greedy_continuation(cand_engine, ids, greedy) if ref_greedy is not None else None
    result.greedy = greedy_summary(ref_greedy, cand_greedy, detokenize)
    timings["greedy_s"] = time.perf_counter() - started
    result.prompt = prompt if tokens is None else None
    result.token_texts = [detokenize([t]) for t in ids] if detokenize([ids[0]]) is not None else None
    result.environment = environment()
    result.command = command
    result.timings = timings
    result.notes = _notes(ref_trace, cand_trace)
    if out is not None:
        from tracer.reports import write_report

        write_report(result, out)
    return result


def _detokenizer(source):
    from tracer.model import detokenize

    if is_loaded_model(source):
        return lambda ids: None
    return lambda ids: detokenize(source, ids)


def _notes(*traces: Trace) -> list[str]:
    """What a side skipped or could not use, said rather than ignored."""
    notes = []
    for trace in traces:
        if trace.meta.get("unused_config_keys"):
            notes.append(f"{trace.label}: config keys not read: {', '.join(trace.meta['unused_config_keys'])}")
        if trace.meta.get("unused_tensors"):
            names = trace.meta["unused_tensors"]
            notes.append(f"{trace.label}: {len(names)} tensors in the files are not used, e.g. {names[0]}")
        if trace.not_recorded:
            reasons = sorted(set(trace.not_recorded.values()))
            notes.append(f"{trace.label}: {len(trace.not_recorded)} points not recorded ({'; '.join(reasons)})")
    return notes
