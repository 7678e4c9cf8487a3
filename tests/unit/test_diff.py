import math

import pytest
import torch

from tracer import Trace, TraceMeta, TracerError, compare
from tracer.comparison.diff import compare_point
from tracer.comparison.result import Tolerance


def trace(tensors, **meta):
    return Trace(dict(tensors), TraceMeta(**{"engine": "test", "variant": {}, "tokens": [1, 2, 3], **meta}))


def test_metrics_on_literal_tensors():
    ref = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    cand = torch.tensor([[3.0, 4.0], [0.0, 0.5]])
    p = compare_point("model.norm", ref, cand, Tolerance())
    assert p.max_abs == 0.5 and p.max_ref == 4.0
    assert p.rel_l2 == pytest.approx(0.5 / 5.0)
    assert p.cosine == pytest.approx(25 / (5 * math.sqrt(25.25)))
    assert p.diverged and not p


def test_rel_l2_is_scale_invariant_so_massive_activations_do_not_fake_a_divergence():
    ref = torch.randn(5, 576, dtype=torch.float64) * 22_500
    cand = ref * (1 + 1e-7)
    p = compare_point("model.layers.20", ref, cand, Tolerance())
    assert p.max_abs > 1e-4  # an absolute tolerance of 1e-4 would call this a divergence
    assert p.rel_l2 == pytest.approx(1e-7, rel=1e-3) and not p.diverged


def test_masked_entries_of_scores_are_excluded():
    ref = torch.zeros(2, 3, 3)
    cand = ref.clone()
    cand[:, 0, 2] = 1e9  # above the diagonal: never attended to
    assert compare_point("model.layers.0.self_attn.scores", ref, cand, Tolerance()).max_abs == 0
    assert compare_point("model.layers.0.self_attn.o_proj", ref[0], cand[0], Tolerance()).max_abs == 1e9


def test_nan_never_compares_as_a_match():
    ref = torch.ones(4)
    cand = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    assert compare_point("model.norm", ref, cand, Tolerance()).diverged
    assert compare_point("model.norm", ref, cand, Tolerance(atol=1.0)).diverged


def test_allclose_override():
    ref, cand = torch.tensor([100.0, 1.0]), torch.tensor([100.5, 1.0])
    assert not compare_point("x", ref, cand, Tolerance(atol=0.6)).diverged
    assert compare_point("x", ref, cand, Tolerance(atol=0.4)).diverged
    assert not compare_point("x", ref, cand, Tolerance(rtol=0.01)).diverged
    assert Tolerance(atol=0.4).to_dict()["criterion"] == "allclose"


def test_first_divergence_and_unrecorded_points_in_execution_order():
    t = torch.ones(3, 4)
    ref = trace({"model.embed_tokens": t, "model.layers.0.input_layernorm": t, "model.layers.0.self_attn.q_proj": t},
                num_layers=1)
    cand = trace({"model.embed_tokens": t, "model.layers.0.input_layernorm": t * 1.0000001,
                  "model.layers.0.self_attn.q_proj": t * 2}, num_layers=1,
                 not_recorded={"model.layers.0.self_attn.scores": "fused"})
    result = compare(ref, cand)
    assert not result and result.verdict == "diverged"
    first = result.first_divergence
    assert (first.point == "model.layers.0.self_attn.q_proj"
            and first.last_agreeing == "model.layers.0.input_layernorm")
    assert first.upstream_points == 2 and first.upstream_max_rel_l2 < 1e-6
    assert [p.point for p in result.points][-1] == "model.layers.0.self_attn.scores"
    assert result.points[-1].missing_on == "both" and result.points[-1].reason == "fused"


def test_shape_mismatch_names_the_point_and_both_shapes():
    with pytest.raises(TracerError, match=r"shape mismatch at model.norm: reference \(3, 4\), candidate \(2, 4\)"):
        compare(trace({"model.norm": torch.ones(3, 4)}), trace({"model.norm": torch.ones(2, 4)}))


def test_different_tokens_refuse_to_compare():
    with pytest.raises(TracerError, match="ran other token ids"):
        compare(trace({"x": torch.ones(1)}), trace({"x": torch.ones(1)}, tokens=[9]))


def test_logits_summary_last_position_and_all_positions():
    ref = torch.tensor([[0.0, 5.0], [1.0, 2.0], [3.0, 1.0]])
    cand = torch.tensor([[0.0, 5.5], [2.5, 2.0], [3.0, 1.25]])
    logits = compare(trace({"lm_head": ref}), trace({"lm_head": cand})).logits
    assert logits.max_abs == 0.25 and logits.max_ref == 3.0
    assert logits.max_abs_all == 1.5
    assert logits.argmax_agree == pytest.approx(2 / 3)


def test_the_first_divergence_is_a_value_whose_dict_is_its_piece_of_the_json():
    ref = torch.arange(12.0).reshape(3, 4)
    result = compare(trace({"model.norm": ref}), trace({"model.norm": ref * 2}))
    first = result.first_divergence
    assert (first.point, first.shape, first.index, first.upstream_points) == ("model.norm", (3, 4), 0, 0)
    assert first.by_position == (3.0, 7.0, 11.0) and first.by_head is None  # max |diff| per token
    assert first.top_channels[0] == {"channel": 3, "max_abs": 11.0}
    assert any("rms_norm_eps" in hint for hint in first.hints)
    assert list(result.to_dict()["first_divergence"]) == [
        "point", "layer", "shape", "max_abs", "max_ref", "rel_l2", "cosine", "noise", "threshold", "local_rel_l2",
        "index", "localized_by", "last_agreeing", "upstream_points", "upstream_max_rel_l2", "by_position", "by_head",
        "top_channels", "hints", "unseen"]
    assert result.to_dict()["first_divergence"]["shape"] == [3, 4]
    assert first.brief() == {"point": "model.norm", "layer": None, "rel_l2": first.rel_l2, "max_abs": 11.0,
                             "max_ref": 11.0}


def test_result_json_contract():
    result = compare(trace({"lm_head": torch.ones(3, 4)}), trace({"lm_head": torch.ones(3, 4)}))
    d = result.to_dict()
    for key in ("verdict", "model", "prompt", "tokens", "reference", "candidate", "tolerance", "first_divergence",
                "points", "logits", "greedy", "error"):
        assert key in d
    assert d["verdict"] == "match" and bool(result)
    assert set(d["points"][0]) >= {"point", "layer", "max_abs", "max_ref", "rel_l2", "cosine", "diverged"}
    assert result.table().loc["lm_head", "rel_l2"] == 0.0


def test_traces_with_no_point_in_common_are_not_a_match():
    with pytest.raises(TracerError, match="share no point to compare"):
        compare(trace({"model.norm": torch.ones(3, 4)}), trace({"lm_head": torch.ones(3, 4)}))


def test_an_unknown_engine_is_refused_before_anything_loads(tiny_llama, monkeypatch):
    import tracer
    from tracer.files import sources

    monkeypatch.setattr(sources, "resolve_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(TracerError, match="unknown engine 'jax'"):
        tracer.run(tiny_llama(), candidate="jax")


def test_metrics_in_f32_chunks_are_the_f64_definitions():
    """f32 chunks with f64 sums: rel_l2 and max|d| to 1e-6 relative of their f64 values on
    heavy-tailed values spanning several chunks, and 1 - cosine with its digits however close to 1."""
    from tracer.comparison.diff import CHUNK

    generator = torch.Generator().manual_seed(0)
    n = 3 * CHUNK + 123
    ref = torch.randn(n, generator=generator) * torch.exp(2 * torch.randn(n, generator=generator))
    for scale in (1e-7, 1e-3, 1.0):
        cand = ref + scale * ref.abs().mean() * torch.randn(n, generator=generator)
        r, c = ref.double(), cand.double()
        got = compare_point("model.layers.0", ref, cand, Tolerance())
        assert got.rel_l2 == pytest.approx(float((c - r).norm() / r.norm()), rel=1e-6)
        assert got.max_abs == pytest.approx(float((c - r).abs().max()), rel=1e-6)
        # 1 - cos as half the squared distance of the unit vectors: exact to f64's digits however close to 1
        # cos is (1 - c·r/(|c||r|) loses them, and its sign, to the order threads sum the dot product in)
        one_minus_cos = float((c / c.norm() - r / r.norm()).norm() ** 2 / 2)
        assert 1 - got.cosine == pytest.approx(one_minus_cos, rel=1e-3, abs=1e-15)
    assert compare_point("x", ref, -0.5 * ref, Tolerance()).cosine == pytest.approx(-1.0)
    assert compare_point("x", ref, ref.clone(), Tolerance()).rel_l2 == 0.0


@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_summed_a_block_at_a_time_are_the_sums_of_one_call_per_chunk(threads):
    """Each chunk's sums are one row of a block: the same numbers, to the last bit, as one torch call per
    chunk, whatever the thread count, across block and chunk boundaries, in f32 and f64, NaN included."""
    from tracer.comparison import diff

    def per_chunk(r_all, c_all, dtype):
        sums = [0.0] * 4
        for start in range(0, r_all.numel(), diff.CHUNK):
            r, c = r_all[start:start + diff.CHUNK].to(dtype), c_all[start:start + diff.CHUNK].to(dtype)
            d = c - r
            for k, (a, b) in enumerate(((r, r), (d, d), (c, c), (r, d))):
                sums[k] += float((a * b).sum())
        return sums

    generator, before = torch.Generator().manual_seed(3), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (5, diff.CHUNK, diff.CHUNK + 1, diff.BLOCK_CHUNKS * diff.CHUNK + 7, 150_001):
            ref = torch.randn(n, generator=generator) * 10
            cand = ref + 1e-3 * torch.randn(n, generator=generator)
            for dtype in (torch.float32, torch.float64):
                assert list(diff._sums(ref, cand, dtype, Tolerance())[:4]) == per_chunk(ref, cand, dtype), (n, dtype)
        cand[n // 2] = math.nan
        assert all(math.isnan(x) for x in diff._sums(ref, cand, torch.float32, Tolerance())[1:4])
    finally:
        torch.set_num_threads(before)


def test_a_rel_l2_at_its_threshold_is_decided_in_f64(monkeypatch):
    """Within BORDERLINE of the threshold the sums are redone in f64 (the f32 ones could round across it)."""
    from tracer.comparison import diff

    ref = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    cand = ref + 1e-5 * torch.randn(5000, generator=torch.Generator().manual_seed(2))
    exact = float((cand.double() - ref.double()).norm() / ref.double().norm())
    dtypes = []
    real_sums = diff._sums
    monkeypatch.setattr(diff, "_sums", lambda r, c, dtype, tol: dtypes.append(dtype) or real_sums(r, c, dtype, tol))
    on_threshold = Tolerance(noise_floor=exact, noise_factor=1.0)
    judged = compare_point("x", ref, cand, on_threshold, noise=exact / 2)
    assert dtypes == [torch.float32, torch.float64] and judged.rel_l2 == pytest.approx(exact, rel=1e-12)
    dtypes.clear()
    compare_point("x", ref, cand, Tolerance(noise_floor=2 * exact, noise_factor=1.0), noise=exact / 2)
    assert dtypes == [torch.float32]
