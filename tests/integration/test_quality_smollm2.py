"""`tracer quality` on the bundled SmolLM2 over tests/data/porting.txt (307 tokens).

A wrong RoPE base loses a lot (mean KLD 0.126 at -c 128 here, docs/quality.md); llama.cpp on the
bundled Q4_1 GGUF loses little against transformers on its own f32 conversion (the same weights:
only llama.cpp's 8-bit activations and f16 KV cache differ), and tracer's emulation of that run
(`preset=llamacpp,weights=gguf`, bit-exact on these kernels) loses what llama.cpp loses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tracer

TEXT = Path(__file__).resolve().parents[1] / "data" / "porting.txt"


def test_a_wrong_theta_loses_over_the_text(default_model):
    q = tracer.quality(text_file=TEXT, model=default_model, variant="theta=10000", ctx=64, progress=False)
    assert q.tokens == 307 and q.chunks == 4 and q.statistics.count == 4 * 31 and q.bos is None
    assert q.statistics.kld.value > 0.05 and q.statistics.same_top.value < 0.95
    assert q.exact_kld.value == pytest.approx(q.statistics.kld.value, rel=0.05)


def test_llamacpp_loses_what_its_emulation_loses(default_model):
    pytest.importorskip("llama_cpp")
    q = tracer.quality(text_file=TEXT, model=default_model, candidate="llamacpp", ctx=32, chunks=2, by_layer=True,
                       progress=False)
    layers = q.layers
    assert 1e-4 < layers.total_kld < 0.05  # far less than a wrong RoPE base loses (> 0.05 above)
    assert layers.emulated_kld == pytest.approx(layers.total_kld, rel=1e-3)  # the emulation is that run
    assert layers.floor_kld < 1e-8  # hf and tracer's f32 forward agree to rounding
    assert 0.7 < layers.sum_of_shares < 1.3
    shares = {s.component: s.share for s in layers.shares}
    assert shares["model.embed_tokens"] == 0.0  # the directory's embedding is this GGUF's, dequantized exactly
    assert max(shares, key=shares.get) != "model.embed_tokens" and shares["model.layers.0"] > 0
