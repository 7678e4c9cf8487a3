"""A family is a composition: a made-up one, declared and registered in a test, gets its point order,
its tensor shapes, its knobs, the CLI's help and a reimpl recording from that declaration alone (no
table elsewhere edited).

The made-up family is a Llama that also norms the MLP output before the residual add
(`post_feedforward_layernorm`, as Gemma and OLMo-2 do), so every derived fact differs from Llama's in
one checkable place."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tracer.cli import build_parser
from tracer.core.errors import TracerError
from tracer.model.components.block import PRE_NORM, Block
from tracer.model.config import load_config, read_hf
from tracer.model.families import LLAMA, expected_shapes, register, unregister
from tracer.model.knobs import check_family, knobs_for
from tracer.model.points import POST_ATTENTION_NORM, POST_FF_NORM, all_points, layer_order, source_point, sub_points

POST_FF = POST_FF_NORM
MADE_UP = LLAMA.derive(name="llama_postff", title="Llama with an MLP post-norm", model_types=("llama_postff",),
                       adds="a made-up Llama that norms the MLP output before the residual add",
                       block=Block((PRE_NORM[0], (POST_ATTENTION_NORM, POST_FF))))


@pytest.fixture
def made_up():
    register(MADE_UP)
    yield MADE_UP.name
    unregister(MADE_UP.name)


@pytest.fixture
def made_up_dir(tmp_path, made_up):
    """A tiny random model of the made-up family: a tiny Llama, its model_type changed, one norm added per layer."""
    folder = write_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": made_up}))
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for n in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{n}.{POST_FF}.weight"] = 1 + 0.1 * torch.randn(config["hidden_size"],
                                                                               generator=generator)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_point_order_follows_the_row(made_up):
    llama = layer_order("llama")
    assert layer_order(made_up) == (*llama[:-1], POST_FF, "")
    assert sub_points(made_up)[""].source == POST_FF
    assert sub_points(made_up)[POST_FF].source == "mlp.down_proj"
    assert source_point("model.layers.1", made_up) == f"model.layers.1.{POST_FF}"
    assert all_points(2, made_up)[-5:] == ["model.layers.1.mlp.down_proj", f"model.layers.1.{POST_FF}",
                                           "model.layers.1", "model.norm", "lm_head"]


def test_shapes_follow_the_row(made_up_dir, made_up):
    spec = read_hf(load_config(made_up_dir))
    assert spec.family == made_up
    llama_names = set(expected_shapes(spec.replace(family="llama")))
    shapes = expected_shapes(spec)
    assert set(shapes) - llama_names == {f"model.layers.{n}.{POST_FF}.weight" for n in range(spec.num_hidden_layers)}
    assert shapes[f"model.layers.0.{POST_FF}.weight"] == (spec.hidden_size,)


def test_knobs_follow_the_row(made_up):
    names = [knob.name for knob in knobs_for(made_up)]
    assert "norm" in names  # Llama's RMSNorm: candle's variant of it applies
    assert not {"norm_offset", "window", "qkv_split", "config", "preset"} & set(names)
    refusal = "^knob 'norm_offset' does not apply to llama_postff models; it applies to gemma2, gemma3$"
    with pytest.raises(TracerError, match=refusal):
        check_family({"norm_offset": "drop"}, made_up)


def test_cli_help_lists_the_row(made_up, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["variants", "--help"])
    assert "llama_postff" in " ".join(capsys.readouterr().out.split())


def test_reimpl_records_the_made_up_family(made_up_dir, made_up):
    trace = tracer.record(made_up_dir, TOKENS, engine="reimpl")
    assert trace.meta.family == made_up
    assert trace.points == all_points(2, made_up)
    # the block output is the residual plus the MLP output normed by the added norm (HF's RMSNorm: f32, then weight)
    down, mid = trace["model.layers.0.mlp.down_proj"], trace["model.layers.0.resid_mid"]
    weight = load_file(str(made_up_dir / "model.safetensors"))[f"model.layers.0.{POST_FF}.weight"]
    normed = weight * (down * torch.rsqrt(down.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(trace[f"model.layers.0.{POST_FF}"], normed, rtol=0, atol=1e-6)
    torch.testing.assert_close(trace["model.layers.0"], mid + normed, rtol=0, atol=1e-6)
