"""The cheap noise floor (`tracer.pipeline.noise_floor`): an f64 run of the prompt's first rows, scaled, and the
exact floor measured wherever a verdict rests on it."""

import dataclasses

import pytest
import torch

import tracer
from tests.conftest import write_tiny_llama
from tracer.comparison.result import Tolerance
from tracer.files.sources import ModelSource
from tracer.model.points import layer_of
from tracer.pipeline.noise_floor import FLOOR_SCALE, estimate_noise, floor_rows, prefix_noise
from tracer.reports.terminal import terminal_summary
from tracer.traces.trace import Trace

IDS = torch.randint(3, 97, (64,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A tiny Llama, its reference on 64 tokens and that reference's exact floor."""
    model = write_tiny_llama(tmp_path_factory.mktemp("floor") / "m")
    reference = tracer.record(model, IDS, engine="hf", progress=False)
    return model, reference, estimate_noise(ModelSource(model), reference, {})


def test_the_cheap_floor_runs_a_quarter_to_a_half_of_the_prompt():
    assert [floor_rows(n, "cheap") for n in (7, 16, 17, 64, 65, 128, 300, 512, 2048)] == \
        [7, 16, 16, 16, 32, 32, 128, 128, 512]
    assert floor_rows(300, "exact") == 300


def test_the_cheap_floor_is_the_exact_floor_of_the_first_rows(measured):
    """The reference's rows of the first 16 tokens against an f64 run of those tokens alone: what a run of those
    16 tokens measures (the same rounding up to the summation order of a 16-row against a 64-row product)."""
    model, reference, exact = measured
    source = ModelSource(model)
    cheap = prefix_noise(source, reference, {}, 16, None)
    alone = estimate_noise(source, tracer.record(model, IDS[:16], engine="hf", progress=False), {})
    assert cheap.keys() == exact.keys() == alone.keys()
    moving = [p for p in alone if alone[p] > 1e-8]
    assert len(moving) > 30
    assert all(0.5 < cheap[p] / alone[p] < 2 for p in moving)
    # on this model the calibration's scale covers the whole prompt's floor at every point
    assert all(exact[p] <= FLOOR_SCALE * cheap[p] for p in moving)


def perturbed(reference: Trace, point: str, rel_l2: float) -> Trace:
    """`reference` with `point` moved by exactly `rel_l2` (relative L2), every other point as it is."""
    value = reference[point].double()
    direction = torch.randn(value.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    moved = value + direction * (rel_l2 * value.norm() / direction.norm())
    tensors = dict(reference.tensors) | {point: moved.float()}
    return Trace(tensors, dataclasses.replace(reference.meta, engine="file"))


@pytest.mark.parametrize("share", [0.9, 1.5])
def test_a_thin_margin_is_settled_by_the_exact_floor(measured, tmp_path, monkeypatch, share):
    """A candidate 0.9 × its exact bound away at one point of the last layer is a match, one 1.5 × away
    diverges there, whatever the scaled floor would say: the cheap floor's run measures the exact floor through
    that layer (the point's error lies within the band where the scaled floor cannot tell), as --floor exact
    does for the whole prompt."""
    model, reference, exact = measured
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))  # each run measures its own floor
    tolerance = Tolerance()
    last = max(layer_of(p) or 0 for p in exact)
    point = max((p for p in exact if layer_of(p) == last), key=exact.get)
    bound = tolerance.threshold(exact[point])
    assert bound > tolerance.noise_floor  # the point's own floor decides, not the absolute one
    path = perturbed(reference, point, share * bound).save(tmp_path / "candidate.safetensors")
    cheap = tracer.run(model, tokens=IDS, candidate=f"file:{path}", greedy=0, progress=False)
    full = tracer.run(model, tokens=IDS, candidate=f"file:{path}", greedy=0, noise_floor="exact", progress=False)
    assert cheap.verdict == full.verdict == ("match" if share < 1 else "diverged")
    judged = {p.point: p for p in cheap.points}[point]
    assert judged.threshold == pytest.approx(bound, rel=1e-12)  # the exact floor's bound, not the scaled one
    assert (cheap.floor.rows, cheap.floor.tokens, full.floor.rows) == (16, 64, 64)
    assert layer_of(cheap.floor.exact_through) == last
    if share > 1:
        assert cheap.first_divergence.point == full.first_divergence.point == point
    else:
        assert full.floor.closest == (point, pytest.approx(share, rel=1e-3))  # (the f32 rounding of the move)
        header = " ".join(terminal_summary(cheap).split())  # (wrapped to the terminal's width)
        assert f"cheap (an f64 run of the first 16 of 64 tokens, × {FLOOR_SCALE:g}; exact through" in header
        assert f"closest to its bound: {point} at 0.90 of it" in header


def test_a_floor_read_from_the_cache_is_said_and_prompts_sharing_its_rows_share_it(tmp_path, monkeypatch):
    """The cheap floor is keyed by its rows' tokens: a prompt of 64 tokens after one of 40 with the same first
    16 reads it from the cache (an extension of a measured prompt), and one of 64 after one of 128 that measured
    32 rows takes those: more rows than it needs. The exact values a confirmation measured are kept for the same
    prompt."""
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    model = write_tiny_llama(tmp_path / "m", max_position_embeddings=256)
    ids = IDS + IDS[:64]

    def run(count):
        return tracer.run(model, tokens=ids[:count], variant="theta=500", greedy=0, progress=False)

    first, extended, again = run(40), run(64), run(64)
    assert not first.floor.from_cache and extended.floor.from_cache and again.floor.from_cache
    assert (first.floor.rows, extended.floor.rows) == (16, 16)
    assert first.floor.exact_through == extended.floor.exact_through == "model.layers.0.self_attn.q_rope"
    assert [p.noise for p in again.points] == [p.noise for p in extended.points]
    assert "from the cache" in again.floor.text() and "from the cache" not in first.floor.text()
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "another cache"))
    longer, shorter = run(128), run(64)
    assert (longer.floor.rows, longer.floor.from_cache) == (32, False)
    assert (shorter.floor.rows, shorter.floor.from_cache) == (32, True)
    assert shorter.first_divergence.point == first.first_divergence.point


def test_the_floor_flag_is_checked_and_said():
    with pytest.raises(tracer.TracerError, match="unknown noise floor 'full': cheap or exact"):
        tracer.run(noise_floor="full", progress=False)


def test_a_confirmation_that_cannot_run_is_said_and_the_scaled_floor_stands(measured, tmp_path, monkeypatch):
    """Where the exact floor of the stretch cannot be measured, the verdict rests on the scaled floor (never
    below the exact one on any calibrated model) and the header says it was not confirmed."""
    from tracer.pipeline import run as run_module

    model, _, _ = measured
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))
    measure = run_module.estimate_noise

    def failing(*args, through=None, **kwargs):
        if through is not None:
            raise tracer.TracerError("out of memory for the f64 run")
        return measure(*args, **kwargs)

    monkeypatch.setattr(run_module, "estimate_noise", failing)
    result = tracer.run(model, tokens=IDS, variant="theta=500", greedy=0, progress=False)
    assert result.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert result.floor.exact_through is None
    assert result.floor.unconfirmed == ("the exact floor through model.layers.0.self_attn.q_rope could not be "
                                        "measured (out of memory for the f64 run)")
    assert "not confirmed: the exact floor through" in result.floor.text()
