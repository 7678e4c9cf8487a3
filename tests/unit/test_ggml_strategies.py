"""The regime knobs on the reimpl engine (tracer.ggml.strategies), on tiny random Llamas: what each
changes, the llama.cpp preset against llama.cpp itself on a tiny quantized GGUF, the regime's
noise floor, per-op teacher forcing and the regime a llama.cpp run implies."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.cpu_builds import AMD, AMD_CPU, INTEL, INTEL_CPU, skip_unless_exact_here, this_cpu_caveats
from tests.ggml_gguf import quantized_models
from tracer.core.errors import TracerError
from tracer.engines.registry import engines_honouring
from tracer.files.sources import ModelSource
from tracer.ggml import ops
from tracer.ggml.quants import Blocks
from tracer.ggml.strategies import GGUFWeights, implied_regime, regime_catalogue
from tracer.model.config import load_config, read_hf
from tracer.model.knobs import PRESETS, expand_presets
from tracer.pipeline.catalogue import diagnosis_variants
from tracer.reimpl.forward import Model

LLAMACPP = {"preset": "llamacpp", "weights": "gguf"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(tiny HF directory, its Q4_1/Q8_0 GGUF, a copy of the directory converted from it)."""
    return quantized_models(tmp_path_factory.mktemp("ggml"))


def test_the_regime_knobs_are_listed_for_reimpl_and_the_preset_expands():
    for knob in ("weights", "act_quant", "act_round", "kv_cache", "ops", "accumulate", "flash_attn"):
        assert "reimpl" in engines_honouring(knob)
    assert engines_honouring("kv_cache") == engines_honouring("flash_attn") == ("reimpl", "llamacpp")
    assert expand_presets({"preset": "llamacpp", "weights": "gguf"}) == {**PRESETS["llamacpp"], "weights": "gguf"}


def test_weights_quantize_every_projection_and_nothing_else(tiny_llama):
    model = tiny_llama()
    plain = tracer.record(model, TOKENS, engine="reimpl", progress=False)
    q8 = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q8_0", progress=False)
    assert torch.equal(plain["model.embed_tokens"], q8["model.embed_tokens"])
    assert torch.equal(plain["model.layers.0.input_layernorm"], q8["model.layers.0.input_layernorm"])
    assert 1e-4 < _rel(q8["model.layers.0.self_attn.q_proj"], plain["model.layers.0.self_attn.q_proj"]) < 1e-2
    q4 = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q4_0", progress=False)
    assert _rel(q4["model.layers.0.self_attn.q_proj"], plain["model.layers.0.self_attn.q_proj"]) > \
        5 * _rel(q8["model.layers.0.self_attn.q_proj"], plain["model.layers.0.self_attn.q_proj"])


def test_act_quant_auto_leaves_f32_weights_alone_and_quantizes_a_quantized_ones_input(tiny_llama):
    model = tiny_llama()
    plain = tracer.record(model, TOKENS, engine="reimpl", progress=False)
    auto = tracer.record(model, TOKENS, engine="reimpl", variant="act_quant=auto", progress=False)
    assert all(torch.equal(plain[p], auto[p]) for p in plain.points)  # f32 weights: no vec-dot type
    weights_only = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q4_1", progress=False)
    both = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q4_1,act_quant=auto", progress=False)
    point = "model.layers.0.self_attn.q_proj"
    assert 1e-4 < _rel(both[point], weights_only[point]) < 2e-2  # 8-bit activations (Q8_1)
    away = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q4_1,act_quant=q8_1,act_round=away",
                         progress=False)
    explicit = tracer.record(model, TOKENS, engine="reimpl", variant="weights=q4_1,act_quant=q8_1", progress=False)
    assert torch.equal(explicit[point], both[point])
    assert _rel(away["lm_head"], explicit["lm_head"]) < 1e-2


def test_kv_cache_rounds_keys_and_values_and_records_the_scores(tiny_llama):
    with pytest.raises(TracerError, match="kv_cache=q8_0 stores heads in 32-value blocks; this model's head_dim is 16"):
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="kv_cache=q8_0", progress=False)
    model = tiny_llama("d32", num_attention_heads=2, num_key_value_heads=1)  # head_dim 32
    plain = tracer.record(model, TOKENS, engine="reimpl", progress=False)
    f16 = tracer.record(model, TOKENS, engine="reimpl", variant="kv_cache=f16", progress=False)
    q8 = tracer.record(model, TOKENS, engine="reimpl", variant="kv_cache=q8_0", progress=False)
    point = "model.layers.0.self_attn.scores"
    assert torch.equal(plain["model.layers.0.self_attn.k_rope"], f16["model.layers.0.self_attn.k_rope"])
    assert 0 < _rel(f16[point], plain[point]) < 1e-3 < _rel(q8[point], plain[point]) < 3e-2


def test_regimes_refuse_f64_and_gguf_weights_need_a_gguf(tiny_llama):
    with pytest.raises(TracerError, match="dtype=f64 cannot combine with regime knobs"):
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="weights=q8_0,dtype=f64", progress=False)
    with pytest.raises(TracerError, match=r"weights=gguf needs a model converted from a GGUF file") as info:
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="weights=gguf", progress=False)
    assert "\n" not in str(info.value)


def test_gguf_weights_are_the_files_blocks_with_q_and_k_rows_back_in_hf_order(quantized):
    model, gguf, _ = quantized
    weights = GGUFWeights(gguf)
    assert weights.types()["model.layers.0.self_attn.q_proj.weight"] == "q4_1"
    assert weights.types()["model.embed_tokens.weight"] == "q8_0"
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Blocks) and q.shape == (64, 64)
    original = Model.from_dir(model).weights["model.layers.0.self_attn.q_proj.weight"]
    assert _rel(q.values(), original) < 0.1  # 4-bit, same rows: un-permuted
    assert _rel(q.values(), original.flip(0)) > 1.0  # another row order is far off


def test_the_llamacpp_preset_is_llama_cpp_to_the_bit_on_a_quantized_gguf(quantized):
    """Q4_1 projections, a Q8_0 embedding and lm_head, an f16 KV cache and flash attention, at 7
    tokens (one-chunk flash attention) and at 70 (the tiled path): every recorded point equal."""
    pytest.importorskip("llama_cpp")
    skip_unless_exact_here(this_cpu_caveats())
    from tracer.engines import llamacpp

    _, gguf, converted = quantized
    engine = llamacpp.load(ModelSource(converted), {"threads": 1}, argument=str(gguf))
    for tokens in (TOKENS, (TOKENS * 10)[:70]):
        ours = tracer.record(converted, tokens, engine="reimpl", variant=LLAMACPP, progress=False)
        result = tracer.compare(ours, engine.record(tokens))
        compared = [p for p in result.points if p.recorded]
        assert result.verdict == "match" and len(compared) == 33
        assert all(p.rel_l2 == 0 for p in compared), [(p.point, p.rel_l2) for p in compared if p.rel_l2]


# bf16's dot products depend on the CPU: llama.cpp takes AVX512-BF16's _mm512_dpbf16_ps where it has it
BF16_PATH = "bf16-dpbf16" if ops.takes_dpbf16() else "bf16-avx512f"


@pytest.mark.parametrize("kv_cache", ["f16", "f32", pytest.param("bf16", id=BF16_PATH)])
def test_flash_attention_off_is_llama_cpps_unfused_attention_to_the_bit(quantized, kv_cache):
    """mul_mat on the cache (tinyBLAS), soft_max, mul_mat with the probabilities in the cache's
    type: scores and probabilities are recorded on both sides, and equal. With a bf16 cache on a
    CPU with AVX512-BF16 (the test's id says which path this machine takes) tinyBLAS and
    ggml_vec_dot_bf16 run _mm512_dpbf16_ps, which the regime then emulates."""
    pytest.importorskip("llama_cpp")
    skip_unless_exact_here(this_cpu_caveats())
    from tracer.engines import llamacpp

    _, gguf, converted = quantized
    knobs = {"kv_cache": kv_cache, "flash_attn": "off"}
    engine = llamacpp.load(ModelSource(converted), {"threads": 1, **knobs}, argument=str(gguf))
    ours = tracer.record(converted, TOKENS, engine="reimpl", variant={**LLAMACPP, **knobs}, progress=False)
    result = tracer.compare(ours, engine.record(TOKENS))
    compared = [p for p in result.points if p.recorded]
    assert len(compared) == 37 and all(p.rel_l2 == 0 for p in compared)  # scores and probs of both layers too


def test_the_quantized_caches_go_through_flash_attention_only(tiny_llama):
    with pytest.raises(TracerError, match="kv_cache=q8_0 needs flash attention"):
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="preset=llamacpp,kv_cache=q8_0,flash_attn=off",
                      progress=False)
    with pytest.raises(TracerError,
                       match="flash_attn=on is llama.cpp's flash attention: on the reimpl engine it needs"):
        tracer.record(tiny_llama(), TOKENS, engine="reimpl", variant="flash_attn=on", progress=False)


def test_regime_noise_is_the_per_op_spread_of_another_summation_order(quantized):
    from tracer.pipeline.noise_floor import estimate_noise, regime_noise

    _, _, converted = quantized
    reference = tracer.record(converted, TOKENS, engine="reimpl", variant=LLAMACPP, progress=False)
    noise = regime_noise(ModelSource(converted), reference, LLAMACPP)
    assert noise["model.embed_tokens"] == 0 and noise["model.layers.0.input_layernorm"] == 0
    assert noise["model.layers.0.resid_mid"] == 0  # an f32 add of forced inputs: no order to change
    assert 1e-9 < noise["model.layers.0.self_attn.q_proj"] < 1e-5
    assert 1e-9 < noise["model.layers.1.mlp.down_proj"] < 1e-5
    assert estimate_noise(ModelSource(converted), reference, LLAMACPP) == noise  # handed over to regime_noise


@pytest.mark.parametrize("cpu, build", [(AMD_CPU, AMD), (INTEL_CPU, INTEL)], ids=["amd", "intel"])
def test_the_regime_is_exact_on_both_cpus_and_names_an_fp16_builds_unmeasured_path(cpu, build):
    types = {"model.embed_tokens.weight": "q8_0", "model.layers.0.mlp.up_proj.weight": "q4_1",
             "model.layers.0.mlp.down_proj.weight": "iq4_nl", "model.layers.1.mlp.down_proj.weight": "f16"}
    flags = set(cpu["flags"].split())
    assert implied_regime(types, {}, flags, build, head_dim=64) == ({"preset": "llamacpp", "weights": "gguf"}, [])
    _, caveats = implied_regime(types, {}, flags, build, head_dim=128)
    if "AVX512_FP16" in build:  # flash attention's f16 values in f16 arithmetic: by its definition, unmeasured
        assert caveats == ["this llama.cpp build accumulates flash attention's values in AVX512-FP16 arithmetic "
                           "(128 of 128 columns): emulated from the instructions' definition, not yet measured "
                           "against llama.cpp"]
    else:
        assert caveats == []
    assert implied_regime(types, {"flash_attn": "off"}, flags, build, head_dim=128)[1] == []  # no f16 accumulator


def test_op_forcing_feeds_every_op_the_references_inputs(tiny_llama):
    from tracer.engines.load import resolve_and_load

    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="reimpl", variant="theta=500", progress=False)
    engine = resolve_and_load("reimpl", model, {})
    per_op, per_block = engine.op_trace(reference), engine.local_trace(reference)
    rope = "model.layers.1.self_attn.q_rope"
    assert _rel(per_op[rope], reference[rope]) > 1e-2  # the op with the wrong theta: its own error
    after = "model.layers.1.self_attn.o_proj"
    assert _rel(per_op[after], reference[after]) < 1e-6 < _rel(per_block[after], reference[after])


def test_diagnose_tries_the_regimes_once_each(tiny_llama):
    variants = diagnosis_variants(read_hf(load_config(tiny_llama())))
    assert len(variants) == len(set(variants))
    assert "weights=q4_1,act_quant=q8_1" in variants and "weights=q4_0" in variants
    assert set(regime_catalogue()) - set(variants) == set()


def test_implied_regime_names_what_is_not_bit_exact():
    exact_types = {"model.embed_tokens.weight": "q8_0", "model.layers.0.mlp.up_proj.weight": "q4_1"}
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512dq"}
    build = frozenset({"AVX2", "AVX512", "AVX512_BF16"})
    assert implied_regime(exact_types, {}, flags, build) == ({"preset": "llamacpp", "weights": "gguf"}, [])
    variant, caveats = implied_regime({**exact_types, "x": "q4_k"}, {"kv_cache": "bf16", "flash_attn": "off"},
                                      {"avx2"}, build)
    assert variant == {"preset": "llamacpp", "weights": "gguf", "kv_cache": "bf16", "flash_attn": "off"}
    assert len(caveats) == 2 and "Q4_K weights" in caveats[0] and "lacks fma, f16c:" in caveats[1]
    # AVX2 alone is emulated (8 lanes, its exp); AVX-512F without DQ takes AVX2's exp with 16 lanes: not
    assert implied_regime(exact_types, {}, {"avx2", "fma", "f16c"}, frozenset({"AVX2"}))[1] == []
    assert "lacks avx512dq:" in implied_regime(exact_types, {}, {"avx2", "fma", "f16c", "avx512f"}, build)[1][0]
    # A build with AMX multiplies Q4_1 and Q8_0 in AMX tiles: a caveat, so the per-op view decides.
    _, caveats = implied_regime(exact_types, {}, flags, build | {"AMX_INT8"})
    assert caveats == ["this llama.cpp build multiplies Q4_1, Q8_0 weights in AMX tiles (AMX_INT8), which are not "
                       "emulated: build llama-cpp-python without AMX (docs/engine-llamacpp.md)"]
    assert json.dumps(variant)  # a plain dict: what the reimpl engine takes as its variant
