"""The llama.cpp regime on the bundled SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding), against
llama.cpp 0.3.36 itself on this machine's CPU (x86 with AVX2/AVX-512: tracer.ggml emulates that
code path), and the regime knobs against f32.

Measured here: with preset=llamacpp,weights=gguf every one of llama.cpp's 453 recorded points is
reproduced with a difference of exactly 0, free-running and per op on llama.cpp's own inputs; with
another summation order the per-op view stays within 4e-5 (the robust view on other CPUs); a
tensor corrupted in the file is the first divergence in the regime and invisible in the raw view.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tracer
from tests.cpu_builds import skip_unless_exact_here, this_cpu_caveats
from tests.readme import run_recipe
from tracer.engines.load import resolve_and_load
from tracer.ggml.strategies import emulates_this_cpu
from tracer.traces.layouts import sub_point

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
LLAMACPP = {"preset": "llamacpp", "weights": "gguf"}


@pytest.fixture(scope="module")
def llamacpp_trace(default_model):
    pytest.importorskip("llama_cpp")
    return tracer.record(default_model, PROMPT_IDS, engine="llamacpp", progress=False)


def test_the_llamacpp_regime_is_llama_cpp_to_the_bit(default_model, llamacpp_trace):
    skip_unless_exact_here(this_cpu_caveats())
    ours = tracer.record(default_model, PROMPT_IDS, engine="reimpl", variant=LLAMACPP, progress=False)
    result = tracer.compare(ours, llamacpp_trace)
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == 453  # scores/probs: fused by flash attention
    assert [p.point for p in compared if p.rel_l2 != 0] == []


def test_per_op_on_llama_cpps_inputs_is_exact_here_and_within_1e_4_in_another_order(default_model, llamacpp_trace):
    worst = {}
    for accumulate in ("ggml", "f32"):
        engine = resolve_and_load("reimpl", default_model, {**LLAMACPP, "accumulate": accumulate})
        result = tracer.compare(llamacpp_trace, engine.op_trace(llamacpp_trace))
        worst[accumulate] = {}
        for p in result.points:
            if p.recorded:
                kind = sub_point(p.point)
                worst[accumulate][kind] = max(worst[accumulate].get(kind, 0.0), p.rel_l2)
    assert max(worst["f32"].values()) < 1e-4  # measured 3.8e-5, at self_attn.context (f16 accumulator)
    assert worst["f32"]["self_attn.q_proj"] < 1e-6 and worst["f32"]["mlp.down_proj"] < 1e-6
    # an AVX2-only CPU: 1.7e-5 at self_attn.context, 4e-8 at mlp.act (another exp), its Q4_1 matmuls exact
    assert max(worst["ggml"].values()) < 1e-4 and worst["ggml"]["mlp.down_proj"] == 0.0
    skip_unless_exact_here(this_cpu_caveats())  # last: the rest holds on any CPU
    assert set(worst["ggml"].values()) == {0.0}


def _corrupt(source, target, tensor: str = "blk.7.ffn_down.weight", every: int = 20) -> float:
    """A copy of the GGUF with the first two quants of one block in `every` of `tensor` moved by one
    step each (Q4_1 nibbles, 15 -> 14, else +1): the relative change of that weight."""
    from tracer.files.gguffile import GGUFFile
    from tracer.ggml.quants import from_gguf_bytes

    data = bytearray(source.read_bytes())
    info = GGUFFile(source).tensors[tensor]
    blocks = np.frombuffer(data, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(-1, 20).copy()
    before = from_gguf_bytes("q4_1", blocks.reshape(info.shape[0], -1), info.shape).values()
    chosen = blocks[::every, 4:5]  # values 0 and 16 of every `every`-th block (one byte of nibbles)
    low, high = chosen & 0x0F, chosen >> 4
    low, high = np.where(low == 15, 14, low + 1), np.where(high == 15, 14, high + 1)
    blocks[::every, 4:5] = (low | (high << 4)).astype(np.uint8)
    data[info.offset:info.offset + info.nbytes] = blocks.tobytes()
    target.write_bytes(bytes(data))
    after = from_gguf_bytes("q4_1", blocks.reshape(info.shape[0], -1), info.shape).values()
    return float((after - before).norm() / before.norm())


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_block_quantized_weights_diverge_at_the_first_projection(default_model, kind):
    result = tracer.run(default_model, tokens=PROMPT_IDS, variant=f"weights={kind}", greedy=0, progress=False)
    assert result.verdict == "diverged"
    assert result.first_divergence.point == "model.layers.0.self_attn.q_proj"
    assert {"q8_0": 1e-3, "q4_0": 1e-2}[kind] < result.first_divergence.rel_l2 < 0.1


def test_regime_auto_reads_llama_cpp_as_correct_and_keeps_the_raw_view(default_model, tmp_path):
    """The README's GGUF recipe, as written: ./my-model the bundled model's directory, my-model.gguf its GGUF."""
    from tracer.files.sources import bundled_gguf

    run_recipe("A GGUF", tmp_path, {"my-model": default_model, "my-model.gguf": bundled_gguf()})
    result = json.loads((tmp_path / "tracer-report" / "summary.json").read_text())
    regime = result["regime"]
    assert regime["variant"] == LLAMACPP and result["verdict"] == "match"
    compared = [p for p in result["points"] if p["recorded"]]
    assert len(compared) == 453
    raw = regime["raw"]["first_divergence"]
    assert raw["layer"] == 0 and sub_point(raw["point"]) in ("self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj")
    # what the Q4_1/Q8_1 regime costs over f32, where a user of this GGUF pays it
    assert regime["cost"]["model.layers.0.input_layernorm"] < 1e-6 and regime["cost"]["lm_head"] > 1e-2
    assert result["greedy"]["candidate"]  # llama.cpp's own continuation beside the f32 reference's
    skip_unless_exact_here(regime["caveats"])  # last: the rest holds on any CPU
    assert all(p["rel_l2"] == 0 for p in compared) and set(regime["per_op"].values()) == {0.0}


def test_regime_auto_names_a_corrupted_tensor_alone_and_the_raw_view_hides_it(default_model, tmp_path):
    """One run of `--regime auto` on a GGUF with one tensor corrupted: the regime's first divergence is
    that tensor's matmul with every point before it exactly llama.cpp's; the raw view against f32 has the
    file's formats first, at layer 0, and the corrupted matmul lost among them."""
    pytest.importorskip("llama_cpp")
    from tracer.files.sources import bundled_gguf

    corrupted = tmp_path / "corrupted.gguf"
    change = _corrupt(bundled_gguf(), corrupted)
    assert 1e-2 < change < 3e-2  # measured 1.6e-2
    result = tracer.run(default_model, tokens=PROMPT_IDS, candidate=f"llamacpp:{corrupted}", regime="auto",
                        greedy=0, progress=False)
    # the candidate's own file, audited first: the corrupted tensor is taken requantized from the directory's weights
    assert result.regime.variant == {**LLAMACPP, "gguf_file": str(corrupted.resolve()), "requantize": "blk.7.ffn_down"}
    assert result.regime.audit.damaged == ("blk.7.ffn_down.weight",)
    first = result.first_divergence
    assert result.verdict == "diverged" and first.point == "model.layers.7.mlp.down_proj"
    assert first.rel_l2 > 1e-3
    if emulates_this_cpu(result.regime.caveats):  # every point before it: exactly llama.cpp's
        assert first.upstream_max_rel_l2 == 0.0
    else:  # this CPU's paths not emulated: every point before it within the per-op bound
        upstream = [p for p in result.points[:first.index] if p.recorded]
        assert all(p.rel_l2 <= p.threshold and p.threshold >= 0.999 * result.regime.per_op_bound for p in upstream)
    assert result.regime.per_op_over == ("model.layers.7.mlp.down_proj",)  # per op: that matmul alone
    assert result.regime.raw.first_divergence.layer == 0  # quantization itself diverges at the first projection
    # against f32, the corrupted matmul reads about what the file's formats cost there (the regime's cost:
    # the clean tensor's, taken requantized): 4.5e-2 against 4.4e-2, lost in the rest
    raw = tracer.run(default_model, tokens=PROMPT_IDS, candidate=f"llamacpp:{corrupted}", greedy=0, progress=False)
    down = {p.point: p.rel_l2 for p in raw.points if p.recorded}["model.layers.7.mlp.down_proj"]
    assert raw.first_divergence.layer == 0 and down < 1.1 * result.regime.cost["model.layers.7.mlp.down_proj"]


def test_regime_auto_judges_free_running_past_the_old_64_tokens_and_every_point_is_exactly_0(default_model):
    """140 tokens: 3 tiles of 64 keys in llama.cpp's tiled flash attention, the last one partial,
    and a last pass of 4 tokens in the compiled matmul kernels (8 tokens a pass)."""
    pytest.importorskip("llama_cpp")
    skip_unless_exact_here(this_cpu_caveats())
    tokens = (PROMPT_IDS * 40)[:140]
    result = tracer.run(default_model, tokens=tokens, candidate="llamacpp", regime="auto", greedy=0, progress=False)
    assert result.regime.verdict_view == "free" and result.regime.variant == LLAMACPP
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == 453
    assert [p.point for p in compared if p.rel_l2 != 0] == []


def test_past_the_bit_exact_length_the_per_op_view_judges_and_reads_llama_cpp_as_correct(default_model, monkeypatch):
    """The per-op view past tracer.pipeline.regime_view.EXACT_TOKENS, with that limit lowered to 64 here (at 2048
    tokens the same check would take minutes)."""
    pytest.importorskip("llama_cpp")
    monkeypatch.setattr("tracer.pipeline.regime_view.EXACT_TOKENS", 64)

    tokens = (PROMPT_IDS * 40)[:64 + 16]
    result = tracer.run(default_model, tokens=tokens, candidate="llamacpp", regime="auto", greedy=0, progress=False)
    assert result.regime.verdict_view == "per_op"
    assert result.regime.variant == {**LLAMACPP, "accumulate": "f32"}  # torch's BLAS sums: ~1.4× a forward
    assert result.verdict == "match" and result.regime.per_op_over == ()  # measured at 512 tokens: worst 1.8e-6
