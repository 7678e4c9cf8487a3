"""A streamed run's sides advancing together (tracer/pipeline/lockstep.py): the same Result, point for
point, as the sides run one after the other, with each block's weights mapped from the files once."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.comparison.result import Tolerance
from tracer.engines.load import resolve_and_load
from tracer.files.sources import resolve_source
from tracer.model.points import layer_point
from tracer.pipeline import lockstep, reference_cache
from tracer.pipeline.request import Side

# tied and untied embeddings, Gemma's scaled embedding, offset norms and capped logits
FAMILIES = ["llama", "gemma2"]


def bf16_shards(folder):
    """The tiny model's weights re-saved as a checkpoint ships: bf16, in two shards with their index."""
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(folder / "model.safetensors")).items()}
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, str(folder / file), metadata={"format": "pt"})
    weight_map = {name: file for file, part in halves.items() for name in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lockstep")
    return {family: bf16_shards(write_tiny_family(root / family, family, max_position_embeddings=512))
            for family in FAMILIES}


def results(model, monkeypatch, **run):
    """(one side after the other, in lockstep): tracer.run's Results, streamed (the second one checked
    to have gone through the lockstep pass)."""
    call = dict(tokens=TOKENS, stream=True, greedy=0, progress=False) | run
    monkeypatch.setattr(reference_cache, "load", lambda key: None)  # both measure their noise floor
    with monkeypatch.context() as patch:
        patch.setattr(lockstep, "applies", lambda *args: False)
        apart = tracer.run(model, **call)
    passes, run_pass = [], lockstep.run
    monkeypatch.setattr(lockstep, "run", lambda *args, **kwargs: passes.append(run_pass(*args, **kwargs)) or passes[-1])
    together = tracer.run(model, **call)
    assert len(passes) == 1 and passes[0].compared is not None  # streamed: the candidate judged as it came, spilled
    return apart, together


def same(apart, together):
    assert together.verdict == apart.verdict
    assert together.first_divergence == apart.first_divergence
    assert [p.to_dict() for p in together.points] == [p.to_dict() for p in apart.points]
    assert together.logits == apart.logits


@pytest.mark.parametrize(("family", "variant"), [("llama", None), ("gemma2", "theta=1000")])
def test_lockstep_gives_the_same_result_point_for_point(tiny, family, variant, monkeypatch):
    apart, together = results(tiny[family], monkeypatch, variant=variant)
    same(apart, together)
    assert "noise_s" in together.timings and "local_s" in together.timings
    assert (together.verdict == "match") == (variant is None)
    if variant:  # a fault the local errors place: they ran in the pass
        assert together.first_divergence.point == "model.layers.0.self_attn.q_rope"
        assert any(p.local_rel_l2 and p.local_rel_l2 > 0 for p in together.points)


def test_a_long_prompt_spills_and_measures_its_noise_floor_on_its_first_tokens(tiny, monkeypatch):
    """300 tokens (0.7 s on 2 quiet cores, 18 s at load 13): the reference spilled to disk, the
    candidate judged as it comes, the cheap noise floor measured on the first 128 tokens in a pass of its own."""
    tokens = [int(t) for t in torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(1))]
    apart, together = results(tiny["llama"], monkeypatch, variant="theta=1000", tokens=tokens)
    same(apart, together)
    assert (together.floor.rows, together.floor.tokens) == (128, 300)  # the cheap floor: its first rows
    assert together.floor.exact_through == "model.layers.0.self_attn.q_rope"  # the first divergence confirmed


def test_each_blocks_weights_are_mapped_once_and_every_run_is_its_own(tiny):
    """One pass: the reference, the candidate, the local errors and the noise floor are what each
    gives alone, and each tensor of a block is mapped from the files once (not once per run)."""
    from tracer.pipeline.noise_floor import estimate_noise
    from tracer.pipeline.run import local_errors

    model = tiny["gemma2"]
    engine = resolve_and_load("hf", model, {}, stream=True)
    files = engine.model.tracer_weight_files
    files.maps.clear()
    source = resolve_source(model)
    done = lockstep.run(engine, source, TOKENS, lambda side: None, reference=Side.of("hf"),
                        candidate=Side.of("reimpl", "eps=1e-3"), tolerance=Tolerance(), floor_rows=len(TOKENS))
    block_tensors = [name for name in files if name.startswith(layer_point(0, "") + ".")]
    assert block_tensors and {files.maps[name] for name in block_tensors} == {1}
    alone = resolve_and_load("hf", model, {}, stream=True).record(TOKENS)
    assert done.reference.points == alone.points
    assert all(torch.equal(done.reference[p], alone[p]) for p in alone.points)
    candidate = resolve_and_load("reimpl", model, {"eps": 1e-3}, stream=True)
    expected = candidate.record(TOKENS)
    assert done.candidate.points == expected.points
    assert all(torch.equal(done.candidate[p], expected[p]) for p in expected.points)
    assert done.candidate.meta == expected.meta
    assert done.local == local_errors(candidate, alone)
    assert done.shared_blocks == 1  # block 0's input is the embedding, the same on both; eps= changes its output
    noise = estimate_noise(source, alone, {})
    assert done.noise.keys() == noise.keys()
    assert all(done.noise[p] == noise[p] or (math.isnan(noise[p]) and math.isnan(done.noise[p])) for p in noise)


def test_the_local_run_shares_the_candidates_blocks_while_their_inputs_agree(tiny):
    """A port that matches: every block's input is the reference's, bit for bit, so the local run's
    blocks are the candidate's own (run once, recorded into both), and its errors are what running
    them again gives."""
    from tracer.pipeline.run import local_errors

    model = tiny["llama"]
    engine = resolve_and_load("hf", model, {}, stream=True)
    done = lockstep.run(engine, resolve_source(model), TOKENS, lambda side: None, reference=Side.of("hf"),
                        candidate=Side.of("reimpl"), tolerance=Tolerance(), floor_rows=None)
    candidate = resolve_and_load("reimpl", model, {}, stream=True)
    assert done.shared_blocks == candidate.model.spec.num_hidden_layers
    expected = local_errors(candidate, resolve_and_load("hf", model, {}, stream=True).record(TOKENS))
    assert done.local == expected and any(layer_point(0, "") in name for name in expected)


@pytest.mark.parametrize(("rows", "bias"), [(1300, False), (512, True), (7, True)])
def test_an_f64_matmul_upcast_by_rows_is_the_whole_upcast_ones_to_f64_rounding(rows, bias):
    """The noise floor's f64 run multiplies a block's f32 matrices 512 rows at a time: the whole
    upcast matrix's product, a bias included, to the last few f64 ulps (BLAS may order a column's sum
    otherwise for a 276-row chunk than for the whole: 7e-16 measured at 2 threads), far below the
    1e-7 that any f32 rounding on the way would leave."""
    from tracer.reimpl.forward import upcasting_linear

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, 9, 256, generator=gen, dtype=torch.float64)
    weight = torch.randn(rows, 256, generator=gen).to(torch.bfloat16).float()
    b = torch.randn(rows, generator=gen) if bias else None
    whole = torch.nn.functional.linear(x, weight.double(), None if b is None else b.double())
    got = upcasting_linear(x, weight, b)
    assert got.dtype == torch.float64 and got.shape == whole.shape
    assert (got - whole).abs().max() <= 1e-14 * whole.abs().max()
    assert torch.equal(upcasting_linear(x, weight.double(), None if b is None else b.double()), whole)
