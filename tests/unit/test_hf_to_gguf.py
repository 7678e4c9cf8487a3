"""A model directory as a GGUF (tracer.files.hf_to_gguf): gguf-py's writer against llama.cpp's own
convert_hf_to_gguf.py, family by family, and `--candidate llamacpp` on a directory.

llama.cpp's converter is the one in llama-cpp-python's source distribution (vendor/llama.cpp of the
0.3.36 the suite installs, unpacked where $LLAMACPP_SOURCE says); without it the comparison skips,
saying so (docs/measured.md has the comparison's figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TOKENS, write_tiny_llama
from tests.families import TINY_FAMILIES, write_tiny_family
from tracer.core.errors import TracerError
from tracer.files import hf_to_gguf

SOURCE = Path(os.environ.get("LLAMACPP_SOURCE", "llama.cpp-source-not-given"))
ROOT = Path(__file__).resolve().parents[2]


def _contents(path: Path) -> tuple[dict, dict]:
    """(every metadata key -> its types and value, every tensor -> its type, shape and bytes)."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {key: (field.types, field.contents()) for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {t.name: (t.tensor_type.name, [int(n) for n in t.shape], np.array(t.data).tobytes())
               for t in reader.tensors}
    return meta, tensors


# the tiny families tracer's writer writes (it has none for a mixture of experts yet)
WRITTEN = [family for family in TINY_FAMILIES if TINY_FAMILIES[family][0] in hf_to_gguf.FAMILIES]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (llama.cpp's file, tracer's file) for each tiny family, f32 and the converter's default."""
    if not (SOURCE / hf_to_gguf.SCRIPT).is_file():
        pytest.skip(f"llama.cpp's {hf_to_gguf.SCRIPT} is not here ({SOURCE}): set $LLAMACPP_SOURCE to the "
                    "vendor/llama.cpp of llama-cpp-python's unpacked source")
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("hf_to_gguf")
    jobs, out = [], {}
    for family in WRITTEN:
        model = write_tiny_family(folder / family, family)
        if family == "gemma3":  # Gemma3Model counts the tokenizer's tokens to cut the embedding: 97 of them
            vocab = {f"t{n}": n for n in range(97)}
            (model / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab},
                                                               "added_tokens": []}))
        for outtype in ("f32", "auto"):
            theirs, ours = folder / f"{family}-{outtype}-llamacpp.gguf", folder / f"{family}-{outtype}.gguf"
            jobs.append((str(SOURCE / hf_to_gguf.SCRIPT), str(model), str(theirs), outtype, "no_vocab"))
            hf_to_gguf.write_gguf(model, ours, outtype)
            out[family, outtype] = theirs, ours
    # one child for every conversion: the script's own classes and gguf-py, as its main() runs them
    code = ("import sys, json; from tracer.files.hf_to_gguf import _run_here\n"
            "for job in json.loads(sys.argv[1]): _run_here(*job)")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.parametrize("outtype", ["f32", "auto"])
@pytest.mark.parametrize("family", WRITTEN)
def test_tracers_writer_writes_what_llamacpps_converter_writes(pairs, family, outtype):
    theirs, ours = (_contents(path) for path in pairs[family, outtype])
    assert ours[0] == theirs[0]  # every metadata key, its type and value
    assert ours[1].keys() == theirs[1].keys()
    assert [name for name in theirs[1] if ours[1][name] != theirs[1][name]] == []  # type, shape, bytes
    if family in ("gemma2", "gemma3"):  # the norms as 1 + w, one of the transforms this compares
        assert any(name.endswith("_norm.weight") for name in ours[1])


def test_the_transforms_are_the_converters(pairs):
    """What the comparison above holds the writer to: Llama's q rows permuted, Gemma's norms shifted,
    Gemma 2's soft-capping in the metadata, f16 matrices by default from f32 weights."""
    import gguf
    import torch
    from safetensors.torch import load_file

    reader = gguf.GGUFReader(pairs["gemma2", "f32"][1])
    weights = load_file(str(pairs["gemma2", "f32"][1].parent / "gemma2" / "model.safetensors"))
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    assert torch.equal(torch.from_numpy(np.array(norm.data)), weights["model.layers.0.input_layernorm.weight"] + 1)
    assert reader.fields["gemma2.attn_logit_softcapping"].contents() == 20.0
    llama = gguf.GGUFReader(pairs["llama", "f32"][1])
    q = next(t for t in llama.tensors if t.name == "blk.0.attn_q.weight")
    hf_weights = load_file(str(pairs["llama", "f32"][1].parent / "llama" / "model.safetensors"))
    hf_q = hf_weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(torch.from_numpy(np.array(q.data)), hf_q)  # rows moved: RoPE pairs adjacent
    assert torch.equal(torch.from_numpy(np.array(q.data)).sort(0).values, hf_q.sort(0).values)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(pairs["llama", "auto"][1]).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"


def test_bad_directories_are_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(hf_to_gguf.CONVERTER_ENV, raising=False)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(TracerError, match="model_type 'gpt2': tracer has no GGUF writer"):
        hf_to_gguf.converted_gguf(tmp_path / "gpt2", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(TracerError, match="no safetensors file"):
        hf_to_gguf.converted_gguf(tmp_path / "empty", tmp_path / "cache")
    with pytest.raises(TracerError, match="no config.json"):
        hf_to_gguf.converted_gguf(tmp_path / "nothing", tmp_path / "cache")
    monkeypatch.setenv(hf_to_gguf.CONVERTER_ENV, str(tmp_path))
    with pytest.raises(TracerError, match="no convert_hf_to_gguf.py there"):
        hf_to_gguf.find_converter()


def test_a_model_directory_as_llamacpp_candidate(tmp_path, capsys, monkeypatch):
    """`tracer run --model DIR --candidate llamacpp`: converted once, said in one line, cached; at
    llama.cpp's exact f32 settings every point matches the f32 reference."""
    pytest.importorskip("llama_cpp")
    model = write_tiny_llama(tmp_path / "tiny")
    monkeypatch.delenv(hf_to_gguf.CONVERTER_ENV, raising=False)
    environment = {k: v for k, v in os.environ.items() if k != hf_to_gguf.CONVERTER_ENV}
    environment["TRACER_CACHE"] = str(tmp_path / "cache")
    command = [sys.executable, "-m", "tracer", "run", "--model", str(model), "--candidate", "llamacpp",
               "--variant", "kv_cache=f32,flash_attn=off", "--tokens", ",".join(map(str, TOKENS)), "--greedy", "0",
               "--out", str(tmp_path / "report")]
    first = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    said = [line for line in first.stderr.splitlines() if line.startswith("tracer: GGUF of tiny")]
    assert len(said) == 1 and "gguf-py's writer" in said[0] and "(cached)" not in said[0]
    gguf = Path(said[0].rsplit(": ", 1)[1])
    assert gguf.is_file() and gguf.is_relative_to(tmp_path / "cache" / "gguf")
    assert "verdict: MATCH" in first.stdout
    again = hf_to_gguf.converted_gguf(model, tmp_path / "cache")  # the CLI's cache, found again, said once
    hf_to_gguf.converted_gguf(model, tmp_path / "cache")
    assert again == gguf
    said = capsys.readouterr().err.splitlines()
    assert said == [f"tracer: GGUF of tiny (cached) by gguf-py's writer (no convert_hf_to_gguf.py found: "
                    f"${hf_to_gguf.CONVERTER_ENV}): {gguf}"]


def test_llamacpps_converter_where_the_user_has_it(tmp_path, monkeypatch, capsys):
    """$TRACER_LLAMACPP_CONVERTER names a llama.cpp checkout: its convert_hf_to_gguf.py writes the file
    (the same tensors and metadata as tracer's writer), and the line says so."""
    if not (SOURCE / hf_to_gguf.SCRIPT).is_file():
        pytest.skip(f"llama.cpp's {hf_to_gguf.SCRIPT} is not here ({SOURCE})")
    model = write_tiny_llama(tmp_path / "tiny")
    monkeypatch.setenv(hf_to_gguf.CONVERTER_ENV, str(SOURCE))
    path = hf_to_gguf.converted_gguf(model, tmp_path / "cache")
    said = capsys.readouterr().err.splitlines()
    assert said == [f"tracer: GGUF of tiny by llama.cpp's {(SOURCE / hf_to_gguf.SCRIPT).resolve()}: {path}"]
    assert _contents(path) == _contents(hf_to_gguf.write_gguf(model, tmp_path / "ours.gguf", "f32"))
