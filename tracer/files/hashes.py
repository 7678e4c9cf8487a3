"""Cache entries that check themselves: content hashes written when an entry is completed, checked
on every use, so a damaged entry (a weights file changed in place, a file gone, a garbled
manifest) is rebuilt or refused, never used.

An entry is a folder that `tracer.files.convert.cached_build` filled and renamed into place (a GGUF
conversion, an ONNX export). `seal` writes its completion record: for every file, its size and
SHA-256, and the file's stat (size, mtime, ctime, inode). `damage` compares: where the stat is
unchanged the file was not written since (a write moves ctime, which no user call can set back),
so the common case costs one `stat` per file; where the stat moved (a copy of the cache, a write),
the file is hashed again (SmolLM2's 538 MB weights: about 1.2 s here), and an unchanged hash
refreshes the recorded stat. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

RECORD_VERSION = 1
MEMOS = "sources"  # content_hashes' memos, one per folder, under a cache's root


def seal(folder: Path, marker: str) -> None:
    """Write `folder/marker`: the completion record with every file's size, hash and stat."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != marker):
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": file_hash(path)}
    record = {"completed": time.time(), "version": RECORD_VERSION, "files": files, "stat": stats(folder, files)}
    _write_record(folder / marker, record)


def damage(folder: Path, marker: str) -> str | None:
    """What is wrong with a completed entry (one phrase), or None when every file is as sealed.

    An entry completed before records carried hashes is sealed now, as it is (it was trusted
    before; from now on it is checked)."""
    try:
        record = json.loads((folder / marker).read_text())
    except (OSError, ValueError):
        return f"its completion record {marker} is unreadable"
    if not isinstance(record, dict):
        return f"its completion record {marker} is garbled"
    files = record.get("files")
    if files is None:
        seal(folder, marker)
        return None
    if not isinstance(files, dict) or not isinstance(record.get("stat"), dict):
        return f"its completion record {marker} is garbled"
    now = stats(folder, files)
    for name, expected in files.items():
        if name not in now:
            return f"{name} is missing"
        if now[name] == record["stat"].get(name):
            continue
        if not isinstance(expected, dict) or now[name][0] != expected.get("size"):
            return f"{name} changed size since it was built"
        if file_hash(folder / name) != expected.get("sha256"):
            return f"{name} changed since it was built (its SHA-256 differs)"
    if now != record["stat"]:  # same contents, new stats (a copied cache): hash once, not on every use
        try:
            _write_record(folder / marker, {**record, "stat": now})
        except OSError:
            pass  # a read-only cache is checked by hash each time: slower, still correct
    return None


def stats(folder: Path, names) -> dict[str, list[int]]:
    """name -> [size, mtime_ns, ctime_ns, inode] for the names that exist."""
    found = {}
    for name in names:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        found[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return found


def file_hash(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def content_hashes(folder: Path, names: list[str], cache: Path) -> dict[str, str]:
    """name -> SHA-256 of each named file in `folder`, hashed again only where its stat (size, mtime,
    ctime, inode) moved since the folder's memo under `cache/sources/` recorded it, so that the
    common case costs one `stat` per file. A cache keyed by these serves a copy of the same files
    (another folder, a new download) as it serves the original. A memo that cannot be read or
    written costs the hashing, never a wrong hash; writing one removes the memos of folders that
    are gone (a temporary folder's)."""
    where = str(folder.resolve())
    memo = cache / MEMOS / f"{hashlib.sha256(where.encode()).hexdigest()[:24]}.json"
    try:
        known = json.loads(memo.read_text())
        files = known["files"] if known["folder"] == where and isinstance(known["files"], dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        files = {}
    now = stats(folder, names)
    hashes, hashed = {}, False
    for name in names:
        seen = files.get(name)
        if isinstance(seen, dict) and seen.get("stat") == now.get(name) and isinstance(seen.get("sha256"), str):
            hashes[name] = seen["sha256"]
        else:
            hashes[name] = file_hash(folder / name)  # stat taken first: a write during hashing moves it again
            files[name], hashed = {"stat": now.get(name), "sha256": hashes[name]}, True
    if hashed:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            _write_record(memo, {"folder": where, "files": files})
            _prune_memos(memo.parent)
        except OSError:
            pass
    return hashes


def model_contents(folder: Path, cache: Path) -> list[tuple[str, str]]:
    """(name, SHA-256) of a model folder's `config.json` and safetensors files, by name: what an export
    or a conversion made from the folder is keyed by (`content_hashes`, under `cache`)."""
    names = sorted(p.name for p in folder.iterdir()
                   if p.is_file() and (p.name == "config.json" or p.suffix == ".safetensors"))
    return sorted(content_hashes(folder, names, cache).items())


def _prune_memos(folder: Path) -> None:
    for memo in folder.glob("*.json"):
        try:
            if not Path(json.loads(memo.read_text())["folder"]).is_dir():
                memo.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue


def code_digest(packages: list[tuple[str, Path]]) -> str:
    """sha256 of each (package name, folder)'s .py files: their names within the package and their
    contents, not where they lie, so that another checkout or install of the same code gives the
    same digest (0.02 s for tracer's 2.5 MB)."""
    digest = hashlib.sha256()
    for name, folder in packages:
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(folder).as_posix()}\0{file_hash(path)}".encode())
    return digest.hexdigest()


def _write_record(path: Path, record: dict) -> None:
    """Atomically: a reader sees the old record or the new one, never half of one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
