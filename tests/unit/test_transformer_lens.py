"""TransformerLens caches (HookedTransformer's hook names, TransformerBridge's module hooks) onto points.

No TransformerLens needed: the names are the ones a real TransformerLens 4.3 bridge cache holds
(tests/dumps.py, copied from a run on SmolLM2), and the dump is built from a tracer trace of a tiny
Llama in TransformerLens' layout. tests/integration/test_transformer_lens_smollm2.py runs the real
bridge when it is installed.
"""

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.dumps import save_dump, transformer_lens_4_dump, transformer_lens_4_names
from tracer.names.aliases import AliasTable, token_names


@pytest.mark.parametrize("name, point", [
    # TransformerLens 3 (HookedTransformer) names, which the TransformerLens 4 bridge keeps as aliases
    ("hook_embed", "model.embed_tokens"),
    ("blocks.3.attn.hook_q", "model.layers.3.self_attn.q_proj"),
    ("blocks.3.attn.hook_v", "model.layers.3.self_attn.v_proj"),
    ("blocks.3.attn.hook_rot_k", "model.layers.3.self_attn.k_rope"),
    ("blocks.3.attn.hook_attn_scores", "model.layers.3.self_attn.scores"),
    ("blocks.3.attn.hook_z", "model.layers.3.self_attn.context"),
    ("blocks.3.hook_resid_mid", "model.layers.3.resid_mid"),
    ("blocks.3.hook_mlp_out", "model.layers.3.mlp.down_proj"),
    ("blocks.29.hook_resid_post", "model.layers.29"),
    # TransformerLens 4 (TransformerBridge) module hooks: the norms' outputs have points now
    ("embed.hook_out", "model.embed_tokens"),
    ("blocks.3.ln1.hook_out", "model.layers.3.input_layernorm"),
    ("blocks.3.attn.q.hook_out", "model.layers.3.self_attn.q_proj"),
    ("blocks.3.attn.o.hook_in", "model.layers.3.self_attn.context"),
    ("blocks.3.attn.o.hook_out", "model.layers.3.self_attn.o_proj"),
    ("blocks.3.ln2.hook_in", "model.layers.3.resid_mid"),
    ("blocks.3.ln2.hook_out", "model.layers.3.post_attention_layernorm"),
    ("blocks.3.mlp.gate.hook_out", "model.layers.3.mlp.gate_proj"),
    ("blocks.3.mlp.in.hook_out", "model.layers.3.mlp.up_proj"),
    ("blocks.3.mlp.out.hook_in", "model.layers.3.mlp.act"),
    ("blocks.3.hook_out", "model.layers.3"),
    ("ln_final.hook_out", "model.norm"),
    ("unembed.hook_out", "lm_head"),
    ("hook_unembed", "lm_head"),
])
def test_transformer_lens_names_map_onto_points(name, point):
    resolved = AliasTable().resolve(name)
    assert resolved.point == point and resolved.alias.runtime == "transformer_lens"


def test_every_name_of_a_real_bridge_cache_is_a_point_or_skipped_with_a_reason():
    table = AliasTable()
    names = transformer_lens_4_names(2)
    assert len(names) == 6 + 2 * 46 + 7  # the bundled SmolLM2's cache: 1393 names for 30 layers
    for name, point in names:
        if name in token_names():
            continue
        resolved = table.resolve(name)
        if point is None:
            assert resolved is None and table.skip_reason(name), name
        else:
            assert resolved is not None and resolved.point == point, name


def test_the_normalized_hooks_are_not_the_norms_outputs():
    """hook_normalized is x / rms before the weight in both versions: skipped, pointing at ln*.hook_out."""
    table = AliasTable()
    assert table.resolve("blocks.0.ln1.hook_normalized") is None
    assert "blocks.{i}.ln1.hook_out" in table.skip_reason("blocks.0.ln1.hook_normalized")
    assert "before the norm weight" in table.skip_reason("ln_final.hook_normalized")


@pytest.fixture
def reference(tiny_llama):
    return tracer.record(tiny_llama(), TOKENS, engine="hf", progress=False)


def test_a_bridge_cache_of_a_tiny_llama_matches_at_every_point(reference, tmp_path):
    # No tokens in the metadata: the cache's own embed.hook_in carries them.
    path = save_dump(transformer_lens_4_dump(reference), tmp_path / "tl.safetensors", runtime="TransformerLens 4.3")
    result = tracer.compare_files(reference, path)
    compared = [p.point for p in result.points if p.recorded]
    assert result.verdict == "match" and compared == reference.points  # all 37, the norms among them
    assert result.logits.max_abs_all == 0.0
    notes = " | ".join(result.notes)
    assert "match no alias" not in notes  # every name of the cache is known
    skipped = [name for name, point in transformer_lens_4_names(2) if point is None and name not in token_names()]
    assert len(skipped) == 39 and "34 more known names not compared" in notes  # 5 named, each with its reason
    points = [point for _, point in transformer_lens_4_names(2) if point is not None]
    repeated = {point for point in points if points.count(point) > 1}
    assert (len(points) - len(set(points)), len(repeated)) == (28, 24)
    assert "28 more names for 24 points already named" in notes  # one note for all of them


def test_a_wrong_norm_weight_in_a_bridge_cache_is_localized_to_that_norm(reference, tmp_path):
    dump = transformer_lens_4_dump(reference)
    for name in ("blocks.1.ln2.hook_out", "blocks.1.mlp.hook_in"):  # the norm's output and its copy
        dump[name] = dump[name] * 1.01
    result = tracer.compare_files(reference, save_dump(dump, tmp_path / "tl.safetensors"))
    assert result.first_divergence.point == "model.layers.1.post_attention_layernorm"
    assert result.first_divergence.rel_l2 == pytest.approx(0.01, rel=1e-3)
    assert result.first_divergence.last_agreeing == "model.layers.1.resid_mid"


def test_per_head_hooks_are_read_as_batch_pos_head_d_head_even_when_pos_equals_heads(tiny_llama, tmp_path):
    """The tiny Llama has 4 query heads: at 4 tokens [T, H, D] and [H, T, D] have one shape."""
    reference = tracer.record(tiny_llama(), TOKENS[:4], engine="hf", progress=False)
    path = save_dump(transformer_lens_4_dump(reference), tmp_path / "tl.safetensors", tokens=reference.tokens)
    result = tracer.compare_files(reference, path)
    assert result.verdict == "match" and result.logits.max_abs_all == 0.0
    assert any("T equals the head count" in note and "[T, H, D]" in note for note in result.notes)
    assert torch.equal(reference["model.layers.0.self_attn.q_rope"],
                       transformer_lens_4_dump(reference)["blocks.0.attn.hook_rot_q"][0].transpose(0, 1))
