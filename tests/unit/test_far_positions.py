"""RoPE scaling at far positions without long prompts (`--position-offset`): every rope type transformers
scales with (linear, llama3, yarn, dynamic NTK, Phi-3's longrope) agrees bitwise between hf and reimpl
at position 100000, prefill and cached decode; each classic scaling mistake of a port (a knob of Rope)
first diverges at layer 0's q_rope with a hint about RoPE; tiny random models written as real files."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.engines.base import at_positions
from tracer.engines.load import resolve_and_load
from tracer.model.components.rope import rope_attention_scaling, rope_inv_freq, yarn_mscale
from tracer.model.config import read_hf
from tracer.model.points import Q_ROPE, layer_point

FAR = 100_000
LONG_CONTEXT = 131_072
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen2.5's
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0], "long_factor": [3.0, 4.0, 5.0]}
# name -> config overrides of a tiny Llama (Phi-3's longrope: a tiny Phi-3, rotary on half of each head)
SCALED = {
    "llama3": dict(rope_theta=500000.0, max_position_embeddings=LONG_CONTEXT, rope_scaling=LLAMA3),
    "yarn": dict(max_position_embeddings=LONG_CONTEXT, rope_scaling=YARN),
    "linear": dict(max_position_embeddings=LONG_CONTEXT, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # dynamic NTK scales past max_position_embeddings only: at 100000 its base has grown 195-fold
    "dynamic": dict(max_position_embeddings=2048, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "longrope": dict(max_position_embeddings=LONG_CONTEXT, original_max_position_embeddings=4096,
                     rope_scaling=LONGROPE, sliding_window=None),
}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scaled")
    return {name: write_tiny_family(folder / name, "phi3", **overrides) if name == "longrope"
            else write_tiny_llama(folder / name, **overrides) for name, overrides in SCALED.items()}


@pytest.mark.parametrize("name", SCALED)
def test_hf_and_reimpl_agree_bitwise_at_position_100000_prefill_and_decode(scaled, name):
    hf = tracer.record(scaled[name], TOKENS, engine="hf", position_offset=FAR, decode=2, progress=False)
    reimpl = tracer.record(scaled[name], TOKENS, engine="reimpl", position_offset=FAR, decode=2, progress=False)
    assert len(hf.steps) == len(reimpl.steps) == 2 and hf.steps[-1].meta.position_offset == FAR + len(TOKENS) + 1
    for ours, theirs in zip((reimpl, *reimpl.steps), (hf, *hf.steps)):
        unequal = [p for p in theirs.points if not torch.equal(ours[p], theirs[p])]
        assert not unequal, unequal
    if name == "dynamic":  # without its scaling the model has 2048 positions (the test below shows it at work)
        return
    # the scaling is at work there: without it, layer 0's queries are other ones
    plain = tracer.record(scaled[name], TOKENS, engine="reimpl", position_offset=FAR, variant="rope_scaling=drop",
                          progress=False)
    assert not torch.allclose(plain[layer_point(0, Q_ROPE)], hf[layer_point(0, Q_ROPE)], rtol=1e-3, atol=1e-3)


def test_run_at_position_100000_matches(scaled):
    result = tracer.run(scaled["yarn"], tokens=TOKENS, position_offset=FAR, greedy=1, decode=1, progress=False)
    assert result.verdict == "match" and len(result.steps) == 2 and result.greedy.same_prefix == 1


@pytest.fixture(scope="module")
def references(scaled):
    """hf's trace of each scaled model at (name, first position), recorded once."""
    cache = {}

    def reference(name: str, offset: int):
        if (name, offset) not in cache:
            cache[name, offset] = tracer.record(scaled[name], TOKENS, engine="hf", position_offset=offset,
                                                progress=False)
        return cache[name, offset]

    return reference


# (model, variant, offset, the hint's words, rel_l2 bounds of layer 0's q_rope)
MISTAKES = [
    ("llama3", "llama3_factors=ignore", FAR, "every position differs at RoPE", (0.3, 2)),  # measured 0.72
    # at 0..6 only the long wavelengths differ, by little: measured 8.7e-4
    ("llama3", "llama3_factors=ignore", 0, "exact at position 0 and growing with position", (1e-4, 3e-3)),
    ("yarn", "yarn_mscale=drop", FAR, f"the candidate is the reference × {1 / yarn_mscale(4.0):.6g}", (0.1, 0.15)),
    ("yarn", "yarn_mscale=drop", 0, f"the candidate is the reference × {1 / yarn_mscale(4.0):.6g}", (0.1, 0.15)),
    ("longrope", "longrope_ctx=4096", FAR, "every position differs at RoPE", (0.3, 2)),  # short factors at 100000
    ("longrope", f"longrope_ctx={LONG_CONTEXT}", 0, "exact at position 0", (0.3, 2)),  # long ones at 0..6 (#24823)
]


@pytest.mark.parametrize("name, variant, offset, words, bounds", MISTAKES,
                         ids=[f"{m}-{v}-{o}" for m, v, o, *_ in MISTAKES])
def test_each_scaling_mistake_first_diverges_at_q_rope_with_a_hint(scaled, references, name, variant, offset, words,
                                                                   bounds):
    candidate = tracer.record(scaled[name], TOKENS, engine="reimpl", variant=variant, position_offset=offset,
                              progress=False)
    first = tracer.compare(references(name, offset), candidate).first_divergence
    assert first.point == layer_point(0, Q_ROPE) and first.upstream_max_rel_l2 == 0.0, first.point
    assert bounds[0] < first.rel_l2 < bounds[1]
    assert (first.by_position[0] == 0.0) == (offset == 0 and variant != "yarn_mscale=drop")  # mscale scales position 0
    assert any(words in hint for hint in first.hints), first.hints


def test_a_scaling_mistake_is_localized_by_a_run_at_position_100000(scaled):
    result = tracer.run(scaled["yarn"], tokens=TOKENS, variant="yarn_mscale=drop", position_offset=FAR, greedy=0,
                        progress=False)
    first = result.first_divergence
    assert result.verdict == "diverged" and first.point == layer_point(0, Q_ROPE) and first.localized_by == "local"


@pytest.mark.parametrize("variant, offset", [
    ("longrope_ctx=4096", 0),  # a short context and a short prompt: short factors on both sides
    (f"longrope_ctx={LONG_CONTEXT}", FAR),  # a long context at far positions: long factors on both sides
])
def test_longrope_picked_by_the_context_shows_only_where_context_and_sequence_disagree(scaled, references, variant,
                                                                                        offset):
    candidate = tracer.record(scaled["longrope"], TOKENS, engine="reimpl", variant=variant,
                              position_offset=offset, progress=False)
    reference = references("longrope", offset)
    assert all(torch.equal(reference[p], candidate[p]) for p in reference.points)


def test_dynamic_ntk_is_stateless_on_hf_as_on_reimpl(scaled):
    """transformers keeps the frequencies of the longest sequence seen; tracer's hf engine restarts them
    for each forward, so a trace does not depend on what ran before."""
    engine = resolve_and_load("hf", scaled["dynamic"], {})
    point = layer_point(0, Q_ROPE)
    first = engine.record(TOKENS, **at_positions(FAR, len(TOKENS)))[point]
    engine.record(TOKENS * 3, **at_positions(FAR, 3 * len(TOKENS)))
    assert torch.equal(engine.record(TOKENS, **at_positions(FAR, len(TOKENS)))[point], first)


def test_dynamic_ntk_is_plain_rope_within_max_positions_and_has_no_limit(scaled):
    spec = read_hf({**_config(scaled["dynamic"])})
    plain = spec.replace(rope_scaling=None)
    assert torch.equal(rope_inv_freq(spec, num_tokens=2048), rope_inv_freq(plain, num_tokens=2048))
    assert not torch.equal(rope_inv_freq(spec, num_tokens=2049), rope_inv_freq(plain, num_tokens=2049))
    # its own use is past max_position_embeddings (2048): no limit there, as in transformers (the test
    # above runs it at 100000); without its scaling the model has 2048 positions
    with pytest.raises(TracerError, match="the prompt has 7 tokens from position 100000; the model has 2048 positions"):
        tracer.run(scaled["dynamic"], tokens=TOKENS, position_offset=FAR, variant="rope_scaling=drop", progress=False)


def _config(folder) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("rope_scaling, extra", [
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, {}),  # Qwen2.5
    ({"type": "yarn", "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 0.707,
      "original_max_position_embeddings": 4096}, {}),  # DeepSeek's keys (mscale over mscale_all_dim)
    ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
      "original_max_position_embeddings": 4096}, {}),  # gpt-oss's untruncated ramp
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25, "original_max_position_embeddings": 8192}, {}),
    ({"rope_type": "yarn", "factor": 4.0}, {"original_max_position_embeddings": 8192}),  # at top level: it wins
    ({"rope_type": "dynamic", "factor": 2.0}, {}),
])
def test_real_yarn_and_dynamic_configs_read_as_transformers_computes_them(rope_scaling, extra):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 163840, "rope_scaling": rope_scaling, **extra}
    spec = read_hf(config)
    theirs = LlamaConfig(**config)
    for key, value in extra.items():  # what from_pretrained leaves as an attribute before the rope is computed
        setattr(theirs, key, value)
    kind = spec.rope_scaling["rope_type"]
    length = FAR + len(TOKENS)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[kind](theirs, "cpu", seq_len=torch.tensor(length))
    assert torch.equal(rope_inv_freq(spec, num_tokens=length), inv_freq)
    assert rope_attention_scaling(spec) == attention


def test_a_scaling_knob_on_a_model_without_its_rope_type_is_refused_in_one_line(scaled, tmp_path):
    with pytest.raises(TracerError, match=r"llama3_factors=ignore changes nothing here: this model's rope_type is "
                                          r"'yarn', not llama3$"):
        tracer.record(scaled["yarn"], TOKENS, engine="reimpl", variant="llama3_factors=ignore")
    with pytest.raises(TracerError, match="longrope_ctx=4096 changes nothing here: this model's rope_type is "
                                          "'default'"):
        tracer.record(write_tiny_llama(tmp_path / "plain"), TOKENS, engine="reimpl", variant="longrope_ctx=4096")
    unit = write_tiny_llama(tmp_path / "unit", max_position_embeddings=LONG_CONTEXT,
                            rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})  # DeepSeek-V2-Lite's
    with pytest.raises(TracerError, match="yarn_mscale=drop changes nothing here: this model's YaRN attention factor "
                                          "is 1"):
        tracer.record(unit, TOKENS, engine="reimpl", variant="yarn_mscale=drop")
    with pytest.raises(TracerError, match="bad value 'long' for knob 'longrope_ctx'; expected sequence | an allocated"):
        tracer.record(scaled["longrope"], TOKENS, engine="reimpl", variant="longrope_ctx=long")


def test_variants_lists_the_scaling_knobs(capsys):
    assert main(["variants", "--family", "phi3"]) == 0
    out = capsys.readouterr().out
    for knob in ("llama3_factors", "longrope_ctx", "yarn_mscale"):
        assert f"\n{knob} " in out, knob


def test_longrope_crossing_its_pretraining_length_during_decode_names_the_step(scaled):
    """Positions 4086..4092 then 4 steps: the sequence passes original_max_position_embeddings (4096) at
    step 4, where transformers switches to the long factors (the cached keys keep the short ones); a port
    that picks them by a context of 4096 keeps the short ones there."""
    result = tracer.run(scaled["longrope"], tokens=TOKENS, variant="longrope_ctx=4096", position_offset=4086,
                        greedy=0, decode=4, progress=False)
    assert [step.verdict for step in result.steps] == ["match"] * 4 + ["diverged"]
    assert result.first_divergence.point == layer_point(0, Q_ROPE)
    assert any("LongRoPE's long factors past original_max_position_embeddings" in hint
               for hint in result.first_divergence.hints)


def test_a_sweep_tries_the_scaling_mistake_of_the_models_own_rope_type(scaled):
    from tracer.pipeline.catalogue import default_variants

    knobs = {name: {v for v in default_variants(read_hf(_config(scaled[name])))
                    if v.split("=")[0] in ("llama3_factors", "longrope_ctx", "yarn_mscale")} for name in SCALED}
    assert knobs == {"llama3": {"llama3_factors=ignore"}, "yarn": {"yarn_mscale=drop"}, "linear": set(),
                     "dynamic": set(), "longrope": {f"longrope_ctx={LONG_CONTEXT}"}}
