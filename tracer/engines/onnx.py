"""The `onnx` engine: ONNX Runtime on an export of the model that tracer makes and caches.

How the points become graph outputs. The exporter (`torch.onnx.export(dynamo=True)`) names values
with global counters (`linear_1`, `add_315`) that change with the model's size, the transformers
version and the exporter's own passes; the module path survives only in node metadata
(`pkg.torch.onnx.name_scopes`), and the virtual points (q/k after RoPE, scores, probs, context,
resid_mid, mlp.act) are no module's output, so naming them from the graph would take pattern rules
(the Add after a Mul after a Slice...) that break whenever transformers rewrites its forward or the
exporter its decompositions. Instead tracer exports a wrapper (`RecordingExport`) whose forward runs
the transformers model under the hf engine's own recording hooks (`tracer.hooks.recording_modules`
and `recording_attention`) with a recorder that collects the tensors and returns them as the
graph's outputs, named after their points. The exporter traces through the hooks, so the names come
from the same code that names the hf reference, for any model transformers can export, and no rule
reads the graph. The recorded tensors are the computation's own values, not copies beside it:
each output feeds another node of the graph (checked in tests/unit/test_onnx.py), except the
logits, and scores and probs, which leave as a Slice of their last `ATTENTION_ROWS` query rows
(all of them for shorter prompts; what `kept` keeps anyway, so ORT never hands back (H, T, T)
matrices at 2048 tokens) of a value that does. Attention is exported in
its eager form (transformers' `eager_attention_forward`, op for op), which is what makes scores and
probabilities exist as values.

The export is made once per model (the contents of its config and weights, wherever they lie: a copied
or re-downloaded folder reuses it; `tracer.files.hashes.content_hashes` hashes a file again only
after it is written), dtype and exporter versions (torch, transformers, onnx, onnxscript) and kept
under `tracer.files.convert.cache_root()/onnx`,
built in a temporary folder renamed into place when complete (`tracer.files.convert.cached_build`, as the
GGUF conversion). A model whose layers are one computation is exported at two layers and layer 1's
nodes are repeated for the rest (`tracer.engines.onnx_layers`: SmolLM2 36.7 s -> 8.6 s, the same
outputs to the bit). The sequence length is a dynamic dimension, so one export serves every prompt
length and greedy decoding. Next to `model.onnx` (every point an output) the cache holds
`plain.onnx`, the same graph with only the logits as output, sharing the weights file: that is the
model as it would be shipped, which `logits()` (greedy decoding) and the benchmark's plain forward
run. ORT's optimizer may fuse differently when intermediates are outputs, so the two are compared
in the tests.

Knobs: `dtype` (f32 | f16: the model loaded in that dtype, then exported; ORT's CPU provider has
no bf16 kernels for this graph) and `ort_opt` (ORT's graph optimization level; default `all`, as
ORT itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import re
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from tracer.core.errors import TracerError, one_line
from tracer.core.progress import detail
from tracer.core.versions import installed_version
from tracer.engines import onnx_layers
from tracer.engines.base import EngineBase
from tracer.engines.hf import load as load_hf
from tracer.engines.onnx_layers import NotRepeatable
from tracer.engines.registry import ENGINES
from tracer.files.convert import cache_root, cached_build
from tracer.files.hashes import model_contents
from tracer.files.sources import ModelSource
from tracer.hooks import recording_attention, recording_modules
from tracer.model.config import read_hf
from tracer.model.knobs import setting
from tracer.model.points import LOGITS, is_causal
from tracer.traces.trace import ATTENTION_ROWS, Trace, TraceRecorder

EXPORT_FORMAT = 3  # bump when RecordingExport or the export settings change what it writes: older exports are rebuilt
MODEL_FILE, PLAIN_FILE, DATA_FILE, MANIFEST_FILE = "model.onnx", "plain.onnx", "model.onnx.data", "export.json"
INPUT = "input_ids"
DTYPES = ("f32", "f16")
# The knob's values -> ORT's levels (ORT_ENABLE_ALL is its default).
OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
              "layout": "ORT_ENABLE_LAYOUT", "all": "ORT_ENABLE_ALL"}
# Distributions whose versions shape the exported file (ORT only runs it).
EXPORTER = ("torch", "transformers", "onnx", "onnxscript")


def runtime() -> dict:
    return {"name": "onnxruntime", "version": installed_version("onnxruntime"),
            **{dist: installed_version(dist) for dist in ("onnx", "onnxscript")}}


class ONNXEngine(EngineBase):
    entry = ENGINES["onnx"]
    device = torch.device("cpu")

    def __init__(self, export_dir: Path, variant: dict, label: str, spec):
        self.export_dir, self.variant, self.label, self.spec = export_dir, variant, label, spec
        self.manifest = read_manifest(export_dir)
        self.level = setting(variant, "ort_opt")
        self.session = self._session(MODEL_FILE)
        self.points = [output.name for output in self.session.get_outputs()]
        self._plain = None  # made on first use: a second session holds a second copy of the weights
        self.vocab_size, self.max_positions = spec.vocab_size, spec.max_position_embeddings

    def record(self, tokens: list[int], recorder=None, *, positions=None) -> Trace:
        """Every point, from one ORT run of the export whose outputs are the points."""
        self.first_position(tokens, positions)  # its tokens run from 0: other positions are refused
        recorder = recorder if recorder is not None else TraceRecorder()
        outputs = self.session.run(self.points, self._feed(tokens))
        for name, array in zip(self.points, outputs):
            recorder(name, torch.from_numpy(array))  # numpy arrays on ORT's own buffers: no copy
        meta = self.meta(tokens, self.manifest["dtype"], {}, num_layers=self.manifest["num_layers"], runtime=runtime(),
                         ort_opt=self.level, export=str(self.export_dir))
        return Trace(recorder.tensors, meta)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """(T, V) from the plain export (logits its only output), as the model would be shipped."""
        return torch.from_numpy(self.plain.run([LOGITS], self._feed(tokens))[0][0])

    @property
    def plain(self):
        if self._plain is None:
            self._plain = self._session(PLAIN_FILE)
        return self._plain

    def _feed(self, tokens: list[int]) -> dict:
        return {INPUT: np.array([tokens], dtype=np.int64)}  # (1, T)

    def _session(self, file: str):
        import onnxruntime as ort  # onnx: an optional runtime

        options = ort.SessionOptions()
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[self.level])
        options.log_severity_level = 3  # errors only: its warnings (unused initializers...) are not ours to show
        try:
            return ort.InferenceSession(str(self.export_dir / file), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail / NotImplemented / RuntimeException
            raise TracerError(f"onnxruntime cannot load {self.export_dir / file}: {one_line(exc)}") from None


def read_manifest(export_dir: Path) -> dict:
    """export.json, or one line saying the export is unusable (the cache check rebuilds a damaged
    entry before this; this is the last word on one it could not judge)."""
    try:
        manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise TracerError(f"the ONNX export {export_dir} has no readable {MANIFEST_FILE} "
                          f"({getattr(exc, 'strerror', None) or one_line(exc)}): "
                          "delete the folder to rebuild it") from None
    if not isinstance(manifest, dict) or not {"dtype", "num_layers"} <= manifest.keys():
        raise TracerError(f"the ONNX export {export_dir} has a garbled {MANIFEST_FILE}: "
                          "delete the folder to rebuild it")
    return manifest


# ----------------------------------------------------------------------------- export


class RecordingExport(torch.nn.Module):
    """transformers' model under tracer's recording hooks: its forward returns every point,
    in execution order (`names` after a call)."""

    def __init__(self, hf_engine):
        super().__init__()
        self.model = hf_engine.model
        self.layer_prefixes = hf_engine.layer_prefixes
        self.family, self.model_points = hf_engine.family, hf_engine.model_points  # the family's points, as hf records
        self.names: list[str] = []

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        collected: dict[str, torch.Tensor] = {}
        module_names = {module: name for name, module in self.model.named_modules()}
        with recording_modules(self.model, self._keep(collected), self.layer_prefixes, self.family,
                               self.model_points), \
                recording_attention(self.model, self._keep(collected), module_names):
            self.model(input_ids=input_ids, use_cache=False)
        self.names = list(collected)
        return tuple(collected.values())

    @staticmethod
    def _keep(collected: dict):
        def record(name: str, tensor: torch.Tensor) -> None:
            # What `kept` keeps of a long attention matrix, cut inside the graph: (1, H, rows, T)
            collected[name] = tensor[..., -ATTENTION_ROWS:, :] if is_causal(name) else tensor

        return record


def export_path(model_dir: Path, dtype: str) -> Path:
    """Where the export of this model directory's files (their contents, wherever they lie) in `dtype` is cached."""
    identity = [dtype, EXPORT_FORMAT, model_contents(model_dir, cache_root()),
                *[(dist, installed_version(dist)) for dist in EXPORTER]]
    key = hashlib.sha1(json.dumps(identity).encode()).hexdigest()[:12]
    built = sorted((cache_root() / "onnx").glob(f"*-{dtype}-{key}"))  # the same files in a folder of another name
    if built:
        return built[0]
    stem = re.sub(r"[^a-z0-9._-]+", "-", model_dir.name.lower()).strip("-.") or "model"
    return cache_root() / "onnx" / f"{stem}-{dtype}-{key}"


def exported(model_dir: Path, dtype: str) -> Path:
    """The cached export (made now if missing): model.onnx, plain.onnx, their weights, export.json."""
    target = export_path(model_dir, dtype)
    return cached_build(target, lambda folder: _export(model_dir, dtype, folder), progress=False)


def _export(model_dir: Path, dtype: str, folder: Path, *, repeat: bool = True) -> None:
    """repeat: export two layers and repeat the second (`tracer.engines.onnx_layers`) where the
    layers are one computation; False exports every layer (the tests compare the two)."""
    detail(f"exporting to ONNX ({dtype}; first use only)")
    started = time.perf_counter()
    try:
        program, names, num_layers, layers = _exported_program(model_dir, dtype, repeat)
    except NotRepeatable as reason:  # the layers are not one computation after all: every layer, as before
        program, names, num_layers, _ = _exported_program(model_dir, dtype, False)
        layers = f"every layer exported ({reason})"
    program.save(str(folder / MODEL_FILE), external_data=True)
    _write_plain(folder)
    manifest = {"format": EXPORT_FORMAT, "model": str(model_dir), "dtype": dtype, "points": names,
                "num_layers": num_layers,
                "layers": layers, "seconds": round(time.perf_counter() - started, 1),
                "versions": {dist: installed_version(dist) for dist in EXPORTER}}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def _exported_program(model_dir: Path, dtype: str, repeat: bool):
    """(the torch.onnx program, the points in execution order, the number of layers, how they were made)."""
    hf = load_hf(ModelSource(model_dir), {"dtype": dtype})
    wrapper = RecordingExport(hf).eval()
    # (1, T); not one token, which torch.export would specialize T to
    example = torch.arange(min(8, hf.max_positions)).unsqueeze(0)
    with torch.inference_mode():
        wrapper(example)  # the point names, in execution order
    names, layer_prefixes = wrapper.names, list(hf.layer_prefixes)
    repeat = repeat and onnx_layers.repeatable(hf.model)
    if repeat:
        weights = hf.model.state_dict()  # before the cut: every layer's
        onnx_layers.cut_to_template(hf.model, layer_prefixes)
        with torch.inference_mode():
            wrapper(example)  # the two layers' points: the names the exporter gives the outputs
    seq = torch.export.Dim("seq", min=1, max=hf.max_positions)
    with _quiet_exporter() as said:
        try:
            program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=[INPUT],
                                        output_names=wrapper.names, dynamic_shapes={INPUT: {1: seq}},
                                        optimize=False, verbose=False)
        except Exception as exc:  # noqa: BLE001 - the exporter raises anything from torch.export to onnxscript
            last = [line for line in said.getvalue().splitlines() if line.strip()][-1:]
            raise TracerError(f"torch.onnx.export failed on {model_dir}: {one_line(exc)}"
                              + (f" ({last[0]})" if last else "")) from None
    if repeat:
        onnx_layers.repeat_layers(program.model, layer_prefixes, names, weights)
    _merge_duplicates(program.model)
    layers = f"layers {onnx_layers.TEMPLATE_LAYERS}.. repeat layer 1" if repeat else "every layer exported"
    return program, names, len(layer_prefixes), layers


def _merge_duplicates(model) -> None:
    """One node for each value the graph computes twice: a point recorded as a reshape of what the
    forward reshapes again is then the value the forward goes on with.

    In place of the exporter's `optimize=True`, whose pattern rewriter took half the export's time
    for fusions ORT makes itself when it loads the graph (`ort_opt`); the points are the same to the bit.
    """
    from onnx_ir.passes.common import (  # onnx: an optional runtime
        CommonSubexpressionEliminationPass,
        RemoveUnusedNodesPass,
    )

    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter prints its steps on stdout (which `--json -` keeps for one JSON object) and warns
    through logging and warnings; kept in a buffer, whose last line goes into an error."""
    said = io.StringIO()
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(said), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield said
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _write_plain(folder: Path) -> None:
    """plain.onnx: model.onnx with the logits as its only output, without the nodes that only
    other points needed; it reads the same weights file."""
    import onnx  # onnx: an optional runtime

    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    graph = model.graph
    kept_outputs = [output for output in graph.output if output.name == LOGITS]
    needed, nodes = {LOGITS}, []
    for node in reversed(graph.node):  # nodes are in topological order: walk back from the logits
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed.update(node.input)
    del graph.output[:]
    graph.output.extend(kept_outputs)
    del graph.node[:]
    graph.node.extend(reversed(nodes))
    onnx.save(model, str(folder / PLAIN_FILE))


# ----------------------------------------------------------------------------- loading


def load(source: ModelSource, variant: dict, *, argument: str | None = None, device: torch.device | str = "cpu",
         stream: bool = False) -> ONNXEngine:
    """ORT on tracer's export of the model directory, exported on first use."""
    if source.loaded:
        raise TracerError("the onnx engine exports the model directory itself; pass a path, not a loaded model")
    dtype = setting(variant, "dtype")
    if dtype not in DTYPES:
        raise TracerError(f"the onnx engine runs dtype {' | '.join(DTYPES)}, not {dtype} "
                          "(ONNX Runtime's CPU provider has no kernels for the rest of this graph)")
    spec = read_hf(source.config())  # a config transformers would refuse is one line, before exporting
    return ONNXEngine(exported(source.directory, dtype), variant, source.name, spec)
