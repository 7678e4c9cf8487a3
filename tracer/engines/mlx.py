"""The `mlx` engine: Apple's MLX running the model through mlx-lm, recorded under tracer's points.

mlx-lm builds the model from the same directory (`config.json` read by its own `ModelArgs`,
safetensors weights) and runs its own forward of the family (`mlx_lm/models/llama.py`, `gemma2.py`, ...).
MLX has no hooks, so recording swaps the class of each observed module instance for a subclass whose
`__call__` (or method) records what goes in and out, and swaps it back on exit (even when the forward
raises): the model tree, its parameter paths and every other instance stay untouched, and nothing is left
behind. mlx-lm's module paths are HF's (`model.layers.3.self_attn.q_proj`), so they are the point names.

What each observed call gives (`planned_calls`, read off the family's points and mlx-lm's names for them in
`tracer.names.mlx`): module outputs, module inputs where hf takes one (`resid_mid`, `act(gate) * up`), and
mlx-lm's own calls: its RoPE module, called twice per layer (queries then keys, (B, H, T, D) as the
q_rope / k_rope points), the context (o_proj's input), the logits (the head's call; the model's output is
the soft-capped logits), Gemma's embedding after its sqrt(hidden) scale (the input of the first block's
first norm), and Gemma 2's scores and probabilities (the input and output of `mx.softmax` in its unfused
attention). Every other family runs attention as one fused call (`mx.fast.scaled_dot_product_attention`):
scores and probabilities never exist as arrays, and are "not recorded".

A mixture of experts' routing (`mlx_lm/models/{mixtral,qwen2_moe,qwen3_moe,olmoe}.py`): the router's logits are
its `gate`'s output, the scores its `mx.softmax` over every expert (Mixtral's softmax is over the k picked
logits only: never formed), the picked experts `switch_mlp`'s second argument; the weights, the experts' sum and
Qwen2-MoE's gated shared expert are arithmetic on `switch_mlp`'s output, recorded by handing that output on as a
`Following` proxy. argpartition leaves the picks in no order: they are laid out in top-k's (`in_top_k_order`).

MLX is lazy: the recorded arrays are collected during the forward and evaluated together with
the logits in one `mx.eval`, then handed to the recorder one by one as torch tensors.
"""

from __future__ import annotations

import inspect
import sys
import traceback
from collections import deque
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch

from tracer.core.errors import TracerError, one_line
from tracer.core.torch_types import TORCH_DTYPES
from tracer.core.versions import installed_version
from tracer.engines.base import EngineBase, at_positions, decode_steps, per_layer
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.files.weights import check_weight_files
from tracer.model.component import family_named
from tracer.model.config import NON_FORWARD_KEYS, read_hf
from tracer.model.knobs import setting
from tracer.model.kv_cache import ring_slots
from tracer.model.points import (
    CACHE_K,
    CACHE_V,
    EXPERTS,
    FUSED_AWAY,
    ROUTER_LOGITS,
    ROUTER_SCORES,
    SHARED_EXPERT,
    TOP_K_INDEX,
    TOP_K_WEIGHTS,
    layer_point,
    model_point_records,
    split_point,
    sub_points,
)
from tracer.names.mlx import MLX, UNSEEN
from tracer.names.vocabulary import Name
from tracer.traces.trace import Trace, TraceRecorder

FUSED = ("mlx-lm runs attention as one fused call (mx.fast.scaled_dot_product_attention): "
         "scores and probabilities never exist as arrays")

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # knob value -> mlx.core dtype name
DEVICES = {"cpu": "cpu", "mps": "gpu"}  # torch device type -> MLX device (mps: Metal on Apple silicon)


def runtime() -> dict:
    return {"name": "mlx", "version": installed_version("mlx"),
            "mlx_lm": installed_version("mlx-lm")}


class MLXEngine(EngineBase):
    entry = ENGINES["mlx"]

    def __init__(self, model, config: dict, variant: dict, label: str, device: torch.device):
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        self.model, self.config, self.variant, self.label, self.device = model, config, variant, label, device
        self.spec = read_hf(config)  # what transformers reads: the positions the reference has
        self.family = self.spec.family
        self.final_softcap = self.spec.final_logit_softcapping is not None  # the reference has capped logits
        self.stream = getattr(mx, DEVICES[device.type])
        self.num_layers = len(model.layers)
        self.dtype = setting(variant, "dtype")
        self.vocab_size, self.max_positions = model.args.vocab_size, self.spec.max_position_embeddings
        self.layouts = traced_layouts(self.family)

    def record(self, tokens: list[int], recorder=None, *, positions=None) -> Trace:
        """Every point mlx-lm's forward exposes; `recorder` (default in memory) may spill to disk."""
        self.first_position(tokens, positions)  # its tokens run from 0: other positions are refused
        recorder = recorder if recorder is not None else TraceRecorder()
        self._recorded(tokens, recorder)
        return Trace(recorder.tensors, self._meta(tokens))

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0) -> Trace:
        """The prefill and `count` decode steps with mlx-lm's own cache (`make_prompt_cache`: a `KVCache`
        per layer, a `RotatingKVCache` where the model makes one), each step's position the cache's
        `offset`, as mlx-lm's generate runs it; every step's points and what each cache holds."""
        from mlx_lm.models.cache import make_prompt_cache  # mlx, an optional runtime: loaded where it runs

        self.first_position(tokens, at_positions(offset, len(tokens)).get("positions"))  # from 0 only
        cache = make_prompt_cache(self.model)

        def forward(ids: list[int], start: int) -> tuple[Trace, torch.Tensor]:
            recorder = TraceRecorder()
            logits = self._recorded(ids, recorder, cache)  # (1, T, V)
            return Trace(recorder.tensors, self._meta(ids, start or None)), logits[0]

        return decode_steps(forward, tokens, count, forced, offset)

    def _recorded(self, tokens: list[int], recorder, cache: list | None = None) -> torch.Tensor:
        """One forward (after what `cache` holds, if any) with every point handed to `recorder`, and
        each layer's cache contents after it; returns the model's output, the logits (1, T, V)."""
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        recorded: deque[tuple[str, object]] = deque()

        def record(name: str, array) -> None:
            layout = self.layouts.get(split_point(name)[1])
            recorded.append((name, layout(array) if layout else array))

        with recording_calls(self.model, self.family, record, final_softcap=self.final_softcap,
                             spec=self.spec) as planned:
            logits = self._forward(tokens, cache)
        got = {name for name, _ in recorded}
        missing = [point for point in planned if point not in got]
        if missing:  # mlx-lm's code took another path than its model file's (a point left unrecorded otherwise)
            raise TracerError(f"mlx-lm's forward never gave {missing[0]} (the mlx engine's plan for its "
                              f"{self.family} model; {len(missing)} point(s) in all)")
        rings = {}  # a rotating cache's points -> (tokens it took, its slots): laid out as the ring
        for i, layer in enumerate(cache or ()):
            keys, values = cache_contents(layer)  # (1, KV, S, D) each: slices taken now, this step's contents
            points = layer_point(i, CACHE_K), layer_point(i, CACHE_V)
            recorded.extend(zip(points, (keys, values)))
            if getattr(layer, "max_size", None):
                rings |= dict.fromkeys(points, (layer.offset, layer.max_size))
        mx.eval([logits, *(array for _, array in recorded)])  # one evaluation of the whole lazy graph
        routed = {name: to_torch(array) for name, array in recorded if split_point(name)[1] in PICKS}
        in_top_k_order(routed)
        out = to_torch(logits)
        while recorded:  # each MLX array let go once the recorder holds its copy
            name, array = recorded.popleft()
            tensor = out if array is logits else routed[name] if name in routed else to_torch(array)
            if name in rings:
                tensor = ring_slots(tensor[0], *rings[name])[None]  # (1, KV, min(S, W), D) in the ring's slots
            recorder(name, tensor)
        return out

    def _meta(self, tokens: list[int], offset: int | None = None):
        not_recorded = per_layer(self.num_layers, {**fused_points(self.family), **unseen_points(self.family)})
        return self.meta(tokens, TORCH_DTYPES[self.dtype], not_recorded, num_layers=self.num_layers,
                         runtime=runtime(), unused_config_keys=unread_config_keys(self.config, type(self.model.args)),
                         position_offset=offset)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return to_torch(self._forward(tokens))[0]  # (T, V)

    def _forward(self, tokens: list[int], cache: list | None = None):
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        with mx.stream(self.stream):
            try:
                return self.model(mx.array([tokens]), cache=cache)  # (1, T, V), lazy
            except TracerError:
                raise
            except Exception as exc:  # noqa: BLE001 - mlx-lm's own code: an IndexError, a shape ValueError...
                raise TracerError(f"mlx-lm's forward failed in {runtime_line(exc)} ({type(exc).__name__}: "
                                  f"{one_line(exc, 40)})") from None


def runtime_line(exc: BaseException) -> str:
    """Where in mlx-lm's code `exc` was raised (its innermost frame there), `gemma3_text.py:195`."""
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if "mlx_lm" in Path(f.filename).parts), frames[-1])
    return f"{Path(frame.filename).name}:{frame.lineno}"


def cache_contents(cache) -> tuple:
    """What one layer's mlx-lm cache holds, (1, KV, S, D) keys (after RoPE) and values in the order their
    tokens came: a `KVCache`'s filled slots (`keys_and_values`); a `RotatingKVCache`'s (a sliding layer's)
    in temporal order (its own `_temporal_order`), which `ring_slots` lays out as the ring every cache is
    compared in. mlx-lm's own slots are not the ring rule's: a prompt longer than the window stays whole
    until the next token trims it to the last W and writes slot 0."""
    if not getattr(cache, "max_size", None):
        return cache.keys_and_values()
    if cache.keep:
        raise TracerError(f"mlx-lm's rotating cache keeps its first {cache.keep} tokens beside its ring: "
                          "not a sliding window's ring")
    return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)


def traced_layouts(family: str) -> dict:
    """Sub-point -> how an mlx-lm array of it becomes tracer's layout, where it differs: a point observed per
    head, (B, T, H, D) (Qwen3's q/k norms) or (B, H, T, D) (Gemma 3's), held as (B, T, H*D) as hf merges it;
    an unfused attention's scores and probabilities, which mlx-lm computes per kv head and repeat
    (B, KV, R, T, S), held as (B, H, T, S), head h = kv * R + r (transformers' repeat_kv order)."""
    layouts = {sub: fn for sub, point in sub_points(family).items() if (fn := PER_HEAD.get(point.observed))}
    return layouts | dict.fromkeys(FUSED_AWAY, merged_kv_heads) | ROUTED


def batch_rows(array):
    """A routing point as mlx-lm forms it, (B, T, X), or (T, X) where its block flattens the tokens first
    (OLMoE's), as (1, T, X): one row per token, under the batch axis every recorded point has."""
    return array.reshape(1, -1, array.shape[-1])


def picked_weights(array):
    """The operand mlx-lm multiplies the picked experts' outputs (.., k, C) by: the weights (.., k, 1) -> (1, T, k)."""
    return array.reshape(1, -1, array.shape[-2])


def picked_ids(array):
    """mlx-lm's picked experts, uint32 (.., k) as argpartition gives them -> int64 (1, T, k), the point's dtype."""
    import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

    return batch_rows(array).astype(mx.int64)


PICKS = (TOP_K_INDEX, TOP_K_WEIGHTS)  # laid out together (`in_top_k_order`)
ROUTED = {ROUTER_LOGITS: batch_rows, ROUTER_SCORES: batch_rows, TOP_K_INDEX: picked_ids,
          TOP_K_WEIGHTS: picked_weights, EXPERTS: batch_rows, SHARED_EXPERT: batch_rows}


def in_top_k_order(tensors: dict) -> None:
    """Each layer's picked experts and their weights (`tensors`, point -> torch (1, T, k), in place) laid out in
    the point's order, descending weight, each weight moved with its expert. mlx-lm picks by
    `argpartition`, which leaves the k picks in no order (`qwen3_moe.py` takes the last k of an ascending
    partition: on the CPU build they come smallest first); its block sums over them, so their order is no part
    of what it computes, and a comparison slot by slot would pair one expert's weight with another's. A
    permutation of mlx-lm's own arrays: no value is recomputed, and ties keep mlx-lm's order (stable)."""
    for point in [point for point in tensors if split_point(point)[1] == TOP_K_INDEX]:
        weights_point = layer_point(split_point(point)[0], TOP_K_WEIGHTS)
        if weights_point not in tensors:
            continue
        order = tensors[weights_point].float().argsort(dim=-1, descending=True, stable=True)  # (1, T, k)
        tensors[point] = tensors[point].gather(-1, order)
        tensors[weights_point] = tensors[weights_point].gather(-1, order)


def merged_kv_heads(array):
    if array.ndim != 5:
        return array
    batch, kv, repeats, *rest = array.shape
    return array.reshape(batch, kv * repeats, *rest)  # (B, KV, R, T, S) -> (B, H, T, S)


PER_HEAD = {  # hf's observation of a per-head point -> its merge, (B, T, H*D)
    "output:(T, H, D)": lambda array: array.reshape(*array.shape[:-2], -1),  # (B, T, H, D) -> (B, T, H*D)
    "output:(H, T, D)": lambda array: array.transpose(0, 2, 1, 3).reshape(  # (B, H, T, D) -> (B, T, H*D)
        array.shape[0], array.shape[2], -1),
}


def fused_points(family: str) -> dict[str, str]:
    """The family's attention points mlx-lm never forms (its fused attention), each with why."""
    named = MLX.for_family(family_named(family))
    return {sub: FUSED for sub in FUSED_AWAY if sub not in named}


def to_torch(array) -> torch.Tensor:
    """An evaluated MLX array as a torch tensor of the same dtype (bf16, which numpy lacks, through
    its bits)."""
    import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

    if array.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(array.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def unread_config_keys(config: dict, args_class) -> list[str]:
    """Keys of config.json that change the forward but mlx-lm's `ModelArgs` does not read (a
    transformers-5 `rope_parameters`, for one: mlx-lm then runs its default theta, 10000)."""
    fields = inspect.signature(args_class).parameters
    return sorted(k for k in config if k not in fields and k not in NON_FORWARD_KEYS)


# ----------------------------------------------------------------------------- recording


Sides = dict[str, str]  # one call's sides (`Name.side`: "input", "output", "input[1]", "output*", ...) -> point


def planned_calls(model, family: str, final_softcap: bool = False, spec=None) -> dict[str, list[Sides]]:
    """Call (`tracer.names.mlx`: a module path, a module's method, mlx.core's function in a module, the
    model "") -> what each of its calls gives (side -> point), in call order, read off `family`'s points:
    mlx-lm's own name for a point where it has one (the first of its names the model has), else the
    module's output, or the input of the module hf takes the point from. The soft-capped logits are
    planned where the reference caps them (`final_softcap`). A layer's points are those the family records
    there on `spec` (the config read as transformers reads it: a mixture of experts' dense layers have no
    router; None: every point). A point planned nowhere is one mlx-lm never forms (`unseen_points`), or an
    error."""
    modules = dict(model.named_modules())
    own = MLX.for_family(family_named(family))
    unseen, mlp = unseen_points(family), family_named(family).mlp
    plan: dict[str, list[Sides]] = {}

    def put(path: str, call: int, side: str, point: str) -> None:
        slots = plan.setdefault(path, [])
        slots += [{} for _ in range(call + 1 - len(slots))]
        slots[call][side] = point

    def put_named(names: tuple[Name, ...], point: str, layer: int | None) -> None:
        paths = [name.pattern if layer is None else layer_point(layer, name.pattern) for name in names]
        found = next((i for i, path in enumerate(paths) if call_target(path, modules)), None)
        if found is None:
            raise TracerError(f"mlx-lm built a model without {paths[0]}: the mlx engine cannot record {point}")
        put(paths[found], names[found].call, names[found].side, point)

    for point, record in model_point_records(family, final_softcap).items():
        if point in own:
            put_named(own[point], point, None)
        elif record.observed == "output":
            put(point, 0, "output", point)
    for i in range(len(model.layers)):
        for sub, record in sub_points(family).items():
            if spec is not None and not mlp.records_on(spec, i, sub):
                continue  # (a dense layer's router, a sparse layer's gated MLP)
            point = layer_point(i, sub)
            if sub in own:
                put_named(own[sub], point, i)
            elif sub in unseen:
                continue  # never an array in mlx-lm (the trace's not_recorded says why)
            elif record.observed.startswith("output"):
                put(point, 0, "output", point)
            elif record.observed.startswith("input:"):
                put(layer_point(i, record.observed.removeprefix("input:")), 0, "input", point)
            elif sub not in FUSED_AWAY:  # (the attention's scores and probabilities: `fused_points`)
                raise TracerError(f"the mlx engine has no call of mlx-lm's {family} model for {point}")
    return plan


def unseen_points(family: str) -> dict[str, str]:
    """The family's points mlx-lm never forms as arrays (not its fused attention's), each with why."""
    return UNSEEN.get(family, {})


FUNCTIONS = ".mx."  # `self_attn.mx.softmax`: mlx.core's softmax as the module's own code calls it


def call_target(path: str, modules: dict) -> tuple[str, str] | None:
    """(module path, what of it is called: "__call__", a method's name, or "mx.<function>") for a call
    path; None where the model has no such call."""
    if path in modules:
        return path, "__call__"
    module, functions, function = path.partition(FUNCTIONS)
    if functions and module in modules:
        return module, "mx." + function
    module, _, method = path.rpartition(".")
    if module in modules and callable(getattr(modules[module], method, None)):
        return module, method
    return None


@contextmanager
def recording_calls(model, family: str, record, *, final_softcap: bool = False, spec=None):
    """Swap every observed module's class for a recording subclass, and the `mx` a model file calls
    mlx.core's functions through for one that records the planned ones; restore all of them on exit."""
    modules = dict(model.named_modules())
    watched: dict[str, dict[str, object]] = {}  # module path -> what of it is recorded -> its calls' sides
    plan = planned_calls(model, family, final_softcap, spec)
    for path, calls in plan.items():
        module, member = call_target(path, modules)
        watched.setdefault(module, {})[member] = iter(calls)
    if len({id(modules[path]) for path in watched}) < len(watched):
        raise TracerError("mlx-lm shares one module between two observed paths: their calls cannot be told apart")
    running: list[tuple[str, dict]] = []  # the recording modules whose call is under way, innermost last
    with ExitStack() as restore:
        functions: dict[str, set[str]] = {}  # model file -> the mlx.core functions its modules' calls record
        for path, members in watched.items():
            names = {member.removeprefix("mx.") for member in members if member.startswith("mx.")}
            if names:
                functions.setdefault(type(modules[path]).__module__, set()).update(names)
        for file, names in functions.items():
            restore.enter_context(_recording_functions(sys.modules[file], names, running, record))
        for path, members in watched.items():
            module = modules[path]
            original = type(module)
            module.__class__ = _recording_class(original, path, members, running, record)
            restore.callback(setattr, module, "__class__", original)
        yield [point for calls in plan.values() for sides in calls for point in sides.values()]


def _record_call(what: str, calls, record, call, args, kwargs):
    """One call of `what`, its planned sides recorded: its arguments, its output, and what mlx-lm's code
    then does with the output (`Following`)."""
    sides = next(calls, None)
    if sides is None:
        raise TracerError(f"mlx-lm called {what} more often than the family's forward does; the mlx engine "
                          "cannot tell which point each call is")
    for side, point in sides.items():
        if side.startswith("input"):
            record(point, args[int(side.removeprefix("input").strip("[]") or 0)])  # "input[1]": the second
    output = call(*args, **kwargs)
    if "output" in sides:
        record(sides["output"], output)
    after = {side.removeprefix("output"): point for side, point in sides.items()
             if side.startswith("output") and side != "output"}
    return Following(output, after, record, what) if after else output


class Following:
    """A call's output handed on to mlx-lm's code, which records what that code's next operations on it take or
    give, as planned (`steps`: "*" the operand it is multiplied by, "*.sum" that product's `.sum(...)`,
    "*.sum+" the operand added to that sum -> a point each). mlx-lm's MoE blocks form the routing weights,
    the experts' sum and the gated shared expert as arithmetic on `switch_mlp`'s output, never as a call:
    `y = (y * scores[..., None]).sum(axis=-2)`, then `y + shared_expert_output` (Qwen2-MoE). Every other
    attribute is the array's (`dtype`, `shape`); another operation while a step is pending is an error, never
    a point left unrecorded."""

    def __init__(self, array, steps: dict[str, str], record, what: str):
        self._array, self._steps, self._record, self._what = array, steps, record, what

    def _then(self, step: str, value, result):
        """`result` of the step `step` (its operand or its result `value` recorded), handed on with the steps
        after it."""
        if step not in self._steps and not any(key.startswith(step) for key in self._steps):
            raise TracerError(f"mlx-lm's code applied {step!r} to the output of {self._what}, where the mlx engine "
                              f"expected {' then '.join(sorted(self._steps, key=len))}: it cannot record "
                              f"{', '.join(self._steps.values())}")
        if step in self._steps:
            self._record(self._steps[step], value)
        after = {key.removeprefix(step): point for key, point in self._steps.items()
                 if key.startswith(step) and key != step}
        return Following(result, after, self._record, self._what) if after else result

    def __mul__(self, other):
        return self._then("*", other, self._array * other)

    def __add__(self, other):
        return self._then("+", other, self._array + other)

    def sum(self, *args, **kwargs):
        result = self._array.sum(*args, **kwargs)
        return self._then(".sum", result, result)

    def __getattr__(self, name):
        if name.startswith("__") or callable(getattr(self._array, name)):
            raise TracerError(f"mlx-lm's code called {name} on the output of {self._what}, where the mlx engine "
                              f"expected {' then '.join(sorted(self._steps, key=len))}")
        return getattr(self._array, name)


def _recording_class(original: type, path: str, members: dict, running: list, record) -> type:
    """A subclass of `original` whose call, and each planned method, records its planned points; its
    call is marked running while under way, for the mlx.core functions it calls (`_recording_functions`)."""

    def __call__(self, *args, **kwargs):
        running.append((path, members))
        try:
            if "__call__" not in members:
                return original.__call__(self, *args, **kwargs)
            return _record_call(path or "the model", members["__call__"], record,
                                lambda *a, **k: original.__call__(self, *a, **k), args, kwargs)
        finally:
            running.pop()

    def method(name: str):
        def recorded(self, *args, **kwargs):
            return _record_call(f"{path}.{name}", members[name], record,
                                lambda *a, **k: getattr(original, name)(self, *a, **k), args, kwargs)
        return recorded

    own = {name: method(name) for name in members if name != "__call__" and not name.startswith("mx.")}
    return type(f"Recording{original.__name__}", (original,), {"__call__": __call__, **own})


@contextmanager
def _recording_functions(file, names: set[str], running: list, record):
    """`file`'s (an mlx-lm model module's) `mx` swapped for mlx.core with the functions `names` recorded: a
    call of one is recorded under the innermost running module that plans it (any other call runs as is)."""
    core = file.mx

    def recording(name: str):
        function = getattr(core, name)

        def called(*args, **kwargs):
            path, members = running[-1] if running else ("", {})
            calls = members.get(f"mx.{name}")
            if calls is None:
                return function(*args, **kwargs)
            return _record_call(f"{path}{FUNCTIONS}{name}", calls, record, function, args, kwargs)
        return called

    class Core:  # mlx.core, but for `names`
        def __getattr__(self, name):
            return getattr(core, name)

    proxy = Core()
    for name in names:
        setattr(proxy, name, recording(name))
    file.mx = proxy
    try:
        yield
    finally:
        file.mx = core


# ----------------------------------------------------------------------------- loading


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device: torch.device | str = "cpu",
         stream: bool = False) -> MLXEngine:
    """mlx-lm's model from a model directory, in the `dtype` knob's dtype."""
    if source.loaded:
        raise TracerError("the mlx engine loads the model directory itself; pass a path, not a loaded model")
    device = torch.device(device)
    dtype = setting(variant, "dtype")
    if dtype not in DTYPES:
        raise TracerError(f"the mlx engine runs dtype {' | '.join(DTYPES)}, not {dtype}")
    config = source.config()
    read_hf(config)  # a config transformers would refuse is one line here, not an error deep inside mlx-lm
    check_weight_files(source.directory)  # a damaged file is named in one line, not deep inside MLX
    model = _load_model(source.directory, dtype, device)
    return MLXEngine(model, config, variant, source.name, device)


def _load_model(model_dir: Path, dtype: str, device: torch.device):
    try:
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs
    except ImportError as exc:  # Linux: `mlx` without `mlx-cpu` has no backend library to load
        raise TracerError(f"MLX is installed without a backend ({one_line(exc)}): pip install -e '.[mlx]'") from None
    from mlx_lm.utils import load_model  # mlx, an optional runtime: loaded where it runs

    if not mx.is_available(getattr(mx, DEVICES[device.type])):
        raise TracerError(f"device {device}: this MLX build ({runtime()['version']}) has no {DEVICES[device.type]} "
                          "backend (Metal needs macOS on Apple silicon)")
    try:
        model, _ = load_model(model_dir)
    except Exception as exc:  # noqa: BLE001 - mlx-lm raises ValueError, KeyError, FileNotFoundError...
        raise TracerError(f"mlx-lm cannot load {model_dir}: {one_line(exc)}") from None
    # Floating parameters only, as from_pretrained(dtype=...) does (a bf16 checkpoint runs in f32 by default).
    model.set_dtype(getattr(mx, DTYPES[dtype]))
    mx.eval(model.parameters())
    return model
