"""Building cached model directories once, and the GGUF conversion that is built that way.

``cached_build`` runs a build at most once per target, across threads and processes (an flock),
in a temporary sibling renamed into place when complete. Each use of an entry touches its lock file,
and each new build removes the entries beside it that no run has used for UNUSED_DAYS (an export or
a conversion made by an earlier version, or of a model long deleted, is never used again).
``convert_gguf`` is the build that dequantizes a GGUF into f32 safetensors, ``tokenizer.json`` and a
``config.json``. A Llama's config is written transformers-4-style with top-level ``rope_theta``, the
file candle and our own reader expect; another family transformers can load from GGUF (Qwen2, Qwen3,
Mistral, Gemma 2, Gemma 3, Phi-3: ``tracer.model.families``) gets the config its loaded transformers
config saves.

Only the conversion imports transformers; reading weights (``tracer.files.weights``) and tokenizing
(``tracer.files.tokenizer``) use ``safetensors`` and ``tokenizers`` directly, so the reimplementation
engine never pays for (or depends on) transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tracer.core.errors import TracerError, one_line
from tracer.core.versions import installed_version
from tracer.files import hashes as cache
from tracer.files.tokenizer import TOKENIZER_FILE
from tracer.files.weights import WEIGHTS_FILE
from tracer.model.families import family_of, model_types
from tracer.model.points import LOGITS, WEIGHT

__all__ = ["cache_root", "cached_build", "convert_gguf", "is_complete"]

# Written last inside the temporary build directory, so its presence means "complete".
COMPLETE_MARKER = ".tracer-complete"

CONFIG_FILE = "config.json"

# A cache entry (a build here, a reference measurement) no run has used for this long is removed the next time
# one beside it is made: another version sharing the cache keeps the entries it uses.
UNUSED_DAYS = 30

_STAGES = ("load + dequantize", "write weights", "write tokenizer", "write config")

# Serialises the (rare) concurrent conversions inside one process: silencing transformers and
# parsing the GGUF once swap module attributes, which two threads must not save and restore
# interleaved. Reentrant: a conversion holds it around both swaps, one inside the other.
_SWAP_LOCK = threading.RLock()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder holding converted models: ``cache_dir``, else ``$TRACER_CACHE``, else ``~/.cache/tracer``."""
    chosen = cache_dir or os.environ.get("TRACER_CACHE") or "~/.cache/tracer"
    return Path(chosen).expanduser()


def is_complete(target: Path) -> bool:
    """Completed and intact: every file as it was when the entry was sealed (`tracer.files.hashes`)."""
    return (target / COMPLETE_MARKER).is_file() and cache.damage(target, COMPLETE_MARKER) is None


def cached_build(target: Path, build: Callable[[Path], None], progress: bool = True) -> Path:
    """Run ``build(tmp_dir)`` at most once per ``target``, across threads and processes.

    The build writes into a temporary sibling that is renamed into place only when complete,
    so an interrupted run never leaves a directory that later runs would trust. A new entry then
    removes those beside it unused for UNUSED_DAYS (`prune_unused`).
    """
    if is_complete(target):
        _mark_used(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(_lock_file(target), target, progress):
        # Whoever held the lock before us may have finished the job while we waited.
        if is_complete(target):
            _mark_used(target)
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
            # BaseException too: Ctrl-C during the ~10 s conversion must not leave a temp dir.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _mark_used(target)
    prune_unused(target.parent)
    return target


def _lock_file(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _mark_used(target: Path) -> None:
    """The entry's lock file's mtime is when a run last used it (what `prune_unused` reads)."""
    try:
        os.utime(_lock_file(target))
    except OSError:  # a read-only cache: its entries are never pruned by this process either
        pass


def prune_unused(folder: Path) -> list[Path]:
    """Remove the complete entries in `folder` whose lock file says no run has used them for UNUSED_DAYS;
    the removed paths. An entry another process holds (building it, or removing it) is skipped, and the
    lock files stay (removing one would let two processes lock different files for the same entry)."""
    oldest = time.time() - UNUSED_DAYS * 86400
    removed = []
    for lock in folder.glob(".*.lock"):
        entry = folder / lock.name[1:-len(".lock")]
        try:
            if lock.stat().st_mtime >= oldest or not (entry / COMPLETE_MARKER).is_file():
                continue
            with open(lock, "a+") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                if lock.stat().st_mtime >= oldest:  # used while this process looked
                    continue
                # out of the way first (a name `_remove_leftovers` cleans if this process dies), then removed
                doomed = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=folder))
                os.replace(entry, doomed / entry.name)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(entry)
        except OSError:  # a read-only cache, or another process removed it first
            continue
    return removed


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


def convert_gguf(
    gguf: Path, out: Path, *, source: dict[str, Any], progress: bool, expected: str | None
) -> None:
    """Dequantize a GGUF into ``out``: f32 safetensors, tokenizer, config (transformers-4 style for Llama)."""
    # Plain tqdm, not tqdm.auto: the notebook widget needs ipywidgets, which we do not require.
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
    with bar, _gguf_parsed_once():
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
    import torch  # torch: the CLI checks its arguments without it
    from transformers import AutoModelForCausalLM  # transformers: 0.5 s, when a model loads

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
    if model.config.model_type not in model_types():
        raise TracerError(
            f"GGUF file {gguf} holds a {model.config.model_type!r} model; tracer traces: {', '.join(model_types())}"
        )
    # A tensor the file lacks would be silently random-initialised by transformers.
    missing = set(info.get("missing_keys", ()))
    if model.config.tie_word_embeddings:
        missing.discard(LOGITS + WEIGHT)
    if missing:
        names = ", ".join(sorted(missing)[:3]) + (" ..." if len(missing) > 3 else "")
        raise TracerError(f"GGUF file {gguf} lacks {len(missing)} tensor(s): {names}")
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' progress bars (ours says what is happening); keep its warnings."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # transformers: 0.5 s, when a model loads
    from transformers.utils import logging as hf_logging  # transformers: 0.5 s, when a model loads

    with _SWAP_LOCK:
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


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """One conversion, one parse: transformers reads the GGUF anew for the config, the weights and
    the tokenizer (3.5 s each for SmolLM2's 49k-entry vocabulary) and rebuilds gguf's tensor-name
    map at every level of its module walk (6 s in all). Within the block a file is parsed once and
    a map built once per architecture and depth; both are read-only to their callers, so the
    converted files are byte for byte what they were (tests/unit/test_convert.py).

    The parse reads the file through plain numpy views of its memory map (`_plain_views`): a slice
    of a `numpy.memmap` runs Python code, and the parse takes 3.7 million of them for SmolLM2's
    vocabulary (2.1 s; 0.7 s as plain views of the same bytes)."""
    import gguf  # gguf-py: 0.1 s, for GGUF files only

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def parsed_once(path, mode: str = "r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = _plain_views(reader)(path, mode)
        return readers[key]

    with _SWAP_LOCK:  # the gguf package's names are process-wide
        gguf.GGUFReader, gguf.get_tensor_name_map = parsed_once, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@functools.cache
def _plain_views(reader: type) -> type:
    """`reader` (gguf's GGUFReader) whose `data`, the file's memory map, is a plain ndarray over the
    same mapping: every field and tensor it slices from it is then a plain view too (a `reader`
    that is not a class, one wrapped by a caller, is used as it is)."""
    import numpy as np  # numpy: with gguf-py, for GGUF files only

    if not isinstance(reader, type):
        return reader

    class PlainViews(reader):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, value):
            self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViews


def _write_weights(model, out: Path) -> None:
    import torch  # torch: the CLI checks its arguments without it
    from safetensors.torch import save_file  # torch: the CLI checks its arguments without it

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        # Tied: lm_head shares storage with embed_tokens, which safetensors refuses to save
        # twice; HF and our reader re-tie it from the config.
        state.pop(LOGITS + WEIGHT, None)
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def _write_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer  # transformers: 0.5 s, when a model loads

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
    its transformers config saves itself (what `tracer.model.config.read_hf` reads for that family)."""
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
    data = {key: value for key, value in config.to_diff_dict().items() if key not in _NOT_SAVED}
    data["architectures"] = [family_of(config.model_type).architecture]
    for key in ("rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if isinstance(data.get(key), float):
            data[key] = _f32_shortest(data[key])
    data["rope_parameters"] = _shortest_floats(data.get("rope_parameters"))
    return {**data, "torch_dtype": "float32",
            "tracer_source": {**source, "transformers_version": installed_version("transformers")}}


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
            "transformers_version": installed_version("transformers"),
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
