"""The two CPUs the project runs on (CI included), as a native llama.cpp build on each describes
itself: its feature report (`llama_print_system_info`, which names what the build was compiled
for) and the /proc/cpuinfo fields tracer reads the rest off (`tracer.ggml.ops.report_features`).
Unit tests of a CPU-dependent path feed both builds, whichever machine they run on; a test against
this machine's llama.cpp checks this machine's path and skips, saying why, where the regime here
is not exact (`skip_unless_exact_here`).

- AMD: an AMD EPYC (Zen 4: AVX-512 with BF16 and VNNI; no AVX-VNNI, AVX512-FP16 or AMX); GCC 12
  tunes its native build for Zen (ZNVER).
- INTEL: a Sapphire-Rapids-class Xeon (AVX-512 with BF16, VNNI and FP16; AVX-VNNI; AMX, which the
  README's build leaves out with -mno-amx-int8).

- ZEN3: an AMD EPYC without AVX-512 (Zen 3: AVX2, FMA, F16C), where CI has run too: ggml's AVX2 code,
  8-lane vectors and AVX2's exp (`tracer.ggml.ops.f32_lanes`, `avx512_exp`).
"""

from __future__ import annotations

import pytest

from tracer.ggml.ops import report_features

AMD_REPORT = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
              "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
INTEL_REPORT = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
                "REPACK = 1 | ")
ZEN3_REPORT = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
               "OPENMP = 1 | REPACK = 1 | ")
AMD_CPU = {"vendor_id": "AuthenticAMD", "flags": "fma f16c avx2 avx512f avx512dq avx512_bf16 avx512_vnni"}
INTEL_CPU = {"vendor_id": "GenuineIntel",
             "flags": "fma f16c avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512_fp16 avx_vnni amx_int8 amx_tile"}
ZEN3_CPU = {"vendor_id": "AuthenticAMD", "flags": "fma f16c avx2"}
AMD = report_features(AMD_REPORT, AMD_CPU)
INTEL = report_features(INTEL_REPORT, INTEL_CPU)
ZEN3 = report_features(ZEN3_REPORT, ZEN3_CPU)
BUILDS = {"amd": AMD, "intel": INTEL}  # the two AVX-512 builds the repack paths are measured on


def this_cpu_caveats(head_dim: int | None = None) -> list[str]:
    """The regime's caveats on this machine's CPU and llama.cpp build alone, whatever the weights: where a
    test's bit-exact claim cannot hold here before it runs anything."""
    from tracer.ggml.strategies import implied_regime

    return implied_regime({}, head_dim=head_dim)[1]


def skip_unless_exact_here(caveats) -> None:
    """Skip a bit-for-bit comparison with this machine's llama.cpp (or candle) where the regime
    names a path here that it does not claim (a CPU without AVX2 or FMA, an AMX build): there is no
    exact answer to check on this machine; the unit tests check each CPU's paths from its report."""
    if caveats:
        pytest.skip("the regime is not exact on this machine: " + "; ".join(caveats))
