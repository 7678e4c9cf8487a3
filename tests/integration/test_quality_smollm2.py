"""`tracer quality` on the bundled SmolLM2 over tests/data/porting.txt (307 tokens).

A wrong RoPE base loses a lot (mean KLD 0.126 at -c 128 here, docs/quality.md); llama.cpp on the
bundled Q4_1 GGUF loses little against transformers on its own f32 conversion (the same weights:
only llama.cpp's 8-bit activations and f16 KV cache differ). Where the loss is made is checked on
tiny models (tests/unit/test_quality*.py): on SmolLM2 it costs ~20 forwards per chunk.
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


def test_llamacpp_on_the_model_s_own_gguf_loses_little(default_model):
    pytest.importorskip("llama_cpp")
    q = tracer.quality(text_file=TEXT, model=default_model, candidate="llamacpp", ctx=64, progress=False)
    assert 1e-4 < q.statistics.kld.value < 0.05  # far less than a wrong RoPE base loses (> 0.05 above)
    assert q.statistics.same_top.value > 0.8
    assert q.exact_kld.value == pytest.approx(q.statistics.kld.value, rel=0.05)
