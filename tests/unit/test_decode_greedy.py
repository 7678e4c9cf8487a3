"""The greedy check on each side's own KV cache, and `--decode N` on `sweep` and `diagnose` (tiny random Llama).

The continuation of an engine that decodes is its cached decode with nothing recorded (one forward per
token, as generating costs; tracer's own forward with no cache knob checks the other side's continuation
first, in one forward, and decodes only past where they part). Where the sides part, the step whose argmax
flips is recorded from each side's cache and names the same point as the uncached forwards over the same
tokens do, and a bug that lives only in the cache is now seen by the greedy check, with its layer and op."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer.cli import main
from tracer.comparison.diff import compare
from tracer.comparison.result import Tolerance
from tracer.engines.load import resolve_and_load
from tracer.files.sources import resolve_source
from tracer.model.config import load_config, read_hf
from tracer.model.knobs import parse_variant
from tracer.model.points import CACHE_K, Q_ROPE, SCORES, layer_point
from tracer.pipeline import greedy
from tracer.pipeline.catalogue import default_variants, diagnosis_variants

STEPS = 8
DECODE = 4


@pytest.fixture(scope="module")
def engines(llama_dir):
    source = resolve_source(str(llama_dir), False)
    return source, resolve_and_load("hf", source, {})


def counted(engine) -> list[int]:
    """The lengths of the token lists `engine`'s model runs from now on, one per forward."""
    fed, forward = [], engine.model.forward

    def counting(tokens, *args, **kwargs):
        fed.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    engine.model.forward = counting
    return fed


def test_the_cached_continuation_is_what_transformers_generates_one_forward_per_token(engines):
    source, hf = engines
    with torch.inference_mode():
        generated = hf.model.generate(torch.tensor([TOKENS]), max_new_tokens=STEPS, do_sample=False,
                                      min_new_tokens=STEPS)[0, len(TOKENS):].tolist()
    assert greedy.generated(hf, TOKENS, STEPS) == generated
    reimpl = resolve_and_load("reimpl", source, {})
    fed = counted(reimpl)
    assert greedy.generated(reimpl, TOKENS, STEPS) == generated
    assert fed == [len(TOKENS)] + [1] * (STEPS - 1)  # the prompt once, then one token per step: no recompute


def test_a_guess_is_checked_in_one_forward_and_the_cache_decodes_only_past_where_it_parts(engines):
    source, hf = engines
    reference = greedy.generated(hf, TOKENS, STEPS)
    reimpl = resolve_and_load("reimpl", source, {})
    fed = counted(reimpl)
    assert greedy.generated(reimpl, TOKENS, STEPS, guess=reference) == reference
    assert fed == [len(TOKENS) + STEPS - 1]  # the prompt and the guess, once
    parting = 3
    wrong = reference[:parting] + [(token + 1) % 97 for token in reference[parting:]]
    fed.clear()
    assert greedy.generated(reimpl, TOKENS, STEPS, guess=wrong) == reference
    # the check, then the prompt and the 3 agreed tokens into the cache, then one token per step
    assert fed == [len(TOKENS) + STEPS - 1, len(TOKENS) + parting] + [1] * (STEPS - parting - 1)


def test_a_cache_knob_decodes_every_step_with_the_cache_whatever_the_guess(engines):
    source, hf = engines
    reference = greedy.generated(hf, TOKENS, STEPS)
    restarted = resolve_and_load("reimpl", source, parse_variant("decode_positions=restart"))
    assert not restarted.decode_is_forward and resolve_and_load("reimpl", source, {}).decode_is_forward
    fed = counted(restarted)
    continuation = greedy.generated(restarted, TOKENS, STEPS, guess=reference)
    assert fed == [len(TOKENS)] + [1] * (STEPS - 1)
    assert continuation != reference  # the bug lives in the cache: a forward over the guess would not see it


@pytest.mark.parametrize("variant, flip_point", [
    ("theta=500", layer_point(0, Q_ROPE)),
    ("rope=interleaved", layer_point(0, Q_ROPE)),
    ("kv_repeat=tile", layer_point(0, SCORES)),
])
def test_the_flip_step_on_the_cache_names_the_point_the_uncached_forwards_name(engines, variant, flip_point):
    source, hf = engines
    candidate = resolve_and_load("reimpl", source, parse_variant(variant))
    reference = greedy.generated(hf, TOKENS, STEPS)
    parted = greedy.summary(reference, greedy.generated(candidate, TOKENS, STEPS, guess=reference), str)
    assert parted.first_flip is not None
    ids = TOKENS + reference[:parted.first_flip - 1]
    uncached = compare(hf.record(ids), candidate.record(ids), Tolerance()).first_divergence
    steps = [greedy.flip_step(side, TOKENS, reference, parted.first_flip) for side in (hf, candidate)]
    cached = compare(*steps, Tolerance()).first_divergence
    assert steps[0].tokens == ids[-1:] or parted.first_flip == 1  # the flip's step, fed the reference's token
    assert cached.point == uncached.point == flip_point


@pytest.mark.parametrize("variant, point", [
    ("decode_positions=restart", layer_point(0, Q_ROPE)),
    ("cache_keys=unrotated", layer_point(0, CACHE_K)),
])
def test_a_bug_only_in_the_cache_parts_the_continuations_and_is_named(llama_dir, variant, point):
    """Before, both continuations were uncached: identical, and nothing named."""
    result = tracer.run(llama_dir, tokens=TOKENS, variant=variant, greedy=STEPS, noise_floor=False, progress=False)
    assert result.verdict == "match"  # the prompt's uncached forward cannot see it
    assert result.greedy.first_flip is not None
    assert result.greedy.first_flip_divergence.point == point


def test_a_side_whose_cache_refuses_is_decoded_uncached(engines):
    source, hf = engines
    regime = resolve_and_load("reimpl", source, {"ops": "candle"})  # candle's attention: no KV cache emulated
    with pytest.raises(tracer.TracerError, match="KV cache"):
        regime.decode(TOKENS, 1)
    reference = greedy.generated(hf, TOKENS, STEPS)
    assert greedy.decoded(regime, TOKENS, STEPS) is None
    assert greedy.generated(regime, TOKENS, STEPS, guess=reference) == greedy.continuation(regime, TOKENS, STEPS)


# --- sweep and diagnose --decode --------------------------------------------------------------------


def test_with_decode_the_sweep_runs_the_decode_only_knobs(llama_dir):
    spec = read_hf(load_config(llama_dir))
    plain, decoding = default_variants(spec), default_variants(spec, decode=True)
    assert "decode_positions=restart" not in plain and "cache_keys=unrotated" not in plain
    assert set(decoding) - set(plain) == {"decode_positions=restart", "cache_keys=unrotated", "cache_reset=kept"}
    assert {"decode_positions=restart", "cache_keys=unrotated"} <= set(diagnosis_variants(spec, decode=True))


def test_sweep_decode_compares_every_variants_steps(llama_dir, capsys):
    assert main(["sweep", "--model", str(llama_dir), "--tokens", ",".join(map(str, TOKENS)), "--decode", str(DECODE),
                 "--variants", "decode_positions=restart; cache_keys=unrotated; theta=500", "--no-noise",
                 "--no-report", "--json", "-"]) == 0
    rows = {row["variant"]: row for row in json.loads(capsys.readouterr().out)["variants"]}
    found = {variant: (row["step"], row["first_divergence"]["point"]) for variant, row in rows.items()}
    assert found == {"decode_positions=restart": (1, layer_point(0, Q_ROPE)),
                     "cache_keys=unrotated": (0, layer_point(0, CACHE_K)),
                     "theta=500": (None, layer_point(0, Q_ROPE))}  # the prefill diverges: no step
    assert all(row["verdict"] == "diverged" for row in rows.values())
    result = tracer.sweep(llama_dir, tokens=TOKENS, decode=DECODE, variants="decode_positions=shifted",
                          noise_floor=False, progress=False)
    assert result.rows[0].step == 1 and len(result.rows[0].result.steps) == DECODE + 1
    assert result.table().loc["decode_positions=shifted", "step"] == 1


def test_diagnose_decode_ranks_the_cache_mistake_first(llama_dir, capsys):
    observed = tracer.record(llama_dir, TOKENS, engine="reimpl", variant="decode_positions=restart", decode=DECODE,
                             progress=False)
    tried = "decode_positions=restart; cache_keys=unrotated; theta=500; eps=1e-3"
    plain = tracer.diagnose(observed, llama_dir, variants=tried, progress=False)
    assert plain.observed.verdict == "match"  # the prompt alone cannot tell
    result = tracer.diagnose(observed, llama_dir, variants=tried, decode=DECODE, progress=False)
    assert result.observed.step == 1 and result.observed.first_divergence.point == layer_point(0, Q_ROPE)
    assert result.best["variant"] == "decode_positions=restart"
    assert result.ranking[0]["score"] > result.ranking[1]["score"]
    with pytest.raises(tracer.TracerError, match=f"the trace holds {DECODE} decode steps"):
        tracer.diagnose(observed, llama_dir, variants=tried, decode=DECODE + 1, progress=False)
