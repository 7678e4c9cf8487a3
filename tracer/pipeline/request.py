"""A command's request as a few frozen values, checked in one place before torch is imported or
anything is written, then resolved once.

`Inputs` (model, prompt or tokens, chat, system, max tokens, the first position), `Placement` (device, stream,
offload, max memory), `Outputs` (report folder, JSON file, trace file) and a `Side` per engine (the
engine argument parsed into an `EngineRef`, its knobs parsed and checked against it) make a `Request`,
built once (by the CLI from its flags, by the API from its arguments). Each checks itself when built:
value ranges, duplicates, knobs an engine cannot honour, what the inputs ask of each engine (positions,
decode, batch), the regime against the sides, and that every output location can be written, so a
mistake is one line (`TracerError`) before any work starts, never a traceback after it. `regime_knobs`
does the same for --regime. The pipeline's commands (`tracer.pipeline.commands`) take the request whole
and resolve it once as they start (`Request.resolved()`: what needs the model or torch,
`tracer.engines.load.resolve_target`). No torch here until `resolved()` (tests/unit/test_request.py
checks it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from tracer.comparison.result import Tolerance
from tracer.core.errors import TracerError
from tracer.core.folders import replaceable_folder
from tracer.engines.offload import Offload, parse_max_memory
from tracer.engines.registry import EngineEntry, EngineRef, engine_with_knobs, registered
from tracer.files.sources import check_source
from tracer.files.tokenizer import TOKENIZER_FILE, check_prompt
from tracer.model.knobs import PRESETS, format_knob_value, knobs_of_kind, parse_variant, variant_text
from tracer.pipeline import streamed
from tracer.pipeline.catalogue import parse_variants

if TYPE_CHECKING:
    from tracer.engines.load import LoadTarget

DEFAULT_PROMPT = "The capital of France is"
# What a model without a tokenizer (a `save_pretrained` folder of the model alone) is fed in place of
# the default prompt: ids below 64, which every vocabulary has; the run's notes say so.
DEFAULT_TOKENS = (1, 17, 5, 42, 8, 63, 3)
GREEDY_STEPS = 20  # greedy tokens a run decodes by default (`tracer.pipeline.greedy.default_steps`)
DEFAULT_CTX = 512  # `tracer quality`'s tokens per chunk: llama-perplexity's default -c
DEVICE_FORM = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
# What --regime takes: the number-format knobs, a 16-bit dtype, and the presets made of those.
REGIME_EXTRA = ("dtype",)
# (the file that marks a report folder, what the folder is called): `tracer run`'s, `tracer sweep`'s
RUN_REPORT, SWEEP_REPORT = ("summary.json", "report"), ("sweep.json", "sweep")


def whole_number(value, name: str, *, minimum: int) -> int | None:
    """`value` as an int of at least `minimum` (None stays None); a float, a bool or a smaller
    number is the user's error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TracerError(f"{name} takes a whole number, got {value!r}")
    if value < minimum:
        raise TracerError(f"{name} must be at least {minimum}, got {value}")
    return value


def token_list(tokens) -> tuple[int, ...] | None:
    """Token ids as a tuple of non-negative ints (a list, a tuple, a 1-D tensor or a "1,2,3" string)."""
    if tokens is None:
        return None
    if isinstance(tokens, str):
        try:
            tokens = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            raise TracerError(f"--tokens takes comma-separated integers, got {tokens!r}") from None
    elif hasattr(tokens, "tolist"):  # a tensor or an array, without importing torch here
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or any(isinstance(t, list) for t in tokens):
        raise TracerError("token ids are a flat list of integers")
    odd = [t for t in tokens if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if odd:
        raise TracerError(f"token ids are integers, got {odd[0]!r}")
    tokens = [int(t) for t in tokens]  # numpy's integers too
    if not tokens:
        raise TracerError("empty token list")
    if any(t < 0 for t in tokens):
        raise TracerError(f"token id {min(tokens)} is negative")
    return tuple(tokens)


def token_rows(tokens) -> tuple[tuple[int, ...], ...] | None:
    """A batch's token ids, one row each: "1,2,3;4,5" or a list of lists; None when `tokens` is one row."""
    if isinstance(tokens, str) and ";" in tokens:
        return tuple(token_list(row) for row in tokens.split(";"))
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(row, (list, tuple)) or hasattr(row, "tolist")
                                                            for row in tokens):
        return tuple(token_list(row) for row in tokens)
    return None


# How the noise floor is measured (docs/floor.md): "cheap", an f64 run of the prompt's first quarter scaled
# by its calibration, with the exact floor measured wherever a verdict rests on it; "exact", an f64 run of
# the whole prompt.
FLOORS = ("cheap", "exact")


def floor_mode(noise_floor: bool | str | None) -> str | None:
    """A request's `noise_floor` as one of FLOORS, or None (no floor: the fixed bound)."""
    if noise_floor is True:
        return FLOORS[0]
    if noise_floor is False or noise_floor is None:
        return None
    if noise_floor not in FLOORS:
        raise TracerError(f"unknown noise floor {noise_floor!r}: {' or '.join(FLOORS)} (or False: none)")
    return noise_floor


@dataclass(frozen=True)
class Inputs:
    """What the model is fed: a model (a directory, a .gguf file, None for the bundled SmolLM2,
    or a loaded transformers model), a prompt or token ids, the chat template, a truncation, the
    absolute position of the first token (`position_offset`, 0 by default: RoPE at far positions),
    the decode steps after the prompt (`decode`, 0 by default: the prefill alone), and the batch
    (`batch`, 1 by default; docs/batch.md).

    A batch of B rows is B prompts (a list of prompts; `--prompt` given B times) or B rows of token ids
    (a list of lists; `--tokens "1,2,3;4,5"`), or one of either repeated B times; `rows` holds them, and
    `prompt`/`tokens` the first. Several prompts without `batch`, or a count other than `batch`, are
    refused in one line: which prompts make the batch is never guessed."""

    model: object = None
    prompt: str | None = DEFAULT_PROMPT
    tokens: tuple[int, ...] | None = None
    chat: bool = False
    system: str | None = None
    max_tokens: int | None = None
    position_offset: int = 0
    decode: int = 0
    batch: int = 1
    rows: tuple = field(default=(), init=False)  # a batch's prompts (str) or token rows (tuple[int, ...])

    def __post_init__(self):
        whole_number(self.batch, "--batch", minimum=1)
        given = token_rows(self.tokens)
        if given is None and isinstance(self.prompt, (list, tuple)) and self.tokens is None:
            given = tuple(self.prompt)
            if not given:
                raise TracerError("an empty list of prompts")
        if given is not None:
            if self.batch == 1 and len(given) > 1:
                raise TracerError(f"{len(given)} prompts: a run takes one, or several as one batch (--batch "
                                  f"{len(given)}, on run and record)")
            if len(given) not in (1, self.batch):
                raise TracerError(f"--batch {self.batch} with {len(given)} prompts: give {self.batch} prompts, or one "
                                  f"to repeat {self.batch} times")
            field_name = "prompt" if isinstance(given[0], str) else "tokens"
            object.__setattr__(self, field_name, given[0])
        object.__setattr__(self, "tokens", token_list(self.tokens))
        if self.batch > 1:
            if self.decode:
                raise TracerError("--batch with --decode: a batched cached decode is not traced yet; run them apart")
            if self.position_offset:
                raise TracerError("--batch with --position-offset: a left-padded row's positions start at 0 at its "
                                  "first real token; run them apart")
            rows = given if given is not None and len(given) == self.batch else None
            object.__setattr__(self, "rows", rows or (self.tokens or self.prompt,) * self.batch)
        whole_number(self.max_tokens, "--max-tokens", minimum=1)
        # None is the default in Python as on the command line: from position 0, no decode
        offset = whole_number(self.position_offset, "--position-offset", minimum=0)
        object.__setattr__(self, "position_offset", offset or 0)
        object.__setattr__(self, "decode", whole_number(self.decode, "--decode", minimum=0) or 0)
        if self.tokens is None:
            if self.prompt is None:
                raise TracerError("give a prompt or token ids")
            check_prompt(self.prompt)
        if self.tokens is not None and (self.chat or self.system is not None):
            raise TracerError("chat templates apply to a prompt, not to token ids")
        if self.system is not None and not self.chat:
            raise TracerError("a system message needs the chat template: pass chat=True (--chat)")
        if isinstance(self.model, (str, os.PathLike)):
            if not str(self.model).strip():
                raise TracerError("--model is empty; leave it out for the bundled SmolLM2")
            check_source(self.model)

    @property
    def text(self) -> str | None:
        """The prompt as given (None when token ids were)."""
        return None if self.tokens is not None else self.prompt


@dataclass(frozen=True)
class Placement:
    """Where the models run: a torch device, whether weights are streamed block by block, and
    accelerate's big-model placement (`offload` folder, `max_memory` per device)."""

    device: str = "cpu"
    stream: bool | None = None  # None: `run` streams models past tracer.pipeline.streamed.STREAM_BYTES
    offload: str | None = None
    max_memory: dict | None = None

    def __post_init__(self):
        device = str(self.device)
        if not DEVICE_FORM.match(device):
            raise TracerError(f"unknown device {device!r}; devices: cpu, cuda, cuda:N, mps")
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "max_memory", parse_max_memory(self.max_memory))
        if self.offload is not None:
            object.__setattr__(self, "offload", str(self.offload))
            writable_folder(self.offload, "--offload")

    @property
    def accelerate(self) -> Offload | None:
        """The `Offload` the options ask for, or None (every side loads its model whole)."""
        if self.offload is None and self.max_memory is None:
            return None
        return Offload(self.offload, self.max_memory)


# The keywords of an API call that name the request's fields (`tracer.run(..., tokens=..., device=...)`):
# every field of `Inputs` but the model and the prompt (given first), every field of `Placement`.
REQUEST_KEYWORDS = (*(f.name for f in fields(Inputs) if f.init and f.name not in ("model", "prompt")),
                    *(f.name for f in fields(Placement)))


def request_of(function: str, model, prompt, keywords: dict) -> tuple[Inputs, Placement]:
    """The `Inputs` and `Placement` of an API call, each built once: `model`, `prompt` and `keywords`
    naming their other fields (`REQUEST_KEYWORDS`); any other keyword is refused as Python refuses one."""
    unknown = [name for name in keywords if name not in REQUEST_KEYWORDS]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    placement = {f.name for f in fields(Placement)}
    return (Inputs(model, prompt, **{k: v for k, v in keywords.items() if k not in placement}),
            Placement(**{k: v for k, v in keywords.items() if k in placement}))


@dataclass(frozen=True)
class Outputs:
    """Where a command writes: the report folder (None: no report), the JSON file ("-": stdout),
    the trace file (`tracer record -o`). Each checked writable when built, before any work."""

    report: str | None = None
    json: str | None = None
    trace: str | None = None
    kind: tuple[str, str] = RUN_REPORT

    def __post_init__(self):
        if self.report is not None:
            writable_folder(self.report, "--out")
            replaceable_folder(Path(self.report).absolute(), *self.kind)
        if self.json is not None and self.json != "-":
            writable_file(self.json, "--json")
        if self.trace is not None:
            writable_file(self.trace, "cannot write trace")  # the words Trace.save uses: one message from CLI and API


def writable_folder(path, option: str) -> None:
    """A folder that exists and can be written, or that can be made (its nearest existing parent
    is a writable folder)."""
    target = Path(path).expanduser()
    if not str(path).strip():
        raise TracerError(f"{option} is empty")
    if target.exists() and not target.is_dir():
        raise TracerError(f"{option} {path}: a file is there, not a folder")
    existing = next(p for p in (target, *target.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise TracerError(f"{option} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TracerError(f"{option} {path}: {existing} cannot be written")


def writable_file(path, option: str) -> None:
    """A file whose folder exists and can be written (tracer makes no folder for a single file)."""
    target = Path(path).expanduser()
    if not str(path).strip():
        raise TracerError(f"{option} is empty")
    if target.is_dir():
        raise TracerError(f"{option} {path}: a folder is there, not a file")
    folder = target.absolute().parent
    if not folder.is_dir():
        raise TracerError(f"{option} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise TracerError(f"{option} {path}: cannot be written")


def check_tolerance(atol, rtol) -> None:
    """Elementwise tolerances are finite numbers >= 0."""
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise TracerError(f"{name} takes a finite number >= 0, got {value!r}")


def check_greedy(greedy, name: str = "--greedy") -> None:
    whole_number(greedy, name, minimum=0)


# An engine argument carrying its own knobs, as a side's label writes them: "llamacpp:m.gguf[kv_cache=f32]"
OWN_KNOBS = re.compile(r"^(?P<engine>[^\[]+)\[(?P<knobs>[^\]]*=[^\]]*)\]$")


@dataclass(frozen=True)
class Side:
    """One side of a run, parsed and checked once: its engine (`EngineRef`, its runtime installed) and
    the knobs it runs with, each one that engine honours (a saved trace takes none)."""

    engine: EngineRef
    variant: dict = field(default_factory=dict)

    @classmethod
    def of(cls, engine: str | EngineRef, variant=None) -> Side:
        """`engine` ("hf", "file:PATH", ...) and `variant` ("theta=10000", a dict) parsed and checked
        (`tracer.engines.registry.engine_with_knobs`). The engine may carry knobs of its own as its label
        writes them, `ENGINE[K=V,...]` (each of a triangulation's candidates its own); `variant` adds to
        them, a knob in both being given twice."""
        own = OWN_KNOBS.match(engine) if isinstance(engine, str) else None
        if own is None:
            return cls(*engine_with_knobs(engine, variant))
        knobs, added = parse_variant(own["knobs"]), parse_variant(variant)
        twice = sorted(set(knobs) & set(added))
        if twice:
            raise TracerError(f"knob {twice[0]!r} is given twice (in {engine} and in the variant)")
        return cls(*engine_with_knobs(own["engine"], {**knobs, **added}))

    @property
    def text(self) -> str:
        """The side as one engine argument, its knobs in brackets (what `Side.of` reads back)."""
        return f"{self.engine}[{variant_text(self.variant)}]" if self.variant else str(self.engine)

    @property
    def entry(self) -> EngineEntry:
        return self.engine.entry


def candidate_sides(candidate, variant=None) -> tuple[Side | None, tuple[Side, ...]]:
    """A run's candidates, as (the candidate, ()) or, for two or more, (None, a triangulation's candidates).

    `candidate` is one engine argument, or a list of them; `variant` is the knobs of a lone candidate.
    Several candidates each carry their own knobs (`ENGINE[K=V,...]`, `Side.of`): a variant given beside
    them is refused, since whose it is would be a guess."""
    if not isinstance(candidate, (list, tuple)):
        return Side.of(candidate, variant), ()
    if not candidate:
        raise TracerError("an empty list of candidates")
    if len(candidate) == 1:
        return Side.of(candidate[0], variant), ()
    if parse_variant(variant):
        raise TracerError(f"--variant with {len(candidate)} candidates: give each its own, e.g. "
                          "'llamacpp[kv_cache=f32]'")
    return None, tuple(Side.of(engine) for engine in candidate)


def one_candidate(candidate, command: str):
    """The one candidate of a command that takes one (`sweep`'s variants run on it, `quality` scores it); a list of
    them (one is fine) is refused beyond one, naming where several go."""
    if not isinstance(candidate, (list, tuple)):
        return candidate
    if len(candidate) != 1:
        raise TracerError(f"tracer {command} takes one --candidate; several: tracer run --candidate A --candidate B")
    return candidate[0]


def sweep_candidate(candidate) -> Side:
    """`tracer sweep`'s one candidate, bare: each variant is the knobs it runs with, so knobs of its own (in
    brackets) are refused, naming where they go."""
    side = Side.of(one_candidate(candidate, "sweep"))
    if side.variant:
        raise TracerError(f"tracer sweep runs each variant on a bare candidate: put {variant_text(side.variant)} "
                          "in --variants")
    return side


def check_triangulation(candidates: tuple[Side, ...], inputs: Inputs, regime) -> None:
    """Several candidates traced on one reference run: each one once, on the prompt's forward alone (a
    decode, a batch and a regime view are traced one candidate at a time for now, each said in one line)."""
    if len(candidates) < 2:
        raise TracerError(f"a triangulation takes two candidates or more, got {len(candidates)}")
    texts = [side.text for side in candidates]
    twice = next((text for text in texts if texts.count(text) > 1), None)
    if twice is not None:
        raise TracerError(f"candidate {twice} is given twice")
    n = len(candidates)
    if inputs.decode:
        raise TracerError(f"--decode with {n} candidates is not traced yet; decode one candidate at a time")
    if inputs.batch > 1:
        raise TracerError(f"--batch with {n} candidates is not traced yet; run a batch one candidate at a time")
    if regime is not None:
        raise TracerError(f"--regime with {n} candidates: each regime is its own reference; run one at a time")


def check_positions(offset: int, *sides: Side) -> None:
    """A first position other than 0 needs engines that take positions (their registry entry says);
    any other is refused in one line, naming the ones that can."""
    for side in sides if offset else ():
        if not side.entry.positions:
            able = ", ".join(entry.name for entry in registered().values() if entry.positions)
            raise TracerError(f"--position-offset {offset}: the {side.entry.name} engine runs its tokens "
                              f"from position 0; engines that take positions: {able}")


def check_decode(steps, *sides: Side) -> int:
    """`--decode N`: a whole number of steps, on engines that decode with their own KV cache (their registry
    entry says); any other is refused in one line, naming the ones that can. Returns N (0: no decode)."""
    steps = whole_number(steps, "--decode", minimum=0) or 0
    for side in sides if steps else ():
        if not side.entry.decode:
            able = ", ".join(entry.name for entry in registered().values() if entry.decode)
            why = f" ({side.entry.no_decode})" if side.entry.no_decode else ""
            raise TracerError(f"--decode {steps}: the {side.entry.name} engine does not decode with a KV "
                              f"cache here{why}; engines that do: {able}")
    return steps


def check_batch(batch: int, *sides: Side) -> None:
    """`--batch B` (B > 1) needs engines that run a left-padded batch (their registry entry says); any other is
    refused in one line, naming the ones that can."""
    for side in sides if batch > 1 else ():
        if not side.entry.batch:
            able = ", ".join(entry.name for entry in registered().values() if entry.batch)
            raise TracerError(f"--batch {batch}: the {side.entry.name} engine does not run a padded batch here; "
                              f"engines that do: {able}")


def regime_knobs(regime) -> dict | str | None:
    """`--regime`: "auto", or knobs of a number-format regime only (ggml's formats and arithmetic,
    a dtype, `preset=llamacpp`); a porting-mistake knob there is refused, naming --variant."""
    if regime is None or regime == "auto":
        return regime
    knobs = parse_variant(regime)
    if not knobs:
        raise TracerError("--regime needs 'auto' or knobs, e.g. --regime weights=q4_1,act_quant=q8_1")
    allowed = (*knobs_of_kind("regime"), *REGIME_EXTRA)
    for name, value in knobs.items():
        regime_preset = name == "preset" and all(k in allowed for k in PRESETS.get(value, {"": 0}))
        if name not in allowed and not regime_preset:
            raise TracerError(f"--regime takes auto or number-format knobs ({', '.join(allowed)}, preset=llamacpp); "
                              f"{name}={format_knob_value(value)} is not one (a porting mistake goes in --variant)")
    return knobs


def check_regime_run(reference: EngineRef, candidate: EngineRef) -> None:
    """The regime view replaces the reference by tracer's model in the regime: it needs a model the
    candidate runs, compared against the f32 reference of a runnable engine."""
    if candidate.entry.argument_required:
        raise TracerError(f"--regime needs a candidate that runs the model; {candidate} is a saved trace "
                          "(compare it with --reference reimpl --reference-variant KNOBS)")
    if reference.entry.argument_required:
        raise TracerError(f"--regime compares against f32 {reference} as the raw view: it needs an engine that runs "
                          "the model, not a saved trace")


@dataclass(frozen=True)
class Request:
    """One command's request, built once at its edge (the CLI from its flags, the API from its arguments)
    and checked as it is built, before torch loads: what the model is fed (`inputs`), where it runs
    (`placement`), where results go (`outputs`), the `reference` side and the `candidate` side (None for
    a command with one engine: `record`'s is its reference; None too for a triangulation, whose
    `candidates` are two or more traced on one reference run, `tracer.pipeline.commands.triangulate`),
    the tolerance, the greedy continuation (None: the default), the noise floor, the number-format
    `regime` (None, "auto" or its knobs), a sweep's or a diagnosis's `variants` (None: the catalogue's;
    parsed here), the command line that repeats the run and whether a progress bar shows.

    Every side is checked against what the inputs ask of it (positions, decode, batch), and the regime
    against the sides. What needs the model or torch (the source, the device, offloading, the families
    the engines trace, streaming by size) each command resolves once as it starts, `resolved()`, into the
    `target` every engine of the command loads on (`tracer.engines.load.LoadTarget`); nothing after
    resolves it again."""

    inputs: Inputs
    placement: Placement = field(default_factory=Placement)
    reference: Side = field(default_factory=lambda: Side(EngineRef.named("hf")))
    candidate: Side | None = None
    outputs: Outputs = field(default_factory=Outputs)
    tolerance: Tolerance = field(default_factory=Tolerance)
    greedy: int | None = None
    noise_floor: bool | str | None = True  # True: "cheap" (FLOORS); False, None: no floor
    regime: dict | str | None = None
    variants: tuple[dict, ...] | None = None
    command: str | None = None
    progress: bool = True
    candidates: tuple[Side, ...] = ()  # a triangulation's candidates (`candidate` is then None)
    target: LoadTarget | None = None  # set by `resolved()`
    notes: tuple[str, ...] = ()  # what resolving chose by itself (weights streamed by size), said in the result
    resolve_s: float = 0.0  # how long resolving took (a GGUF converted on first use): part of the run's load time

    def __post_init__(self):
        if self.target is not None:
            return  # a resolved request: its values were checked when it was built, before `resolved()`
        if self.candidates:  # before what each engine can do: a triangulation's own limits are said first
            if self.candidate is not None:
                raise TracerError("a request has one candidate or a triangulation's candidates, not both")
            check_triangulation(self.candidates, self.inputs, self.regime)
        sides = self.sides
        check_positions(self.inputs.position_offset, *sides)
        check_decode(self.inputs.decode, *sides)
        check_batch(self.inputs.batch, *sides)
        check_greedy(self.greedy)
        object.__setattr__(self, "noise_floor", floor_mode(self.noise_floor))
        object.__setattr__(self, "regime", regime_knobs(self.regime))
        if self.regime is not None and not self.candidates:
            check_regime_run(self.reference.engine, self.candidate.engine)
            if self.inputs.batch > 1:
                raise TracerError("--batch with --regime: a regime's own steps run one prompt; run them apart")
        if self.variants is not None:
            object.__setattr__(self, "variants", parse_variants(self.variants))

    @property
    def sides(self) -> tuple[Side, ...]:
        """The reference, then the candidate where there is one (a triangulation's candidates in order)."""
        return (self.reference, *([] if self.candidate is None else [self.candidate]), *self.candidates)

    def resolved(self) -> Request:
        """This request with what its engines load resolved once (`tracer.engines.load.resolve_target`: the
        device, offloading and the model's family checked against every engine, the model source resolved,
        a GGUF converted on first use), and `placement.stream` None decided by the model's size
        (`tracer.pipeline.streamed`, said in `notes`). Every refusal is one line, before any engine loads. A
        resolved request is returned as it is: nothing is resolved twice."""
        from tracer.engines.load import resolve_target  # torch: imported only once every value has been checked

        if self.target is not None:
            return self
        started = time.perf_counter()
        placement = self.placement
        target = resolve_target(self.inputs.model, tuple(side.engine for side in self.sides), device=placement.device,
                                stream=bool(placement.stream), offload=placement.accelerate, progress=self.progress)
        notes = []
        if placement.stream is None:
            stream, notes = streamed.resolve(None, target.source)
            target = dataclasses.replace(target, stream=stream)
        inputs, fed = default_input(self.inputs, target.source)
        return dataclasses.replace(self, inputs=inputs, target=target, notes=(*fed, *notes),
                                   resolve_s=time.perf_counter() - started)


def default_input(inputs: Inputs, source) -> tuple[Inputs, list[str]]:
    """`inputs`, with `DEFAULT_TOKENS` in place of the default prompt where the model has no tokenizer to
    read it with (and the note that says so); a prompt the user gave still needs one."""
    folder = None if source.loaded else source.directory
    given = inputs.tokens is not None or inputs.chat or \
        any(row != DEFAULT_PROMPT for row in inputs.rows or (inputs.prompt,))
    if given or (folder is not None and (Path(folder) / TOKENIZER_FILE).is_file()):
        return inputs, []
    name = "the loaded model" if folder is None else Path(folder).name
    ids = ",".join(map(str, DEFAULT_TOKENS))
    return dataclasses.replace(inputs, prompt=None, tokens=DEFAULT_TOKENS), [
        f"{name} has no {TOKENIZER_FILE}: fed the default token ids {ids} (--tokens to choose)"]
