"""Unit tests for tracer.files.convert: the conversion cache (once across threads and processes, nothing
half-written) and the config.json a converted GGUF gets.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tracer.files import convert

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- cache


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "env"))
    assert convert.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert convert.cache_root() == tmp_path / "env"
    monkeypatch.delenv("TRACER_CACHE")
    assert convert.cache_root() == Path("~/.cache/tracer").expanduser()


def test_racing_threads_build_once(tmp_path):
    calls = []

    def slow_build(out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    target = tmp_path / "cache" / "model"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert.cached_build(target, slow_build, False)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [target] * 4
    assert (target / "config.json").is_file()
    assert not list(target.parent.glob(".model.tmp-*"))


def test_racing_processes_build_once(tmp_path):
    # Two interpreters start together on an empty cache: flock must make one wait for the other.
    script = textwrap.dedent(
        """
        import os, sys, time
        from pathlib import Path
        from tracer.files.convert import cached_build

        root = Path(sys.argv[1])
        while not (root / "go").exists():
            time.sleep(0.005)

        def build(out):
            with open(root / "builds.log", "a") as log:
                log.write(f"{os.getpid()}\\n")
            time.sleep(0.5)
            (out / "config.json").write_text("{}")

        print(cached_build(root / "cache" / "model", build, progress=False))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    time.sleep(0.3)  # let both interpreters reach the start line
    (tmp_path / "go").touch()
    outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "cache" / "model")}


def test_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "model"

    def broken(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # an interrupted conversion, the worst case

    with pytest.raises(KeyboardInterrupt):
        convert.cached_build(target, broken)
    assert not target.exists()
    assert not list(tmp_path.glob(".model.tmp-*"))

    def good(out: Path) -> None:
        (out / "config.json").write_text("{}")

    assert convert.cached_build(target, good) == target
    assert (target / convert.COMPLETE_MARKER).is_file()


def test_leftovers_of_a_killed_build_are_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()  # no completion marker: someone copied half of it, or an old layout
    (target / "junk").write_text("x")
    stale = tmp_path / ".model.tmp-dead"
    stale.mkdir()

    def good(out: Path) -> None:
        (out / "config.json").write_text("{}")

    convert.cached_build(target, good)
    assert sorted(p.name for p in target.iterdir()) == [convert.COMPLETE_MARKER, "config.json"]
    assert not stale.exists()


# --------------------------------------------------------------------------- config writer


def fake_config(**overrides):
    values = dict(
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        hidden_act="silu",
        hidden_size=576,
        initializer_range=0.02,
        intermediate_size=1536,
        max_position_embeddings=8192,
        mlp_bias=False,
        num_attention_heads=9,
        num_hidden_layers=30,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=9.999999747378752e-06,  # 1e-5 after a trip through GGUF's float32
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        vocab_size=49152,
        quantization_config={"quant_method": "gguf"},
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def test_config_is_transformers4_style():
    data = convert._llama_config_dict(fake_config(), {"gguf_file": "x.gguf"})
    assert data["rope_theta"] == 100000.0
    assert data["rope_scaling"] is None
    assert data["rms_norm_eps"] == 1e-05
    assert data["architectures"] == ["LlamaForCausalLM"]
    assert data["torch_dtype"] == "float32"
    assert data["tracer_source"]["gguf_file"] == "x.gguf"
    assert "rope_parameters" not in data
    assert "quantization_config" not in data


def test_config_keeps_rope_scaling():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    data = convert._llama_config_dict(fake_config(rope_parameters=rope), {})
    assert data["rope_theta"] == 500000.0
    assert data["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_f32_shortest_keeps_non_f32_values():
    assert convert._f32_shortest(9.999999747378752e-06) == 1e-05
    assert convert._f32_shortest(0.1) == 0.1
    assert convert._f32_shortest(1e-5) == 1e-5  # a double that is not an f32 value stays as is


def test_a_conversion_parses_the_gguf_once_and_writes_the_same_bytes(tmp_path, monkeypatch):
    """transformers reads a GGUF once for the config, once for the weights and once for the
    tokenizer; `convert._gguf_parsed_once` hands all three one parse, read through plain views of
    the file's memory map, and what is written is byte for byte what three stock parses write."""
    gguf = pytest.importorskip("gguf")
    from tests.conftest import write_tiny_llama
    from tests.tiny_gguf import write_tiny_gguf

    gguf_file = write_tiny_gguf(write_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf")
    parses = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parses.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    written, parse_counts = {}, {}
    for name, context in (("once", convert._gguf_parsed_once), ("each", contextlib.nullcontext)):
        monkeypatch.setattr(convert, "_gguf_parsed_once", context)
        parses.clear()
        out = tmp_path / name
        out.mkdir()
        convert.convert_gguf(gguf_file, out, source={"gguf": gguf_file.name}, progress=False, expected=None)
        written[name] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        parse_counts[name] = len(parses)
    assert parse_counts["once"] == 1 and parse_counts["each"] >= 2
    assert "model.safetensors" in written["once"] and written["once"] == written["each"]
    assert gguf.GGUFReader is Counted  # the package's own name is back after the conversion
