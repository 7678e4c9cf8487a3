"""`Trace`: what one run recorded, as data.

An ordered map point name -> tensor (execution order) plus metadata (engine, variant, model,
token ids, dtype, library versions, points the engine could not observe). Saved as one
safetensors file whose metadata holds a JSON manifest; never pickle.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tracer.core.errors import TracerError, one_line
from tracer.core.renderers import render
from tracer.model.knobs import side_label
from tracer.model.points import has_head_axis, is_causal, is_integer_point, layer_of
from tracer.names.aliases import alias_table, rename, token_names

MANIFEST_KEY = "tracer"
MAX_LAYERS = 10_000  # far above any Llama (405B has 126 blocks)
FORMAT_VERSION = 2  # 2: decode steps (`Trace.steps`); a version 1 file reads as a trace without steps
STEP_PREFIX = "step{}/"  # a decode step's tensors in the file: "step3/model.layers.0.self_attn.k_rope"


@dataclass(frozen=True, kw_only=True)
class TraceMeta:
    """What a trace says about its run, beside the tensors. None: this trace does not say (the key
    is absent from its manifest). Saved as the JSON object `meta` of the manifest (`to_dict`).

    Attributes written by every engine (`tracer.engines.base.trace_meta`):
        engine: the registry name ("hf", "reimpl", ...); "file" for a dump from another runtime.
        variant: knob -> value the engine ran with.
        model: the model directory, .gguf file or label the engine ran.
        tokens: the token ids of the forward.
        dtype: the dtype it computed in, without "torch." ("float32", "f16").
        device: where it ran ("cpu", "cuda:0").
        versions: package -> version (python, platform, torch, transformers, safetensors).
        not_recorded: point -> why this engine cannot observe it.

    Attributes written by `tracer.record` (the request):
        prompt: the prompt text the tokens came from.
        chat: the chat template's details where it was applied.

    Attributes on the model (engines, and a dump's metadata):
        num_layers: decoder blocks.
        family: the model family (`tracer.model.families`), which orders and explains the points.
        position_offset: the absolute position of the first token (None: 0); the engines that take
            positions (`--position-offset`) write it.
        cache_start: a decoded trace's (a cached prefill's, a decode step's): the position of the first
            token its KV cache took, the prompt's first (None: 0); its cache holds the tokens from there
            to its own last (`tracer.engines.base.decode_steps` writes it).
        num_attention_heads, num_key_value_heads, head_dim: a dump's attention shape.

    Attributes one engine writes:
        attn_implementation: transformers' attention kernel (hf).
        placement: where accelerate put the modules (hf on a device_map).
        unused_config_keys: config.json keys the engine did not read.
        unused_tensors: weights the model did not use.
        notes: what the engine itself says about its run (candle).
        runtime: a non-PyTorch runtime: {name, version, ...} from an engine, its text from a dump.
        ort_opt, export: ONNX Runtime's optimization level and the export folder (onnx).
        weights, flash_attn, outputs, system_info: the model as llama.cpp describes it, its
            flash attention ("on"/"off"), the positions it returns ("all"/"last"), its build (llamacpp).
        candle: candle's forward, kernels and the config values it read (candle).

    Attributes of a dump from another runtime (`import_foreign`; llama.cpp writes `sources` too):
        file: the path it was read from.
        sources: point -> {name, runtime, layout, qk_order} of the tensor it came from.
        unknown_names: tensor names that map to no point.
        skipped_names: tensor name -> why it was left out.
        duplicate_names: point -> the other names that mapped onto it.
        differing_names: point -> {a duplicate name whose tensor differs from the compared one: its max|diff|
            to it, None where its shape differs}.

    extra: keys tracer does not know (a foreign runtime's metadata, a newer tracer's keys), kept
        and written back as they came.
    """

    # In the order the engines, then `tracer.record`, write them: a manifest keeps its key order.
    engine: str | None = None
    variant: dict | None = None
    model: str | None = None
    tokens: list[int] | None = None
    dtype: str | None = None
    device: str | None = None
    versions: dict[str, str | None] | None = None
    not_recorded: dict[str, str] | None = None
    num_layers: int | None = None
    attn_implementation: str | None = None
    runtime: dict | str | None = None
    ort_opt: str | None = None
    export: str | None = None
    weights: str | None = None
    flash_attn: str | None = None
    outputs: str | None = None
    sources: dict[str, dict] | None = None
    system_info: str | None = None
    candle: dict | None = None
    notes: list[str] | None = None
    unused_config_keys: list[str] | None = None
    unused_tensors: list[str] | None = None
    family: str | None = None
    position_offset: int | None = None
    cache_start: int | None = None
    placement: str | None = None
    prompt: str | None = None
    chat: dict | None = None
    file: str | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    unknown_names: list[str] | None = None
    skipped_names: dict[str, str] | None = None
    duplicate_names: dict[str, list[str]] | None = None
    differing_names: dict[str, dict[str, float | None]] | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The manifest's `meta` object: every key this trace says, then `extra` as it came."""
        said = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{key: value for key, value in said.items() if value is not None}, **self.extra}

    @classmethod
    def from_dict(cls, meta: dict) -> TraceMeta:
        """A manifest's `meta` object (checked by `_manifest`); keys tracer does not know go to `extra`."""
        return cls(**{key: value for key, value in meta.items() if key in META_KEYS},
                   extra={key: value for key, value in meta.items() if key not in META_KEYS})


META_KEYS = frozenset(f.name for f in fields(TraceMeta)) - {"extra"}


@dataclass
class Trace:
    """One side's recording.

    Attributes:
        tensors: point name -> tensor in execution order, batch dimension dropped.
        meta: what the trace says about its run (`TraceMeta`): engine, variant, model, token ids,
            dtype, device, versions, points this engine cannot observe, ...
        steps: with `--decode N`, the N decode steps after this trace's prefill, each a trace of one
            token at its position (`meta.tokens`, `meta.position_offset`) recorded with the engine's
            own KV cache; empty for a single forward.

    Example:
        >>> trace = tracer.record(None, "The capital of France is", engine="reimpl", progress=False)
        >>> trace["model.layers.0.self_attn.q_rope"].shape
        torch.Size([9, 5, 64])
        >>> Trace.load(trace.save("reimpl.safetensors")).points == trace.points
        True
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: TraceMeta = field(default_factory=TraceMeta)
    steps: list[Trace] = field(default_factory=list)

    def __getitem__(self, point: str) -> torch.Tensor:
        return self.tensors[point]

    def __contains__(self, point: str) -> bool:
        return point in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def table(self):
        """One row per point (execution order): layer, shape, dtype, max |x| — a pandas DataFrame."""
        import pandas as pd  # pandas: 0.2 s, for a table only

        rows = [{"point": name, "layer": layer_of(name), "shape": tuple(t.shape),
                 "dtype": str(t.dtype).removeprefix("torch."),
                 "max_abs": float(t.abs().max()) if t.numel() else 0.0}
                for name, t in self.tensors.items()]
        frame = pd.DataFrame(rows, columns=["point", "layer", "shape", "dtype", "max_abs"])
        return frame.astype({"layer": "Int64"}).set_index("point")

    def _repr_html_(self) -> str:
        """Jupyter's view: engine, variant, tokens, and the points folded over layers."""
        return render("trace_html", self)

    @property
    def points(self) -> list[str]:
        return list(self.tensors)

    @property
    def not_recorded(self) -> dict[str, str]:
        return self.meta.not_recorded or {}

    @property
    def tokens(self) -> list[int] | None:
        return self.meta.tokens

    @property
    def variant(self) -> dict:
        return self.meta.variant or {}

    @property
    def label(self) -> str:
        """`engine[knob=value,...]`, how reports and summaries name this side; `candle (file)` for a
        dump whose metadata names its runtime."""
        engine, runtime = "?" if self.meta.engine is None else self.meta.engine, self.meta.runtime
        if engine == "file" and runtime:  # a dump's metadata names its runtime; a live engine's {"name", ...}
            engine = f"{runtime.get('name') if isinstance(runtime, dict) else runtime} (file)"
        return side_label(engine, self.variant)

    def save(self, path: str | os.PathLike) -> Path:
        """Write one safetensors file; the manifest (order and metadata) goes in its header."""
        path = Path(path)
        manifest = {"format": FORMAT_VERSION, "points": self.points, "meta": self.meta.to_dict()}
        tensors = {name: t.detach().contiguous() for name, t in self.tensors.items()}
        if self.steps:
            manifest["steps"] = [{"points": step.points, "meta": step.meta.to_dict()} for step in self.steps]
            for number, step in enumerate(self.steps, start=1):
                prefix = STEP_PREFIX.format(number)
                tensors |= {prefix + name: t.detach().contiguous() for name, t in step.tensors.items()}
        if not path.parent.is_dir():
            raise TracerError(f"cannot write trace {path}: no folder {path.parent}")
        tensors = _own_storage(tensors)
        tmp = path.with_name(path.name + ".partial")
        try:
            save_file(tensors, str(tmp), metadata={MANIFEST_KEY: json.dumps(manifest)})
            os.replace(tmp, path)
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            # A full disk or a read-only folder is the user's to fix; safetensors raises several types.
            raise TracerError(f"cannot write trace {path}: {one_line(exc)}") from exc
        except BaseException:  # Ctrl-C: no .partial file left behind either
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, aliases=None) -> Trace:
        """Read a trace written by `save`, or a dump from another runtime (docs/trace-format.md).

        A file without tracer's manifest is imported: its names go through the alias table
        (`tracer.names.aliases`; `aliases` adds a user mapping: a dict, a JSON file path or an
        AliasTable), its metadata keys (`tokens`, `runtime`, `model`, `qk_order`, head counts)
        become the trace's `TraceMeta` (other keys its `extra`), and names that map to no point are kept in
        `meta.unknown_names`.
        """
        path = Path(path)
        if not path.is_file():
            raise TracerError(f"trace file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise TracerError(f"cannot read trace {path}: {one_line(exc)}") from None
        if MANIFEST_KEY not in header:
            return import_foreign(tensors, header, path, aliases)
        manifest = _manifest(path, header[MANIFEST_KEY])
        steps = []
        for number, step in enumerate(manifest.get("steps", []), start=1):
            prefix = STEP_PREFIX.format(number)
            names = [name for name in tensors if name.startswith(prefix)]
            steps.append(_ordered({name.removeprefix(prefix): tensors.pop(name) for name in names},
                                  step["points"], step["meta"]))
        trace = _ordered(tensors, manifest.get("points", []), manifest.get("meta", {"engine": "file"}))
        trace.steps = steps
        return trace


def _ordered(tensors: dict[str, torch.Tensor], points: list[str], meta: dict) -> Trace:
    """A trace of `tensors` in its manifest's point order (any others after them)."""
    order = [p for p in points if p in tensors]
    order += [p for p in tensors if p not in order]
    return Trace({p: tensors[p] for p in order}, TraceMeta.from_dict(meta))


# Metadata keys a foreign file may carry (all safetensors metadata values are strings).
FOREIGN_TEXT_KEYS = ("runtime", "model", "prompt", "dtype")
FOREIGN_INT_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim")
QK_ORDERS = ("half", "interleaved")


def import_foreign(tensors: dict[str, torch.Tensor], header: dict[str, str], path: Path, aliases=None) -> Trace:
    """A dump from another runtime as a Trace: names mapped onto points, metadata read. Metadata keys
    tracer does not read stay in `meta.extra`, as text."""
    read = {key: header[key] for key in FOREIGN_TEXT_KEYS if key in header}
    read |= {key: _int_metadata(header[key], key, path) for key in FOREIGN_INT_KEYS if key in header}
    tokens = token_names()
    token_tensor = next((name for name in tokens if name in tensors), None)
    if "tokens" in header:
        read["tokens"] = _token_metadata(header["tokens"], path)
    elif token_tensor is not None:
        read["tokens"] = [int(t) for t in tensors[token_tensor].reshape(-1).tolist()]
    floats = {name: t for name, t in tensors.items() if name not in tokens}
    renamed = rename(floats, alias_table(aliases))
    if "qk_order" in header:
        if header["qk_order"] not in QK_ORDERS:
            raise TracerError(f"{path}: metadata qk_order is {header['qk_order']!r}; expected half or interleaved")
        for source in renamed.sources.values():
            source["qk_order"] = header["qk_order"]
    for point, tensor in renamed.tensors.items():
        if not tensor.is_floating_point() and not is_integer_point(point):
            raise TracerError(f"{path}: tensor {renamed.sources[point]['name']} ({point}) is {tensor.dtype}, "
                              f"not a floating-point activation")
    layers = [int(p.split(".")[2]) for p in renamed.tensors if p.startswith("model.layers.")]
    # qk_order went into the sources; a key named like one tracer sets itself ("engine", "num_layers")
    # would contradict it: left out.
    unread = {key: text for key, text in header.items() if key not in META_KEYS and key != "qk_order"}
    meta = TraceMeta(engine="file", file=str(path), **read, sources=renamed.sources, unknown_names=renamed.unknown,
                     skipped_names=renamed.skipped, duplicate_names=renamed.duplicates,
                     differing_names=renamed.differing or None,
                     num_layers=max(layers) + 1 if layers else None, extra=unread)
    return Trace(renamed.tensors, meta)


def _int_metadata(text: str, key: str, path: Path) -> int:
    try:
        return int(text)
    except ValueError:
        raise TracerError(f"{path}: metadata {key} is {text!r}; expected an integer") from None


def _token_metadata(text: str, path: Path) -> list[int]:
    """Token ids written as a JSON list ("[1, 2, 3]") or comma-separated ("1,2,3")."""
    try:
        ids = json.loads(text) if text.strip().startswith("[") else [int(t) for t in text.split(",") if t.strip()]
        if not all(isinstance(t, int) for t in ids):
            raise ValueError
        return ids
    except ValueError:
        raise TracerError(f"{path}: metadata tokens is {text[:60]!r}; expected a JSON list of ids or 1,2,3") from None


def _manifest(path: Path, text: str) -> dict:
    """tracer's manifest of a trace file, checked as far as `load` and `compare` rely on it."""
    try:
        manifest = json.loads(text)
    except ValueError:
        raise TracerError(f"cannot read trace {path}: its manifest is not valid JSON") from None
    points, meta = ((manifest.get("points", []), manifest.get("meta", {})) if isinstance(manifest, dict)
                    else (None, None))
    if not (isinstance(points, list) and all(isinstance(p, str) for p in points) and isinstance(meta, dict)
            and all(isinstance(meta.get(key, {}), dict) for key in ("variant", "not_recorded"))):
        raise TracerError(f"cannot read trace {path}: its manifest is malformed")
    steps = manifest.get("steps", [])
    if not (isinstance(steps, list) and all(
            isinstance(step, dict) and isinstance(step.get("points"), list) and isinstance(step.get("meta"), dict)
            and all(isinstance(p, str) for p in step["points"]) for step in steps)):
        raise TracerError(f"cannot read trace {path}: its decode steps are malformed")
    tokens = meta.get("tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
        raise TracerError(f"cannot read trace {path}: its token ids are malformed")
    layers = meta.get("num_layers", 0)
    # num_layers sizes the point vocabulary compare() builds: a forged 10**12 must not eat the memory.
    if not isinstance(meta.get("engine", ""), str) or type(layers) is not int or not 0 <= layers <= MAX_LAYERS:
        raise TracerError(f"cannot read trace {path}: its engine or num_layers is malformed")
    return manifest


# Attention matrices are (H, T, T): 9 GB per trace for SmolLM2 at 2048 tokens. Past this many
# tokens only their last query rows are kept, (H, ATTENTION_ROWS, T), by every recorder alike.
ATTENTION_ROWS = 128


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in a storage of its own, as safetensors writes them: two points may be views of one
    value (a mixture of experts' output is its experts' sum reshaped, in transformers as in tracer)."""
    seen, own = set(), {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        own[name] = tensor.clone() if storage in seen and tensor.numel() else tensor
        seen.add(storage)
    return own


def kept(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What a recorder keeps of a point: batch dropped, long attention matrices cut to their last rows."""
    value = tensor.detach()[0]
    if is_causal(name) and value.shape[-2] > ATTENTION_ROWS:
        value = value[..., -ATTENTION_ROWS:, :]  # (H, rows, T)
        # A view would keep (H, T, T) alive; a point from an accelerator comes to the CPU anyway.
        return value.clone() if value.device.type == "cpu" else value.cpu()
    return value.cpu()  # traces live on the CPU: compared, saved and kept apart from the device's memory


def rows_before(point: str, tensor: torch.Tensor, cut: int, tokens: int, *,
                every_row: bool = False) -> torch.Tensor | None:
    """A point's rows of the prompt's first `cut` tokens, as a view ((T, X): rows; (H, T, D): axis 1;
    (H, Q, T) attention: the query rows of those tokens it kept and their keys), or None where none
    comes before `cut` or its token axis is not the prompt's (`tokens` long). `every_row`: None as well
    where an attention matrix kept only some of them (a long prompt keeps its last query rows)."""
    if cut <= 0:
        return None
    if is_causal(point):
        queries, keys = tensor.shape[-2:]
        first_query = keys - queries  # a long prompt keeps its last query rows only
        if keys != tokens or cut <= first_query or (every_row and first_query > 0):
            return None
        return tensor[..., :cut - first_query, :cut]
    axis = 1 if has_head_axis(point) else 0
    if tensor.dim() <= axis or tensor.shape[axis] != tokens:
        return None
    return tensor.narrow(axis, 0, cut)


class FirstRows(Mapping):
    """point -> its rows of the prompt's first `cut` tokens (`rows_before`), of a trace or of a recorder's
    points as they come; a point with no such rows is not held. A causal model's first rows depend on the
    first tokens only: they are what a run of those tokens alone records, up to the summation order."""

    def __init__(self, points: Mapping, cut: int, tokens: int):
        self.points, self.cut, self.tokens = points, cut, tokens

    def __getitem__(self, point: str) -> torch.Tensor:
        rows = rows_before(point, self.points[point], self.cut, self.tokens, every_row=True) \
            if point in self.points else None
        if rows is None:
            raise KeyError(point)
        return rows

    def __contains__(self, point) -> bool:
        try:
            self[point]
        except KeyError:
            return False
        return True

    def __iter__(self):
        return (point for point in self.points if point in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def first_rows(trace: Trace, cut: int) -> Trace:
    """`trace` as a run of its first `cut` tokens would have recorded it (`FirstRows`), nothing copied."""
    tokens = list(trace.tokens or ())
    return Trace(FirstRows(trace.tensors, cut, len(tokens)), dataclasses.replace(trace.meta, tokens=tokens[:cut]))


class TraceRecorder:
    """The `record(name, tensor)` callable both engines feed, keeping every point in memory."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        # No clone: every recorded tensor is a fresh result that neither forward modifies in place.
        self.tensors[name] = kept(name, tensor)
