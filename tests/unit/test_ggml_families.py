"""llama.cpp's bit-exact regime beyond Llama: a tiny model of a family, converted as a user converts it
(tracer.files.hf_to_gguf, the writer that matches llama.cpp's converter) and quantized by llama.cpp's own
quantizer (Q8_0, Q4_K_M), run by llama.cpp (in its child process) and by tracer's reimplementation in
llama.cpp's regime (`preset=llamacpp,weights=gguf`): every point llama.cpp records, logits included,
exactly equal; one corrupted block found by the audit and localized to its layer and projection.

Widths are multiples of 256, so that k-quants apply to every projection (a 48-wide model gets only
fallbacks); head size 64, whose f16 dot products show the order of a head's dims (12 does not).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

import tracer
from tests.audited_gguf import damage_block
from tests.conftest import TOKENS
from tests.cpu_builds import AMD_CPU, BUILDS, INTEL_CPU, skip_unless_exact_here
from tests.families import write_tiny_family
from tests.quantized_gguf import quantize_gguf
from tracer.engines import isolated
from tracer.engines.registry import ENGINES
from tracer.files.hf_to_gguf import write_gguf
from tracer.files.sources import ModelSource
from tracer.ggml import ops
from tracer.ggml.strategies import GGUFWeights, implied_regime

KQUANT_FAMILY = dict(vocab_size=288, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, head_dim=64)
REGIME = {"preset": "llamacpp", "weights": "gguf"}
TYPES = ("Q8_0", "Q4_K_M")
# Gemma 2: llama.cpp scales queries by 1/sqrt(head_dim) and reads no query_pre_attn_scalar; the tiny one
# takes them equal, as the released 2B and 9B have them.
# Gemma 3: llama.cpp makes every 6th layer global whatever the config's layer_types (the converter writes
# no pattern): two sliding layers here, as its default pattern has them.
FAMILIES = {"qwen3": {}, "gemma2": dict(query_pre_attn_scalar=64),
            "gemma3": dict(query_pre_attn_scalar=64, layer_types=["sliding_attention"] * 2),
            "olmo2": dict(tie_word_embeddings=False),  # llama.cpp's OLMo-2 needs an output.weight: not tied
            # llama.cpp runs these without a sliding window (Qwen2's graph has none, a Mistral GGUF carries
            # none, Phi-3's is "currently disabled"): the tiny models without one, as llama.cpp computes them
            "qwen2": dict(use_sliding_window=False), "mistral": dict(sliding_window=None),
            "phi3": dict(sliding_window=None)}
LOCALIZED = ("qwen3", "gemma2", "gemma3", "olmo2")  # the corrupted-tensor test: the families with their own norms
DAMAGED = "blk.1.attn_k.weight"  # one block of it corrupted: found at layer 1's k_proj


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """family -> (model directory, {type: its GGUF}), each family built once, when first asked for."""
    pytest.importorskip("llama_cpp")
    built = {}

    def build(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            model = write_tiny_family(folder / "model", family, **KQUANT_FAMILY, **FAMILIES[family])
            f32 = write_gguf(model, folder / "F32.gguf", "f32")
            built[family] = model, {kind: quantize_gguf(f32, folder / f"{kind}.gguf", kind) for kind in TYPES}
        return built[family]

    return build


def _llamacpp(model, gguf) -> tracer.Trace:
    engine = isolated.load(ENGINES["llamacpp"], ModelSource(model), {}, argument=str(gguf))
    try:
        return engine.record(TOKENS)
    finally:
        engine.close()


def _in_regime(model, gguf, **extra) -> tracer.Trace:
    skip_unless_exact_here(implied_regime(GGUFWeights(gguf).types(), {})[1])
    return tracer.record(model, TOKENS, engine="reimpl", variant={**REGIME, "gguf_file": str(gguf), **extra},
                         progress=False)


def _distances(reference, candidate) -> list[tuple[str, float]]:
    """(point, rel_l2) for every point llama.cpp recorded, in the forward's order."""
    out = []
    for name in reference.tensors:
        if name in candidate.tensors:
            ref, cand = reference[name].double(), candidate[name].double()
            assert ref.shape == cand.shape, name
            out.append((name, float((ref - cand).norm() / ref.norm())))
    return out


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_recorded_point_is_exactly_0(quantized, family, kind):
    model, files = quantized(family)
    distances = _distances(_in_regime(model, files[kind]), _llamacpp(model, files[kind]))
    names = [name for name, _ in distances]
    assert "lm_head" in names and "model.layers.1.mlp.down_proj" in names and len(names) >= 27, names
    assert [(name, d) for name, d in distances if d != 0] == []


@pytest.mark.parametrize("family", LOCALIZED)
def test_a_corrupted_tensor_is_localized(quantized, family, tmp_path):
    """The audit names the damaged tensor; the regime takes it requantized from the directory's
    weights (as `--regime auto` does), so llama.cpp parts from it at that projection, and at
    nothing before it."""
    model, files = quantized(family)
    bad = damage_block(files["Q4_K_M"], tmp_path / "bad.gguf", DAMAGED, block=1, quants=3)
    audit = tracer.audit_gguf(bad, model, progress=False)
    assert audit.damaged == (DAMAGED,)
    requantize = DAMAGED.removesuffix(".weight")
    distances = _distances(_in_regime(model, bad, requantize=requantize), _llamacpp(model, bad))
    first = next(n for n, (_, d) in enumerate(distances) if d != 0)
    assert distances[first][0] == "model.layers.1.self_attn.k_proj", distances[first]
    assert all(d == 0 for _, d in distances[:first])
    assert first > 10  # all of layer 0 and layer 1's input norm, q_proj before it


def test_the_gelu_table_is_ggmls():
    """Gemma's GeGLU reads ggml's f16 GELU table: the one computed here is the one ggml-cpu fills at
    init, entry for entry (every f16 input; the build's features do not enter it)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    library.ggml_cpu_init()
    native = np.frombuffer((ctypes.c_uint16 * 65536).in_dll(library, "ggml_table_gelu_f16"), dtype=np.float16)
    ours = ops.gelu_table()
    assert torch.equal(torch.from_numpy(native.astype(np.float32)).nan_to_num(7.0), ours.nan_to_num(7.0))


@pytest.mark.parametrize("build", ["amd", "intel"])
def test_both_cpu_kinds_take_the_emulated_paths(quantized, build):
    """The other CPU, through its feature report: on each build every family's files take only paths
    the regime emulates (no caveat), so the exact comparison above is what holds there. The families'
    own ops (NEOX RoPE, GeGLU's table, soft-capping's tanhf, the q/k norms) have no feature-dependent
    path; the kernels they sit between are the Llama ones, checked per CPU in test_ggml_strategies."""
    flags = set({"amd": AMD_CPU, "intel": INTEL_CPU}[build]["flags"].split())
    for family in FAMILIES:
        for path in quantized(family)[1].values():
            weights = GGUFWeights(path)
            regime = implied_regime(weights.types(), {}, flags, BUILDS[build], head_dim=weights.head_dim)
            assert regime == ({"preset": "llamacpp", "weights": "gguf"}, []), (family, path.name)
