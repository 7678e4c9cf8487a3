"""Cache entries check themselves (`tracer.files.hashes`): a file changed in place (even with its mtime
put back), a file gone, a garbled record: the entry is rebuilt, saying so, never used. On the
real entries: a GGUF conversion and an ONNX export whose weights were changed in place."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tracer.core.errors import TracerError
from tracer.files import convert, sources
from tracer.files import hashes as cache

MARKER = convert.COMPLETE_MARKER


def sealed(folder):
    folder.mkdir()
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (folder / "sub").mkdir()
    (folder / "sub" / "export.json").write_text('{"dtype": "f32"}\n')
    cache.seal(folder, MARKER)
    return folder


def flip_in_place(path, offset=100):
    """One byte changed, size kept and the mtime put back: what `touch -r` would hide."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    with open(path, "r+b") as handle:
        handle.write(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_intact_entry_passes_on_its_stats_alone(tmp_path, monkeypatch):
    entry = sealed(tmp_path / "e")
    monkeypatch.setattr(cache, "file_hash", lambda path: pytest.fail("hashed an unchanged file"))
    assert cache.damage(entry, MARKER) is None


@pytest.mark.parametrize("damage, said", [
    (lambda e: flip_in_place(e / "weights.bin"), "weights.bin changed since it was built (its SHA-256 differs)"),
    (lambda e: (e / "sub" / "export.json").unlink(), "sub/export.json is missing"),
    (lambda e: (e / "sub" / "export.json").write_text("{garbled"), "sub/export.json changed size"),
    (lambda e: (e / MARKER).write_text("{not json"), "completion record .tracer-complete is unreadable"),
    (lambda e: (e / MARKER).write_text('{"files": 3, "stat": {}}'), "is garbled"),
])
def test_damage_is_found_and_named(tmp_path, damage, said):
    entry = sealed(tmp_path / "e")
    damage(entry)
    assert said in cache.damage(entry, MARKER)


def test_a_copied_entry_is_hashed_once_then_trusted_on_its_new_stats(tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(sealed(tmp_path / "e"), copy)  # new inodes and ctimes, same contents
    assert cache.damage(copy, MARKER) is None
    monkeypatch.setattr(cache, "file_hash", lambda path: pytest.fail("hashed again"))
    assert cache.damage(copy, MARKER) is None


def test_an_entry_from_before_hashes_is_sealed_as_it_is(tmp_path):
    entry = tmp_path / "old"
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    (entry / MARKER).write_text(json.dumps({"completed": 1.0}))
    assert cache.damage(entry, MARKER) is None
    assert "config.json" in json.loads((entry / MARKER).read_text())["files"]
    (entry / "config.json").write_text('{"changed": 1}')
    assert "config.json" in cache.damage(entry, MARKER)


def test_cached_build_rebuilds_a_damaged_entry_and_says_so(tmp_path, capsys):
    builds = []

    def build(out):
        builds.append(out)
        (out / "weights.bin").write_bytes(b"\x01" * 4096)

    target = tmp_path / "cache" / "entry"
    convert.cached_build(target, build, progress=False)
    flip_in_place(target / "weights.bin")
    assert convert.cached_build(target, build, progress=False) == target
    assert len(builds) == 2 and (target / "weights.bin").read_bytes() == b"\x01" * 4096
    err = capsys.readouterr().err
    assert f"the cache entry {target} is damaged (weights.bin changed since it was built" in err and "rebuilding" in err
    assert convert.cached_build(target, build, progress=False) == target and len(builds) == 2  # intact now: used


def test_a_new_entry_removes_those_beside_it_unused_for_thirty_days_and_no_other(tmp_path):
    import fcntl
    import time

    def build(out):
        (out / "weights.bin").write_bytes(b"\x02" * 4096)

    folder = tmp_path / "cache"
    entries = {name: convert.cached_build(folder / name, build, progress=False)
               for name in ("unused", "used", "building", "recent")}
    (folder / "not-an-entry").mkdir()  # a folder of another kind (the reference cache's) beside them
    (folder / ".not-an-entry.lock").touch()
    days_ago = time.time() - (convert.UNUSED_DAYS + 1) * 86400
    for name in ("unused", "used", "building", "not-an-entry"):
        os.utime(folder / f".{name}.lock", (days_ago, days_ago))
    os.utime(folder / ".recent.lock", (days_ago + 2 * 86400,) * 2)  # 29 days: kept
    assert convert.cached_build(entries["used"], build, progress=False) == entries["used"]  # a use touches it
    assert (folder / ".used.lock").stat().st_mtime > time.time() - 60
    with open(folder / ".building.lock", "a+") as held:  # another process holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        convert.cached_build(folder / "new", build, progress=False)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "building", "new", "not-an-entry", "recent", "used"]
    assert (folder / ".unused.lock").exists()  # lock files stay
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]
    assert convert.prune_unused(folder) == [folder / "building"]  # no longer held


def test_a_damaged_gguf_conversion_is_rebuilt_never_used(tmp_path, monkeypatch, capsys):
    from tests.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(write_tiny_llama(tmp_path / "m"), tmp_path / "tiny.gguf")
    converted = sources.resolve_model(gguf, progress=False)
    weights = converted / "model.safetensors"
    good = weights.read_bytes()
    flip_in_place(weights, offset=len(good) - 10)  # a weight, not the header
    assert sources.resolve_model(gguf, progress=False) == converted
    assert "is damaged (model.safetensors changed since it was built" in capsys.readouterr().err
    assert weights.read_bytes() == good


def test_a_damaged_onnx_export_is_rebuilt_and_the_verdict_stays_right(tmp_path, monkeypatch, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from tracer.engines.onnx import DATA_FILE, MANIFEST_FILE, export_path, exported, read_manifest

    model = write_tiny_llama(tmp_path / "m")
    built = exported(model, "f32")  # in the user's cache: the tiny model is the same bytes every run, built once
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    export = shutil.copytree(built, export_path(model, "f32"))  # a copy of the cache: checked by its hashes
    flip_in_place(export / DATA_FILE, offset=(export / DATA_FILE).stat().st_size // 2)  # same size, mtime kept
    result = tracer.run(model, tokens=TOKENS, candidate="onnx", greedy=0, progress=False)
    assert f"the cache entry {export} is damaged ({DATA_FILE} changed since it was built" in capsys.readouterr().err
    assert result.verdict == "match"
    (export / MANIFEST_FILE).write_text("{garbled")  # past the check (a legacy entry): one line, no traceback
    with pytest.raises(TracerError, match=f"has no readable {MANIFEST_FILE}"):
        read_manifest(export)
