"""`tracer quality --by-layer` with llama.cpp as the candidate, on a tiny model quantized to Q8_0 by
llama.cpp's own quantizer: tracer's emulation of llama.cpp's run (`preset=llamacpp,weights=gguf`,
bit-exact on Q8_0) loses exactly what llama.cpp loses, so the shares are shares of the real loss."""

from __future__ import annotations

import random

import pytest
from safetensors.torch import load_file, save_file

import tracer
from tests.conftest import write_tiny_llama
from tests.cpu_builds import skip_unless_exact_here
from tests.quantized_gguf import quantize_gguf
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(a tiny Llama with soft next-token distributions, the same model as a Q8_0 GGUF)."""
    pytest.importorskip("llama_cpp")
    folder = tmp_path_factory.mktemp("quality-llamacpp")
    model = write_tiny_llama(folder / "soft", seed=0)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.1  # spread distributions (test_quality.py)
    save_file(tensors, model / "model.safetensors")
    f32 = write_tiny_gguf(model, folder / "soft-f32.gguf")
    return model, quantize_gguf(f32, folder / "soft-q8_0.gguf", "Q8_0", requantize=False)


def test_the_emulated_candidate_loses_what_llamacpp_loses(quantized):
    model, gguf = quantized
    tokens = [random.Random(0).randrange(97) for _ in range(96)]
    q = tracer.quality(tokens=tokens, model=model, candidate=f"llamacpp:{gguf}", ctx=32, by_layer=True,
                       progress=False)
    layers = q.layers
    assert layers.candidate == f"preset=llamacpp,weights=gguf on {gguf.name}"
    assert 1e-5 < layers.total_kld < 1e-2  # 8-bit weights and activations: a small loss, not none
    assert layers.floor_kld == 0.0  # hf and tracer's f32 forward: the same logits on this model
    shares = {s.component: s.share for s in layers.shares}
    assert shares["model.embed_tokens"] > 0 and shares["lm_head"] > 0  # Q8_0 embedding, tied lm_head
    assert shares["model.norm"] < 1e-6  # ggml's RMSNorm against transformers': rounding only
    assert 0.5 < layers.sum_of_shares < 1.5
    skip_unless_exact_here(layers.caveats)  # last: the rest holds on any CPU
    assert layers.emulated_kld == layers.total_kld  # bit-exact: the same logits on both paths
