"""The base types of a model's declaration: a point, a config field, a component, the steps it resolves,
a family (a composition of components), and the registry of families.

A component (`tracer.model.components`) is a small frozen declaration, configured like an nn.Module
declaration (`Attention(projections=FusedQKV(), qk_norm=PerHeadNorm())`), that states its facts once:
its points in execution order (`Point`), its weights and
their shapes (functions of the spec), its config fields (`ConfigField`), its knobs (the porting
mistakes it can make), its steps (`steps(knobs, spec)`: slot name -> function, resolved once) and its
forward (torch, imported lazily: importing `tracer.model` never loads torch). A family is a
composition (`Family`): the point order, the shapes, how hf observes each point and which knobs apply
are read off it (`tracer.model.points`, `tracer.model.knobs`), never restated; so are other runtimes'
names for its points (`tracer.names`, keyed by these points). `register` adds a family (built-ins and a test's alike).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from tracer.core.errors import TracerError, unknown_name


@dataclass(frozen=True)
class Point:
    """One point, as the component that computes it declares it.

    Attributes:
        name: the path under the layer ("self_attn.q_rope"; "" is the block output), or a model point.
        label: a short label for figures and tables.
        layout: "rows" | "merged" | "heads" | "attention" (`tracer.model.points`).
        op: the kind of op that computes it ("norm", "projection", "rope", "scores", "softmax",
            "attention", "residual", "activation", "block", "router", "experts", ...), which hints read.
        what: one line saying what it is.
        source: the point it is computed from (`tracer.model.points.BLOCK_INPUT` for the block's input;
            "" for the embeddings).
        observed: how the hf engine sees it: "output" (the module's output), "output:(T, H, D)" or
            "output:(H, T, D)" (per head, merged into (T, H·D)), "output:(T, X)" (a module that drops
            the batch), "output[i]:(T, X)" (the i-th value returned by the module the point is a virtual
            point under: a router's top-k indices; "MODULE>output[i]:(T, X)": of the module named),
            "within:MODULE:WHAT" (a value computed inside that module's forward, `tracer.hooks.within`),
            "module:MODULE" (the output of another module under the layer), "input:MODULE" (the first input
            of that module under the layer), "attention" (the recording attention function), "model:FIELD"
            (a field of the whole model's output).
        gguf_permuted: its last axis holds q/k RoPE pairs, which GGUF's converter permutes.
    """

    name: str
    label: str
    layout: str
    op: str
    what: str
    source: str
    observed: str = "output"
    gguf_permuted: bool = False

    def replace(self, **changes) -> Point:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ConfigField:
    """A config.json key a component reads: its default when the key is absent
    (`tracer.model.config.REQUIRED`: none, the key must be there) and its kind of value, which names the
    shared checker that checks it (`tracer.model.config.FIELD_CHECKS`: "positive_int", "positive_number",
    "bool", "optional_number", "optional_positive_int", "layers": a list of layer indices; "": its
    component's `read_config` checks it). Without a `read_config` of its component, the checked value
    becomes the spec attribute of the same name (`spec.num_local_experts`). `aliases`: other keys
    transformers reads as this one (its config's `attribute_map`: Qwen3-MoE's `num_experts` is its
    `num_local_experts`)."""

    key: str
    default: Any
    kind: str = "positive_int"
    aliases: tuple[str, ...] = ()


class Component:
    """A part of a model. Subclasses are frozen dataclasses overriding what they declare.

    How a family reads its config.json (as mlx-lm's per-model `ModelArgs.from_dict`): beyond the sizes
    every family shares (`tracer.model.config.LlamaSpec`), each component declares the keys it reads
    (`config_fields`: key, default, kind), the spec attributes its forward reads with their value where no
    config sets them (`spec_fields`: no window, no cap, no bias), and, where a value needs logic
    (Qwen's use_sliding_window with max_window_layers, Gemma 3's nested rope_parameters), a
    `read_config` that returns the spec values itself. `tracer.model.config.read_hf` merges what the
    family's components read into the spec's `extra`; `spec.sliding_window` reads it back.
    """

    knobs: tuple = ()  # the `tracer.model.knobs.Knob` records of the porting mistakes it can make
    # its weights (relative to the layer) the reference keeps in f32 in a bf16 or f16 load (transformers'
    # `_keep_in_fp32_modules_strict`: DeepSeek-V3's router)
    f32_weights: tuple[str, ...] = ()
    config_fields: tuple[ConfigField, ...] = ()
    # spec attribute -> its value in a model whose config does not set it (the feature off); the same
    # in every component that declares it (`spec_field_defaults`)
    spec_fields: dict[str, Any] = {}
    # spec attribute -> spec -> its value, computed each time it is read (`spec.rotary_dim`: it follows
    # a head_dim knob)
    spec_properties: dict[str, Callable] = {}

    def read_config(self, config: dict) -> dict | None:
        """The spec values it reads from config.json, checked (shared ones such as rope_theta included);
        None: each of its `config_fields` as declared (`tracer.model.config.read_fields`).

        Raises:
            TracerError: a value transformers would refuse, naming the key.
        """
        return None

    def parts(self) -> tuple[Component, ...]:
        """The components inside this one (attention's projections, q/k norm, RoPE)."""
        return ()

    def weights(self, spec) -> dict[str, tuple[int, ...]]:
        """Its weights (HF names, relative to the layer for a block's part) and their shapes."""
        return {}

    def records_on(self, spec, layer: int, point: str) -> bool:
        """Whether it records its point `point` in block `layer` (a mixture of experts' dense layers do not route)."""
        return True

    def layer_weights(self, spec, layer: int) -> dict[str, tuple[int, ...]]:
        """Its weights in one layer: `weights`, unless its layers differ (a mixture of experts' dense layers)."""
        return self.weights(spec)

    def steps(self, knobs: dict, spec) -> dict[str, Callable]:
        """Its strategy slots for a variant's knobs (presets expanded): slot name -> function."""
        return {}

    def all_parts(self) -> tuple[Component, ...]:
        """Every part inside it, depth first, then itself (the order its weights are listed in)."""
        return (*(each for part in self.parts() for each in part.all_parts()), self)


class Steps:
    """The forward's replaceable steps: the merged slots of a family's components, chosen once
    from the variant. A regime replaces slots by name (`replace`); an unknown slot is an error."""

    def __init__(self, slots: dict[str, Any]):
        clashing = sorted(set(slots) & set(dir(Steps)))
        if clashing:
            raise TracerError(f"a step cannot be named {clashing[0]!r}")
        self.__dict__.update(slots)  # read as plain attributes: the forward reads steps hundreds of times
        object.__setattr__(self, "_slots", dict(slots))

    def __getattr__(self, slot: str):
        raise AttributeError(f"no step {slot!r} in this model's forward")

    def __setattr__(self, name, value):
        raise AttributeError("steps are resolved once; use replace()")

    def __contains__(self, slot: str) -> bool:
        return slot in self._slots

    def slots(self) -> dict[str, Any]:
        return dict(self._slots)

    def replace(self, **changes) -> Steps:
        unknown = sorted(set(changes) - set(self._slots))
        if unknown:
            raise TracerError(f"no step {unknown[0]!r} in this model's forward (its steps: {', '.join(self._slots)})")
        return Steps({**self._slots, **changes})


def merged_steps(components, knobs: dict, spec) -> dict[str, Any]:
    """The slots of `components` for a variant; two components filling one slot must agree."""
    slots: dict[str, Any] = {}
    for component in components:
        for slot, step in component.steps(knobs, spec).items():
            if slot in slots and slots[slot] is not step:
                raise TracerError(f"two components fill the step {slot!r} differently ({type(component).__name__})")
            slots[slot] = step
    return slots


@dataclass(frozen=True)
class Family:
    """One model family: a composition of components, stating only how it differs from its parent
    (`derive`).

    Attributes:
        name: tracer's name, also the `model_type` of its config.json (`gemma3` reads `gemma3_text`).
        title: how people write it ("Gemma 2").
        model_types: the `model_type` values that are this family.
        architecture: the transformers class the hf engine loads (`Gemma2ForCausalLM`).
        adds: one line, what it adds over Llama (`tracer variants`, docs/families.md).
        embedding, norm, attention, mlp, block, head: its components (`tracer.model.components`);
            `norm` is its RMSNorm flavour, which every norm of the model uses.
        config: the defaults transformers gives the shared sizes in this family
            (`tracer.model.config.FamilyConfig`); what else it reads, its components declare.
        gguf_arch: llama.cpp's architecture name, which keys gguf's `TensorNameMap`.
        hints: point (or sub-point) -> what this family does there that a port gets wrong.
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    architecture: str
    adds: str
    embedding: Component
    norm: Component
    attention: Component
    mlp: Component
    block: Component
    head: Component
    config: Any = None
    gguf_arch: str = "llama"
    hints: dict[str, str] = field(default_factory=dict)

    def derive(self, **changes) -> Family:
        """This family with `changes` (a child states only how it differs)."""
        return dataclasses.replace(self, **changes)

    def components(self) -> tuple[Component, ...]:
        """Its components in the order the forward runs them (the family's norm with the embedding)."""
        return (self.embedding, self.norm, self.attention, self.mlp, self.block, self.head)

    def graph(self) -> tuple[Component, ...]:
        """What its forward computes: two families with equal graphs are the same computation."""
        return self.components()

    def all_components(self) -> tuple[Component, ...]:
        return tuple(each for component in self.components() for each in component.all_parts())

    @cached_property
    def _sub_points(self) -> dict[str, Point]:
        points = self.block.points(self)
        return {point.name: point for point in points}

    @cached_property
    def _model_points(self) -> dict[str, Point]:
        first, *rest = self.embedding.points(self), self.head.points(self)
        return {point.name: point for group in (first, *rest) for point in group}

    def sub_points(self) -> dict[str, Point]:
        """Its per-layer points in execution order."""
        return self._sub_points

    def model_points(self) -> dict[str, Point]:
        """Its points outside the blocks in execution order (the capped logits where its head can cap)."""
        return self._model_points

    def layer_weights(self, spec, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Block `layer`'s tensors (names relative to the layer) with their shapes."""
        return {name: shape for component in (self.block, self.attention, self.mlp)
                for each in component.all_parts() for name, shape in each.layer_weights(spec, layer).items()}

    def knobs(self) -> tuple:
        """The knobs its components declare (the model-wide ones are not listed here)."""
        seen: dict[str, Any] = {}
        for component in self.all_components():
            for knob in component.knobs:
                seen.setdefault(knob.name, knob)
        return tuple(seen.values())

    def config_fields(self) -> tuple[ConfigField, ...]:
        """The config.json keys its components read, in the order the forward runs them."""
        return tuple(f for component in self.all_components() for f in component.config_fields)

    def steps(self, knobs: dict, spec) -> dict[str, Any]:
        return merged_steps(self.all_components(), knobs, spec)


# --- the registry ---------------------------------------------------------------------------------

_REGISTRY: dict[str, Family] = {}
_VERSION = [0]  # changes with every registration: what is read off the registry is cached per version


def register(family: Family) -> Family:
    """Add a family (or replace one of the same name); returns it."""
    _REGISTRY[family.name] = family
    _VERSION[0] += 1
    return family


def unregister(name: str) -> None:
    """Remove a family (a test's made-up one, when the test is done)."""
    if _REGISTRY.pop(name, None) is not None:
        _VERSION[0] += 1


def registry_version() -> int:
    return _VERSION[0]


_SPEC_FIELDS: list = [-1, {}, {}]  # registry version, then the two tables read off it


def spec_field_defaults() -> dict[str, Any]:
    """spec attribute -> its value where no config sets it, as the registered families' components
    declare them (`Component.spec_fields`): what `spec.sliding_window` reads on a Llama, or on a spec
    built without a family's reading (candle's reader, a GGUF's sizes)."""
    return _spec_tables()[0]


def spec_properties() -> dict[str, Callable]:
    """spec attribute -> how it is computed from the spec (`Component.spec_properties`)."""
    return _spec_tables()[1]


def _spec_tables() -> tuple[dict, dict]:
    if _SPEC_FIELDS[0] != _VERSION[0]:
        defaults: dict[str, Any] = {}
        properties: dict[str, Callable] = {}
        for family in _REGISTRY.values():
            for component in family.all_components():
                for name, off in component.spec_fields.items():
                    defaults.setdefault(name, off)
                for name, compute in component.spec_properties.items():
                    properties.setdefault(name, compute)
        _SPEC_FIELDS[:] = [_VERSION[0], defaults, properties]
    return _SPEC_FIELDS[1], _SPEC_FIELDS[2]


def registered() -> dict[str, Family]:
    """name -> family, every registered one in registration order."""
    return dict(_REGISTRY)


def model_types() -> dict[str, Family]:
    """model_type -> its family, every registered one's (read each time: a test may register one)."""
    return {model_type: family for family in _REGISTRY.values() for model_type in family.model_types}


def family_named(name: str | None) -> Family:
    """A registered family by tracer's name (None: Llama).

    Raises:
        TracerError: a name no registered family has.
    """
    family = _REGISTRY.get(name or "llama")
    if family is None:
        raise TracerError(unknown_name("family", name, _REGISTRY, "`tracer variants`"))
    return family


def family_of(model_type: str | None) -> Family:
    """The family of a config's `model_type` (absent: Llama, as tracer always read it).

    Raises:
        TracerError: a model type tracer does not trace, in one line naming the supported ones.
    """
    known = model_types()
    family = known.get("llama" if model_type is None else model_type)
    if family is None:
        raise TracerError(f"unsupported model_type {model_type!r}; tracer traces: {', '.join(known)}")
    return family


@dataclass(frozen=True)
class Run:
    """What a component's forward reads while it computes: the model's spec and steps, its weights
    (names relative to the layer inside a block), the recorder (the same names), the absolute
    positions of the tokens (`tracer.model.components.rope.Positions`) and an optional KV cache."""

    spec: Any
    steps: Steps
    weights: Any
    record: Callable
    positions: Any = None
    cache: Any = None
    index: int | None = None  # the layer, inside a block
