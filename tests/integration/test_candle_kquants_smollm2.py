"""candle on the file a user makes of SmolLM2: llama.cpp's own quantizer to Q4_K_M (Q5_0 where a row
is 576 wide, Q4_K/Q6_K for ffn_down, Q8_0 for token_embd and some attn_v), traced by
`--candidate candle:FILE --regime auto`. candle's Q5_0 loop, its Q8_K quantizer and its k-quant
kernels are emulated (tracer.ggml.candle, candle_kernels): every point exactly 0, no caveat.

Measured here: 513 points, max|diff| 0, 5 tokens; 512 tokens the same (docs/engine-candle.md).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

import tracer
from tests.quantized_gguf import quantize_gguf
from tracer.files.gguffile import GGUFFile

from .test_ggml_smollm2 import PROMPT_IDS

CANDLE_Q = {"preset": "candle-q", "weights": "gguf"}


@pytest.fixture(scope="module")
def q4_k_m(default_model, tmp_path_factory):
    """(the Q4_K_M file, SmolLM2's directory with its tracer_source naming that file: the regime's
    `weights=gguf` reads its tensors). The directory links to the cached one's files: converting
    the file would leave another 540 MB copy in the user's cache on every run."""
    pytest.importorskip("candle")
    from tracer.engines.candle import check_platform
    from tracer.files.sources import bundled_gguf

    try:
        check_platform()
    except tracer.TracerError as exc:
        pytest.skip(str(exc))
    folder = tmp_path_factory.mktemp("q4_k_m")
    gguf_file = quantize_gguf(bundled_gguf(), folder / "smollm2-q4_k_m.gguf", "Q4_K_M")
    model = folder / "model"
    model.mkdir()
    for file in default_model.iterdir():
        if file.name != "config.json":
            (model / file.name).symlink_to(file)
    config = json.loads((default_model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tracer_source": {"gguf_file": str(gguf_file)}}))
    return gguf_file, model


def test_a_q4_k_m_smollm2_is_candles_regime_at_every_point(q4_k_m):
    gguf_file, model = q4_k_m
    kinds = Counter(info.kind for info in GGUFFile(gguf_file).tensors.values())
    assert {"q5_0", "q4_k", "q6_k", "q8_0"} <= set(kinds)  # the mix a user's file has
    result = tracer.run(model, tokens=PROMPT_IDS, candidate=f"candle:{gguf_file}", regime="auto", greedy=0,
                        noise_floor=False, progress=False)  # exactly 0 needs no noise floor
    assert result.regime.variant == CANDLE_Q and result.regime.caveats == ()
    recorded = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(recorded) == 513 and all(p.rel_l2 == 0 for p in recorded)
