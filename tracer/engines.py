"""Engines: what produces a `Trace` from token ids.

- `hf`: the real transformers model, observed (`tracer.hooks`).
- `reimpl`: our instrumented Llama (`tracer.llama`); no transformers import.
- `file:PATH`: a trace saved earlier, here or by another runtime.

Each engine has `name`, `variant`, `device` (where its model runs), `vocab_size`, `max_positions`,
`record(tokens) -> Trace` and `logits(tokens) -> (T, V) tensor or None` (an unrecorded forward,
used for greedy decoding).
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

import torch

from tracer.errors import TracerError
from tracer.llama import Llama
from tracer.points import LAYER_POINTS, layer_point
from tracer.trace import Trace, TraceRecorder
from tracer.variants import check_engine

ENGINES = ("hf", "reimpl", "file:PATH")
DEVICES = ("cpu", "cuda", "mps")


def environment() -> dict:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("torch", "transformers", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def check_device(device: str | torch.device) -> torch.device:
    """A device this torch can run the model on; anything else is the user's error, in one line."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in DEVICES:
        raise TracerError(f"unknown device {str(device)!r}; devices: {', '.join(DEVICES)} (cuda:N for one GPU of several)")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise TracerError(f"device {device}: torch {torch.__version__} sees no CUDA GPU here")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise TracerError(f"device {device}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0..)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise TracerError(f"device {device}: torch {torch.__version__} sees no Apple GPU here")
    return parsed


def trace_meta(engine, model: str, tokens: list[int], dtype: torch.dtype, not_recorded: dict, **extra) -> dict:
    """The metadata every engine writes into its traces."""
    return {
        "engine": engine.name,
        "variant": dict(engine.variant),
        "model": model,
        "tokens": list(tokens),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(engine.device),
        "versions": environment(),
        "not_recorded": not_recorded,
        **extra,
    }


def per_layer(num_layers: int, reasons: dict[str, str]) -> dict[str, str]:
    """Expand {"self_attn.scores": reason} to every layer's point, in execution order."""
    return {
        layer_point(i, sub): reasons[sub] for i in range(num_layers) for sub in LAYER_POINTS if sub in reasons
    }


def is_loaded_model(source) -> bool:
    return hasattr(source, "state_dict") and hasattr(source, "config")


class ReimplEngine:
    name = "reimpl"

    def __init__(self, llama: Llama, model: str):
        self.llama, self.model, self.variant = llama, model, llama.variant

    @property
    def device(self) -> torch.device:
        return self.llama.device

    @classmethod
    def load(cls, source, variant: dict, device: str | torch.device = "cpu", stream: bool = False) -> ReimplEngine:
        """`stream`: read each block's weights from the memory-mapped files when it runs (one block in memory)."""
        from tracer.model import resolve_model

        check_engine(variant, cls.name)
        placement = {"device": check_device(device), "stream": stream}
        if is_loaded_model(source):
            # An already loaded transformers model: its config and weights, read our own way.
            config = source.config.to_dict()
            llama = Llama.from_config(config, dict(source.state_dict()), variant, **placement)
            return cls(llama, config.get("_name_or_path", "loaded model"))
        model_dir = resolve_model(source)
        return cls(Llama.from_dir(model_dir, variant, **placement), str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.llama.spec.vocab_size

    @property
    def max_positions(self) -> int:
        return self.llama.spec.max_position_embeddings

    def record(self, tokens: list[int], recorder=None) -> Trace:
        """Every point of one forward; `recorder` (default in memory) may spill to disk instead."""
        recorder = recorder if recorder is not None else TraceRecorder()
        self.llama.forward(torch.tensor(tokens), recorder)
        spec = self.llama.spec
        not_recorded = per_layer(spec.num_hidden_layers, self.llama.strategies.not_recorded())
        meta = trace_meta(self, self.model, tokens, self.llama.strategies.dtype, not_recorded,
                          num_layers=spec.num_hidden_layers, unused_config_keys=list(spec.unused_keys),
                          unused_tensors=self.llama.unused_tensors)
        return Trace(recorder.tensors, meta)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.llama.forward(torch.tensor(tokens))


class FileEngine:
    """A saved trace standing in for an engine: it can be compared, not run again."""

    name = "file"
    device = "cpu"

    def __init__(self, path: str | Path, aliases=None):
        self.path = Path(path)
        self.trace = Trace.load(self.path, aliases)  # another runtime's dump: names mapped onto points
        self.variant = self.trace.meta.get("variant", {})
        self.vocab_size = self.max_positions = None

    def record(self, tokens: list[int], recorder=None) -> Trace:
        """The saved trace itself (it is already on disk or in memory; `recorder` has nothing to do)."""
        recorded = self.trace.tokens
        if recorded is not None and list(recorded) != list(tokens):
            raise TracerError(f"trace {self.path} was recorded on tokens {recorded}, not {list(tokens)}")
        return self.trace

    def logits(self, tokens: list[int]) -> None:
        return None


def check_engine_name(name: str) -> None:
    """Refuse an unknown engine before any model loads."""
    if name not in ("hf", "reimpl") and not name.startswith("file:"):
        raise TracerError(f"unknown engine {name!r}; engines: {', '.join(ENGINES)}")


def load_engine(name: str, source, variant: dict, *, device: str | torch.device = "cpu", stream: bool = False):
    """`hf`, `reimpl` or `file:PATH` -> an engine ready to record, its model on `device`.

    `stream` (reimpl only) keeps one block's weights in memory at a time; the hf engine loads the
    whole model (for checkpoints larger than memory, see transformers' `device_map` offloading).
    """
    check_engine_name(name)
    if name == "reimpl":
        return ReimplEngine.load(source, variant, device, stream)
    if name == "hf":
        from tracer.hooks import HFEngine

        return HFEngine.load(source, variant, device)
    if name.startswith("file:"):
        if variant:
            raise TracerError("a saved trace (file:PATH) cannot take variant knobs")
        return FileEngine(name.removeprefix("file:"))
