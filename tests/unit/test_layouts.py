"""Layout normalization on literal tensors: batch, head layouts, rows, GGUF q/k order, padding."""

import pytest
import torch

from tracer.core.errors import TracerError
from tracer.traces.layouts import Fixes, align, fix_notes, from_interleaved, reconcile, to_interleaved
from tracer.traces.trace import Trace, TraceMeta

T, H, KV, D, C = 5, 4, 2, 8, 32
g = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=g)


def run(point, canon, other, source=None, head_dim=None):
    fixes = Fixes()
    canon, other = reconcile(point, canon, other, source, head_dim, fixes, "candidate")
    return canon, other, fix_notes(fixes)


def gguf_permute(weight, heads):
    """llama.cpp convert_hf_to_gguf's q/k weight permutation, written from its source."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def test_from_interleaved_undoes_the_gguf_weight_permutation():
    weight, x = randn(H * D, C), randn(T, C)
    hf_q = x @ weight.T  # (T, H*D) half-split
    gguf_q = x @ gguf_permute(weight, H).T  # what llama.cpp computes with the converted weight
    assert not torch.allclose(gguf_q, hf_q)
    torch.testing.assert_close(from_interleaved(gguf_q, D), hf_q, rtol=0, atol=0)
    torch.testing.assert_close(to_interleaved(hf_q, D), gguf_q, rtol=0, atol=0)


def test_rope_on_adjacent_pairs_after_unpermuting_equals_hf_half_split_rope():
    theta, q = 10000.0, randn(T, H * D)
    freqs = torch.arange(T)[:, None].float() * theta ** (-torch.arange(0, D, 2).float() / D)  # (T, D/2)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # (T, 1, D/2)
    heads = q.reshape(T, H, D)
    lo, hi = heads[..., : D // 2], heads[..., D // 2 :]
    hf = torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), -1)  # HF: pairs (j, j + D/2)
    gg = to_interleaved(q, D).reshape(T, H, D)
    even, odd = gg[..., 0::2], gg[..., 1::2]
    ggml = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).reshape(T, H, D)  # ggml: pairs (2j, 2j+1)
    _, got, notes = run("model.layers.0.self_attn.q_rope", hf.transpose(0, 1), ggml,
                        {"name": "Qcur-0", "layout": "THD", "qk_order": "interleaved"})
    torch.testing.assert_close(got, hf.transpose(0, 1), rtol=0, atol=1e-6)
    assert "un-permuted from GGUF's interleaved order" in notes[0]


@pytest.mark.parametrize("point, canon, make", [
    ("model.layers.0.mlp.down_proj", (T, C), lambda x: x[None]),  # batch
    ("model.layers.0.self_attn.q_proj", (T, H * D), lambda x: x.reshape(T, H, D)),  # [T, H, D]
    ("model.layers.0.self_attn.v_proj", (T, KV * D),
     lambda x: x.reshape(T, KV, D).transpose(0, 1)[None]),  # [1, KV, T, D]
    ("model.layers.0.self_attn.context", (T, H * D), lambda x: x.reshape(1, T, H, D)),  # TransformerLens hook_z
    ("model.layers.0.self_attn.k_rope", (KV, T, D), lambda x: x.transpose(0, 1)),  # [T, KV, D]
    ("model.layers.0.self_attn.q_rope", (H, T, D), lambda x: x.transpose(0, 1).reshape(T, H * D)),  # [T, H*D]
])
def test_foreign_layouts_come_back_to_the_point_shape(point, canon, make):
    ref = randn(*canon)
    _, got, _ = run(point, ref, make(ref))
    assert torch.equal(got, ref)


def test_ambiguous_shape_uses_the_runtime_layout_and_says_so():
    ref = randn(H, H, D)  # T == H: [T, H, D] and [H, T, D] have the same shape
    _, got, notes = run("model.layers.0.self_attn.q_rope", ref, ref.transpose(0, 1).contiguous(),
                        {"name": "Qcur-0", "layout": "THD"})
    assert torch.equal(got, ref)
    assert "ambiguous" in notes[0] and "[T, H, D]" in notes[0]
    _, same, _ = run("model.layers.0.self_attn.q_rope", ref, ref.clone(), {"name": "blocks.0.q", "layout": "HTD"})
    assert torch.equal(same, ref)


def test_last_position_only_is_compared_on_that_row():
    logits = randn(T, 11)
    canon, got, notes = run("lm_head", logits, logits[-1:])  # candle's forward: (b, V) with b = 1
    assert torch.equal(canon, logits[-1:]) and torch.equal(got, logits[-1:])
    assert notes == ["candidate holds only the last position at lm_head: compared on those rows only"]
    for last in (logits[-1], logits[-1:][None]):  # a bare (V,), or (1, 1, V)
        canon, got, _ = run("lm_head", logits, last)
        assert torch.equal(canon, logits[-1:]) and torch.equal(got, logits[-1:])
    rows, got, notes = run("model.layers.1", randn(T, C), randn(2, C))  # llama.cpp's output rows
    assert rows.shape == (2, C) and "the last 2 positions" in notes[0]


def test_padded_kv_cache_columns_are_dropped_only_when_zero():
    probs = torch.softmax(randn(H, T, T), -1)
    padded = torch.cat((probs, torch.zeros(H, T, 3)), -1)
    _, got, notes = run("model.layers.0.self_attn.probs", probs, padded)
    assert torch.equal(got, probs) and "padded" in notes[0]
    with pytest.raises(TracerError, match="cannot reconcile"):
        run("model.layers.0.self_attn.probs", probs, torch.cat((probs, torch.ones(H, T, 3)), -1))


def test_irreconcilable_shapes_name_the_point_both_shapes_and_the_source():
    with pytest.raises(TracerError, match=r"shape mismatch at model\.layers\.2\.mlp\.down_proj: cannot reconcile the "
                                          r"candidate's \(1, 5, 33\) \(from 'blocks\.2\.mlp\.c_proj'\) with the other "
                                          r"side's \(5, 32\)"):
        run("model.layers.2.mlp.down_proj", randn(T, C), randn(1, T, C + 1), {"name": "blocks.2.mlp.c_proj"})


def test_interleaved_projection_needs_the_head_size():
    with pytest.raises(TracerError, match="without the head size"):
        run("model.layers.0.self_attn.q_proj", randn(T, H * D), randn(T, H * D), {"qk_order": "interleaved"})
    ref = randn(T, H * D)
    _, got, _ = run("model.layers.0.self_attn.q_proj", ref, to_interleaved(ref, D), {"qk_order": "interleaved"}, D)
    assert torch.equal(got, ref)


def test_dtype_difference_is_said():
    ref = randn(T, C)
    _, got, notes = run("model.norm", ref, ref.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and notes == ["candidate is bfloat16, the other side float32, at 1 points: "
                                                     "both up-cast to f64 for the metrics"]


def test_align_takes_tracer_layout_as_template_on_either_side():
    ours = Trace({"model.layers.0": randn(T, C), "lm_head": randn(T, 7)}, TraceMeta(num_layers=1))
    dump = Trace({"model.layers.0": ours["model.layers.0"][None], "lm_head": ours["lm_head"][-1:]},
                 TraceMeta(sources={"model.layers.0": {"name": "l_out-0"}, "lm_head": {"name": "result_output"}}))
    for ref, cand in ((ours, dump), (dump, ours)):
        ref2, cand2, notes = align(ref, cand)
        assert ref2["lm_head"].shape == cand2["lm_head"].shape == (1, 7)
        assert torch.equal(ref2["model.layers.0"], cand2["model.layers.0"])
        side = "reference" if ref is dump else "candidate"
        assert f"{side}: dropped a leading batch dimension of 1 at 1 points" in notes


def test_align_lists_what_each_side_lacks():
    ours = Trace({"model.embed_tokens": randn(T, C), "model.layers.0.mlp.act": randn(T, 3),
                  "model.layers.1.mlp.act": randn(T, 3)})
    dump = Trace({"model.embed_tokens": ours["model.embed_tokens"], "model.layers.0.resid_mid": randn(T, C)},
                 TraceMeta(sources={"model.embed_tokens": {"name": "inp_embd"}}, unknown_names=["weird"]))
    _, _, notes = align(ours, dump)
    assert "not in the candidate: 2 points, compared on the rest (mlp.act ×2)" in notes
    assert "not in the reference: 1 points, compared on the rest (resid_mid)" in notes
    assert any(n.startswith("candidate: 1 tensor names match no alias and were not compared: weird") for n in notes)
