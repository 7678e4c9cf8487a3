"""`--regime auto` on GGUFs a user makes with llama.cpp's quantizer from a model directory that was
NOT converted from them (the per-tensor types path): a correct file reads match with or without an
importance matrix, and one damaged block is found by the audit and shows at its own op, every
earlier point within its floor (exactly 0 where the kernels are emulated)."""

from __future__ import annotations

import json

import pytest

import tracer
from tests.audited_gguf import activation_imatrix, damage_block
from tests.conftest import TOKENS
from tests.quantized_gguf import quantize_gguf, write_kquant_llama
from tracer.ggml.strategies import emulates_this_cpu
from tracer.reports.terminal import terminal_summary

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """(model directory, GGUFs by name): Q4_K_M and F16 of the directory's own weights by llama.cpp,
    Q4_K_M with an importance matrix of its activations, and Q4_K_M with one block of blk.1.attn_k
    changed (two quant bytes: four quants moved by 8 levels)."""
    folder = tmp_path_factory.mktemp("regime-audit")
    model, f32 = write_kquant_llama(folder)
    q4_k_m = quantize_gguf(f32, folder / "Q4_K_M.gguf", "Q4_K_M")
    return model, {
        "Q4_K_M-imatrix": quantize_gguf(f32, folder / "Q4_K_M-imatrix.gguf", "Q4_K_M",
                                        imatrix=activation_imatrix(model, TOKENS)),
        "F16": quantize_gguf(f32, folder / "F16.gguf", "F16"),
        "damaged": damage_block(q4_k_m, folder / "Q4_K_M-damaged.gguf", "blk.1.attn_k.weight", 5, quants=2),
    }


def regime_run(model, gguf, out=None):
    return tracer.run(model, tokens=TOKENS, reference="reimpl", candidate=f"llamacpp:{gguf}", regime="auto",
                      greedy=0, progress=False, out=out)


@pytest.mark.parametrize("name", ["Q4_K_M-imatrix", "F16"])
def test_a_correct_file_reads_match_on_its_own_tensor_types(kquant, name):
    model, files = kquant
    result = regime_run(model, files[name])
    regime = result.regime
    assert regime.variant["weights"] == "gguf" and regime.variant["gguf_file"] == str(files[name].resolve())
    assert "requantize" not in regime.variant
    assert result.verdict == "match", terminal_summary(result)
    assert regime.audit.verdict == ("legitimate" if "imatrix" in name else "identical")
    assert regime.raw.verdict == "diverged"  # the file's formats against f32


def test_a_damaged_block_shows_at_its_op_with_everything_before_it_within_its_floor(kquant, tmp_path):
    model, files = kquant
    result = regime_run(model, files["damaged"], out=tmp_path / "report")
    regime = result.regime
    assert regime.audit.damaged == ("blk.1.attn_k.weight",)
    assert regime.variant["requantize"] == "blk.1.attn_k"
    assert result.verdict == "diverged"
    first = result.first_divergence
    assert first.point == "model.layers.1.self_attn.k_proj"
    upstream = [p for p in result.points[:first.index] if p.recorded]
    if regime.verdict_view == "free":  # every kernel emulated on this branch and CPU: bit-exact
        assert first.upstream_max_rel_l2 == 0.0
    else:  # Q4_K judged per op: the ops whose kernels are emulated exactly 0, the others within their floor
        assert all(p.rel_l2 <= p.threshold for p in upstream)
        if emulates_this_cpu(regime.caveats):  # else this CPU's exp and lanes are not the ones emulated
            assert all(p.rel_l2 == 0.0 for p in upstream if not p.point.endswith("_proj"))
    assert first.rel_l2 > 100 * first.threshold
    line = "audit: blk.1.attn_k.weight (Q4_K) damaged: one block of 128 at "
    assert line in terminal_summary(result) and "requantize=blk.1.attn_k" in terminal_summary(result)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["regime"]["audit"]["damaged"][0]["tensor"] == "blk.1.attn_k.weight"
    assert summary["regime"]["variant"]["gguf_file"] == str(files["damaged"].resolve())  # the file, exactly
    assert line in (tmp_path / "report" / "summary.md").read_text()
    assert line in (tmp_path / "report" / "report.html").read_text()


def test_a_second_run_reads_the_audit_from_the_cache_and_a_rewritten_file_is_audited_again(kquant, tmp_path,
                                                                                            monkeypatch):
    import dataclasses
    import shutil

    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    model, files = kquant
    gguf = shutil.copy(files["damaged"], tmp_path / "file.gguf")
    first, second = (regime_run(model, gguf) for _ in range(2))
    assert not first.regime.audit.cached and second.regime.audit.cached
    assert dataclasses.replace(second.regime.audit, cached=False) == first.regime.audit
    assert second.regime.variant == first.regime.variant  # the damaged tensor requantized, as audited
    assert second.first_divergence.point == first.first_divergence.point == "model.layers.1.self_attn.k_proj"
    said = "audit read from the cache (an earlier run audited this file against these weights)"
    assert said in " ".join(terminal_summary(second).split()) and "from the cache (an earlier run audited" \
        not in " ".join(terminal_summary(first).split())
    shutil.copy(files["Q4_K_M-imatrix"], gguf)  # the same path, other bytes: audited again
    third = regime_run(model, gguf).regime.audit
    assert not third.cached and third.verdict == "legitimate" and not third.damaged
