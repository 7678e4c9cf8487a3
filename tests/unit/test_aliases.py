"""The alias table: other runtimes' names onto points, a user mapping file, unknown names listed."""

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.dumps import CANDLE_NAMES, GGML_NAMES
from tracer.core.errors import TracerError
from tracer.model.points import all_points
from tracer.names.aliases import AliasTable, alias_table, is_point, load_alias_file, rename
from tracer.traces.trace import Trace


@pytest.mark.parametrize("name, point", [
    # candle llama.rs fields
    ("wte", "model.embed_tokens"),
    ("blocks.4.rms_1", "model.layers.4.input_layernorm"),
    ("blocks.4.attn.k_proj", "model.layers.4.self_attn.k_proj"),
    ("blocks.4.attn", "model.layers.4.self_attn.o_proj"),
    ("blocks.12.mlp.c_fc1", "model.layers.12.mlp.gate_proj"),
    ("blocks.12.mlp.c_fc2", "model.layers.12.mlp.up_proj"),
    ("blocks.12.mlp.c_proj", "model.layers.12.mlp.down_proj"),
    ("blocks.12", "model.layers.12"),
    ("ln_f", "model.norm"),
    ("lm_head", "lm_head"),
    # llama.cpp graph names
    ("inp_embd", "model.embed_tokens"),
    ("Qcur-3", "model.layers.3.self_attn.q_rope"),
    ("Vcur-3", "model.layers.3.self_attn.v_proj"),
    ("kqv_out-3", "model.layers.3.self_attn.context"),
    ("ffn_inp-3", "model.layers.3.resid_mid"),
    ("ffn_out-3", "model.layers.3.mlp.down_proj"),
    ("l_out-29", "model.layers.29"),
    ("result_norm", "model.norm"),
    ("result_output", "lm_head"),
    # GGUF tensor names
    ("blk.2.attn_q", "model.layers.2.self_attn.q_proj"),
    ("blk.2.ffn_down", "model.layers.2.mlp.down_proj"),
    ("output_norm", "model.norm"),
    # TransformerLens hooks
    ("hook_embed", "model.embed_tokens"),
    ("blocks.1.attn.hook_rot_q", "model.layers.1.self_attn.q_rope"),
    ("blocks.1.attn.hook_pattern", "model.layers.1.self_attn.probs"),
    ("blocks.1.attn.hook_z", "model.layers.1.self_attn.context"),
    ("blocks.1.mlp.hook_pre", "model.layers.1.mlp.gate_proj"),
    ("blocks.1.mlp.hook_pre_linear", "model.layers.1.mlp.up_proj"),
    ("blocks.1.mlp.hook_post", "model.layers.1.mlp.act"),
    ("blocks.1.hook_resid_post", "model.layers.1"),
    # HF module paths (and MLX's): the points themselves, plus two module outputs
    ("model.layers.7.self_attn.q_rope", "model.layers.7.self_attn.q_rope"),
    ("model.layers.7.mlp", "model.layers.7.mlp.down_proj"),
])
def test_known_names_map_onto_points(name, point):
    assert AliasTable().resolve(name).point == point


def test_every_runtime_name_the_test_dumps_use_resolves_to_its_point():
    table = AliasTable()
    for names in (CANDLE_NAMES, GGML_NAMES):
        for ours, theirs in names.items():
            assert table.resolve(theirs.replace("{i}", "5")).point == ours.replace("{i}", "5")


def test_layout_hints_follow_the_runtime():
    table = AliasTable()
    assert table.resolve("Qcur-0").alias.qk_order == "interleaved"
    assert table.resolve("blk.0.attn_k").alias.qk_order == "interleaved"
    assert table.resolve("blocks.0.attn.hook_rot_q").alias.qk_order == "half"
    assert table.resolve("Qcur-0").alias.layout == "THD" and table.resolve("blocks.0.attn.q_proj").alias.layout == "HTD"


def test_every_point_is_a_point_and_near_misses_are_not():
    assert all(is_point(p) for p in all_points(3))
    for name in ("model.layers.0.mlp.act_fn", "model.layers.x", "model.norm.weight", "blocks.0.attn.q_rope"):
        assert not is_point(name) and AliasTable().resolve(name) is None


def test_rename_lists_unknown_names_and_says_why_known_ones_are_skipped():
    tensors = {"blocks.0.mlp.c_proj": torch.ones(2), "kq-0": torch.ones(2), "my_custom_thing": torch.ones(2),
               "blocks.0.ln1.hook_normalized": torch.ones(2)}
    renamed = rename(tensors, AliasTable())
    assert list(renamed.tensors) == ["model.layers.0.mlp.down_proj"]
    assert renamed.unknown == ["my_custom_thing"]
    assert "before the scale its softmax applies" in renamed.skipped["kq-0"]
    assert "before the norm weight" in renamed.skipped["blocks.0.ln1.hook_normalized"]


def test_two_names_for_one_point_keep_the_first_and_say_so():
    renamed = rename({"blocks.1.attn.o_proj": torch.ones(2), "blocks.1.attn": torch.zeros(2)}, AliasTable())
    assert renamed.sources["model.layers.1.self_attn.o_proj"]["name"] == "blocks.1.attn.o_proj"
    assert renamed.duplicates == {"model.layers.1.self_attn.o_proj": ["blocks.1.attn"]}
    assert renamed.differing == {"model.layers.1.self_attn.o_proj": {"blocks.1.attn": 1.0}}


def test_a_duplicate_that_is_not_the_compared_tensor_is_said_with_its_difference(tmp_path):
    """A forward-hook dump names the MLP's output twice (the module and the down_proj that returns it):
    the same tensor in a correct forward, said quietly; a fault in the one not compared is said as such."""
    from tracer.traces.layouts import name_notes

    output = torch.arange(12.0).reshape(1, 3, 4)
    point = "model.layers.0.mlp.down_proj"
    for down_proj, said in (
            (output.clone(), f"{point} is given by model.layers.0.mlp (compared) and by {point} too"),
            (output * 1.01, f"{point} gives {point} too, but not model.layers.0.mlp's tensor (max|diff| 0.11): "
                            "only model.layers.0.mlp's is compared")):
        path = tmp_path / "dump.safetensors"  # safetensors writes its names sorted: the module's comes first
        save_file({point: down_proj, "model.layers.0.mlp": output}, str(path))
        assert name_notes(Trace.load(path), "candidate") == [f"candidate: {said}"]


def test_user_mapping_file_extends_and_overrides(tmp_path):
    path = tmp_path / "aliases.json"
    path.write_text(json.dumps({"h{i}.mlp_out": "model.layers.{i}.mlp.down_proj",
                                "Qcur-{i}": "model.layers.{i}.self_attn.q_proj",  # the pre-RoPE Qcur
                                "debug_norm-{i}": None}))
    table = alias_table(path)
    assert table.resolve("h3.mlp_out").point == "model.layers.3.mlp.down_proj"
    resolved = table.resolve("Qcur-2")
    assert resolved.point == "model.layers.2.self_attn.q_proj"
    assert resolved.alias.qk_order == "interleaved"  # still llama.cpp's GGUF order
    assert table.resolve("l_out-2").point == "model.layers.2"  # built-ins still there
    assert table.resolve("debug_norm-1") is None and table.skip_reason("debug_norm-1") == "ignored by the aliases file"


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read aliases file"),
    ("[1, 2]", "expected a JSON object"),
    ('{"a": 3}', "expected a point name or null"),
    ('{"x{i}": "model.layers.{i}.mlp.down"}', "which is not a tracer point"),
    ('{"x": "model.layers.{i}"}', "use {i} on both sides"),
])
def test_bad_mapping_files_are_one_clear_error(tmp_path, content, message):
    path = tmp_path / "a.json"
    path.write_text(content)
    with pytest.raises(TracerError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_alias_file(path)


def test_loading_a_foreign_file_maps_names_and_reads_metadata(tmp_path):
    path = tmp_path / "dump.safetensors"
    save_file({"blocks.0.mlp.c_proj": torch.ones(1, 3, 4), "mystery": torch.ones(2), "tokens": torch.tensor([5, 6, 7])},
              str(path), metadata={"runtime": "candle 0.11", "head_dim": "64"})
    trace = Trace.load(path)
    assert trace.points == ["model.layers.0.mlp.down_proj"]
    assert trace.tokens == [5, 6, 7] and trace.meta.runtime == "candle 0.11" and trace.meta.head_dim == 64
    assert trace.meta.unknown_names == ["mystery"] and trace.meta.engine == "file"
    assert trace.meta.sources["model.layers.0.mlp.down_proj"]["name"] == "blocks.0.mlp.c_proj"


@pytest.mark.parametrize("metadata, message", [
    ({"tokens": "1,x"}, "metadata tokens"),
    ({"head_dim": "sixty"}, "metadata head_dim"),
    ({"qk_order": "sideways"}, "metadata qk_order"),
])
def test_bad_foreign_metadata_is_one_clear_error(tmp_path, metadata, message):
    path = tmp_path / "dump.safetensors"
    save_file({"l_out-0": torch.ones(2, 3)}, str(path), metadata=metadata)
    with pytest.raises(TracerError, match=message):
        Trace.load(path)


def test_the_gguf_names_are_gguf_pys_own():
    """GGUF's tensor names are asked of gguf-py's TensorNameMap (tracer writes none down): every
    tensor a Llama needs has its GGUF name there, the names llama.cpp's files use, and reading a
    name back gives the tensor (what the regime's and candle's weight readers do)."""
    from tracer.model.config import LlamaSpec
    from tracer.model.families import expected_shapes
    from tracer.names.gguf import gguf_names, gguf_tensor_name, hf_tensor_name

    layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    assert sorted(gguf_names("llama").values()) == sorted(["token_embd", "output_norm", "output",
                                                           *(f"blk.{{i}}.{stem}" for stem in layer)])
    spec = LlamaSpec(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
                     max_position_embeddings=128)
    for name in expected_shapes(spec):
        gguf_name = gguf_tensor_name(name)
        assert gguf_name is not None and hf_tensor_name(gguf_name) == name, name
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
