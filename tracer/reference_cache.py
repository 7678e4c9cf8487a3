"""What a run measures on the reference side besides its trace, kept between runs: the f64 noise
floor and the reference's greedy continuation.

Both depend only on the model, the tokens and the reference (not on the candidate), yet cost more
than the reference's own forward (an f64 forward; a decode of 20 steps, each reading every
weight). A porting session runs the same model and prompt again and again with another candidate
or variant: from the second run they are read from `<cache>/reference/` instead.

An entry is keyed by everything the measurements depend on: the model folder's files as they are
on disk (size, mtime, ctime, inode of each: any write moves ctime), the token ids, the reference
engine, its variant and placement, whether a noise floor and how many greedy steps were asked
for, the versions of torch and transformers, and tracer's own source files (their stats: an
edited tracer measures again). An entry that cannot be read is measured again; one that cannot
be written is not kept (a read-only cache costs time, never a wrong answer). No torch here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from tracer.cache import stats

FORMAT = 1
# tracer's own code, whose edits change what it measures: the package and the hf engine's
# `tracer.hooks` (a folder of its own in a source checkout, inside the package in a wheel).
_SOURCES = ("tracer", "tracer.hooks")


def folder_state(folder: Path) -> dict[str, list[int]]:
    """name -> [size, mtime_ns, ctime_ns, inode] of every file directly in `folder`."""
    return stats(folder, sorted(p.name for p in folder.iterdir() if p.is_file()))


def entry_key(model_dir: Path, tokens: list[int], **context) -> dict:
    """The key of one reference's measurements: the model's files, the tokens and `context`
    (engine, variant, placement, what was asked for), with the versions that shape the numbers."""
    from tracer.convert import package_version

    folders = {Path(location).resolve() for name in _SOURCES
               for location in importlib.util.find_spec(name).submodule_search_locations}
    code = {str(path): [path.stat().st_size, path.stat().st_mtime_ns]
            for folder in sorted(folders) for path in sorted(folder.rglob("*.py"))}
    return {"format": FORMAT, "model": str(model_dir.resolve()), "files": folder_state(model_dir),
            "tokens": list(tokens), "context": context,
            "versions": {name: package_version(name) for name in ("torch", "transformers")}, "tracer": code}


def entry_path(key: dict) -> Path:
    from tracer.convert import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "reference" / f"{digest[:40]}.json"


def load(key: dict) -> dict | None:
    """The measurements stored under `key`, or None (none stored, or unreadable)."""
    try:
        entry = json.loads(entry_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key, default=str)):
        return None  # a digest collision or a garbled file: measure again
    return entry.get("measured")


def store(key: dict, measured: dict) -> None:
    """Keep `measured` (JSON values) under `key`, atomically; a cache that cannot be written keeps nothing."""
    path = entry_path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "measured": measured}, default=str))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
