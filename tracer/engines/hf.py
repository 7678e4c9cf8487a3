"""The `hf` engine: transformers' own model of the family (`LlamaForCausalLM`, `Gemma2ForCausalLM`,
... as `tracer.model.families` names them), observed, never modified.

Config-level knobs (`theta`, `eps`, `layers`, `head_dim`, `rope_scaling`, `bias`, `config`,
`resave`, `act`, `rope_local`) build the same `LlamaSpec` the reimpl engine builds
(`tracer.model.config.variant_spec`); the fields where it differs from transformers' own reading are
written into the family's config before the weights load, so transformers runs exactly that model;
a change a family's config cannot express (Qwen2's q/k/v biases are not configurable) is refused.
`dtype` and `attn` go to `from_pretrained`.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections import Counter
from contextlib import ExitStack

import torch

from tracer.core.errors import TracerError, one_line
from tracer.core.torch_types import TORCH_DTYPES
from tracer.engines.base import EngineBase, decode_steps, per_layer
from tracer.engines.batch import RowRecorders, left_padded
from tracer.engines.hf_streamed import empty_model, stream_weights
from tracer.engines.registry import ENGINES
from tracer.files.sources import ModelSource
from tracer.files.weights import check_weight_files
from tracer.hooks.modules import recording_modules
from tracer.model.component import family_named, family_of
from tracer.model.components.padding import positions_from_mask
from tracer.model.config import LlamaSpec, config_reading, load_config, read_hf, variant_spec
from tracer.model.knobs import setting
from tracer.model.kv_cache import ring_slots
from tracer.model.points import CACHE_POINTS, layer_point, model_points
from tracer.traces.trace import Trace, TraceRecorder

# A local directory never needs the hub; make sure nothing tries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_LAYER_NAME = re.compile(r"model\.layers\.\d+")


class HFEngine(EngineBase):
    entry = ENGINES["hf"]

    def __init__(self, model, variant: dict, label: str):
        self.model, self.variant, self.label = model, variant, label
        self.vocab_size, self.max_positions = model.config.vocab_size, model.config.max_position_embeddings
        if _dynamic_ropes(model):  # dynamic NTK grows its base past max_position_embeddings: that is its use
            self.max_positions = None
        self.layer_prefixes = [n for n, _ in model.named_modules() if _LAYER_NAME.fullmatch(n)]
        self.family = family_of(model.config.model_type).name
        self.model_points = model_points(getattr(model.config, "final_logit_softcapping", None) is not None,
                                         self.family)

    @property
    def device(self) -> torch.device:
        # A model accelerate placed (device_map) may have its first weights on disk ("meta"): its hooks
        # move the inputs to each module's execution device, so they start on the CPU.
        # A streamed model's parameters are on "meta" between forwards.
        if getattr(self.model, "tracer_device", None) is not None:
            return self.model.tracer_device
        return torch.device("cpu") if getattr(self.model, "hf_device_map", None) else self.model.device

    def record(self, tokens: list[int], recorder=None, *, positions: torch.Tensor | None = None) -> Trace:
        """Every point of one forward at `positions` (transformers' `position_ids`; default 0..T-1);
        `recorder` (default in memory) may spill to disk instead."""
        offset = self.first_position(tokens, positions)
        recorder = recorder if recorder is not None else TraceRecorder()
        restart_dynamic_ropes(self.model)
        self._recorded(recorder, input_ids=self._ids(tokens), use_cache=False, **self._positions(positions))
        return Trace(recorder.tensors, self._meta(tokens, offset))

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0,
               recorded=None) -> Trace:
        """The prefill and `count` decode steps with transformers' own KV cache (`DynamicCache`), each
        step one token at its `position_ids` (a `DynamicSlidingWindowLayer` on each sliding layer); the hooks
        record every step's points and the cache (the `recorded` steps only, where given: `decode_steps`)."""
        from transformers import DynamicCache  # transformers: 0.5 s, when a model loads

        cache = DynamicCache(config=self.model.config)
        restart_dynamic_ropes(self.model)  # then it grows step by step, as in `generate`
        # a sliding layer's cache (`DynamicSlidingWindowLayer`) keeps its last W - 1 keys in position order:
        # its points are laid out as the ring of W slots every cache is compared as (`ring_slots`)
        windows = {i: layer.sliding_window for i, layer in enumerate(cache.layers)
                   if getattr(layer, "is_sliding", False)}
        if windows and count and not family_named(self.family).attention.window:
            # a config's layer_types slide the cache of a family whose attention masks no window (a Llama
            # config written for mlx-lm): past it, the eager mask over every key meets the window's scores
            layer, window = next(iter(windows.items()))
            if len(tokens) + count > window:
                raise TracerError(f"--decode: transformers' {self.family} caches layer {layer} as a {window}-key "
                                  "window but masks none: decode within it")
        written = 0

        def forward(ids: list[int], start: int, record: bool = True) -> tuple[Trace, torch.Tensor]:
            nonlocal written
            recorder = TraceRecorder()
            call = {"input_ids": self._ids(ids), "use_cache": True, **self._cache(cache),
                    **self._positions(torch.arange(start, start + len(ids)))}
            if record:
                out = self._recorded(recorder, cached=True, **call)
            else:
                with torch.inference_mode():
                    out = self.model(**call)
            written += len(ids)
            for layer, window in windows.items():
                for sub in CACHE_POINTS:
                    name = layer_point(layer, sub)
                    if name in recorder.tensors:
                        recorder.tensors[name] = ring_slots(recorder.tensors[name], written, window)  # (KV, ≤ W, D)
            return Trace(recorder.tensors, self._meta(ids, start or None)), out.logits[0]  # (T, V)

        return decode_steps(forward, tokens, count, forced, offset, recorded)

    def record_batch(self, rows: list[list[int]]) -> list[Trace]:
        """The rows left-padded into one batched forward, as `generate` runs a padded batch: `attention_mask`,
        and `position_ids` from it (each row from 0 at its first real token; without them transformers
        counts from the padded sequence's start); one trace per row, at its real positions."""
        padded = left_padded(rows)
        recorders = RowRecorders(padded)
        positions = positions_from_mask(padded.mask.bool())  # (B, T)
        self._recorded(recorders, input_ids=padded.ids.to(self.device), attention_mask=padded.mask.to(self.device),
                       position_ids=positions.to(self.device), use_cache=False)
        return [Trace(recorder.tensors, self._meta(row, None)) for recorder, row in zip(recorders.rows, rows)]

    def _recorded(self, recorder, cached: bool = False, **call):
        """The model called on `call` with every point going to `recorder`."""
        from tracer.hooks.attention import recording_attention  # transformers: loaded when a model is

        names = {module: name for name, module in self.model.named_modules()}
        with ExitStack() as stack, torch.inference_mode():
            stack.enter_context(recording_modules(self.model, recorder, self.layer_prefixes, self.family,
                                                  self.model_points))
            stack.enter_context(recording_attention(self.model, recorder, names, cached))
            return self.model(**call)

    def _cache(self, cache) -> dict:
        """The cache keyword: transformers 5.24 names it `cache`, earlier 5.x releases `past_key_values`."""
        forward = inspect.signature(self.model.forward).parameters
        return {"cache": cache} if "cache" in forward else {"past_key_values": cache}

    def _meta(self, tokens: list[int], offset: int | None):
        from tracer.hooks.attention import unobservable_points  # transformers: loaded when a model is

        implementation = self.model.config._attn_implementation
        not_recorded = per_layer(len(self.layer_prefixes), unobservable_points(implementation))
        return self.meta(tokens, self.model.dtype, not_recorded, num_layers=len(self.layer_prefixes),
                         attn_implementation=implementation,
                         unused_tensors=getattr(self.model, "tracer_unused_tensors", []), family=self.family,
                         position_offset=offset, placement=placement_text(self.model))

    @torch.inference_mode()
    def logits(self, tokens: list[int], *, positions: torch.Tensor | None = None) -> torch.Tensor:
        restart_dynamic_ropes(self.model)
        return self.model(input_ids=self._ids(tokens), use_cache=False, **self._positions(positions)).logits[0]

    @torch.inference_mode()
    def draft(self, tokens: list[int], steps: int, *, positions: torch.Tensor | None = None) -> list[int]:
        """A quick guess at the greedy continuation, decoded with transformers' KV cache (one
        token per step, each at the position after the last); `greedy_continuation` checks it with
        uncached forwards."""
        start = 0 if positions is None else int(positions[0])
        restart_dynamic_ropes(self.model)
        out = self.model(input_ids=self._ids(tokens), use_cache=True, **self._positions(positions))
        picks = [int(out.logits[0, -1].argmax())]
        while len(picks) < steps:
            # transformers 5.24 names the cache `cache`; earlier 5.x releases `past_key_values`
            cache = {"cache": out["cache"]} if "cache" in out else {"past_key_values": out["past_key_values"]}
            at = torch.tensor([start + len(tokens) + len(picks) - 1]) if start else None
            out = self.model(input_ids=self._ids(picks[-1:]), use_cache=True, **cache, **self._positions(at))
            picks.append(int(out.logits[0, -1].argmax()))
        return picks

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], device=self.device)  # (1, T)

    def _positions(self, positions: torch.Tensor | None) -> dict:
        """transformers' `position_ids` (1, T) for absolute positions; the mask stays the prompt's own
        (causal over its T tokens: without a cache, transformers builds it from 0..T-1)."""
        return {} if positions is None else {"position_ids": torch.as_tensor(positions, device=self.device)[None]}


def _dynamic_ropes(model) -> list:
    """The rotary embeddings of dynamic NTK type (transformers' `dynamic_rope_update` keeps state in them)."""
    return [module for module in model.modules()
            if isinstance(getattr(module, "rope_type", None), str) and "dynamic" in module.rope_type
            and hasattr(module, "original_inv_freq")]


def restart_dynamic_ropes(model) -> None:
    """Dynamic NTK's frequencies as a freshly loaded model has them. transformers keeps the frequencies
    of the longest sequence seen (recomputed on growth only, reset only by a sequence within
    max_position_embeddings), so a forward at 100007 after one to 100027 would rotate with the latter's:
    a trace would depend on what ran before it. Each forward or decode starts afresh, as tracer's own
    (stateless) tables do."""
    for module in _dynamic_ropes(model):
        module.register_buffer("inv_freq", module.original_inv_freq.clone(), persistent=False)
        module.max_seq_len_cached = module.original_max_seq_len


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device: torch.device | str = "cpu",
         stream: bool = False, offload=None) -> HFEngine:
    """`source`: a model directory, or a loaded transformers model of a family tracer traces, which
    is recorded where it is (its own device; `device` is for models loaded here). `offload`
    (`tracer.engines.offload.Offload`): accelerate places the model over the devices and the
    offload folder instead (`device` then has no say)."""
    if source.loaded:
        if variant:
            raise TracerError("variant knobs need a model path; an already loaded model is recorded as it is")
        if offload is not None:
            raise TracerError("offloading needs a model path; an already loaded model is recorded where it is")
        return HFEngine(source.module.eval(), {}, source.name)
    model_dir = source.directory
    if offload is not None:
        if torch.device(device).type != "cpu":
            raise TracerError(f"--device {device} with --offload/--max-memory: accelerate places the model over the "
                              "devices max_memory names (device_map=auto); leave --device out")
        return HFEngine(_load(model_dir, variant, offload), variant, str(model_dir))
    if stream:
        return HFEngine(_load(model_dir, variant, stream_to=torch.device(device)), variant, str(model_dir))
    return HFEngine(_load(model_dir, variant).to(device), variant, str(model_dir))


def _load(model_dir, variant: dict, offload=None, stream_to: torch.device | None = None):
    """from_pretrained with the variant's config-level knobs applied before the weights load (and,
    with `offload`, accelerate's device_map="auto" placement); with `stream_to`, the model empty
    and its weights read block by block on that device as the forward runs (`hf_streamed`)."""
    # transformers would answer a damaged file with a traceback, and a missing key with a silent
    # default (hidden_size 4096); our readers name the file or the key in one line first, before
    # transformers is even imported (seconds a user's typo does not need to wait).
    file_config = load_config(model_dir)
    family = family_named(read_hf(file_config).family)
    if "model_type" not in file_config:  # tracer reads it as a Llama; transformers refuses it at length
        raise TracerError(f"transformers cannot read {model_dir}/config.json: no model_type (\"llama\" for a Llama)")
    check_weight_files(model_dir)
    import transformers  # transformers: 0.5 s, when a model loads
    from transformers import AutoConfig  # transformers: 0.5 s, when a model loads
    from transformers.utils import logging as hf_logging  # transformers: 0.5 s, when a model loads
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - e.g. "use_cache": "yes", a key our readers do not use
        raise TracerError(f"transformers cannot read {model_dir}/config.json: {one_line(exc)}") from None
    if variant:
        file_config = load_config(model_dir)
        write_spec(config, read_hf(file_config), variant_spec(file_config, variant))
    # Its progress bar and load report are noise next to tracer's own output and break one-line
    # errors; what they say (missing, misshapen, unused tensors) is checked and said below.
    # accelerate's "Some parameters are on the meta device" line, too: the trace's notes say where
    # the model was placed.
    if stream_to is not None:
        dtype = TORCH_DTYPES[setting(variant, "dtype")]
        model = empty_model(getattr(transformers, family.architecture), config, dtype, setting(variant, "attn"))
        stream_weights(model, model_dir, dtype, stream_to)
        model.tracer_device = stream_to
        return model
    bar_was_on, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    dispatch_logger = logging.getLogger("accelerate.big_modeling")
    dispatch_level = dispatch_logger.level
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dispatch_logger.setLevel(logging.ERROR)
    try:
        model, info = getattr(transformers, family.architecture).from_pretrained(
            model_dir,
            config=config,
            dtype=TORCH_DTYPES[setting(variant, "dtype")],
            attn_implementation=setting(variant, "attn"),
            # a mixture of experts runs transformers' eager loop over its experts, as attention runs eager
            # (5.25 defaults to grouped_mm where it can): the op order tracer's forward mirrors
            experts_implementation="eager",
            output_loading_info=True,
            # Mismatches are then listed in `info` (named below) instead of raised as a RuntimeError
            # that only points at a report we silence.
            ignore_mismatched_sizes=True,
            **_placement(offload),
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise TracerError(f"transformers cannot load {model_dir}: {one_line(exc)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        dispatch_logger.setLevel(dispatch_level)
        if bar_was_on:
            hf_logging.enable_progress_bar()
    # transformers fills missing tensors with random values and only warns: that is another model.
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        shape = tuple(model.get_parameter(missing[0]).shape)  # the same words as the reimpl engine's check
        raise TracerError(f"missing tensor {missing[0]} (expected shape {shape})"
                          + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""))
    if info.get("mismatched_keys"):
        name, file_shape, model_shape = sorted(info["mismatched_keys"])[0]
        raise TracerError(f"shape mismatch, {name}: file {tuple(file_shape)}, model {tuple(model_shape)}")
    model.tracer_unused_tensors = sorted(info.get("unexpected_keys") or [])
    return model.eval()


def _placement(offload) -> dict:
    """from_pretrained's big-model arguments for an `Offload` (none without one)."""
    if offload is None:
        return {}
    # a copy: from_pretrained rewrites the sizes it is given in place (cpu=200KB -> 200000)
    max_memory = None if offload.max_memory is None else dict(offload.max_memory)
    return {"device_map": "auto", "max_memory": max_memory, "offload_folder": offload.folder}


def placement_text(model) -> str | None:
    """Where accelerate put the modules, e.g. "accelerate placed 12 modules on disk, 20 on cpu"."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    if list(device_map) == [""]:
        return f"accelerate placed the whole model on {device_map['']}"
    counts = Counter(str(device) for device in device_map.values())
    return "accelerate placed " + ", ".join(f"{n} module{'s' if n > 1 else ''} on {device}"
                                            for device, n in counts.most_common())


def _write_rope(config, spec: LlamaSpec) -> None:
    """The global RoPE: the whole rope_parameters, or Gemma 3's full_attention entry."""
    params = {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta}
    if spec.partial_rotary_factor != 1.0 or "partial_rotary_factor" in (config.rope_parameters or {}):
        params["partial_rotary_factor"] = spec.partial_rotary_factor
    nested = "full_attention" in (config.rope_parameters or {})
    config.rope_parameters = {**config.rope_parameters, "full_attention": params} if nested else params


def _write_local_rope(config, spec: LlamaSpec) -> None:
    """Gemma 3's sliding layers' RoPE base (rope_local=global)."""
    local = {**config.rope_parameters["sliding_attention"], "rope_theta": spec.rope_local_theta}
    config.rope_parameters = {**config.rope_parameters, "sliding_attention": local}


def _write_activation(config, spec: LlamaSpec) -> None:
    setattr(config, config_reading(spec.family).activation[0], spec.hidden_act)  # Gemma: hidden_activation


def _write_layers(config, spec: LlamaSpec) -> None:
    """More or fewer layers: their types follow (transformers indexes layer_types by layer)."""
    config.num_hidden_layers = spec.num_hidden_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [spec.layer_type(i) for i in range(spec.num_hidden_layers)]


def _refuse_qkv_bias(config, spec: LlamaSpec) -> None:
    raise TracerError(f"transformers' {spec.family} always has q/k/v biases; the hf engine cannot drop them "
                      "(the reimpl engine can: --candidate reimpl)")


# spec value -> how transformers' config of the family holds it (default: the attribute of that name,
# a component's fields included: a mixture of experts' num_experts_per_tok).
_CONFIG_WRITERS = {"rope_theta": _write_rope, "rope_scaling": _write_rope, "rope_local_theta": _write_local_rope,
                   "hidden_act": _write_activation, "num_hidden_layers": _write_layers, "qkv_bias": _refuse_qkv_bias}


def write_spec(config, file_spec: LlamaSpec, spec: LlamaSpec) -> None:
    """Write into transformers' `config` every value where `spec` differs from its own reading."""
    read = file_spec.values()
    for name, value in spec.values().items():
        if value != read.get(name):
            writer = _CONFIG_WRITERS.get(name)
            writer(config, spec) if writer else setattr(config, name, value)
