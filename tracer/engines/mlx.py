"""The `mlx` engine: Apple's MLX running the model through mlx-lm, recorded under tracer's points.

mlx-lm builds the model from the same directory (`config.json` read by its own `ModelArgs`,
safetensors weights) and runs its own Llama forward (`mlx_lm/models/llama.py`). MLX has no hooks,
so recording swaps the class of each observed module instance for a subclass whose `__call__`
records what goes in and out, and swaps it back on exit (even when the forward raises): the model
tree, its parameter paths and every other instance stay untouched, and nothing is left behind.
mlx-lm's module paths are HF's (`model.layers.3.self_attn.q_proj`), so they are the point names.

What each observed call gives (`layer_calls`, read off the family's points): module outputs, plus
three points that are module *inputs*: the context (input of `o_proj`), `resid_mid` (input of
`post_attention_layernorm`) and `act(gate) * up` (input of `down_proj`). mlx-lm calls one RoPE module twice per layer,
queries then keys, in the (B, H, T, D) layout of the q_rope / k_rope points. Attention is one
fused call (`mx.fast.scaled_dot_product_attention`): scores and probabilities never exist as
arrays, and are "not recorded". The logits are the model's output (`embed_tokens.as_linear`
for tied embeddings, `lm_head` otherwise).

MLX is lazy: the recorded arrays are collected during the forward and evaluated together with
the logits in one `mx.eval`, then handed to the recorder one by one as torch tensors.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from tracer.core.errors import TracerError, one_line
from tracer.core.torch_types import TORCH_DTYPES
from tracer.engines.base import EngineBase, at_positions, decode_steps, per_layer
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.files.weights import check_weight_files
from tracer.model.component import family_named
from tracer.model.config import NON_FORWARD_KEYS, read_hf
from tracer.model.knobs import setting
from tracer.model.kv_cache import ring_slots
from tracer.model.points import CACHE_K, CACHE_V, LOGITS, fused_away, layer_point, model_point_records, sub_points
from tracer.names.mlx import MLX
from tracer.traces.trace import Trace, TraceRecorder

# mlx-lm's module paths are HF's; what each observed call gives is read off the family's points
# (`layer_calls`): a module's output where hf observes that module's output, the input of the module hf
# takes an input from, and the point's name in mlx-lm's vocabulary where mlx-lm differs (`tracer.names.mlx`:
# its RoPE module, called twice; the context, the input of o_proj). A point mlx-lm observes per head,
# (B, T, H, D), is held as (B, T, H*D), as hf merges it.
PER_HEAD = "output:(T, H, D)"

FUSED = ("mlx-lm runs attention as one fused call (mx.fast.scaled_dot_product_attention): "
         "scores and probabilities never exist as arrays")
UNOBSERVABLE = fused_away(FUSED)

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # knob value -> mlx.core dtype name
DEVICES = {"cpu": "cpu", "mps": "gpu"}  # torch device type -> MLX device (mps: Metal on Apple silicon)


def runtime() -> dict:
    return {"name": "mlx", "version": importlib.metadata.version("mlx"),
            "mlx_lm": importlib.metadata.version("mlx-lm")}


class MLXEngine(EngineBase):
    entry = ENGINES["mlx"]

    def __init__(self, model, config: dict, variant: dict, label: str, device: torch.device):
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        self.model, self.config, self.variant, self.label, self.device = model, config, variant, label, device
        self.spec = read_hf(config)  # what transformers reads: the positions the reference has
        self.family = self.spec.family
        self.stream = getattr(mx, DEVICES[device.type])
        self.num_layers = len(model.layers)
        self.dtype = setting(variant, "dtype")
        self.vocab_size, self.max_positions = model.args.vocab_size, self.spec.max_position_embeddings

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
        each layer's cache contents after it; returns the logits (1, T, V)."""
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        recorded: deque[tuple[str, object]] = deque()
        per_head = per_head_points(self.family)
        with recording_calls(self.model, self.family,
                             lambda name, array: recorded.append((name, flat_heads(name, array, per_head)))):
            logits = self._forward(tokens, cache)
        recorded.append((LOGITS, logits))
        rings = {}  # a rotating cache's points -> (tokens it took, its slots): laid out as the ring
        for i, layer in enumerate(cache or ()):
            keys, values = cache_contents(layer)  # (1, KV, S, D) each: slices taken now, this step's contents
            points = layer_point(i, CACHE_K), layer_point(i, CACHE_V)
            recorded.extend(zip(points, (keys, values)))
            if getattr(layer, "max_size", None):
                rings |= dict.fromkeys(points, (layer.offset, layer.max_size))
        mx.eval([array for _, array in recorded])  # one evaluation of the whole lazy graph
        out = to_torch(logits)
        while recorded:  # each MLX array let go once the recorder holds its copy
            name, array = recorded.popleft()
            tensor = out if name == LOGITS else to_torch(array)
            if name in rings:
                tensor = ring_slots(tensor[0], *rings[name])[None]  # (1, KV, min(S, W), D) in the ring's slots
            recorder(name, tensor)
        return out

    def _meta(self, tokens: list[int], offset: int | None = None):
        not_recorded = per_layer(self.num_layers, UNOBSERVABLE)
        return self.meta(tokens, TORCH_DTYPES[self.dtype], not_recorded, num_layers=self.num_layers,
                         runtime=runtime(), unused_config_keys=unread_config_keys(self.config, type(self.model.args)),
                         position_offset=offset)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return to_torch(self._forward(tokens))[0]  # (T, V)

    def _forward(self, tokens: list[int], cache: list | None = None):
        import mlx.core as mx  # mlx, an optional runtime: loaded where it runs

        with mx.stream(self.stream):
            return self.model(mx.array([tokens]), cache=cache)  # (1, T, V), lazy


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


def per_head_points(family: str) -> tuple[str, ...]:
    """The family's points a module returns per head, (B, T, H, D) (Qwen3's q/k norms)."""
    return tuple("." + sub for sub, point in sub_points(family).items() if point.observed == PER_HEAD)


def flat_heads(name: str, array, per_head: tuple[str, ...]):
    """A per-head point (B, T, H, D) as tracer holds it, (B, T, H*D); any other array as it is."""
    return array.reshape(*array.shape[:-2], -1) if per_head and name.endswith(per_head) else array


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


def layer_calls(family: str) -> dict[str, list[tuple[str | None, str | None]]]:
    """Observed module (relative to `model.layers.{i}`) -> one (input point, output point) per call, in
    call order, None where that side of the call is not a point: read off `family`'s points."""
    calls: dict[str, list[list[str | None]]] = {}

    def put(module: str, call: int, side: str, sub: str) -> None:
        slots = calls.setdefault(module, [])
        slots += [[None, None] for _ in range(call + 1 - len(slots))]
        slots[call][0 if side == "input" else 1] = sub

    own_names = MLX.for_family(family_named(family))
    for sub, point in sub_points(family).items():
        own = own_names.get(sub, (None,))[0]
        if own is not None:
            put(own.pattern, own.call, own.side, sub)
        elif point.observed.startswith("output"):
            put(sub, 0, "output", sub)
        elif point.observed.startswith("input:"):
            put(point.observed.removeprefix("input:"), 0, "input", sub)
        # the recording attention function's other points (scores, probs): fused away in mlx-lm
    return {module: [tuple(pair) for pair in pairs] for module, pairs in calls.items()}


def observed_calls(model, family: str) -> dict[str, list[tuple[str | None, str | None]]]:
    """Module path -> its (input point, output point) per call, for every observed module of `model`."""
    calls = {point: [(None, point)] for point, record in model_point_records(family, False).items()
             if record.observed == "output" and point != LOGITS}  # the logits: the model's own output
    for i in range(len(model.layers)):
        for sub, points in layer_calls(family).items():
            calls[layer_point(i, sub)] = [tuple(None if p is None else layer_point(i, p) for p in pair)
                                          for pair in points]
    return calls


@contextmanager
def recording_calls(model, family: str, record):
    """Swap every observed module's class for a recording subclass; restore all of them on exit."""
    modules = dict(model.named_modules())
    calls = observed_calls(model, family)
    missing = [path for path in calls if path not in modules]
    if missing:
        raise TracerError(f"mlx-lm built a model without {missing[0]}: not the Llama layout the mlx engine records")
    plan = {id(modules[path]): (path, iter(points)) for path, points in calls.items()}
    if len(plan) < len(calls):
        raise TracerError("mlx-lm shares one module between two observed paths: their calls cannot be told apart")
    swapped = []
    try:
        for path in calls:
            module = modules[path]
            original = type(module)
            module.__class__ = _recording_class(original, plan, record)
            swapped.append((module, original))
        yield
    finally:
        for module, original in swapped:
            module.__class__ = original


def _recording_class(original: type, plan: dict, record) -> type:
    """A subclass of `original` whose call records its planned input and output points."""

    def __call__(self, *args, **kwargs):
        path, points = plan[id(self)]
        pair = next(points, None)
        if pair is None:
            raise TracerError(f"mlx-lm called {path} more often than its Llama forward does; the mlx engine "
                              "cannot tell which point each call is")
        input_point, output_point = pair
        if input_point is not None:
            record(input_point, args[0])
        output = original.__call__(self, *args, **kwargs)
        if output_point is not None:
            record(output_point, output)
        return output

    return type(f"Recording{original.__name__}", (original,), {"__call__": __call__})


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
