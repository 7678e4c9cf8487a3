"""transformers' model with its weights read block by block from the checkpoint (`hf --stream`).

The model is built with its parameters on the meta device (no memory) and its buffers real (the
RoPE tables); each unit of the forward, the embedding, every decoder layer, the final norm and
the lm_head, gets its weights in a forward pre-hook, read from the (sharded) safetensors files in
their stored dtype and converted to the run's, and gives them back in a forward hook. transformers'
own `forward` runs unchanged (its masks, rotary embeddings, caches), and so do tracer's recording
hooks: the points are those of the model loaded whole, bit for bit, the logits to a few f32 ulps
(`_VocabChunks`; tests/unit/test_streamed_hf.py).
Memory then holds one unit's weights at a time, independent of depth (the largest unit is the
lm_head: vocabulary × hidden in the run's dtype), at the price of reading the weights once per
forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tracer.core.errors import TracerError
from tracer.files.weights import WeightFiles


def empty_model(architecture, config, dtype: torch.dtype, attention: str):
    """The family's model with every parameter on the meta device and its buffers real."""
    from accelerate import init_empty_weights  # accelerate: loaded when a model streams

    with init_empty_weights(include_buffers=False):
        model = architecture._from_config(config, dtype=dtype, attn_implementation=attention,
                                          experts_implementation="eager")
    return model.eval()


def stream_weights(model: nn.Module, model_dir, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Give `model` (built by `empty_model`) hooks that bring each unit's weights in from
    `model_dir` when it runs and drop them after; checks the files first (names and shapes)."""
    files = WeightFiles(model_dir)
    shapes = files.shapes()
    sources = _sources(model, shapes)
    unused = sorted(set(shapes) - set(sources.values()))
    model.tracer_unused_tensors = [name for name in unused if not name.endswith("rotary_emb.inv_freq")]
    model.tracer_weight_files = files  # shared with the runs a lockstep run steps beside it (`WeightFiles.holding`)
    device = torch.device(device)
    for module in model.modules():  # the buffers (RoPE tables) live where the weights come in
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    for prefix, unit in _units(model):
        names = {name: sources[_join(prefix, name)] for name, _ in unit.named_parameters()}
        if unit is embedding and isinstance(unit, nn.Embedding) and list(names) == ["weight"]:
            rows = _EmbeddingRows(unit, files, names["weight"], dtype, device)
            unit.register_forward_pre_hook(rows.bring_in)
            unit.register_forward_hook(rows.give_back)
        elif unit is output and type(unit) is nn.Linear and list(names) == ["weight"]:
            unit.forward = _VocabChunks(files, names["weight"], dtype, device)
        else:
            loader = _UnitWeights(unit, names, files, dtype, device)
            unit.register_forward_pre_hook(loader.bring_in)
            unit.register_forward_hook(loader.give_back)


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold weights, each brought in whole: a decoder layer, or a module outside
    the layers that owns parameters itself (embedding, final norm, lm_head)."""
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, nn.ModuleList) and name.endswith("layers")}
    units, inside = [], set()
    for name, module_list in layers.items():
        for index, layer in enumerate(module_list):
            units.append((f"{name}.{index}", layer))
            inside.update(id(m) for m in layer.modules())
    for name, module in model.named_modules():
        if id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
            units.append((name, module))
    return units


def _sources(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """parameter name -> the tensor of the files that holds it (a tied lm_head reads the embedding)."""
    tied = {}
    if getattr(model.config, "tie_word_embeddings", False):
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        names = {id(m): n for n, m in model.named_modules()}
        tied[_join(names[id(output)], "weight")] = _join(names[id(embedding)], "weight")
    sources = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        source = name if name in shapes else tied.get(name)
        if source is None:
            raise TracerError(f"missing tensor {name} (expected shape {tuple(parameter.shape)})")
        if tuple(shapes[source]) != tuple(parameter.shape):
            raise TracerError(f"shape mismatch, {name}: file {tuple(shapes[source])}, "
                              f"model {tuple(parameter.shape)}")
        sources[name] = source
    return sources


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _UnitWeights:
    """One unit's parameters: read and converted before it runs, back on the meta device after."""

    def __init__(self, unit: nn.Module, names: dict[str, str], files: WeightFiles, dtype: torch.dtype,
                 device: torch.device):
        self.unit, self.names, self.files, self.dtype, self.device = unit, names, files, dtype, device

    def bring_in(self, module, args) -> None:
        for name, source in self.names.items():
            _set(self.unit, name, self.files.converted(source, self.dtype, self.device))

    def give_back(self, module, args, output) -> None:
        for name in self.names:
            held = _get(self.unit, name)
            _set(self.unit, name, torch.empty(held.shape, dtype=held.dtype, device="meta"))


def _owner(unit: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (unit.get_submodule(path) if path else unit), leaf


def _get(unit: nn.Module, name: str) -> torch.Tensor:
    owner, leaf = _owner(unit, name)
    return getattr(owner, leaf)


def _set(unit: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, leaf = _owner(unit, name)
    owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)



class _EmbeddingRows:
    """The embedding's pre-hook: a table of only the rows the tokens use, the ids renumbered into it,
    so that the module's own forward (Gemma's scale included) gathers the same values from it; the
    table is dropped after (one row per distinct token, not the vocabulary, in the run's dtype)."""

    def __init__(self, unit: nn.Embedding, files: WeightFiles, source: str, dtype: torch.dtype, device: torch.device):
        self.unit, self.files, self.source, self.dtype, self.device = unit, files, source, dtype, device

    def bring_in(self, module, args):
        ids, *rest = args
        rows, renumbered = torch.unique(ids, return_inverse=True)  # (R,), ids' shape
        with self.files.mapped(self.source) as stored:
            table = stored[rows.cpu()].to(dtype=self.dtype, device=self.device)  # (R, C)
        self.shape, self.padding_idx = self.unit.weight.shape, self.unit.padding_idx
        _set(self.unit, "weight", table)
        self.unit.padding_idx = None  # it only masks gradients; its row index means nothing in the table
        return (renumbered, *rest)

    def give_back(self, module, args, output):
        _set(self.unit, "weight", torch.empty(self.shape, dtype=self.dtype, device="meta"))
        self.unit.padding_idx = self.padding_idx


class _VocabChunks:
    """lm_head's forward, its rows converted `VOCAB_ROWS` at a time (`WeightFiles.row_chunks`): x (…, C)
    -> (…, V). The same sums per output column as the whole weight's, in the order BLAS picks for each
    chunk's shape: bitwise at the default chunk at SmolLM2's, the 1B's and the 8B's shapes where
    measured, else a few f32 ulps of a position's largest logit (docs/memory.md)."""

    def __init__(self, files: WeightFiles, source: str, dtype: torch.dtype, device: torch.device):
        self.files, self.source, self.dtype, self.device = files, source, dtype, device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, rows) for rows in self.files.row_chunks(self.source, self.dtype, self.device)],
                         dim=-1)  # (…, V)
