"""The Python API: `record`, `compare`, `run`. The CLI is a thin map over these.

Run first, compare later: `record` turns a model and tokens into a `Trace`, `compare` turns two
traces into a `Result`, `run` does both for a reference and a candidate engine on the same
tokens, adds greedy continuations, and writes the report folder.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tracer.diff import Result, Tolerance, compare, compare_points
from tracer.engines.base import check_device, environment, is_loaded_model
from tracer.engines.load import check_engine_name, load_engine
from tracer.errors import TracerError
from tracer.progress import detail, stage, with_stages
from tracer.spill import spill_folder
from tracer.model import check_prompt
from tracer.trace import Trace
from tracer.variants import parse_variant

DEFAULT_PROMPT = "The capital of France is"
GREEDY_STEPS = 20
LONG_PROMPT = 128  # past this, greedy decoding (a whole forward per step and side) is off by default


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


@with_stages("load", "record")
def record(model, tokens_or_prompt, engine: str = "hf", variant=None, *, device: str = "cpu", stream: bool = False,
           progress: bool = True) -> Trace:
    """Record every point of one forward pass.

    Args:
        model: a model directory, a `.gguf` file, None for the bundled SmolLM2, or an already
            loaded transformers `LlamaForCausalLM`.
        tokens_or_prompt: a prompt (tokenized with the model's tokenizer) or a list of token ids.
        engine: "hf" (transformers, observed) or "reimpl" (tracer's own Llama).
        variant: knobs such as "theta=10000" or {"theta": 10000}; see `tracer variants`.
        device: where the model runs ("cpu", "cuda", "cuda:1", "mps"); the trace is kept on the CPU.
        stream: reimpl only: read each block's weights from the memory-mapped files when it runs,
            so memory holds one block (for checkpoints larger than memory).

    Returns:
        The `Trace`: point name -> tensor in execution order, with metadata.

    Example:
        >>> trace = tracer.record(None, "The capital of France is", engine="reimpl", variant="theta=10000")
    """
    is_prompt = isinstance(tokens_or_prompt, str)
    if is_prompt:
        check_prompt(tokens_or_prompt)  # before loading anything: a bad prompt fails in no time
    check_engine_name(engine)
    check_device(device)
    from tracer.engines.registry import parse_engine

    if stream and not parse_engine(engine)[0].stream:
        raise TracerError(f"stream is the reimpl engine's (it reads weights block by block); the {engine} engine cannot")
    source = resolve_source(model, progress)
    runner = load_engine(engine, source, parse_variant(variant), device=device, stream=stream)
    ids = token_ids(source, tokens_or_prompt if is_prompt else None, None if is_prompt else tokens_or_prompt)
    check_tokens(ids, runner)
    stage("record")
    trace = runner.record(ids)
    if is_prompt:
        trace.meta["prompt"] = tokens_or_prompt
    return trace


def greedy_continuation(engine, tokens: list[int], steps: int, guess: list[int] | None = None) -> list[int] | None:
    """`steps` greedy tokens, as decoding step by step without a cache (the whole sequence
    recomputed each step) gives them.

    `guess`, the other side's continuation, saves most of those forwards: one forward over the
    prompt and the guess gives this engine's argmax after every prefix of it, and as long as
    they agree the guess is this engine's continuation too. The first disagreement is then
    confirmed by the step's own forward (a longer sequence may round differently), and decoding
    goes on step by step from there. Two sides that agree cost one forward instead of `steps`.
    """
    if engine.max_positions is not None:
        steps = min(steps, engine.max_positions - len(tokens))
    out: list[int] = []
    checked = False  # `out` ends where a check against the guess found a disagreement
    while len(out) < steps:
        on_guess = guess is not None and len(guess) >= steps and out == guess[:len(out)]
        if on_guess and not checked and len(out) < steps - 1:
            agreeing = _agreeing_prefix(engine, tokens, out, guess[:steps])
            if agreeing is None:  # it cannot check a guess: decode step by step
                guess = None
                continue
            out, checked = out + guess[len(out):len(out) + agreeing], True
        else:
            logits = engine.logits(tokens + out)
            if logits is None:
                return None
            out, checked = out + [int(logits[-1].argmax())], False
        detail(f"token {len(out)}/{steps}")
    return out


def _agreeing_prefix(engine, tokens: list[int], done: list[int], guess: list[int]) -> int | None:
    """How many of `guess`'s tokens after `done` this engine would itself pick, from one forward
    over the prompt and the guess; None if it cannot say (no logits, or the last position's only)."""
    logits = engine.logits(tokens + guess[:-1])  # (T + steps - 1, V)
    if logits is None or logits.shape[0] < len(tokens) + len(guess) - 1:
        return None
    picked = logits[len(tokens) - 1 + len(done):].argmax(-1).tolist()  # after each prefix of the guess
    rest = guess[len(done):]
    return next((i for i, (a, b) in enumerate(zip(picked, rest)) if a != b), len(rest))


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


@with_stages("load", "reference", "candidate", "noise floor", "greedy", "report")
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
    greedy: int | None = None,
    out: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    noise_floor: bool = True,
    max_tokens: int | None = None,
    device: str = "cpu",
    stream: bool = False,
) -> Result:
    """Trace a reference and a candidate on the same tokens and localize the first divergence.

    Args:
        model: as in `record` (None: the bundled SmolLM2-135M-Instruct).
        prompt: the text to run; ignored when `tokens` is given.
        tokens: token ids, for models without a tokenizer.
        reference, candidate: engines, "hf", "reimpl" or "file:PATH".
        variant, reference_variant: knobs for each side, e.g. "theta=10000".
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        greedy: greedy tokens to generate on both sides (0: none; default 20, or 0 for prompts
            over 128 tokens, where each step reruns the whole prompt on both sides).
        out: write the report folder there (summary.json, points.csv, curve.png, report.html).
        noise_floor: judge each point against the rounding noise measured by an f64 run of the
            reference model (default); False: against the fixed `Tolerance.rel_l2`.
        max_tokens: keep only the first `max_tokens` tokens of the prompt.
        device: where both models run ("cpu", "cuda", "cuda:1", "mps"); traces are kept on the CPU.
        stream: a reimpl side reads each block's weights from the files when it runs (one block
            in memory); an hf side loads the whole model, which the notes say.

    Prompts over 256 tokens are recorded to a temporary folder point by point and compared from
    there (`tracer.spill`), and attention matrices over 128 tokens keep their last 128 query
    rows, so memory stays bounded (SmolLM2 at 2048 tokens: under 4 GB resident).

    Returns:
        A `Result`; `bool(result)` is True when every point is within tolerance.

    Example:
        >>> result = tracer.run(variant="theta=10000", out="tracer-report")
        >>> result.first_divergence["point"]
        'model.layers.0.self_attn.q_rope'
    """
    reference_variant, variant = parse_variant(reference_variant), parse_variant(variant)
    for engine_name in (reference, candidate):
        check_engine_name(engine_name)
    check_device(device)
    if tokens is None and prompt is not None:
        check_prompt(prompt)  # before loading anything: a bad prompt fails in no time
    timings = {}
    started = time.perf_counter()
    source = resolve_source(model, progress)
    ref_engine = load_engine(reference, source, reference_variant, device=device, stream=stream)
    cand_engine = load_engine(candidate, source, variant, device=device, stream=stream)
    timings["load_s"] = time.perf_counter() - started
    ids = token_ids(source, None if tokens is not None else prompt, tokens)
    truncated = max_tokens is not None and len(ids) > max_tokens
    notes = [f"prompt truncated from {len(ids)} to its first {max_tokens} tokens"] if truncated else []
    notes += _stream_notes(stream, (reference, candidate))
    ids = ids[:max_tokens] if truncated else ids
    for engine in (ref_engine, cand_engine):
        check_tokens(ids, engine)
    if greedy is None:
        greedy = GREEDY_STEPS if len(ids) <= LONG_PROMPT else 0
        notes += [] if greedy else [f"no greedy continuation for a {len(ids)}-token prompt (pass greedy=N to force)"]
    with spill_folder(len(ids)) as sink:
        result = _recorded_comparison(source, (reference, ref_engine, reference_variant), cand_engine, ids,
                                      Tolerance(atol=atol, rtol=rtol), noise_floor, sink, timings)
    result.notes = notes + result.notes
    detokenize = _detokenizer(source)
    with timed(timings, "greedy_s"):
        stage("greedy")
        result.greedy = _greedy(ref_engine, cand_engine, ids, greedy, result.tolerance, detokenize)
    result.prompt = prompt if tokens is None else None
    result.token_texts = [detokenize([t]) for t in ids] if detokenize([ids[0]]) is not None else None
    result.environment = environment()
    result.command = command if command is not None else run_command(
        model, prompt, ids if tokens is not None else None, reference, candidate, variant,
        reference_variant, atol, rtol, greedy, noise_floor, out, max_tokens if tokens is None else None, device, stream)
    result.timings = timings
    result.config_audit = _config_audit(source, variant)
    if out is not None:
        from tracer.reports import write_report

        stage("report")
        write_report(result, out)
    return result


def _draft(engine, tokens: list[int], steps: int) -> list[int] | None:
    """A cached decode to check instead of decoding step by step, where the engine has one (hf)."""
    if not engine.entry.draft or steps < 2:
        return None
    if engine.max_positions is not None:
        steps = min(steps, engine.max_positions - len(tokens))
    return engine.draft(tokens, steps) if steps > 0 else None


def _continuation(engine, ids: list[int], steps: int, guess: list[int] | None) -> list[int] | None:
    """An engine whose registry says greedy="cached" continues with its own cached decode, taken
    as is (llama.cpp's KV-cache decode is what is compared); the others decode without a cache."""
    if engine.entry.greedy == "cached":
        return _draft(engine, ids, steps) if steps > 1 else greedy_continuation(engine, ids, steps)
    return greedy_continuation(engine, ids, steps, guess=guess)


def _greedy(ref_engine, cand_engine, ids: list[int], steps: int, tolerance: Tolerance, detokenize) -> dict | None:
    """Both sides' greedy continuations and, if they part, the first divergent point at that step."""
    ref_greedy = _continuation(ref_engine, ids, steps, _draft(ref_engine, ids, steps)) if steps else None
    cand_greedy = _continuation(cand_engine, ids, steps, ref_greedy) if ref_greedy is not None else None
    summary = greedy_summary(ref_greedy, cand_greedy, detokenize)
    if summary and summary["first_flip"]:
        # Where the two sides part at the step whose argmax flips: same tokens on both sides.
        flip_ids = ids + ref_greedy[: summary["first_flip"] - 1]
        at_flip = compare(ref_engine.record(flip_ids), cand_engine.record(flip_ids), tolerance)
        summary["first_flip_divergence"] = at_flip.first_divergence and {
            k: at_flip.first_divergence[k] for k in ("point", "layer", "max_abs", "max_ref", "rel_l2")}
    return summary


def compare_files(
    reference,
    candidate,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    aliases=None,
    out: str | Path | None = None,
    command: str | None = None,
) -> Result:
    """Compare two saved traces: tracer's own, or dumps from candle, llama.cpp, MLX, PyTorch.

    Names are mapped onto points (`tracer.aliases`), layouts brought to ours (`tracer.layouts`),
    and only the points both sides have are compared; the Result's `notes` say what was missing
    on each side, which names were not recognized and which layout was assumed.

    Args:
        reference, candidate: paths to safetensors files (docs/trace-format.md) or `Trace`s.
        atol, rtol: elementwise tolerance replacing the default relative-L2 criterion.
        aliases: a user name mapping: a dict, a JSON file path, or an `AliasTable`.
        out: write the report folder there.

    Returns:
        A `Result`; `bool(result)` is True when every compared point is within tolerance.

    Raises:
        TracerError: unreadable file, different token ids, shapes that cannot be reconciled.

    Example:
        >>> result = tracer.compare_files("hf.safetensors", "candle-dump.safetensors")
        >>> result.first_divergence["point"]
        'model.layers.7.mlp.down_proj'
    """
    from tracer.aliases import alias_table

    table = alias_table(aliases)  # a bad mapping file is an error even when both traces are tracer's own
    ref_trace, cand_trace = load_trace(reference, table), load_trace(candidate, table)
    result = compare(ref_trace, cand_trace, Tolerance(atol=atol, rtol=rtol))
    result.prompt = ref_trace.meta.get("prompt") or cand_trace.meta.get("prompt")
    result.environment = environment()
    result.command = command
    result.notes += _notes(ref_trace, cand_trace)
    if out is not None:
        from tracer.reports import write_report

        write_report(result, out)
    return result


def load_trace(trace_or_path, aliases=None) -> Trace:
    """A Trace as it is; a file read with `Trace.load`, or a dict name -> tensor, with foreign
    names mapped through the aliases."""
    if isinstance(trace_or_path, Trace):
        return trace_or_path
    if isinstance(trace_or_path, dict):
        from tracer.trace import import_foreign

        return import_foreign(trace_or_path, {}, Path("<dict>"), aliases)
    return Trace.load(trace_or_path, aliases)


def _recorded_comparison(source, reference_side, cand_engine, ids, tolerance, noise_floor, sink, timings) -> Result:
    """Record both sides (into `sink(side)`: memory or a spill folder), measure noise and local error, compare."""
    ref_engine = reference_side[1]  # (engine name, engine, variant)
    with timed(timings, "reference_s"):
        stage("reference")
        ref_trace = ref_engine.record(ids, sink("reference"))
    with timed(timings, "candidate_s"):
        stage("candidate")
        cand_trace = cand_engine.record(ids, sink("candidate"))
    with timed(timings, "noise_s"):
        stage("noise floor")
        noise, noise_note = _noise(source, reference_side, ref_trace, sink) if noise_floor else (None, [])
    with timed(timings, "local_s"):
        local = _local_errors(cand_engine, ref_trace, sink)
    result = compare(ref_trace, cand_trace, tolerance, noise=noise, local=local)
    result.notes += noise_note + _notes(ref_trace, cand_trace) + _memory_notes(len(ids))
    return result


def _config_audit(source, variant: dict) -> dict | None:
    """The audit of the model's config.json (with the candidate's re-save applied), for the report."""
    if is_loaded_model(source):
        return None
    from tracer.config import audit, load_config

    return audit(load_config(source), variant.get("resave", "none"))


def _stream_notes(stream: bool, engines: tuple[str, ...]) -> list[str]:
    """Streaming is the reimplementation's; an hf side asked to stream loads its whole model, said here."""
    if stream and "hf" in engines:
        return ["stream: the hf engine loads its whole model (only the reimpl engine reads weights block by block)"]
    return []


def _memory_notes(num_tokens: int) -> list[str]:
    from tracer.spill import SPILL_TOKENS
    from tracer.trace import ATTENTION_ROWS

    notes = []
    if num_tokens > ATTENTION_ROWS:
        notes.append(f"attention scores and probs are kept and compared on their last {ATTENTION_ROWS} query rows "
                     f"(of {num_tokens}) to bound memory")
    if num_tokens > SPILL_TOKENS:
        notes.append(f"{num_tokens} tokens: traces were written to a temporary folder point by point and compared "
                     "from there, then deleted")
    return notes


@contextmanager
def timed(timings: dict, key: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = time.perf_counter() - started


def _noise(source, reference: tuple, ref_trace: Trace, sink):
    """(noise per point, notes): nothing to measure against for a saved reference trace.

    Past NOISE_TOKENS tokens the noise is measured on the prompt's first NOISE_TOKENS: an f64
    forward costs twice the memory of the f32 one, and rounding noise is a per-op property.
    """
    name, engine, reference_variant = reference
    if name.startswith("file:"):
        return None, ["no noise floor for a saved reference trace: points judged by the fixed rel_l2 bound"]
    from tracer.noise import NOISE_TOKENS, estimate_noise

    notes = []
    if len(ref_trace.tokens) > NOISE_TOKENS:
        ref_trace = engine.record(ref_trace.tokens[:NOISE_TOKENS])
        notes.append(f"noise floor measured on the first {NOISE_TOKENS} tokens (an f64 run of all of them "
                     "would double the memory)")
    try:
        return estimate_noise(source, ref_trace, reference_variant, sink("noise"), engine.device), notes
    except TracerError as exc:
        return None, [f"no noise floor ({exc}): points judged by the fixed rel_l2 bound"]


def _local_errors(engine, reference: Trace, sink) -> dict[str, float] | None:
    """The reimplementation can rerun each block on the reference's inputs; other engines cannot."""
    from tracer.pipeline import local_errors

    return local_errors(engine, reference, sink("local"))


def run_command(model, prompt, tokens, reference, candidate, variant, reference_variant,
                atol, rtol, greedy, noise_floor, out, max_tokens=None, device="cpu", stream=False) -> str | None:
    """The `tracer run` line that repeats a Python `run` call, for the report (None for a model
    object, which no command line can name). Defaults are left out, like a person would."""
    if is_loaded_model(model):
        return None
    import shlex

    from tracer.variants import format_knob_value

    args = ["tracer", "run"] + (["--model", str(model)] if model is not None else [])
    if tokens is not None:
        args += ["--tokens", ",".join(map(str, tokens))]
    elif prompt != DEFAULT_PROMPT:
        args += ["--prompt", prompt]
    args += ["--max-tokens", str(max_tokens)] if max_tokens is not None else []
    args += ["--reference", reference] if reference != "hf" else []
    args += ["--candidate", candidate] if candidate != "reimpl" else []
    for flag, knobs in (("--reference-variant", reference_variant), ("--variant", variant)):
        if knobs:
            args += [flag, ",".join(f"{k}={format_knob_value(v)}" for k, v in knobs.items())]
    args += ["--atol", repr(atol)] if atol is not None else []
    args += ["--rtol", repr(rtol)] if rtol is not None else []
    args += ["--greedy", str(greedy)] if greedy != GREEDY_STEPS else []
    args += [] if noise_floor else ["--no-noise"]
    args += ["--device", str(device)] if str(device) != "cpu" else []
    args += ["--stream"] if stream else []
    args += ["--out", str(out)] if out is not None else ["--no-report"]
    return shlex.join(args)


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


# `sweep`: the reference once, many variants against it (tracer/sweep.py). Not re-exported as
# `tracer.sweep`, which is that submodule's name: use `tracer.api.sweep`.
from tracer.sweep import Sweep, sweep  # noqa: E402
