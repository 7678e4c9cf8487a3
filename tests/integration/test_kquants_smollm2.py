"""The llama.cpp regime on SmolLM2 as users quantize it: the bundled GGUF requantized by llama.cpp's
own quantizer to Q4_K_M (Q4_K and Q6_K `ffn_down`, the 576-wide projections falling back to
Q5_0/Q8_0), against llama.cpp 0.3.36 on this machine's CPU.

Measured here (docs/regimes.md): `tracer run --model FILE.gguf --candidate llamacpp --regime auto`
matches free-running with every one of the 453 points exactly 0, at 5 and at 512 tokens, for
Q4_K_M, Q5_K_M and Q6_K files alike. The test takes the run's two parts that are the k-quants'
own, at 70 tokens: the regime `--regime auto` implies for the file, and that regime against
llama.cpp, every tensor read from the file (the pipeline around them is the Q4_1 file's,
tests/integration/test_ggml_smollm2.py; a directory converted from a GGUF, tests/unit/test_cache.py
and tests/unit/test_families.py).
"""

from __future__ import annotations

import pytest

import tracer
from tests.cpu_builds import skip_unless_exact_here

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


@pytest.fixture(scope="module")
def q4_k_m(default_model, tmp_path_factory):
    """SmolLM2 quantized to Q4_K_M by llama.cpp (made once for the module)."""
    pytest.importorskip("llama_cpp")
    from tests.quantized_gguf import quantize_gguf
    from tracer.files.sources import bundled_gguf

    return quantize_gguf(bundled_gguf(), tmp_path_factory.mktemp("kquants") / "smollm2-Q4_K_M.gguf", "Q4_K_M")


def test_a_q4_k_m_gguf_in_its_implied_regime_is_llama_cpp_to_the_bit(default_model, q4_k_m):
    """70 tokens: the repacked Q4_K gemm (68 rows) and gemv (2), the tiled Q6_K matmul, the tiled
    flash attention; every tensor read from the file in its own type (`gguf_file`), on the bundled
    model's directory, as `--regime auto` takes a candidate file that is not the directory's source."""
    from tracer.ggml.strategies import GGUFWeights, implied_regime

    types = GGUFWeights(q4_k_m).types()
    assert {"q4_k", "q6_k"} <= set(types.values())
    variant, caveats = implied_regime(types, {})
    assert variant == {"preset": "llamacpp", "weights": "gguf"}
    skip_unless_exact_here(caveats)  # a build without AVX2 or FMA: its k-quant kernels are not x86's
    tokens = (PROMPT_IDS * 14)[:70]
    ours = tracer.record(default_model, tokens, engine="reimpl", variant=variant | {"gguf_file": str(q4_k_m)},
                         progress=False)
    theirs = tracer.record(default_model, tokens, engine=f"llamacpp:{q4_k_m}", progress=False)
    result = tracer.compare(ours, theirs)
    compared = [p for p in result.points if p.recorded]
    assert result.verdict == "match" and len(compared) == 453
    assert [p.point for p in compared if p.rel_l2 != 0] == []
