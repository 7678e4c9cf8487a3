"""Every engine as data: its capabilities, declared once, read by the pipeline, `tracer engines`
and `tracer variants`. No torch here (both commands start in well under a second).

An engine is registered (`register(entry)`): the built-ins below, and any other package's
through the entry-point group `tracer.engines` (the entry point's name is the engine's name; loading
it registers its entry: the object it names is an `EngineEntry`, or a module that registers one).

Each engine states, per model family, what tracing it gives (the engine × family matrix, `tracer
engines`, tests/unit/test_matrix.py): traced point for point (`families`), traced with a named runtime
difference (`differences`: what the runtime does on that family by its own design, and the point where it
first shows), not in that runtime (`absent`: the runtime has no such architecture), or not yet (any other
family: refused until its cell matches).

An engine argument may carry an argument after a colon: `file:PATH` (a saved trace),
`llamacpp:PATH.gguf` (another GGUF file than the model's own). It is parsed once, at the edge of a
run (`parse_engine`), into an `EngineRef` that everything downstream takes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from types import ModuleType

from tracer.core.errors import TracerError, unknown_name
from tracer.core.versions import installed_version
from tracer.model.knobs import (
    KNOBS,
    Knob,
    choice,
    fixed,
    parse_variant,
    positive_int,
    register_switch,
    unregister_switch,
    variant_text,
)
from tracer.model.points import (
    CONTEXT,
    EMBED,
    FUSED_AWAY,
    MLP_ACT,
    PROBS,
    Q_ROPE,
    SCORES,
    TOP_K_WEIGHTS,
    split_point,
)


@dataclass(frozen=True)
class Difference:
    """A family an engine traces whose runtime computes it otherwise than transformers, by the runtime's own
    design: a run that first diverges at `point` is told it is the runtime's behaviour, not a port's mistake.

    Attributes:
        family: the family (`tracer.model.families`).
        point: where it first shows: a sub-point (`self_attn.probs`: in whichever layer) or a model point.
        condition: when it shows ("a prompt longer than the window"); "" always.
        what: one line saying what the runtime does ("mlx-lm's gemma2.py has no sliding window").
    """

    family: str
    point: str
    condition: str
    what: str

    def at(self, point: str) -> bool:
        """Whether `point` (a recorded point, `model.layers.3.self_attn.probs`) is where it shows."""
        layer, sub = split_point(point)
        return (sub if layer is not None else point) == self.point


@dataclass(frozen=True)
class Absent:
    """A family the runtime has no architecture for ("not in that runtime"): refused in one line, before
    anything loads, with `why` (the runtime's own words for it: "<runtime version> has no <family> model")."""

    family: str
    why: str


# The states of a cell of the engine × family matrix.
MATCH, DIFFERS, ABSENT, NOT_YET = "match", "differs", "not in runtime", "not yet"


@dataclass(frozen=True)
class EngineEntry:
    """One engine and what it can do.

    Attributes:
        name: what `--reference` / `--candidate` take (before any `:argument`).
        module: the module whose `load(source, variant, *, argument, device, stream)` builds it.
        summary: one line for `tracer engines`.
        kinds: the kinds of knob it honours whole (`tracer.model.knobs.KINDS`: config, semantic, regime).
        knobs: single knobs of the catalogue it honours beyond those kinds (a model knob its runtime
            reads, e.g. llama.cpp's rope_freq_base as `theta`).
        switches: its runtime's own switches (a thread count, a micro-batch, an optimizer level), declared
            here and nowhere else: registering the engine adds them to the catalogue
            (`tracer.model.knobs.register_switch`), where `tracer variants` lists them and `parse_variant`
            checks them. Two engines whose runtimes share a switch name the same `Knob`. Any other knob
            is refused, naming the engines that can (`honoured` is the whole list).
        fused_attention: when its attention is one fused op, which never forms the scores and
            probabilities (`tracer.model.points.FUSED_AWAY`): "always", or the choice that fuses it ("" never);
            each trace's not_recorded says it per run.
        local_errors: it can rerun each block on the reference's inputs (`local_trace`), which
            separates the error a point introduces from the error it inherits.
        draft: it has a cached decode (`draft(tokens, steps)`) that greedy decoding checks.
        logits: it can run an unrecorded forward (`logits(tokens)`), which greedy decoding needs.
        devices: the torch device types it takes.
        stream: it can read weights block by block (`stream=True`).
        argument: what follows the colon ("PATH"), or None; `argument_required` when it must.
        extra: the pip extra that installs its runtime (`pip install -e '.[extra]'`).
        install_env: environment the install needs before `pip`, as the README writes it (llama.cpp
            compiles: its build flags), and install_note what to expect of it.
        requires: (import name, distribution) pairs its runtime needs.
        greedy: how its greedy continuation is taken. "uncached": decoded the way an uncached
            forward over the whole sequence decodes it, each step checked with `logits` (a
            `draft` only saves forwards); "cached": the engine's continuation is its own cached
            decode (`draft`, e.g. llama.cpp with its KV cache), taken as is, because how the
            runtime decodes is what is being compared; "decode": its own cached decode too, run by
            `decode(..., recorded=())` (no point recorded: what generating costs), and at the first flip
            the step whose argmax flips is recorded from each side's cache (`tracer.pipeline.greedy`).
        noise_floor: an f64 run of tracer's own model measures the rounding noise of this engine as
            a reference (true for the PyTorch engines; a runtime with its own number formats, such
            as llama.cpp's quantized matmuls, differs from it by more than rounding).
        offload: it can load its model through accelerate's big-model placement (`--offload DIR`,
            `--max-memory`; `tracer.engines.offload`), for references larger than memory.
        isolated: its runtime is native code that may abort (a segfault, a GGML_ASSERT): it runs
            in a child process (`tracer.engines.isolated`), so a crash ends the run with one
            line naming the engine instead of taking tracer down.
        families: the model families it traces point for point (tests/unit/test_matrix.py holds each to
            `match`); None: every family not named in `differences` or `absent`.
        differences: the families it traces with a runtime difference (`Difference`: the matrix holds each
            to diverging first at one of its family's points, and the run's hints say it is the runtime's own
            behaviour). A family may have several, at different points (Gemma 2 in llama.cpp: its query
            scale, shown first where `query_pre_attn_scalar` is not the head size, and its GELU).
        absent: the families its runtime has no architecture for (`Absent`). Any family in none of the three
            is not traced yet: refused before loading, as an absent one is, in one line of its own.
        positions: it takes explicit absolute positions (`record(tokens, recorder, positions=...)`,
            `--position-offset`); the others start at 0 and refuse another start in one line.
        regime: the number-format regime it computes in on a GGUF (`--regime auto`, `--by-layer`): "ggml"
            (llama.cpp's CPU arithmetic for the file's tensor types), "candle" (candle's); None: it
            implies none beyond its knobs (a dtype).
        regime_with_argument: it computes in `regime` only on the file named after the colon (candle:
            quantized_llama.rs on candle:PATH.gguf; on the model directory llama.rs runs f32).
        decode: it decodes with its own KV cache, every step recorded (`decode(tokens, count, forced=...)`,
            `--decode N`); the others refuse `--decode` in one line naming those that take it.
        batch: it runs a left-padded batch with an attention mask in one forward, every row recorded at its real
            positions (`record_batch(rows)`, `--batch B`); the others refuse `--batch` in one line.
        no_decode: why an engine that runs a live model does not decode (said in that line).
    """

    name: str
    module: str
    summary: str
    kinds: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    switches: tuple[Knob, ...] = ()
    fused_attention: str = ""
    local_errors: bool = False
    draft: bool = False
    greedy: str = "uncached"
    logits: bool = True
    devices: tuple[str, ...] = ("cpu",)
    stream: bool = False
    argument: str | None = None
    argument_required: bool = False
    extra: str | None = None
    install_env: str = ""
    install_note: str = ""
    requires: tuple[tuple[str, str], ...] = ()
    noise_floor: bool = False
    offload: bool = False
    isolated: bool = False
    families: tuple[str, ...] | None = None
    differences: tuple[Difference, ...] = ()
    absent: tuple[Absent, ...] = ()
    positions: bool = False
    regime: str | None = None
    regime_with_argument: bool = False
    decode: bool = False
    batch: bool = False
    no_decode: str = ""

    def __post_init__(self):
        named = [*(self.families or ()), *{d.family: None for d in self.differences}, *(a.family for a in self.absent)]
        twice = sorted({family for family in named if named.count(family) > 1})
        if twice:
            raise TracerError(f"the {self.name} engine states the family {twice[0]} more than once (families, "
                              "differences, absent)")
        points = [(d.family, d.point) for d in self.differences]
        again = next((pair for pair in points if points.count(pair) > 1), None)
        if again:
            raise TracerError(f"the {self.name} engine declares two differences on {again[0]} at {again[1]}")

    def cell(self, family: str) -> str:
        """Its cell of the engine × family matrix: MATCH, DIFFERS, ABSENT or NOT_YET."""
        if self.differences_on(family):
            return DIFFERS
        if any(absent.family == family for absent in self.absent):
            return ABSENT
        return MATCH if self.families is None or family in self.families else NOT_YET

    def differences_on(self, family: str) -> tuple[Difference, ...]:
        """The runtime differences it declares on `family`, in the order declared (none: empty)."""
        return tuple(d for d in self.differences if d.family == family)

    @property
    def every_family(self) -> bool:
        """It traces every family (no family is refused)."""
        return self.families is None and not self.absent

    def refusal(self, family: str) -> str | None:
        """The one line refusing `family` (not in its runtime, or not traced yet); None: it traces it."""
        cell = self.cell(family)
        if cell == ABSENT:
            why = next(absent.why for absent in self.absent if absent.family == family)
            return f"the {self.name} engine cannot trace {family}: {why}"
        if cell == NOT_YET:
            traced = [*(self.families or ()), *{d.family: None for d in self.differences}]
            said = f"the {self.name} engine does not trace {family} yet (it traces {', '.join(traced)})"
            # one line of at most 100 columns: the list gives way to its count past that
            return said if len(said) <= 100 else (f"the {self.name} engine does not trace {family} yet (it traces "
                                                  f"{len(traced)} families: `tracer engines`)")
        return None

    def honours(self, knob: str) -> bool:
        return (knob in self.knobs or any(switch.name == knob for switch in self.switches)
                or (knob in KNOBS and KNOBS[knob].kind in self.kinds))

    @property
    def honoured(self) -> tuple[str, ...]:
        """Every knob it honours, in catalogue order."""
        return tuple(name for name in KNOBS if self.honours(name))

    @property
    def unobservable(self) -> tuple[str, ...]:
        """Per-layer sub-points it can never record."""
        return FUSED_AWAY if self.fused_attention == "always" else ()

    @property
    def emulated(self) -> tuple[str, ...]:
        """Those of its knobs that emulate another runtime's number formats (a regime, not a porting
        mistake): `tracer diagnose` tries them, the default sweep leaves them out."""
        return tuple(name for name, knob in KNOBS.items() if knob.kind == "regime" and "regime" in self.kinds)

    @property
    def usage(self) -> str:
        if self.argument is None:
            return self.name
        return f"{self.name}:{self.argument}" if self.argument_required else f"{self.name}[:{self.argument}]"

    @property
    def install(self) -> str:
        """The command that installs its runtime, exactly as the README gives it (from a clone)."""
        if self.extra is None:
            return f"pip install {' '.join(dist for _, dist in self.requires)}"
        return f"{self.install_env}pip install{' --no-cache-dir' if self.install_env else ''} -e '.[{self.extra}]'"

    def missing_runtime(self) -> list[str]:
        """The distributions its runtime needs that are not installed here."""
        return [dist for module, dist in self.requires if importlib.util.find_spec(module) is None]

    def runtime_versions(self) -> dict[str, str | None]:
        """distribution -> installed version (None when missing)."""
        return {dist: installed_version(dist) for _, dist in self.requires}


ENGINES: dict[str, EngineEntry] = {}  # name -> entry, in the order registered
ENTRY_POINTS = "tracer.engines"  # the entry-point group another package declares its engines in


def register(entry: EngineEntry) -> EngineEntry:
    """Add an engine (built-ins and other packages' alike); registering the same entry again is a no-op."""
    known = ENGINES.get(entry.name)
    if known is not None and known != entry:
        raise TracerError(f"two engines are named {entry.name!r}: {known.module} and {entry.module}")
    for switch in entry.switches:
        register_switch(switch)
    ENGINES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove an engine a test or a notebook registered (a later look-up may find it again by its entry
    point), and its switches no other registered engine declares."""
    entry = ENGINES.pop(name, None)
    for switch in entry.switches if entry else ():
        if not any(switch in other.switches for other in ENGINES.values()):
            unregister_switch(switch.name)


def registered() -> dict[str, EngineEntry]:
    """Every engine: the built-ins, then those installed packages declare (`ENTRY_POINTS`)."""
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if point.name not in ENGINES:
            load_entry_point(point)
    return ENGINES


def load_entry_point(point: importlib.metadata.EntryPoint) -> None:
    """Import what an entry point names: an `EngineEntry` is registered, a module registers its own."""
    try:
        loaded = point.load()
    except Exception as exc:  # another package's import: its failure is said, naming the entry point
        raise TracerError(f"the engine {point.name!r} ({point.value}, entry point of {ENTRY_POINTS}) "
                          f"failed to load: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, EngineEntry):
        register(loaded)
    elif not isinstance(loaded, ModuleType) or point.name not in ENGINES:
        raise TracerError(f"the entry point {point.name} = {point.value} ({ENTRY_POINTS}) names neither an "
                          f"EngineEntry nor a module that registers an engine named {point.name!r}")


def find_entry(name: str) -> EngineEntry | None:
    """The engine named `name`: a registered one, else one an installed package declares."""
    if name not in ENGINES:
        for point in importlib.metadata.entry_points(group=ENTRY_POINTS, name=name):
            load_entry_point(point)
    return ENGINES.get(name)


# ggml's GGML_MAX_N_THREADS: llama.cpp's thread pool has no room for more (100000 segfaulted it).
MAX_THREADS = 512


def _threads(text: str) -> int:
    value = positive_int(text)
    if value > MAX_THREADS:
        raise ValueError(text)
    return value


# llama.cpp's and candle's thread count: one switch both runtimes have.
THREADS = Knob("threads", _threads, f"an integer 1..{MAX_THREADS} (ggml's limit), e.g. threads=2",
               "4, at most the CPU count",
               "the runtime's thread count (llama.cpp n_threads); results should not depend on it",
               fixed("threads=1"), kind="runtime", after="flash_attn")

BUILTINS = (
    EngineEntry(
        "hf", "tracer.engines.hf",
        "transformers' own model, observed through forward hooks and a registered attention function",
        kinds=("config",), fused_attention="attn=sdpa", draft=True, devices=("cpu", "cuda", "mps"),
        noise_floor=True, offload=True, positions=True, decode=True, batch=True, greedy="decode", stream=True,
        requires=(("transformers", "transformers"),),
    ),
    EngineEntry(
        "reimpl", "tracer.engines.reimpl",
        "tracer's own forward of every family in plain torch (tracer/reimpl/), every knob as a step",
        kinds=("config", "semantic", "regime"), fused_attention="attn=sdpa, or flash_attn with ops=ggml",
        local_errors=True, positions=True, decode=True, batch=True, greedy="decode",
        devices=("cpu", "cuda", "mps"), stream=True, noise_floor=True,
    ),
    EngineEntry(
        "file", "tracer.engines.file",
        "a trace saved earlier: tracer's own, or a dump from another runtime (docs/trace-format.md)",
        logits=False, argument="PATH", argument_required=True,
    ),
    EngineEntry(
        "mlx", "tracer.engines.mlx",
        "Apple MLX through mlx-lm on the model directory, its modules' calls recorded (CPU; Metal as mps)",
        knobs=("dtype",), fused_attention="every family but gemma2", devices=("cpu", "mps"), decode=True,
        extra="mlx", requires=(("mlx", "mlx"), ("mlx_lm", "mlx-lm")),
        # each difference is a line of mlx-lm 0.32's own model file, cited and reproduced in docs/engine-mlx.md
        families=("llama", "qwen3", "olmo2", "qwen3_moe", "olmoe"),
        differences=(
            Difference("qwen2", Q_ROPE, "a config holding its theta in rope_parameters only (as "
                       "transformers 5 writes it), other than 1e6",
                       "mlx-lm's qwen2.py reads a top-level rope_theta only, else runs 1e6"),
            Difference("qwen2", CONTEXT, "a prompt longer than the window, on a config whose theta it reads",
                       "mlx-lm's qwen2.py has no sliding window: one causal mask for every layer"),
            Difference("mistral", CONTEXT, "a prompt longer than the window",
                       "mlx-lm runs Mistral with its llama.py, which slides only the layers a config's layer_types "
                       "marks: Mistral's sliding_window is never applied"),
            Difference("gemma2", PROBS, "a prompt longer than the window",
                       "mlx-lm's gemma2.py has no sliding window: one causal mask for every layer"),
            Difference("gemma3", EMBED, "an f32 or f16 run where bf16 cannot hold sqrt(hidden_size)",
                       "mlx-lm's gemma3_text.py scales the embedding by sqrt(hidden_size) rounded to bf16"),
            Difference("phi3", CONTEXT, "a prompt longer than the window",
                       "mlx-lm's phi3.py has no sliding window: one causal mask for every layer"),
            Difference("mixtral", CONTEXT, "a prompt longer than sliding_window",
                       "mlx-lm's mixtral.py has no sliding window: one causal mask for every layer"),
            Difference("qwen2_moe", Q_ROPE, "a config holding its theta in rope_parameters only (as "
                       "transformers 5 writes it), other than 1e6",
                       "mlx-lm's qwen2_moe.py reads a top-level rope_theta only, else runs 1e6"),
            Difference("qwen2_moe", CONTEXT, "use_sliding_window, a prompt longer than the window, on a config "
                       "whose theta it reads",
                       "mlx-lm's qwen2_moe.py has no sliding window: one causal mask for every layer"),
            Difference("qwen2_moe", TOP_K_WEIGHTS, "norm_topk_prob true",
                       "mlx-lm's qwen2_moe.py reads no norm_topk_prob: the top-k weights are never renormalized"),
        ),
    ),
    EngineEntry(
        "onnx", "tracer.engines.onnx",
        "ONNX Runtime on tracer's cached dynamo export of the model, every point a named graph output",
        knobs=("dtype",),
        switches=(Knob("ort_opt", choice("disable", "basic", "extended", "layout", "all"),
                       "disable | basic | extended | layout | all", "all",
                       "ONNX Runtime's graph optimization level (its fusions change the rounding)",
                       # None in the default sweep, which runs on reimpl: --variants ort_opt=disable --candidate onnx
                       fixed(""), kind="runtime", after="preset"),),
        no_decode="tracer's ONNX export is one forward without a cache, with no past-key/value inputs; an "
                  "export with them is not done yet",
        # torch.export stops at transformers' eager experts loop, `for expert_idx in expert_hit` over a nonzero()
        # (GuardOnDataDependentSymNode: Eq(u0, 0), read on a tiny Mixtral and a tiny DeepSeek-V3; the other three
        # run the same loop and fail at the same step, gpt-oss's at its own copy of the loop, read on a tiny
        # gpt-oss); the other experts implementations compute in another order than the reference
        absent=tuple(Absent(family, "torch.export: the eager experts loop is data-dependent")
                     for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")),
        extra="onnx", requires=(("onnxruntime", "onnxruntime"), ("onnx", "onnx"), ("onnxscript", "onnxscript")),
    ),
    EngineEntry(
        "llamacpp", "tracer.engines.llamacpp",
        "llama.cpp (llama-cpp-python) running the model's GGUF, its graph observed through the eval callback",
        # rope_freq_base; the KV cache type and flash attention, regime knobs the reimplementation emulates too
        knobs=("theta", "kv_cache", "flash_attn"),
        switches=(THREADS, Knob("n_ubatch", positive_int, "a positive integer, e.g. n_ubatch=2",
                                "the whole prompt in one",
                                "llama.cpp's micro-batch: the prompt computed in pieces of this many tokens, each a "
                                "graph of its own after the cache the earlier ones filled (other matmul shapes may "
                                "take other kernels)", fixed("n_ubatch=2"), kind="runtime", after="threads")),
        fused_attention="flash_attn=on, or auto where the backend has it",
        draft=True, greedy="cached", argument="PATH", extra="llamacpp", positions=True, decode=True,
        # no wheel on the index: pip compiles llama.cpp, without AMX (docs/engine-llamacpp.md: in a VM that
        # does not hand AMX's tile state over, an AMX build dies with a general-protection fault); no pip
        # cache, which may hold a wheel built with AMX
        install_env='CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" ',
        install_note="compiles llama.cpp without AMX, about 5 minutes on 2 cores",
        requires=(("llama_cpp", "llama-cpp-python"),), isolated=True, regime="ggml",
        # each family's graph in src/models/<arch>.cpp of llama-cpp-python 0.3.36's llama.cpp
        # (docs/engine-llamacpp.md "Families"); the mixtures of experts match on their published configs and
        # differ where a config says what their graph does not read (below; docs/engine-llamacpp.md "Mixtures")
        families=("llama", "qwen3", "olmo2"),
        differences=(
            Difference("qwen2", PROBS, "a prompt longer than the window on a sliding layer",
                       "llama.cpp's qwen2 graph has no sliding window (src/models/qwen2.cpp: build_attn_inp_kv)"),
            Difference("mistral", PROBS, "a prompt longer than sliding_window",
                       "llama.cpp runs Mistral as llama, without a sliding window (src/models/llama.cpp; the "
                       "converter writes none)"),
            Difference("phi3", PROBS, "a prompt longer than sliding_window",
                       "llama.cpp turns Phi-3's sliding window off (src/models/phi3.cpp: \"Phi SWA is currently "
                       "disabled\")"),
            *(Difference(family, SCORES, "query_pre_attn_scalar other than the head size",
                         "llama.cpp scales the queries by 1/sqrt(head_dim) (27B: 1/sqrt(hidden/heads)); "
                         f"query_pre_attn_scalar is not read (src/models/{family}.cpp: f_attention_scale)")
              for family in ("gemma2", "gemma3")),
            *(Difference(family, MLP_ACT, "",
                         "ggml's CPU GELU is a table of f16 values at the input rounded to f16 "
                         "(ggml-cpu/vec.h: GGML_GELU_FP16)") for family in ("gemma2", "gemma3")),
            Difference("gemma3", Q_ROPE, "layer_types other than five sliding layers, then one full",
                       "llama.cpp takes every sixth layer as full, the others sliding (with their rope theta): "
                       "the converter writes no pattern (src/models/gemma3.cpp: load_swa_pattern(ml, 6))"),
            Difference("mixtral", PROBS, "a prompt longer than sliding_window",
                       "llama.cpp runs Mixtral as llama, without a sliding window (src/models/llama.cpp; the "
                       "converter writes none)"),
            # build_moe_ffn's norm_w is a constant of each graph, not the config's norm_topk_prob
            Difference("qwen3_moe", TOP_K_WEIGHTS, "norm_topk_prob false",
                       "llama.cpp's qwen3moe graph always renormalizes the top-k weights (src/models/qwen3moe.cpp: "
                       "build_moe_ffn(..., norm_w=true))"),
            *(Difference(family, TOP_K_WEIGHTS, "norm_topk_prob true",
                         f"llama.cpp's {arch} graph never renormalizes the top-k weights (src/models/{arch}.cpp: "
                         "build_moe_ffn(..., norm_w=false))") for family, arch in (("qwen2_moe", "qwen2moe"),
                                                                                  ("olmoe", "olmoe"))),
        ),
    ),
    EngineEntry(
        "candle", "tracer.engines.candle",
        "candle's own CPU kernels (candle-nn 0.4.2) running candle-transformers 0.11's model files on the model "
        "directory (llama.rs, qwen2.rs, qwen3.rs, mistral.rs, gemma2.rs, gemma3.rs, phi3.rs, olmo2.rs) and "
        "quantized_llama.rs, quantized_qwen2.rs, quantized_qwen3.rs, quantized_phi3.rs or quantized_gemma3.rs "
        "on candle:PATH.gguf; its fused kernels 0.4.2 lacks composed from 0.4.2's ops",
        # candle's config reader and the notes' porting mistakes, in its own forward
        knobs=("theta", "eps", "rope", "config", "resave", "kv_repeat", "mask"), switches=(THREADS,),
        argument="PATH", extra="candle", requires=(("candle", "candle-nn"),), isolated=True, decode=True,
        families=("llama", "qwen3", "olmo2"), regime="candle",
        differences=(
            Difference("qwen2", PROBS, "a prompt longer than the window",
                       "candle's qwen2.rs masks every layer to sliding_window + 1 keys, whatever use_sliding_window "
                       "and max_window_layers say (qwen2.rs:307)"),
            Difference("mistral", PROBS, "a prompt longer than the window",
                       "candle's mistral.rs keeps sliding_window + 1 keys where transformers keeps sliding_window "
                       "(`j + sliding_window < i` masked, mistral.rs:406)"),
            Difference("gemma2", SCORES, "query_pre_attn_scalar other than head_dim",
                       "candle's gemma2.rs scales scores by 1/sqrt(head_dim), never by query_pre_attn_scalar "
                       "(gemma2.rs:240)"),
            Difference("gemma2", PROBS, "a prompt longer than the window",
                       "candle's gemma2.rs windows every layer (gemma2.rs:398), to sliding_window + 1 keys"),
            Difference("gemma3", SCORES, "query_pre_attn_scalar other than head_dim",
                       "candle's gemma3.rs scales scores by 1/sqrt(head_dim), never by query_pre_attn_scalar "
                       "(gemma3.rs:263)"),
            Difference("gemma3", PROBS, "a prompt longer than the window",
                       "candle's gemma3.rs slides layers by its own pattern (gemma3.rs:448), to sliding_window + 1 "
                       "keys"),
            Difference("phi3", PROBS, "a prompt longer than the window",
                       "candle's phi3.rs reads no sliding_window: its mask is causal only (phi3.rs:393)"),
        ),
        regime_with_argument=True,
    ),
)
for builtin in BUILTINS:
    register(builtin)


@dataclass(frozen=True)
class EngineRef:
    """An engine argument parsed once, at the edge of a run: its registry entry, what followed the
    colon (`file:PATH`, `llamacpp:PATH.gguf`), and the text as the user gave it (`str()` gives it back)."""

    entry: EngineEntry
    argument: str | None = None
    text: str = ""

    @classmethod
    def named(cls, name: str) -> EngineRef:
        """A registered engine without an argument, as tracer itself runs one ("reimpl" for a noise floor)."""
        return cls(ENGINES[name], None, name)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def regime(self) -> str | None:
        """The number-format regime this engine computes in on this argument (`EngineEntry.regime`)."""
        if self.entry.regime_with_argument and not self.argument:
            return None
        return self.entry.regime

    def __str__(self) -> str:
        return self.text or self.name


def parse_engine(engine: str | EngineRef) -> EngineRef:
    """`"file:trace.safetensors"` -> the file entry with argument "trace.safetensors" (an `EngineRef`,
    passed through as it is); an unknown name or a missing or unexpected argument is the user's error,
    said before anything loads."""
    if isinstance(engine, EngineRef):
        return engine
    if not isinstance(engine, str):
        raise TracerError(f"an engine is named by a string, got {engine!r}")
    base, colon, argument = engine.partition(":")
    entry = find_entry(base)
    if entry is None:
        raise TracerError(unknown_name("engine", base, registered(), "`tracer engines`"))
    if colon and entry.argument is None:
        raise TracerError(f"the {base} engine takes no argument after ':' (got {engine!r})")
    if colon and not argument:
        raise TracerError(f"{engine!r}: nothing after the colon; give the {base} engine a {entry.argument} "
                          f"({base}:{entry.argument})" + ("" if entry.argument_required else " or drop the colon"))
    if entry.argument_required and not argument:
        raise TracerError(f"the {base} engine needs a {entry.argument}: {base}:{entry.argument}")
    return EngineRef(entry, argument or None, engine)


def check_runtime(entry: EngineEntry) -> None:
    """A runtime that is not installed is one line naming the extra that installs it."""
    missing = entry.missing_runtime()
    if missing:
        note = f" ({entry.install_note})" if entry.install_note else ""
        raise TracerError(f"the {entry.name} engine needs {', '.join(missing)}, which is not installed: "
                          f"{entry.install}{note}")


def engines_honouring(knob: str) -> tuple[str, ...]:
    return tuple(name for name, entry in registered().items() if entry.honours(knob))


def check_engine(variant: dict, engine: str | EngineEntry) -> None:
    """Refuse knobs `engine` (a registered name, or its entry) cannot honour, naming the engines that can."""
    entry = engine if isinstance(engine, EngineEntry) else ENGINES[engine]
    for name in variant:
        if not entry.honours(name):
            engines = ", ".join(engines_honouring(name))
            raise TracerError(
                f"knob {name!r} is not honoured by the {entry.name} engine; engines that honour it: {engines}"
            )


def engine_with_knobs(engine: str | EngineRef, variant=None) -> tuple[EngineRef, dict]:
    """An engine argument ("hf", "file:PATH", ...) and its knobs ("theta=10000", a dict) parsed and checked
    against each other once: a saved trace takes none, every knob is one the engine honours, and its
    runtime is installed. What a run's side is made of (`tracer.pipeline.request.Side.of`), and what one
    engine outside a command loads with (`tracer.engines.load.resolve_and_load`)."""
    ref, knobs = parse_engine(engine), parse_variant(variant)
    if knobs and ref.entry.argument_required:
        raise TracerError(f"{ref} is a saved trace; knobs ({variant_text(knobs)}) need an engine that runs the model")
    check_engine(knobs, ref.entry)
    check_runtime(ref.entry)
    return ref, knobs
