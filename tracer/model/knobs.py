"""The variant catalogue: knobs, their values, and which engines honour them.

A variant is an ordered mapping knob -> value, written on the command line as
`theta=10000,attn=sdpa`. This module only parses and validates; each engine applies the knobs it
honours, and declares which (by kind) in its registry entry (`tracer.engines.registry`). The
model-wide knobs are declared here (`MODEL_WIDE`); a knob that undoes one part of a model (Gemma's
(1 + w) norm, a fused projection's split, a sliding window) is declared by the component that has
that part (`tracer.model.components`), and applies to exactly the families composed of it; a switch
of one runtime (its thread count, its micro-batch) is declared by the engine that runs that runtime
(`EngineEntry.switches`), which registers it here (`register_switch`) as the engine is registered.
`KNOBS` reads all three, live (a test may register a family with a component of its own). Config-level knobs
become a different `LlamaSpec` (`tracer.model.config.apply_overrides`), which the hf engine writes
into transformers' config too; semantic knobs become steps of the reimplementation (each
component's `steps`). A knob an engine cannot honour is an error naming the engines that can, never
silently ignored. No torch here: `tracer variants` starts fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from tracer.core.errors import TracerError, did_you_mean
from tracer.model.component import Family, family_named, registered, registry_version
from tracer.model.points import MLP_ACT

DTYPES = ("f32", "bf16", "f16", "f64")
ACTIVATION_VALUES = ("silu", "gelu", "gelu_tanh", "relu")  # tracer.model.config.ACT_NAMES maps them to transformers'


KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
# Number-format regimes (tracer.ggml.strategies); kept here as text so `tracer variants` needs no torch.
WEIGHT_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "gguf")
ACT_QUANTS = ("none", "q8_0", "q8_1", "q8_k", "auto")


# What a knob changes, which is what an engine declares it honours (`tracer.engines.registry.EngineEntry.kinds`):
KINDS = {
    "config": "the model every PyTorch engine builds (the spec it reads from config.json)",
    "semantic": "one operation of tracer's own forward (the families' porting mistakes among them)",
    "regime": "the number formats: ggml's block formats and CPU arithmetic (tracer.ggml)",
    "runtime": "a switch of one runtime, declared by the engine that runs it (`EngineEntry.switches`)",
}


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]  # raises ValueError on a bad value
    accepted: str  # the accepted form, quoted in errors and `tracer variants`
    default: str
    reproduces: str
    # The variant `tracer sweep` runs for this knob by default, given the model's spec ("": none).
    representative: Callable[[Any], str] = lambda spec: ""
    # A model-wide knob that applies to some families only: asked of the family (None: every family).
    # A component's knob applies to the families composed of that component; it leaves this None.
    applies: Callable[[Family], bool] | None = None
    # Where its representative value diverges first (f32 unless said), for `tracer variants`.
    expected: str = ""
    kind: str = ""  # one of KINDS
    # How reports show its value, where the value itself is too long to read (a file's path: its name);
    # None: as written. The variant itself, in summaries and commands, keeps the whole value.
    display: Callable[[Any], str] | None = None
    # A component's knob: the knob it follows in the catalogue (`tracer variants`, a sweep's order); "": last.
    after: str = ""

    @property
    def values(self) -> tuple[str, ...] | None:
        """Its values, for a knob with a fixed set of them (None for numbers)."""
        return getattr(self.parse, "values", None)

    @property
    def default_value(self) -> Any:
        """The default as a value; None where it is not one ("from config.json", "as loaded", per engine)."""
        try:
            return self.parse(self.default)
        except ValueError:
            return None

    @property
    def families(self) -> tuple[str, ...] | None:
        """The registered families it applies to, by name (None: every family)."""
        if is_whole_model(self.name) and self.applies is None:
            return None
        families = tuple(name for name in registered() if applies_to(self, name))
        return None if families == tuple(registered()) else families  # every family's component


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(text)
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(text)
        return text

    parse.values = values  # what `Knob.values` reads
    return parse


def fixed(text: str) -> Callable[[Any], str]:
    return lambda spec: text


def when(test: Callable[[Any], bool], text: str) -> Callable[[Any], str]:
    """A representative where the model has what the knob changes (a soft-cap, a window, ...); with
    no spec at hand, the value itself."""
    return lambda spec: text if spec is None or test(spec) else ""


def unswept(text: str) -> Callable[[Any], str]:
    """The knob's value for `tracer variants` and the engine checks, and no sweep variant on a model: a
    knob that changes nothing in one forward of one prompt (a decode step's, a padded batch's mistake)."""
    return when(lambda spec: False, text)


def llama_graph(family: Family) -> bool:
    """The candle and llama.cpp readers, presets and emulations know Llama's graph only: a family
    composed of exactly Llama's components."""
    return family.graph() == family_named("llama").graph()


# Families beyond Llama's graph whose llama.cpp graph `tracer.ggml` emulates op for op (ops=ggml) and
# whose GGUF a regime reads (weights=gguf: `tracer.ggml.strategies.GGUFWeights`); each checked bit for
# bit against llama.cpp in tests/unit/test_ggml_families.py.
GGML_FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2")


def ggml_graph(family: Family) -> bool:
    """ops=ggml emulates this family's llama.cpp graph: Llama's, or one of `GGML_FAMILIES`."""
    return llama_graph(family) or family.name in GGML_FAMILIES


def llama_gguf(family: Family) -> bool:
    """A family whose GGUF a regime reads as llama.cpp wrote it (weights=gguf): its tensor names from
    gguf-py's map for its architecture, q/k rows un-permuted where the converter permuted them (Llama's)."""
    # Llama's graph, not merely llama.cpp's "llama" architecture (which Mixtral's experts share): no MoE yet
    return llama_graph(family) or family.name in GGML_FAMILIES


def _llama_only(text: str) -> Callable[[Any], str]:
    """A representative for Llama models only (the candle presets read Llama configs only)."""
    return when(lambda spec: llama_graph(family_named(spec.family)), text)


# transformers' Gemma 2 has no sdpa path (it cannot soft-cap), nor has the fused kernel
_sdpa = when(lambda spec: spec.attn_logit_softcapping is None, "attn=sdpa")


def _file_path(text: str) -> str:
    if not text.strip() or "\n" in text:
        raise ValueError(text)
    return text


def _tensor_names(text: str) -> str:
    """"blk.5.attn_k+blk.7.ffn_down": GGUF tensor names joined by +."""
    names = text.split("+")
    if not all(name and all(ch.isalnum() or ch in "._" for ch in name) for name in names):
        raise ValueError(text)
    return text


def _file_name(value: str) -> str:
    return value.replace("\\", "/").rsplit("/", 1)[-1]


PRESET_NAMES = ("candle", "llamacpp", "candle-q")


MODEL_WIDE: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob("theta", _positive_float, "a positive number, e.g. theta=10000", "from config.json",
             "rope_theta silently 10000 (candle's serde default)",
             lambda spec: "theta=10000" if spec.rope_theta != 10_000 else "theta=500000", kind="config"),
        Knob("eps", _positive_float, "a positive number, e.g. eps=1e-6", "from config.json",
             "a wrong rms_norm_eps", fixed("eps=1e-3"), kind="config"),
        Knob("attn", choice("eager", "sdpa"), "eager | sdpa", "eager",
             "the attention implementation (sdpa fuses scores and softmax)", _sdpa, kind="config"),
        Knob("dtype", choice(*DTYPES), " | ".join(DTYPES), "f32",
             "the load dtype", fixed("dtype=bf16"), kind="config"),
        Knob("rope", choice("half", "interleaved"), "half | interleaved", "half",
             "candle rope_i (adjacent pairs, the GGUF convention) on HF-layout weights", fixed("rope=interleaved"),
             kind="semantic"),
        Knob("rope_scaling", choice("keep", "drop"), "keep | drop", "keep",
             "Llama-3 rope_scaling lost (candle reading a transformers 5 config)", fixed("rope_scaling=drop"),
             kind="config"),
        Knob("kv_repeat", choice("interleave", "tile"), "interleave | tile", "interleave",
             "GQA head order: tile (torch.cat / .repeat) instead of HF repeat_kv", fixed("kv_repeat=tile"),
             kind="semantic"),
        Knob("mask", choice("additive", "where", "none"), "additive | where | none", "additive",
             "HF's min-float add vs candle's masked_fill -inf; none forgets the causal mask", fixed("mask=none"),
             kind="semantic"),
        Knob("attn_math", choice("hf", "candle"), "hf | candle", "hf",
             "candle's attention: q, k, v upcast to f32 throughout, scores divided by sqrt(D)",
             fixed("attn_math=candle"), kind="semantic"),
        Knob("bias", choice("keep", "ignore"), "keep | ignore", "keep",
             "candle's linear_no_bias drops projection biases", fixed("bias=ignore"), kind="config"),
        Knob("logits", choice("all", "last"), "all | last", "all",
             "candle computes lm_head on the last position only", fixed("logits=last"), kind="semantic"),
        Knob("config", choice("hf", "candle"), "hf | candle", "hf",
             "which reader parses config.json (candle 0.11: 13 keys, see `tracer config`)",
             _llama_only("config=candle"), applies=llama_graph, kind="config"),
        Knob("resave", choice("none", "tf5"), "none | tf5", "none",
             "config re-saved by transformers 5 (theta and scaling move into rope_parameters)",
             _llama_only("config=candle,resave=tf5"), applies=llama_graph, kind="config"),
        Knob("preset", choice(*PRESET_NAMES), " | ".join(PRESET_NAMES), "none",
             "every candle-0.11 llama.rs choice, or llama.cpp's CPU arithmetic, at once (explicit knobs override it)",
             _llama_only("preset=candle"), applies=llama_graph, kind="semantic"),
        Knob("weights", choice(*WEIGHT_FORMATS), " | ".join(WEIGHT_FORMATS), "as loaded",
             "weights in a GGUF block format (the gguf package's quantizers), or gguf: a GGUF file's own tensors "
             "(gguf_file=, else the one the model was converted from)",
             fixed("weights=q8_0"), kind="regime"),
        Knob("gguf_file", _file_path, "a GGUF path, e.g. gguf_file=model.gguf",
             "the GGUF the model directory was converted from",
             "with weights=gguf: the tensors of this GGUF (another quantization of the same model), each in its "
             "own type", when(lambda spec: False, "gguf_file=model.gguf,weights=gguf"), applies=llama_gguf,
             kind="regime", display=_file_name),
        Knob("requantize", _tensor_names, "GGUF names joined by +, e.g. blk.5.attn_k", "none",
             "with weights=gguf: these tensors as llama.cpp's quantizer makes them from the model's own weights, "
             "in the file's type (what the regime view's audit takes in place of a damaged tensor)",
             when(lambda spec: False, "requantize=blk.0.attn_k,weights=gguf"), applies=llama_gguf, kind="regime"),
        Knob("act_quant", choice(*ACT_QUANTS), " | ".join(ACT_QUANTS), "none",
             "ggml's activation quantization before a quantized matmul (auto: the weight type's vec-dot type)",
             fixed("act_quant=q8_0"), kind="regime"),
        Knob("act_round", choice("even", "away", "candle"), "even | away | candle", "even",
             "ties of the activation quantization: x86's _mm256_round_ps (even) or ggml's portable C (away); "
             "candle: candle's from_float (x·(1/d), ties away, Q8_1's s = f16(sum)·f16(d) in f16)",
             fixed("act_round=away,act_quant=q8_0"), kind="regime"),
        Knob("ops", choice("hf", "ggml", "candle"), "hf | ggml | candle", "hf",
             "embedding, RMSNorm, RoPE, SwiGLU and (flash) attention as ggml's CPU backend computes them, or "
             "as candle's f32 kernels do (quantized_llama.rs)",
             fixed("ops=ggml"), applies=ggml_graph, kind="regime"),
        Knob("accumulate", choice("ggml", "f32", "f64", "candle"), "ggml | f32 | f64 | candle", "ggml",
             "a regime's sums: ggml's own order (bit-exact on x86, slow), or its matmuls by torch's BLAS in f32 "
             "(another order, fast) or f64 (exact), the rest exact and rounded once; candle: candle's vec_dot "
             "(Q4_1 scalar loop, Q8_0 AVX2)",
             fixed("accumulate=f64,weights=q8_0,act_quant=q8_0"), kind="regime"),
        Knob("layers", positive_int, "a positive integer, e.g. layers=31", "from config.json",
             "num_hidden_layers and the weights disagree", lambda spec: f"layers={spec.num_hidden_layers + 1}",
             kind="config"),
        Knob("head_dim", positive_int, "a positive integer, e.g. head_dim=32", "from config.json",
             "head_dim and the weights disagree", lambda spec: f"head_dim={spec.head_dim // 2}", kind="config"),
        Knob("act", choice(*ACTIVATION_VALUES), " | ".join(ACTIVATION_VALUES), "from config.json",
             "another MLP activation than the config's: exact (erf) GELU for Gemma's tanh approximation, or the "
             "reverse", when(lambda spec: spec.hidden_act == "gelu_pytorch_tanh", "act=gelu"),
             expected=f"layers.0.{MLP_ACT}", kind="config"),
        Knob("kv_cache", choice(*KV_CACHE_TYPES), " | ".join(KV_CACHE_TYPES), "f16 (llamacpp), f32 (reimpl)",
             "the KV cache's storage type (llama.cpp type_k/type_v; f16 by default): keys and values rounded "
             "before attention, which then computes as ggml does with that type", fixed("kv_cache=f32"),
             kind="regime"),
        Knob("flash_attn", choice("on", "off", "auto"), "on | off | auto", "auto",
             "llama.cpp's flash attention (auto: on where the backend has it), which fuses scores, softmax and "
             "context", fixed("flash_attn=off"), kind="regime"),
    )
}


# The switches of the registered engines' runtimes (`tracer.engines.registry.EngineEntry.switches`).
_SWITCHES: dict[str, Knob] = {}
_SWITCHES_VERSION = [0]


def register_switch(knob: Knob) -> Knob:
    """A runtime's own switch joins the catalogue (the engine registry calls it for each switch of an
    engine it registers); a name is one knob, whichever engines name it.

    Raises:
        TracerError: another knob already has its name.
    """
    known = MODEL_WIDE.get(knob.name) or _SWITCHES.get(knob.name) or next(
        (own for family in registered().values() for own in family.knobs() if own.name == knob.name), None)
    if known is not None and known is not knob:
        raise TracerError(f"two knobs are named {knob.name!r}: a runtime switch must have a name of its own")
    if known is None:
        _SWITCHES[knob.name] = knob
        _SWITCHES_VERSION[0] += 1
    return knob


def unregister_switch(name: str) -> None:
    """Remove a switch no registered engine declares any longer (a test's made-up engine, when it is done)."""
    if _SWITCHES.pop(name, None) is not None:
        _SWITCHES_VERSION[0] += 1


def is_whole_model(name: str) -> bool:
    """A knob of the whole model: model-wide, or a runtime's switch (no component declares it)."""
    return name in MODEL_WIDE or name in _SWITCHES


class Catalogue(Mapping):
    """name -> Knob: the model-wide knobs, those the registered families' components declare and the
    registered engines' runtime switches, each placed after the knob it names in `after` (read live: a
    test may register a family with a component of its own)."""

    _cached: tuple[tuple[int, int], dict[str, Knob]] = ((-1, -1), {})

    def _table(self) -> dict[str, Knob]:
        version, table = self._cached
        now = (registry_version(), _SWITCHES_VERSION[0])
        if version != now:
            own = {}
            for family in registered().values():
                for knob in family.knobs():
                    own.setdefault(knob.name, knob)
            added = [knob for name, knob in own.items() if name not in MODEL_WIDE]
            table = _placed(MODEL_WIDE, [*added, *_SWITCHES.values()])
            self._cached = (now, table)
        return table

    def __getitem__(self, name: str) -> Knob:
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _placed(table: dict[str, Knob], knobs: list[Knob]) -> dict[str, Knob]:
    """`table` with each of `knobs` right after the knob it names in `after` (once that one is placed;
    those placed after one anchor keep their order), the rest at the end."""
    names, waiting = list(table), list(knobs)
    placed = dict(table)
    while waiting:
        ready = [knob for knob in waiting if knob.after in placed]
        if not ready:
            break
        for knob in ready:
            anchor = names.index(knob.after)
            while anchor + 1 < len(names) and placed[names[anchor + 1]].after == knob.after:
                anchor += 1
            names.insert(anchor + 1, knob.name)
            placed[knob.name] = knob
            waiting.remove(knob)
    names += [knob.name for knob in waiting]
    placed |= {knob.name: knob for knob in waiting}
    return {name: placed[name] for name in names}


KNOBS = Catalogue()


# What `preset=candle` stands for: candle-transformers 0.11 `models/llama.rs` read op by op.
# rope (half-split pairing) and repeat_kv (interleave order) already agree with transformers.
# `preset=llamacpp`: llama.cpp's CPU forward (ggml-cpu, x86 AVX2/AVX-512): ggml's ops and flash
# attention on an f16 KV cache, activations quantized to each weight's vec-dot type (ties to even),
# sums in ggml's order. The weights stay as loaded: add weights=gguf for the GGUF file's own.
PRESETS: dict[str, dict[str, Any]] = {
    "candle": {"config": "candle", "mask": "where", "attn_math": "candle", "norm": "candle", "logits": "last"},
    "llamacpp": {"ops": "ggml", "act_quant": "auto", "act_round": "even", "kv_cache": "f16", "accumulate": "ggml"},
    # candle's quantized CPU arithmetic (quantized_llama.rs through candle-nn 0.4.2; tracer.ggml.candle)
    "candle-q": {"ops": "candle", "act_quant": "auto", "act_round": "candle", "accumulate": "candle"},
}


def expand_presets(variant: dict) -> dict:
    """The knobs a variant stands for: its preset's knobs, overridden by the ones given explicitly."""
    preset = PRESETS.get(variant.get("preset"), {})
    return {**preset, **{k: v for k, v in variant.items() if k != "preset"}}


def format_knob_value(value) -> str:
    """10000.0 -> "10000", 1e-05 -> "1e-05": how a knob's value is written back."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def variant_text(variant: dict) -> str:
    """{"theta": 10000.0, "rope": "interleaved"} -> "theta=10000,rope=interleaved"."""
    return ",".join(f"{k}={format_knob_value(v)}" for k, v in variant.items())


def variant_label(variant: dict) -> str:
    """`variant_text` as reports show it: a file's path by the file's name (`Knob.display`)."""
    def shown(knob: str, value) -> str:
        display = KNOBS[knob].display if knob in KNOBS else None
        return display(value) if display else format_knob_value(value)

    return ",".join(f"{k}={shown(k, v)}" for k, v in variant.items())


def side_label(engine: str, variant: dict) -> str:
    """`engine[knob=value,...]`: how reports name one side of a comparison."""
    return f"{engine}[{variant_label(variant)}]" if variant else engine


def parse_variant(spec: str | dict | None) -> dict[str, Any]:
    """`"theta=10000,attn=sdpa"` (or a dict, or a list of such strings) -> {"theta": 10000.0, ...}.

    Raises:
        TracerError: unknown knob (with the closest name when it looks like a typo), malformed pair,
            or bad value (quoting the accepted form).
    """
    if not spec:
        return {}
    if isinstance(spec, dict):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    else:
        texts = [spec] if isinstance(spec, str) else list(spec)
        pairs = [_split_pair(item) for text in texts for item in text.split(",") if item.strip()]
    variant: dict[str, Any] = {}
    for name, text in pairs:
        knob = KNOBS.get(name)
        if knob is None:
            raise TracerError(f"unknown knob {name!r} (`tracer variants` lists every knob){did_you_mean(name, KNOBS)}")
        if name in variant:
            raise TracerError(f"knob {name!r} is given twice")
        try:
            variant[name] = knob.parse(text)
        except ValueError:
            raise TracerError(f"bad value {text!r} for knob {name!r}; "
                              + (did_you_mean(text, knob.values or ()).removeprefix("; ")
                                 or f"expected {knob.accepted}")) from None
    return variant


def _split_pair(item: str) -> tuple[str, str]:
    name, sep, value = item.strip().partition("=")
    if not sep or not name.strip() or not value.strip():
        raise TracerError(f"bad variant {item.strip()!r}; expected knob=value, e.g. theta=10000")
    return name.strip(), value.strip()


def applies_to(knob: Knob, family: str) -> bool:
    """A model-wide knob or a runtime's switch applies where its predicate says (everywhere without
    one); a component's knob to the families composed of that component."""
    row = family_named(family)
    if is_whole_model(knob.name):
        return knob.applies is None or knob.applies(row)
    return any(knob.name == own.name for own in row.knobs())


def check_family(variant: dict, family: str) -> None:
    """Refuse knobs that do not apply to the model's family, naming the families they apply to."""
    for name in variant:
        if name in KNOBS and not applies_to(KNOBS[name], family):
            families = ", ".join(KNOBS[name].families)
            raise TracerError(f"knob {name!r} does not apply to {family} models; it applies to {families}")


def knobs_of_kind(kind: str) -> tuple[str, ...]:
    """The names of every knob of one kind (`KINDS`), in catalogue order."""
    return tuple(name for name, knob in KNOBS.items() if knob.kind == kind)


def knobs_for(family: str) -> list[Knob]:
    """The knobs that apply to one family, in catalogue order."""
    return [knob for knob in KNOBS.values() if applies_to(knob, family)]


def setting(variant: dict, name: str) -> Any:
    """The value `variant` gives knob `name`, else the knob's default (None where that is no value)."""
    return variant[name] if name in variant else KNOBS[name].default_value


def is_regime(variant: dict) -> bool:
    """Whether a variant (presets expanded) emulates a number-format regime (`tracer.ggml.strategies`)."""
    return any(KNOBS[knob].kind == "regime" for knob in variant if knob in KNOBS)
