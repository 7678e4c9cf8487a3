"""Every family tracer traces, on tiny random models saved by transformers itself (tests/families.py):
both engines agree bitwise at every point, every point is recorded on both sides, the noise floor and
local errors work, and each family's classic porting mistake first shows where it should, with a hint
that names the family's feature."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import CONFIG_MAPPING, AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import tracer
from tests.conftest import TOKENS
from tests.families import TINY_FAMILIES, WINDOW, family_config, write_tiny_family
from tracer import TracerError
from tracer.cli import main
from tracer.comparison.diff import INTEGER_POINT
from tracer.engines.load import resolve_and_load
from tracer.model.config import load_config, read_hf
from tracer.model.families import FAMILIES
from tracer.model.points import all_points, is_integer_point, layer_order, rank, sub_points

FAMILY_NAMES = list(TINY_FAMILIES)
L0, L1 = "model.layers.0.", "model.layers.1."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> its tiny model directory, written once for the module."""
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(root / family, family) for family in FAMILY_NAMES}


def expected_points(model_dir) -> list[str]:
    spec = read_hf(load_config(model_dir))
    return all_points(spec.num_hidden_layers, spec.family, final_softcap=spec.final_logit_softcapping is not None,
                      spec=spec)


# --- config readers: transformers' own semantics, family by family --------------------------------

MINIMAL = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def transformers_view(config) -> dict:
    """What transformers' config object says about the fields our spec holds."""
    rope = config.rope_parameters
    full, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, None)
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("mistral", "phi3", "mixtral") and window is not None:  # one window on every layer
        layer_types = ["sliding_attention"] * config.num_hidden_layers
    return {
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": getattr(config, "hidden_activation", None) or config.hidden_act,
        "rope_theta": full["rope_theta"], "rope_local_theta": local["rope_theta"] if local else None,
        "partial_rotary_factor": full.get("partial_rotary_factor", 1.0),
        "sliding_window": window if layer_types and "sliding_attention" in layer_types else None,
        "layer_types": tuple(layer_types) if layer_types and "sliding_attention" in layer_types else None,
        "query_pre_attn_scalar": getattr(config, "query_pre_attn_scalar", None),
        "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None),
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None),
    }


VIEWED = ("head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
          "hidden_act", "rope_theta", "rope_local_theta", "partial_rotary_factor", "sliding_window", "layer_types",
          "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def our_view(spec) -> dict:
    return {key: getattr(spec, key) for key in VIEWED}


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f != "llama"])
@pytest.mark.parametrize("keys", ["defaults", "tiny"])
def test_reader_reads_each_family_as_transformers_does(family, keys):
    """Absent keys take each family's own defaults (Qwen's 32 kv heads, Gemma's 256 head_dim and soft-caps,
    Mistral's 4096 window, Gemma 3's two RoPE bases, Phi-3's 1e-5 eps, ...), and written keys are read."""
    model_type = TINY_FAMILIES[family][0]
    overrides = dict(num_key_value_heads=4) if keys == "defaults" else {}
    config = family_config(family) if keys == "tiny" else CONFIG_MAPPING[model_type](**MINIMAL, **overrides)
    ours = read_hf(json.loads(config.to_json_string(use_diff=True)))
    assert ours.family == family
    assert our_view(ours) == transformers_view(config)


def test_absent_kv_heads_follow_each_familys_default():
    assert read_hf({**MINIMAL, "num_attention_heads": 64, "hidden_size": 4096, "model_type": "qwen2"}
                   ).num_key_value_heads == 32
    assert read_hf({**MINIMAL, "num_attention_heads": 32, "hidden_size": 4096, "model_type": "mistral"}
                   ).num_key_value_heads == 8
    assert read_hf({**MINIMAL, "model_type": "olmo2"}).num_key_value_heads == 4  # the query heads
    with pytest.raises(TracerError, match="config.json: num_key_value_heads must be a divisor of num_attention_heads"):
        read_hf({**MINIMAL, "model_type": "qwen3"})  # 32 kv heads for 4 query heads: transformers would break too


def test_phi3_partial_rotary_must_rotate_an_even_part_of_a_head():
    phi3 = {**MINIMAL, "model_type": "phi3"}  # head_dim 12
    assert read_hf({**phi3, "partial_rotary_factor": 0.5}).rotary_dim == 6
    assert read_hf({**phi3, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}).rotary_dim == 6
    for factor in (1.5, 0.25):  # more than a head; 3 dims, not pairs
        with pytest.raises(TracerError, match="partial_rotary_factor must be at most 1, rotating an even number"):
            read_hf({**phi3, "partial_rotary_factor": factor})


def test_an_unknown_model_type_is_one_line_naming_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**MINIMAL, "model_type": "falcon"}))
    assert main(["config", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tracer: error: unsupported model_type 'falcon'; tracer traces: llama, qwen2, qwen3, mistral, "
                   "gemma2, gemma3_text, phi3, olmo2, mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss, deepseek_v3")


def test_config_audit_reads_the_familys_keys_and_keeps_candle_to_llama(tiny, capsys):
    assert main(["config", "--model", str(tiny["gemma2"]), "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    hf = report["readers"]["hf"]
    assert {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
            "sliding_window"} <= set(hf["reads"])
    assert hf["spec"]["family"] == "gemma2" and hf["spec"]["final_logit_softcapping"] == 10.0
    assert "hidden_act" not in hf["reads"]  # Gemma 2 reads hidden_activation; a port reading hidden_act is wrong
    assert report["readers"]["candle"]["error"] == ("the candle reader reads Llama configs only (candle 0.11's "
                                                    "llama.rs); this is a 'gemma2' model")


# --- both engines, every point, every family ------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tracer_run_matches_with_every_point_on_both_sides(tiny, family, capsys):
    assert main(["run", "--model", str(tiny[family]), "--tokens", ",".join(map(str, TOKENS)), "--greedy", "2",
                 "--no-report", "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verdict"] == "match", summary["first_divergence"]
    points = summary["points"]
    assert [p["point"] for p in points] == expected_points(tiny[family])
    # an integer point (the experts a router picks) is the routing diff's: every token routed alike
    ids = [p for p in points if is_integer_point(p["point"])]
    assert all(p["missing_on"] == "neither" and p["reason"] == INTEGER_POINT for p in ids)
    assert summary.get("routing") is None if not ids else summary["routing"]["agreement"] == 1.0
    values = [p for p in points if not is_integer_point(p["point"])]
    assert all(p["recorded"] and p["missing_on"] is None for p in values)
    assert max(p["rel_l2"] for p in values) == 0.0  # bitwise: the same ops in the same order and dtypes
    # the noise floor (an f64 run) and the local errors (each block on the reference's inputs) exist everywhere
    assert all(p["noise"] is not None and p["local_rel_l2"] == 0.0 for p in values)
    assert 0 < max(p["noise"] for p in values) < 1e-5
    assert summary["greedy"]["same_prefix"] == 2


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_records_in_the_familys_execution_order(tiny, family):
    """The hooks fire in transformers' execution order: the order derived from the Family row is that order."""
    trace = tracer.record(tiny[family], TOKENS, engine="hf")
    assert trace.points == expected_points(tiny[family])
    assert trace.meta.family == family
    ranked = sorted(reversed(trace.points), key=lambda point: rank(point, family))
    assert ranked == trace.points


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_is_bitwise_too(tiny, family):
    """Gemma's scale in the model dtype, OLMo-2's f32 RoPE and norm weight, Gemma's f32 (1 + w): all mirrored."""
    reference = tracer.record(tiny[family], TOKENS, engine="hf", variant="dtype=bf16")
    candidate = tracer.record(tiny[family], TOKENS, engine="reimpl", variant="dtype=bf16")
    assert reference.points == [p for p in expected_points(tiny[family])]
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "phi3", "olmo2"])
def test_hooks_never_leak_and_change_nothing(tiny, family):
    engine = resolve_and_load("hf", tiny[family], {})
    interfaces = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    plain = engine.logits(TOKENS)
    trace = engine.record(TOKENS)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.model.modules()) == 0
    assert engine.model.config._attn_implementation == "eager"
    assert (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)) == interfaces
    final = "lm_head.softcap" if family == "gemma2" else "lm_head"
    assert torch.equal(trace[final], plain)  # the recording twin of eager attention is eager attention


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [3.0, 4.0, 5.0]}
ROPES = {  # RoPE beyond the plain one: Phi-3's longrope (short factors, and long ones past the pretraining
    # length, both with its attention factor) and Gemma 3's linear scaling of the global layers only
    "phi3-longrope-short": ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=64)),
    "phi3-longrope-long": ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=4)),
    "gemma3-linear-global": ("gemma3", dict(rope_scaling={"rope_type": "linear", "factor": 8.0})),
}


@pytest.mark.parametrize("name", ROPES)
def test_scaled_ropes_agree_bitwise(tmp_path, name):
    family, overrides = ROPES[name]
    model = write_tiny_family(tmp_path / name, family, **overrides)
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine="reimpl")
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)
    plain = tracer.record(model, TOKENS, engine="reimpl", variant="rope_scaling=drop")
    scaled = (L1,) if family == "gemma3" else (L0, L1)  # Gemma 3's layer 0 is local: its own base, never scaled
    for layer in (L0, L1):
        point = layer + "self_attn.q_rope"
        assert torch.equal(plain[point], reference[point]) == (layer not in scaled)


def test_windows_block_what_transformers_blocks(tiny):
    """On a sliding layer each query sees its last WINDOW keys; on a full layer the whole prefix."""
    trace = tracer.record(tiny["gemma2"], TOKENS, engine="reimpl")
    sliding, full = trace[L0 + "self_attn.probs"], trace[L1 + "self_attn.probs"]
    last = len(TOKENS) - 1
    assert (sliding[:, last, : last - WINDOW + 1] == 0).all() and (sliding[:, last, last - WINDOW + 1:] > 0).all()
    assert (full[:, last] > 0).all()


def test_a_loaded_model_of_a_family_is_recorded_by_both_engines(tiny):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny["gemma3"], attn_implementation="eager")
    on_hf = tracer.record(loaded, TOKENS, engine="hf")
    on_reimpl = tracer.record(loaded, TOKENS, engine="reimpl")
    assert tracer.compare(on_hf, on_reimpl).verdict == "match"
    assert "model.layers.0.self_attn.q_norm" in on_hf and on_hf.meta.family == "gemma3"


# --- the families' classic porting mistakes -------------------------------------------------------

# (family, variant, first divergence, words its hint must say)
MISTAKES = [
    ("gemma2", "norm_offset=drop", L0 + "input_layernorm", "(1 + weight)"),
    ("gemma3", "norm_offset=drop", L0 + "input_layernorm", "(1 + weight)"),
    ("gemma2", "embed_scale=drop", "model.embed_tokens", "sqrt(hidden_size)"),
    ("gemma3", "embed_scale=drop", "model.embed_tokens", "sqrt(hidden_size)"),
    ("gemma2", "softcap=drop", L0 + "self_attn.scores", "soft-caps attention scores"),
    ("qwen3", "qk_norm=drop", L0 + "self_attn.q_norm", "per-head RMSNorm"),
    ("gemma3", "qk_norm=drop", L0 + "self_attn.q_norm", "per-head RMSNorm"),
    ("olmo2", "qk_norm=drop", L0 + "self_attn.q_norm", "whole projection"),
    ("qwen2", "window=ignore", L1 + "self_attn.probs", "sliding-window"),  # Qwen2 windows from max_window_layers=1
    ("mistral", "window=ignore", L0 + "self_attn.probs", "sliding-window"),
    ("gemma2", "window=ignore", L0 + "self_attn.probs", "sliding-window"),
    ("gemma3", "window=ignore", L0 + "self_attn.probs", "sliding-window"),
    ("phi3", "window=ignore", L0 + "self_attn.probs", "sliding-window"),
    ("gemma3", "rope_local=global", L0 + "self_attn.q_rope", "rope_local_base_freq"),
    ("gemma2", "act=gelu", L0 + "mlp.act", "gelu_pytorch_tanh"),
    ("phi3", "qkv_split=kqv", L0 + "self_attn.q_rope", "fused qkv_proj"),
    ("phi3", "qkv_split=qvk", L0 + "self_attn.k_rope", "fused qkv_proj"),
    ("phi3", "gate_up=up_gate", L0 + "mlp.act", "gate first"),
    ("qwen2", "bias=ignore", L0 + "self_attn.q_proj", "q/k/v biases"),
]


@pytest.mark.parametrize("family, variant, point, words", MISTAKES, ids=[f"{f}-{v}" for f, v, *_ in MISTAKES])
def test_each_mistake_first_shows_where_the_family_does_it(tiny, family, variant, point, words):
    result = tracer.run(tiny[family], tokens=TOKENS, variant=variant, greedy=0, progress=False)
    first = result.first_divergence
    assert result.verdict == "diverged"
    assert first.point == point, first.point
    assert first.localized_by == "local" and first.upstream_max_rel_l2 in (0.0, None)  # None: nothing upstream
    assert any(words in hint for hint in first.hints), first.hints


def test_the_final_soft_cap_is_a_point_of_its_own(tiny):
    reference = tracer.record(tiny["gemma2"], TOKENS, engine="hf")
    capped, raw = reference["lm_head.softcap"], reference["lm_head"]
    assert torch.equal(capped, torch.tanh(raw / 10.0) * 10.0)
    assert raw.abs().max() > 10.0 > capped.abs().max()  # the cap binds on this model
    # the logits summary is on what the model returns: the capped logits
    uncapped = tracer.record(tiny["gemma2"], TOKENS, engine="reimpl", variant="softcap=drop")
    summary = tracer.compare(reference, uncapped).logits
    assert summary.max_abs_all == float((uncapped["lm_head.softcap"].double() - capped.double()).abs().max())


def test_window_ignore_matches_while_the_prompt_fits_in_the_window(tiny):
    within = TOKENS[:WINDOW]
    assert tracer.run(tiny["mistral"], tokens=within, variant="window=ignore", greedy=0, progress=False).verdict \
        == "match"
    longer = tracer.run(tiny["mistral"], tokens=TOKENS, variant="window=ignore", greedy=0, progress=False)
    profile = longer.first_divergence.by_position
    assert max(profile[:WINDOW]) == 0 and min(profile[WINDOW:]) > 0  # exact within the window, not after
    assert any("window of 4 keys" in hint for hint in longer.first_divergence.hints)


def test_embed_scale_in_f32_differs_only_in_half_precision(tiny):
    """Gemma rounds sqrt(hidden) to the model's dtype: 6.9375 in bf16 for hidden 48 (6.9282 in f32)."""
    f32 = tracer.run(tiny["gemma2"], tokens=TOKENS, variant="embed_scale=f32", greedy=0, progress=False)
    assert f32.verdict == "match"
    bf16 = tracer.run(tiny["gemma2"], tokens=TOKENS, variant="dtype=bf16,embed_scale=f32",
                      reference_variant="dtype=bf16", greedy=0, progress=False, noise_floor=False)
    assert bf16.first_divergence.point == "model.embed_tokens"
    assert 1e-3 < bf16.first_divergence.rel_l2 < 3e-3  # |6.9375 / 6.9282 - 1| = 1.3e-3, plus bf16 rounding


@pytest.mark.parametrize("family, variant, message", [
    ("qwen2", "norm_offset=drop", "knob 'norm_offset' does not apply to qwen2 models; it applies to gemma2, gemma3"),
    ("gemma2", "config=candle", "the candle reader reads Llama configs only (candle 0.11's llama.rs); this is a "
                                "'gemma2' model"),
    ("gemma2", "preset=candle", "the candle reader reads Llama configs only"),
    ("gemma3", "norm=candle", "knob 'norm' does not apply to gemma3 models; it applies to llama, qwen2, qwen3, "
                              "mistral, phi3"),
    ("llama", "qk_norm=drop", "knob 'qk_norm' does not apply to llama models; it applies to qwen3, gemma3, olmo2"),
    ("gemma3", "softcap=drop", "softcap=drop changes nothing here: attn_logit_softcapping and "
                               "final_logit_softcapping are null"),
    ("qwen3", "window=ignore", "window=ignore changes nothing here: this model's config has no sliding window"),
    ("gemma2", "attn=sdpa", "attn=sdpa cannot soft-cap attention scores"),
])
def test_a_knob_that_does_not_apply_is_an_error_saying_why(tiny, family, variant, message):
    with pytest.raises(TracerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tracer.record(tiny[family], TOKENS, engine="reimpl", variant=variant)


def test_config_level_family_knobs_mean_the_same_on_hf(tiny):
    for family, variant in (("gemma3", "rope_local=global"), ("gemma2", "act=gelu")):
        on_hf = tracer.record(tiny[family], TOKENS, engine="hf", variant=variant)
        on_reimpl = tracer.record(tiny[family], TOKENS, engine="reimpl", variant=variant)
        assert all(torch.equal(on_hf[p], on_reimpl[p]) for p in on_hf.points)
    with pytest.raises(TracerError, match="transformers' qwen2 always has q/k/v biases"):
        tracer.record(tiny["qwen2"], TOKENS, engine="hf", variant="bias=ignore")


def test_sweep_and_diagnose_use_the_familys_knobs(tiny):
    from tracer.pipeline.catalogue import default_variants

    spec = read_hf(load_config(tiny["gemma3"]))
    chosen = default_variants(spec)
    assert {"norm_offset=drop", "embed_scale=drop", "qk_norm=drop", "window=ignore", "rope_local=global",
            "act=gelu"} <= set(chosen)
    assert not {"config=candle", "preset=candle", "norm=candle", "softcap=drop"} & set(chosen)  # Llama's / no caps
    observed = tracer.record(tiny["gemma2"], TOKENS, engine="reimpl", variant="norm_offset=drop")
    diagnosis = tracer.diagnose(observed, tiny["gemma2"], progress=False)
    assert diagnosis.best["variant"] == "norm_offset=drop"
    assert {"softcap=drop", "embed_scale=drop", "window=ignore"} <= {entry["variant"] for entry in diagnosis.ranking}


def test_variants_lists_a_familys_knobs_with_their_first_divergence(capsys):
    assert main(["variants", "--family", "gemma3"]) == 0
    out = capsys.readouterr().out
    assert "rope_local=global: first divergence self_attn.q_rope of the first local layer" in out
    assert "\nnorm_offset " in out and "\nqkv_split " not in out and "\npreset " not in out
    assert main(["variants"]) == 0
    # the title column wraps on a terminal narrower than 100 columns (CI's is 80)
    assert re.search(r"^gemma3 +Gemma 3 ", capsys.readouterr().out, re.M)


def test_point_table_describes_every_familys_points():
    for family in FAMILIES:
        order = layer_order(family)
        entries = sub_points(family)
        assert tuple(entries) == order
        for sub, entry in entries.items():
            assert entry.source == "<in>" or entry.source in order, (family, sub, entry.source)
    assert sub_points("gemma2")["post_attention_layernorm"].source == "self_attn.o_proj"
    assert sub_points("llama")["post_attention_layernorm"].source == "resid_mid"
    assert sub_points("olmo2")["resid_mid"].observed == "input:mlp"


# --- GGUF files of another family -----------------------------------------------------------------


# transformers' GGUF reader takes no head_dim for Qwen3 (its config default, 128, is every Qwen3's), nor windows
GGUF_FAMILIES = {"qwen2": dict(use_sliding_window=False), "qwen3": dict(head_dim=128)}


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_a_gguf_of_another_family_is_converted_and_traced(tmp_path, family):
    pytest.importorskip("gguf")
    from tests.families import write_tiny_gguf
    from tracer.files.sources import gguf_model_path

    source = write_tiny_family(tmp_path / "hf", family, **GGUF_FAMILIES[family])
    gguf = write_tiny_gguf(source, tmp_path / f"{family}.gguf")
    converted = gguf_model_path(gguf, tmp_path / "cache", progress=False)
    assert read_hf(load_config(converted)) == read_hf(load_config(source))
    original = tracer.record(source, TOKENS, engine="reimpl")
    assert all(torch.equal(original[p], t)
               for p, t in tracer.record(converted, TOKENS, engine="reimpl").tensors.items())
    assert tracer.run(converted, tokens=TOKENS, greedy=0, progress=False).verdict == "match"
