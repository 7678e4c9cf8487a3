"""tracer's own forward of every registered family, instrumented: the `reimpl` engine's model.

A family is a composition of components (`tracer.model.families`); each component holds its
forward, mirroring transformers 5.25's `modeling_<family>.py` with eager attention op by op and
dtype by dtype (RMSNorm in f32 then cast back, softmax in f32, the same matmul shapes with a batch
of 1), so that with no variant every point agrees with the `hf` engine at rounding level and a
difference is a real difference. This module loads a model (spec, weights checked against the
shapes its family declares, the variant's steps) and drives it one block at a time by construction:
`embed(ids)`, `block(i, h, positions)` for each layer, `head(h)`; `forward` is those calls in a row,
and a streamed run calls them one by one. It reads `config.json` and safetensors itself;
transformers is never imported on this path.

Positions are an input (absolute, int64 (T,); default 0..T-1, or after what a cache holds), and a
KV cache (`tracer.model.kv_cache.KVCache`) is threaded through the layers: a decode step is a
forward of one token at its position, with the cache of the tokens before it.

Every point of `tracer.model.points` is handed to one `record(name, tensor)` call; tensors keep
their batch dimension of 1 here and the recorder drops it. Variant knobs are resolved once, before
the forward: config-level knobs into a different `LlamaSpec` (`tracer.model.config.apply_overrides`),
semantic knobs and the family's structure into the steps its components declare (`resolve_steps`);
the number-format regime knobs (`weights`, `act_quant`, `kv_cache`, `ops`, ..., `preset=llamacpp`)
replace steps with `tracer.ggml.strategies`'s. The forward calls whatever was picked; it never
tests a knob or a family.

Notation: T tokens, C hidden size, H query heads, KV kv heads, D head dim, V vocab size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from tracer.core.errors import TracerError
from tracer.core.torch_types import TORCH_DTYPES, Recorder
from tracer.files.weights import VOCAB_ROWS, WeightFiles, read_weights
from tracer.model.component import Run, Steps, family_named
from tracer.model.components.attention import ATTENTION_KERNELS, not_recorded
from tracer.model.components.mlp import ACTIVATION_NAMES
from tracer.model.components.rope import Positions
from tracer.model.config import LlamaSpec, apply_overrides, load_config, read_config
from tracer.model.families import expected_shapes
from tracer.model.knobs import expand_presets, is_regime, setting
from tracer.model.points import EMBED, LOGITS, WEIGHT, layer_point, split_point


def _no_record(name: str, tensor: torch.Tensor) -> None:
    pass


def resolve_steps(knobs: dict, spec: LlamaSpec | None = None) -> Steps:
    """The steps a variant's knobs (presets expanded) pick from the components of the model's family
    (`spec`'s; None: a Llama), with the model-wide ones, the regime's put in last."""
    family = family_named(spec.family if spec else None)
    steps = Steps({"dtype": TORCH_DTYPES[setting(knobs, "dtype")], "weights": lambda weights, source: weights,
                   "linear": F.linear, **family.steps(knobs, spec)})
    if not is_regime(knobs):
        return steps  # numba's kernels stay unimported (about 60 MB and 250 ms) outside a regime
    from tracer.ggml.strategies import apply_regime  # numba, for ggml's kernels: a regime's only

    return apply_regime(knobs, steps, spec)


class LayerRecorder:
    """`record` with names relative to one layer (what a block's components record under)."""

    def __init__(self, record: Recorder, layer: int):
        self.record, self.prefix = record, layer_point(layer, "")

    def __call__(self, sub: str, tensor: torch.Tensor) -> None:
        self.record(f"{self.prefix}.{sub}" if sub else self.prefix, tensor)


class Prefixed:
    """The weights under one module path, e.g. a layer's `self_attn.q_proj.weight` (a view: with
    streamed weights nothing is read until a tensor is asked for)."""

    def __init__(self, weights, prefix: str):
        self.weights, self.prefix = weights, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.prefix + name]

    def get(self, name: str, default=None):
        return self.weights.get(self.prefix + name, default)


class Model:
    """A loaded model: spec, weights (checked against the shapes its family declares), and the
    variant's steps.

    `spec` is the file as the variant's config reader sees it (`Model.from_config` picks the
    reader); the config-level knobs (theta, eps, layers, ...) are applied to it here. The
    weights are converted to the variant's dtype on `device` once, or, with `stream=True`, read
    and converted block by block during every forward, so that memory holds one block's
    weights instead of the model's (for checkpoints larger than memory, and for the f64 copy
    that measures the noise floor).

    Example:
        >>> model = Model.from_dir(tracer.default_model_path(), {"theta": 10000.0})
        >>> logits = model.forward(torch.tensor([504, 3575, 282, 4649, 314]))  # (T, V)
        >>> at = model.positions(torch.arange(1000, 1005))  # the same tokens at positions 1000..1004
        >>> h = model.embed(torch.tensor([504, 3575, 282, 4649, 314]))
        >>> for i in range(model.spec.num_hidden_layers):
        ...     h = model.block(i, h, at)
        >>> logits = model.head(h)[0]
    """

    def __init__(self, spec: LlamaSpec, weights: Mapping[str, torch.Tensor], variant: dict | None = None, *,
                 device: torch.device | str = "cpu", stream: bool = False, source: dict | None = None):
        self.variant = dict(variant or {})
        self.knobs = expand_presets(self.variant)
        self.spec = apply_overrides(spec, self.knobs)
        self.family = family_named(self.spec.family)
        self.steps = resolve_steps(self.knobs, self.spec)
        self.device = torch.device(device)
        weights = self.steps.weights(weights, source)  # source: config.json's tracer_source (the GGUF)
        # streamed outside a regime (whose steps read whole tensors): lm_head converted by chunks of rows
        chunked = (LOGITS + WEIGHT,) if stream and not is_regime(self.knobs) else ()
        # and an f64 forward's matrices read in f32 (a lockstep unit's shared conversion), upcast as multiplied
        narrow = bool(chunked) and self.steps.dtype == torch.float64 and self.steps.linear is F.linear
        if narrow:
            self.steps = self.steps.replace(linear=upcasting_linear,
                                            logits=functools.partial(self.steps.logits, linear=upcasting_linear))
        self.weights = prepare_weights(self.spec, weights, self.steps.dtype, self.device, stream, chunked, narrow)
        self.unused_tensors = unused_tensors(self.spec, weights)
        self.layers = [Prefixed(self.weights, layer_point(i, "") + ".") for i in range(self.spec.num_hidden_layers)]

    @classmethod
    def from_config(cls, config: dict, weights: Mapping[str, torch.Tensor], variant: dict | None = None,
                    **placement) -> Model:
        """From a config.json dict, read by the variant's reader (`config`, `resave` knobs)."""
        return cls(read_config(config, expand_presets(variant or {})), weights, variant,
                   source=config.get("tracer_source"), **placement)

    @classmethod
    def from_dir(cls, model_dir: str | Path, variant: dict | None = None, **placement) -> Model:
        """`placement`: `device`, and `stream=True` to read each block's weights from the files when it runs."""
        weights = WeightFiles(model_dir) if placement.get("stream") else read_weights(model_dir)
        return cls.from_config(load_config(model_dir), weights, variant, **placement)

    def not_recorded(self) -> dict[str, str]:
        """Per-layer points this model's forward never forms, each with why."""
        return not_recorded(self.steps)

    # --- driven one block at a time ---------------------------------------------------------------

    def positions(self, positions: torch.Tensor | None = None, count: int | None = None,
                  cache=None) -> Positions:
        """The absolute positions of a forward's tokens (int64 (T,)), with the RoPE tables for them:
        `positions` as given, else `count` positions after what `cache` holds (0 without one)."""
        if positions is None:  # after the cache's last position (a knob may get this wrong: `decode_start`)
            start = 0 if cache is None else self.steps.decode_start(cache)
            positions = torch.arange(start, start + count)
        positions = torch.as_tensor(positions, dtype=torch.int64)
        if positions.dim() != 1:
            raise TracerError(f"positions must be one absolute position per token, (T,); got shape "
                              f"{tuple(positions.shape)}")
        return Positions(positions.to(self.device), self.spec, self.steps, self.steps.dtype, self.device)

    def _run(self, record: Recorder, positions=None, cache=None, layer: int | None = None) -> Run:
        weights = self.weights if layer is None else self.layers[layer]
        return Run(self.spec, self.steps, weights, record, positions, cache, layer)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """tokens (T,) int64 -> embeddings (1, T, C); a batch's (B, T) -> (B, T, C)."""
        ids = tokens.to(self.device)
        ids = ids[None] if ids.dim() == 1 else ids  # (1, T) or (B, T)
        run = self._run(record or _no_record)
        if isinstance(self.weights, StreamedWeights) and not is_regime(self.knobs):
            # only the rows the tokens use are read into the run's dtype, the ids renumbered into them
            rows, ids = torch.unique(ids, return_inverse=True)  # (R,), (1, T)
            table = self.weights.rows(EMBED + WEIGHT, rows)  # (R, C)
            run = dataclasses.replace(run, weights=Overlay(self.weights, {EMBED + WEIGHT: table}))
        return self.family.embedding.forward(ids, run)

    @torch.inference_mode()
    def block(self, layer: int, h: torch.Tensor, positions: Positions, cache=None,
              record: Recorder | None = None) -> torch.Tensor:
        """Block `layer` on its input (1, T, C) at `positions` (`Model.positions`), with an optional cache."""
        run = self._run(LayerRecorder(record or _no_record, layer), positions, cache, layer)
        return self.family.block.forward(h, run, self.family)

    @torch.inference_mode()
    def head(self, h: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """The last block's output (1, T, C) -> logits (1, T, V) ((1, 1, V) with logits=last)."""
        return self.family.head.forward(h, self._run(record or _no_record))

    @torch.inference_mode()
    def head_step(self, point: str, x: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """One point of the head (final norm, logits, capped logits) from its input."""
        return self.family.head.step(point, x, self._run(record or _no_record))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, record: Recorder | None = None, *, positions: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """tokens (T,) int64 -> logits (T, V) ((1, V) with logits=last); every point goes to `record`.

        `positions`: the tokens' absolute positions (T,) (default: 0..T-1, or after what `cache` holds);
            with a cache, every layer also records what its cache holds (`cache_k`, `cache_v`);
        `cache`: a `tracer.model.kv_cache.KVCache` the keys and values are appended to.
        """
        cached = self.steps.attention in ATTENTION_KERNELS.values() or getattr(self.steps.attention, "cached", False)
        if cache is not None and not cached:  # a regime's attention that takes rows after a cache says so
            raise TracerError("a KV cache with this regime's own attention (ops=candle) is not "
                              "emulated: run the regime without a cache")
        record = record or _no_record
        at = self.positions(positions, tokens.shape[0], cache)
        if len(at) != tokens.shape[0]:
            raise TracerError(f"{len(at)} positions for {tokens.shape[0]} tokens")
        h = self.embed(tokens, record)  # (1, T, C)
        for i in range(self.spec.num_hidden_layers):
            h = self.block(i, h, at, cache, record)
        if cache is not None:
            cache.forward_done()
        return self.head(h, record)[0]

    @torch.inference_mode()
    def forward_batch(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                      record: Recorder | None = None) -> torch.Tensor:
        """A left-padded batch: tokens (B, T) int64, attention_mask (B, T) (1 at each row's real tokens, 0 at
        its padding on the left) -> logits (B, T, V); every point goes to `record` with its batch axis.

        As transformers runs a padded batch: each row's positions from 0 at its first real token
        (`generate`'s `attention_mask.cumsum(-1) - 1`; the `batch_positions` knob gets it wrong), and
        attention causal over the padded sequence with the padded keys blocked (`padding_mask` drops that)."""
        if is_regime(self.knobs):
            raise TracerError("a batch with a regime's own steps (weights=, ops=, kv_cache=, ...) is not emulated: "
                              "run the regime on one prompt")
        if tokens.dim() != 2 or tokens.shape != attention_mask.shape:
            raise TracerError(f"a batch is tokens (B, T) with an attention mask of the same shape; got "
                              f"{tuple(tokens.shape)} and {tuple(attention_mask.shape)}")
        record = record or _no_record
        real = attention_mask.to(self.device).bool()  # (B, T)
        positions = self.steps.batch_positions(real)  # (B, T)
        at = Positions(positions, self.spec, self.steps, self.steps.dtype, self.device, real)
        h = self.embed(tokens, record)  # (B, T, C)
        for i in range(self.spec.num_hidden_layers):
            h = self.block(i, h, at, None, record)
        return self.head(h, record)


# --- weights ---------------------------------------------------------------------------------


def check_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every tensor the spec needs is there with its shape (read from the headers for weight
    files); a missing or misshapen tensor, or an activation we lack, is a TracerError."""
    if spec.hidden_act not in ACTIVATION_NAMES:
        raise TracerError(f"hidden_act {spec.hidden_act!r} is not supported (supported: {', '.join(ACTIVATION_NAMES)})")
    shapes = tensors.shapes() if hasattr(tensors, "shapes") else {name: tuple(t.shape) for name, t in tensors.items()}
    for name, shape in expected_shapes(spec).items():
        if name not in shapes:
            raise TracerError(f"missing tensor {name} (expected shape {shape})")
        if shapes[name] != shape:
            raise TracerError(f"shape mismatch, {name}: file {shapes[name]}, model {shape}")


def load_dtype(spec: LlamaSpec, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` is loaded in: f32 for those the family's reference keeps in f32 in a bf16 or f16
    load (`Component.f32_weights`, transformers' `_keep_in_fp32_modules_strict`), else `dtype`."""
    if dtype not in (torch.bfloat16, torch.float16):
        return dtype
    kept = {w for component in family_named(spec.family).all_components() for w in component.f32_weights}
    return torch.float32 if split_point(name)[1] in kept else dtype


def prepare_weights(spec: LlamaSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                    device: torch.device, stream: bool, chunked: tuple[str, ...] = (),
                    narrow_matrices: bool = False) -> Mapping[str, torch.Tensor]:
    """The spec's tensors in `dtype` on `device`, the logits' weight tied to the embedding where the
    config says so: converted now, or (`stream`) on every access, the `chunked` ones as `RowChunks`
    (and, `narrow_matrices`, a block's matrices in f32 where that holds them exactly)."""
    check_weights(spec, tensors)
    shapes = expected_shapes(spec)
    names = {name: name for name in shapes}
    if spec.tie_word_embeddings:
        names[LOGITS + WEIGHT] = EMBED + WEIGHT
    if stream:
        return StreamedWeights(tensors, names, dtype, device, chunked, narrow_matrices, spec)
    converted = {name: tensors[name].to(dtype=load_dtype(spec, name, dtype), device=device) for name in shapes}
    return {name: converted[source] for name, source in names.items()}


class StreamedWeights:
    """name -> tensor, read from the (memory-mapped) files and converted on every access: a forward
    holds the weights of the op it runs, at the price of reading them once per forward."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype,
                 device: torch.device, chunked: tuple[str, ...] = (), narrow_matrices: bool = False,
                 spec: LlamaSpec | None = None):
        self.tensors, self.names, self.dtype, self.device, self.spec = tensors, names, dtype, device, spec
        self.chunked = frozenset(chunked)
        self.narrow_matrices = narrow_matrices

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.chunked:
            return RowChunks(self.tensors, self.names[name], self._dtype(name), self.device)
        dtype = self._dtype(name)
        if hasattr(self.tensors, "converted"):  # weight files: a lockstep run's unit may hold it converted already
            return self.tensors.converted(self.names[name], dtype, self.device)
        with self.stored(self.names[name]) as stored:
            return stored.to(dtype=dtype, device=self.device, copy=True)

    def _dtype(self, name: str) -> torch.dtype:
        """Where the matrices are narrowed, one that the steps' `linear` multiplies (a projection,
        lm_head; not the embedding, whose rows are looked up) stored in 32 bits or fewer comes as it is
        stored, for `upcasting_linear` to widen a chunk at a time (every such value is exact in the wider
        type: nothing is rounded); in f32 inside a lockstep unit, whose f32 conversion the reference has
        made already (`WeightFiles.holding`)."""
        if not self.narrow_matrices or not (name.endswith("_proj" + WEIGHT) or name == LOGITS + WEIGHT):
            return self.dtype if self.spec is None else load_dtype(self.spec, name, self.dtype)
        source = self.names[name]
        header = self.tensors.header(source) if hasattr(self.tensors, "header") else self.tensors[source]
        if not (header.dtype.is_floating_point and header.dtype.itemsize <= 4):
            return self.dtype
        return torch.float32 if getattr(self.tensors, "hold", None) is not None else header.dtype

    def stored(self, name: str):
        """A context: the tensor in its stored dtype, a view of the file's pages where the weights
        are files (`WeightFiles.mapped`), else the mapping's own tensor."""
        return self.tensors.mapped(name) if hasattr(self.tensors, "mapped") else nullcontext(self.tensors[name])

    def get(self, name: str, default=None):
        return self[name] if name in self.names else default

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Some rows of a tensor (an embedding's), read and converted: (len(rows), ...)."""
        with self.stored(self.names[name]) as stored:
            return stored[rows.cpu()].to(dtype=self.dtype, device=self.device)


UPCAST_ROWS = 512  # rows of a narrowed matrix upcast at a time: 16 MB of f64 at a width of 4096, multiplied in cache


def upcasting_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight.to(x.dtype), bias)` without the whole upcast copy: `UPCAST_ROWS` rows of the
    weight at a time, into one buffer, each multiplied while it is in the cache. The same sums per
    output column as the whole weight's, in the order BLAS picks for each shape and thread count:
    bitwise the whole product at most shapes measured, else within a few f64 ulps (≤ 1e-15
    relative: tests/unit/test_lockstep.py), which moves a noise floor (~1e-7) in its eighth digit.
    An f64 copy of a 14336×4096 matrix is 470 MB written and read again per forward (8B shape, 64
    tokens: 75 ms a matrix against 100–114 ms converting it whole into a used buffer first)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    buffer = torch.empty((min(UPCAST_ROWS, weight.shape[0]), weight.shape[1]), dtype=x.dtype, device=x.device)
    parts = []
    for start in range(0, weight.shape[0], UPCAST_ROWS):
        chunk = weight[start:start + UPCAST_ROWS]  # (rows, K)
        part_bias = None if bias is None else bias[start:start + UPCAST_ROWS].to(x.dtype)
        parts.append(F.linear(x, buffer[:len(chunk)].copy_(chunk), part_bias))  # (…, rows)
    return torch.cat(parts, dim=-1)  # (…, N)


class RowChunks:
    """A (V, C) weight given as chunks of `VOCAB_ROWS` rows converted one at a time (the model's head
    multiplies by each: `tracer.model.components.head`; `WeightFiles.row_chunks` for weight files)."""

    in_row_chunks = True  # what `tracer.model.components.head` looks for

    def __init__(self, tensors, name: str, dtype: torch.dtype, device: torch.device):
        self.tensors, self.name, self.dtype, self.device = tensors, name, dtype, device

    def __iter__(self):
        if hasattr(self.tensors, "row_chunks"):
            yield from self.tensors.row_chunks(self.name, self.dtype, self.device)
            return
        stored = self.tensors[self.name]
        for start in range(0, stored.shape[0], VOCAB_ROWS):
            yield stored[start:start + VOCAB_ROWS].to(dtype=self.dtype, device=self.device, copy=True)


class Overlay:
    """A weights mapping with some names replaced (a streamed embedding's rows)."""

    def __init__(self, weights, replaced: dict[str, torch.Tensor]):
        self.weights, self.replaced = weights, replaced

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.replaced[name] if name in self.replaced else self.weights[name]

    def get(self, name: str, default=None):
        return self.replaced[name] if name in self.replaced else self.weights.get(name, default)


def unused_tensors(spec: LlamaSpec, tensors: dict) -> list[str]:
    """Tensors in the files that this spec does not use (e.g. biases a config says are absent)."""
    needed = set(expected_shapes(spec)) | {LOGITS + WEIGHT}
    return sorted(name for name in tensors if name not in needed and not name.endswith("rotary_emb.inv_freq"))

