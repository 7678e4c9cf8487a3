"""What a run measures on the reference side besides its trace, kept between runs: the f64 noise
floor, the reference's greedy continuation and a decode's step floors.

All depend only on the model, the tokens and the reference (not on the candidate), yet cost more
than the reference's own forward (an f64 forward; a decode of 20 steps, each reading every
weight; an uncached and an f64 forward over a decode's tokens). A porting session runs the same
model and prompt again and again with another candidate or variant: from the second run they are
read from `<cache>/reference/` instead.

An entry is keyed by everything its measurement depends on: the model folder's files as they are on
disk (size, mtime, ctime, inode of each: any write moves ctime), the token ids (a cheap floor's: the
first rows it ran, so that a prompt starting with them shares it; `tracer.pipeline.run.floor_keys`),
the reference engine, its variant and placement, what was measured (the floor's exact values, its
cheap ones, or the greedy continuation of so many steps), the versions of torch and transformers,
and tracer's own source files (their contents: an edited tracer measures again, another checkout
of the same code does not). An entry that cannot be read is measured again; one that cannot be
written is not kept (a read-only cache costs time, never a wrong answer). A store removes (at most
once a minute in a process that stores again and again) the entries that can never be read again,
their model folder gone (a temporary one, a deleted download) or its files written since, and those
no run has read for UNUSED_DAYS (an edited tracer's are never read again; another version sharing
the cache keeps its own by using them).
No torch here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

from tracer.core.versions import installed_version
from tracer.files.convert import UNUSED_DAYS, cache_root
from tracer.files.hashes import code_digest, stats

FORMAT = 2  # an entry is three lines of JSON: its model folder and files (what `prune` reads), its key, its values
# A prune reads every entry's first line (about 30 ms with 1,000 entries): a process that stores again and again
# (a notebook, a sweep, the suite's workers) prunes at most this often; a `tracer` command stores once.
PRUNE_EVERY_S = 60.0
_pruned: dict[Path, float] = {}  # folder -> when this process last pruned it (time.monotonic)
# tracer's own code, whose edits change what it measures: the package and the hf engine's
# `tracer.hooks` (a folder of its own in a source checkout, inside the package in a wheel).
_SOURCES = ("tracer", "tracer.hooks")


def folder_state(folder: Path) -> dict[str, list[int]]:
    """name -> [size, mtime_ns, ctime_ns, inode] of every file directly in `folder`."""
    return stats(folder, sorted(p.name for p in folder.iterdir() if p.is_file()))


@functools.cache
def tracer_code() -> str:
    """The digest of tracer's own source files as this process found them (what it runs is what it
    imported)."""
    return code_digest([(name, Path(location)) for name in _SOURCES
                        for location in importlib.util.find_spec(name).submodule_search_locations])


def entry_key(model_dir: Path, tokens: list[int], **context) -> dict:
    """The key of one reference's measurements: the model's files, the tokens and `context`
    (engine, variant, placement, what was asked for), with the versions that shape the numbers."""
    return {"format": FORMAT, "model": str(model_dir.resolve()), "files": folder_state(model_dir),
            "tokens": list(tokens), "context": context,
            "versions": {name: installed_version(name) for name in ("torch", "transformers")}, "tracer": tracer_code()}


def entry_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return cache_root() / "reference" / f"{digest[:40]}.json"


def load(key: dict) -> dict | None:
    """The measurements stored under `key`, or None (none stored, or unreadable)."""
    path = entry_path(key)
    try:
        _, stored, measured = path.read_text().split("\n")[:3]
        stored, measured = json.loads(stored), json.loads(measured)
    except (OSError, ValueError):
        return None
    if stored != json.loads(json.dumps(key, default=str)):
        return None  # a digest collision or a garbled file: measure again
    try:
        os.utime(path)  # used: its modification time is when a run last read it
    except OSError:
        pass  # a read-only cache
    return measured


def store(*entries: tuple[dict, dict]) -> None:
    """Keep each (key, measured: JSON values) entry, atomically, then prune the folder (at most once in
    PRUNE_EVERY_S per process); a cache that cannot be written keeps nothing."""
    folder = None
    for key, measured in entries:
        path = entry_path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        lines = [{"model": key["model"], "files": key["files"]}, key, measured]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text("\n".join(json.dumps(line, default=str) for line in lines))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        folder = path.parent
    if folder is not None and time.monotonic() - _pruned.get(folder, -PRUNE_EVERY_S) >= PRUNE_EVERY_S:
        _pruned[folder] = time.monotonic()
        prune(folder)


def prune(folder: Path) -> list[Path]:
    """Remove the entries in `folder` that no run will read: unused for UNUSED_DAYS, written in an earlier
    FORMAT, or whose model folder is gone or has been written since their measurement; the removed
    paths. An entry another run is writing or removing at the same time is skipped."""
    states: dict[str, dict | None] = {}  # model folder -> its files now (None: gone), looked at once
    oldest = time.time() - UNUSED_DAYS * 86400
    removed = []
    for path in folder.glob("*.json"):
        try:
            if path.stat().st_mtime < oldest:
                stale = True
            else:
                with path.open() as opened:
                    header = json.loads(opened.readline())  # the model folder and its files, not the whole entry
                model = header.get("model") if isinstance(header, dict) else None
                if model is None:
                    stale = "key" in header  # FORMAT 1's one line: no run reads it any more
                else:
                    if model not in states:
                        states[model] = folder_state(Path(model)) if Path(model).is_dir() else None
                    stale = states[model] != header.get("files")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: `load` measures again and `store` replaces it
        if stale:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
