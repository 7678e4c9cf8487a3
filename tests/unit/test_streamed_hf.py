"""transformers' model with its weights read block by block (`hf --stream`, tracer/engines/hf_streamed.py):
every point is the whole-model run's bit for bit but the logits, which are the whole product's to a few f32
ulps (all eight families were checked when it was written; five that cover what differs between them are
kept here), and parameters hold no memory between forwards."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TOKENS
from tests.families import TINY_FAMILIES, write_tiny_family
from tracer import TracerError
from tracer.engines.load import resolve_and_load
from tracer.model.points import FINAL_LOGITS, LOGITS

# tied and untied embeddings, sliding windows, Gemma's scaled embedding and soft-caps, a partial
# rotary, per-layer attention types: what the units and their weights can differ in
FAMILIES = ["llama", "qwen2", "gemma2", "gemma3", "phi3"]
assert set(FAMILIES) <= set(TINY_FAMILIES)

# lm_head multiplied by chunks of rows against the whole matrix: BLAS picks its kernel by shape, so a
# chunk's sums may run in another order. At these tiny shapes (10-row chunks) the AMD EPYC measured up
# to 2.8 f32 ulps of a position's largest logit (3.4 after Gemma's soft-cap); the Intel Xeon, bitwise.
# At the default 16384-row chunks the AMD EPYC is bitwise at SmolLM2's, the 1B's and the 8B's shapes.
LOGIT_ULPS = 8


def same_logits(streamed: torch.Tensor, whole: torch.Tensor) -> bool:
    """Within `LOGIT_ULPS` f32 ulps of each position's largest |logit| (the last axis is the vocabulary)."""
    scale = whole.abs().amax(dim=-1, keepdim=True) * torch.finfo(torch.float32).eps  # (…, 1)
    return bool(((streamed - whole).abs() <= LOGIT_ULPS * scale).all())


def differing(whole: dict, streamed: dict, same=torch.equal) -> list[str]:
    """The points that are not the whole model's by `same`; where `same` is bit for bit, the logits by
    `same_logits`."""
    def agrees(point: str) -> bool:
        if same is torch.equal and point in (LOGITS, FINAL_LOGITS):
            return same_logits(streamed[point], whole[point])
        return same(streamed[point], whole[point])

    return [point for point in whole if not agrees(point)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    return {family: write_tiny_family(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_points_are_the_whole_models_bit_for_bit(tiny, family, monkeypatch):
    from tracer.files import weights

    monkeypatch.setattr(weights, "VOCAB_ROWS", 10)  # lm_head in several chunks of the tiny vocabulary
    whole = resolve_and_load("hf", tiny[family], {})
    streamed = resolve_and_load("hf", tiny[family], {}, stream=True)
    expected, got = whole.record(TOKENS), streamed.record(TOKENS)
    assert got.points == expected.points
    assert differing(expected.tensors, got.tensors) == []
    assert same_logits(streamed.logits(TOKENS), whole.logits(TOKENS))
    assert streamed.draft(TOKENS, 3) == whole.draft(TOKENS, 3)  # transformers' KV cache, blocks streamed
    # between forwards the parameters hold no memory
    assert {p.device.type for p in streamed.model.parameters()} == {"meta"}


def test_a_variant_and_a_dtype_stream_too(tiny):
    variant = {"theta": 10000.0, "dtype": "bf16"}
    whole = resolve_and_load("hf", tiny["llama"], variant).record(TOKENS)
    streamed = resolve_and_load("hf", tiny["llama"], variant, stream=True).record(TOKENS)
    assert all(torch.equal(whole[p], streamed[p]) for p in whole.points)
    assert streamed[next(iter(streamed.points))].dtype == torch.bfloat16


def test_a_missing_or_misshapen_tensor_is_one_line(tiny, tmp_path):
    folder = tmp_path / "damaged"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    tensors = load_file(str(tiny["llama"] / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    shape = tuple(tensors[name].shape)
    save_file({k: v for k, v in tensors.items() if k != name}, str(folder / "model.safetensors"))
    with pytest.raises(TracerError, match=re.escape(f"missing tensor {name} (expected shape {shape})")):
        resolve_and_load("hf", folder, {}, stream=True)
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, str(folder / "model.safetensors"))
    with pytest.raises(TracerError, match=f"shape mismatch, {name}"):
        resolve_and_load("hf", folder, {}, stream=True)


@pytest.mark.parametrize("variant", [{}, {"dtype": "f64"}, {"theta": 1000.0}])
def test_the_reimpl_streamed_with_its_vocabulary_in_chunks_is_bit_for_bit(tiny, variant, monkeypatch):
    """The embedding read as the rows the tokens use, lm_head as chunks of rows (a chunk smaller
    than the tiny vocabulary, so that there are several); in f64, each matrix read in f32 and upcast
    16 rows at a time as it is multiplied."""
    from tracer.files import weights
    from tracer.reimpl import forward
    from tracer.reimpl.forward import Model

    monkeypatch.setattr(weights, "VOCAB_ROWS", 10)
    monkeypatch.setattr(forward, "UPCAST_ROWS", 16)
    ids = torch.tensor(TOKENS)
    for family in ("llama", "gemma2"):  # tied, and Gemma's scaled embedding and capped logits
        whole, streamed = {}, {}
        expected = Model.from_dir(tiny[family], variant).forward(ids, lambda n, t: whole.__setitem__(n, t.clone()))
        got = Model.from_dir(tiny[family], variant, stream=True).forward(
            ids, lambda n, t: streamed.__setitem__(n, t.clone()))
        assert list(whole) == list(streamed)
        # f64's matrices multiplied by chunks of rows: BLAS may order a sum otherwise (a few f64 ulps)
        same = torch.equal if variant.get("dtype") != "f64" else \
            (lambda a, b: bool((a - b).abs().max() <= 1e-13 * max(1.0, float(b.abs().max()))))
        assert differing(whole, streamed, same) == []
        assert (same_logits if same is torch.equal else same)(got, expected)
