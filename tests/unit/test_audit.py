"""The audit of a GGUF's tensors (tracer.ggml.audit) on a tiny Llama with k-quant-sized widths,
quantized by llama.cpp's own quantizer: identical where the file was made from the reference's
weights, legitimate where an importance matrix made it, damaged where one block was changed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.audited_gguf import activation_imatrix, damage_block
from tests.conftest import TOKENS
from tests.quantized_gguf import quantize_gguf, write_kquant_llama
from tracer.core.errors import TracerError
from tracer.files.weights import WeightFiles
from tracer.ggml.audit import audit_gguf
from tracer.ggml.quantizer import GgmlQuantizer, ggml_quantizer
from tracer.reports.summary import audit_lines

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """(model directory, GGUF files by name): its F32 GGUF, llama.cpp's Q4_K_M, Q8_0, F16, BF16 of the
    directory's own weights, and Q4_K_M and Q4_0 made with an importance matrix of its activations."""
    folder = tmp_path_factory.mktemp("audit")
    model, f32 = write_kquant_llama(folder)
    files = {ftype: quantize_gguf(f32, folder / f"{ftype}.gguf", ftype) for ftype in ("Q4_K_M", "Q8_0", "F16", "BF16")}
    files["F32"] = f32
    matrix = activation_imatrix(model, TOKENS)
    for ftype in ("Q4_K_M", "Q4_0"):
        files[f"{ftype}-imatrix"] = quantize_gguf(f32, folder / f"{ftype}-imatrix.gguf", ftype, imatrix=matrix)
    return model, files


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0", "F16"])
def test_a_file_quantized_from_the_reference_is_identical_tensor_for_tensor(kquant, ftype):
    model, files = kquant
    audit = audit_gguf(files[ftype], WeightFiles(model))
    assert audit.verdict == "identical" and audit.count("identical") == len(audit.tensors) == 20
    assert audit.damaged == ()
    assert audit_lines(audit.to_dict()) == [
        f"audit of {ftype}.gguf: every one of its 20 tensors is what llama.cpp's quantizer makes of the "
        f"reference's weights, byte for byte ({audit.quantizer})"]


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q4_0"])
def test_an_importance_matrix_reads_as_legitimate_for_every_tensor(kquant, ftype):
    """Q4_K_M: k-quants, rounded at their stored scales; Q4_0: rounded with the scale its search
    found, then stored with the least-squares one (another scale than the stored)."""
    model, files = kquant
    audit = audit_gguf(files[f"{ftype}-imatrix"], WeightFiles(model))
    assert audit.verdict == "legitimate" and audit.damaged == ()
    differing = [t for t in audit.tensors if t.verdict == "legitimate"]
    assert len(differing) == 14  # every projection; the embedding and the norms get no importance matrix
    assert all(1.0 < t.error_ratio < 16 for t in differing)
    assert "14 of 20 tensors differ from llama.cpp's requantization" in audit_lines(audit.to_dict())[0]


@pytest.mark.parametrize("ftype, tensor, change", [
    ("Q4_K_M", "blk.1.attn_k.weight", {"quants": 2}),  # two quant bytes: four quants moved by 8 levels
    ("Q4_K_M", "blk.0.ffn_up.weight", {"scale": 1.25}),  # the super-block scale
    ("Q8_0", "blk.1.attn_v.weight", {"quants": 1}),
    ("Q4_0-imatrix", "blk.0.attn_q.weight", {"quants": 1}),  # among blocks rescaled by the importance matrix
])
def test_one_damaged_block_is_named(kquant, tmp_path, ftype, tensor, change):
    model, files = kquant
    damaged = damage_block(files[ftype], tmp_path / "damaged.gguf", tensor, 5, **change)
    audit = audit_gguf(damaged, WeightFiles(model))
    assert audit.verdict == "damaged" and audit.damaged == (tensor,)
    entry = next(t for t in audit.tensors if t.tensor == tensor)
    assert (entry.off_blocks, entry.worst_block) == (1, 5)
    [line] = [line for line in audit_lines(audit.to_dict()) if line.startswith("audit: ")]
    assert line.startswith(f"audit: {tensor} ({entry.kind.upper()}) damaged: one block of {entry.blocks} at ")
    assert json.loads(json.dumps(audit.to_dict()))["damaged"][0]["worst_block"] == 5


def test_a_file_of_another_model_is_one_line(kquant, tmp_path):
    from tests.conftest import write_tiny_llama

    _, files = kquant
    other = write_tiny_llama(tmp_path / "other")  # 64 wide
    with pytest.raises(TracerError, match=r"Q4_K_M.gguf is not a file of this model: its output_norm.weight is "
                                          r"\(256,\), the model's model.norm.weight is \(64,\)") as info:
        audit_gguf(files["Q4_K_M"], WeightFiles(other))
    assert "\n" not in str(info.value)


def test_without_llama_cpp_the_audit_says_so_in_one_line(kquant, monkeypatch):
    import tracer.ggml.audit as audit_module

    model, files = kquant
    monkeypatch.setattr("tracer.ggml.quantizer.library_path", lambda: None)
    ggml_quantizer.cache_clear()
    try:
        audit = audit_module.audit_gguf(files["Q4_K_M"], WeightFiles(model))
    finally:
        ggml_quantizer.cache_clear()
    assert audit.verdict == "not_audited" and audit.tensors == ()
    assert audit_lines(audit.to_dict()) == ["audit of Q4_K_M.gguf: llama.cpp's quantizer is not installed "
                                            "(llama-cpp-python): the file's bytes are used as they are"]


def test_the_quantizer_is_llama_cpps_own(kquant):
    """ggml's bytes for a Q4_K row: a k-quant the gguf package cannot make, read back by ggml."""
    quantizer = ggml_quantizer()
    assert isinstance(quantizer, GgmlQuantizer)
    rows = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    raw = quantizer.quantize("q4_k", rows)
    assert raw.shape == (3, 2 * 144)
    values = quantizer.dequantize("q4_k", raw, rows.shape)
    assert 0.02 < np.abs(values - rows).mean() < 0.1  # 4.5 bits: about 1/16 of the range, not exact, not wild
    assert np.array_equal(quantizer.quantize("q4_k", rows[1:2]), raw[1:2])  # rows are quantized alone


def test_a_tensor_requantized_in_place_of_the_files_is_llama_cpps_own_bytes(kquant):
    """requantize= decodes llama.cpp's quantization of the directory's weights: on a file made from
    those very weights, the same model to the bit."""
    import tracer

    model, files = kquant
    from_file = f"weights=gguf,gguf_file={files['Q4_K_M']}"
    plain = tracer.record(model, TOKENS, engine="reimpl", variant=from_file, progress=False)
    redone = tracer.record(model, TOKENS, engine="reimpl", variant=from_file + ",requantize=blk.1.attn_k+token_embd",
                           progress=False)
    assert all(torch.equal(plain[point], redone[point]) for point in plain.points)
    assert redone.label.startswith("reimpl[weights=gguf,gguf_file=Q4_K_M.gguf,requantize=")  # the file by its name


@pytest.mark.parametrize("variant, message", [
    ("gguf_file=x.gguf", r"gguf_file= says which GGUF tensors weights=gguf takes: it needs weights=gguf"),
    ("weights=gguf,gguf_file=/nowhere/x.gguf", r"gguf_file=/nowhere/x.gguf: no such file"),
    ("weights=gguf,gguf_file={Q4_K_M},requantize=blk.9.attn_q", r"Q4_K_M.gguf has no tensor blk.9.attn_q"),
    ("weights=gguf,gguf_file={other}", r"Q4_K_M.gguf is not a file of this model"),
])
def test_a_wrong_file_or_tensor_is_one_line(kquant, tiny_llama, variant, message):
    import tracer

    model, files = kquant
    target = tiny_llama() if "{other}" in variant else model
    variant = variant.format(Q4_K_M=files["Q4_K_M"], other=files["Q4_K_M"])
    with pytest.raises(TracerError, match=message) as info:
        tracer.record(target, TOKENS, engine="reimpl", variant=variant, progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ftype", ["F16", "BF16", "F32"])
def test_regime_auto_on_a_float_file_is_a_regime_the_reimplementation_runs(kquant, ftype):
    """What once answered "bad value 'f16' for knob 'weights'": the file's own float matrices, whose
    kernels (tinyBLAS, ggml_vec_dot_f16/bf16/f32) are emulated: no caveat names their type."""
    import tracer
    from tracer.engines.registry import parse_engine
    from tracer.files.sources import ModelSource
    from tracer.pipeline.regime_view import resolve as resolve_regime

    model, files = kquant
    knobs, caveats, audit = resolve_regime("auto", parse_engine(f"llamacpp:{files[ftype]}"), {}, ModelSource(model))
    assert knobs == {"preset": "llamacpp", "weights": "gguf", "gguf_file": str(files[ftype].resolve())}
    assert audit.verdict == "identical"
    assert not any(caveat.startswith(f"{ftype} weights") for caveat in caveats)
    trace = tracer.record(model, TOKENS, engine="reimpl", variant=knobs, progress=False)
    assert trace["lm_head"].shape == (len(TOKENS), 288)
