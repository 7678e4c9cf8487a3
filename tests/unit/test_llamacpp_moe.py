"""llama.cpp live on the mixtures of experts: tiny Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE saved by transformers,
converted by llama.cpp's own convert_hf_to_gguf.py (the one of llama-cpp-python 0.3.36's source, unpacked where
$LLAMACPP_SOURCE says; skipped without it, as the converter tests are), run in the engine's child against hf:
`match`, every token routed to the same experts in the same order; a corrupted expert found at its layer's
experts. The differences llama.cpp declares on them (norm_topk_prob not read, Mixtral's window) are the matrix's
cells (tests/unit/test_matrix.py `CELL_CONFIGS`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.comparison.routing import AGREE
from tracer.engines.registry import ENGINES
from tracer.files import hf_to_gguf
from tracer.model.points import EXPERTS, MLP, ROUTER_LOGITS, ROUTER_SCORES, TOP_K_INDEX, TOP_K_WEIGHTS, layer_point

SOURCE = Path(os.environ.get("LLAMACPP_SOURCE", "llama.cpp-source-not-given"))
ROOT = Path(__file__).resolve().parents[2]
CELL = "kv_cache=f32,flash_attn=off"  # llama.cpp's exact f32 path, as the matrix runs it

# What llama.cpp's graphs hold of each family where the tiny model's config asks for more: qwen2moe has every layer
# sparse (src/models/qwen2moe.cpp; the converter cannot map a dense layer: "Can not map tensor
# 'model.layers.1.mlp.down_proj.weight'"), olmoe norms k over n_embd (src/models/olmoe.cpp: attn_k_norm {n_embd}),
# so as many KV heads as heads; both as the published checkpoints are.
LLAMACPP_HOLDS = {"qwen2_moe": dict(mlp_only_layers=[]), "olmoe": dict(num_key_value_heads=4)}
# The published configs otherwise: Mixtral-8x7B has no sliding window (with one, llama.cpp's declared difference).
PUBLISHED = {**LLAMACPP_HOLDS, "mixtral": dict(sliding_window=None)}
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ROUTING = (ROUTER_LOGITS, ROUTER_SCORES, TOP_K_WEIGHTS, EXPERTS, MLP)


def converted(models: dict[str, Path], folder: Path) -> dict[str, Path]:
    """Each model directory as the f32 GGUF llama.cpp's converter writes (folder/NAME.gguf, no vocabulary), all in
    one child running the script's own classes; skipped where the converter is absent."""
    pytest.importorskip("llama_cpp")
    script = SOURCE / hf_to_gguf.SCRIPT
    if not script.is_file():
        pytest.skip(f"llama.cpp's {hf_to_gguf.SCRIPT} is not here ({SOURCE}): set $LLAMACPP_SOURCE to the "
                    "vendor/llama.cpp of llama-cpp-python's unpacked source")
    files = {name: folder / f"{name}.gguf" for name in models}
    jobs = [(str(script), str(model), str(files[name]), "f32", "no_vocab") for name, model in models.items()]
    code = ("import sys, json; from tracer.files.hf_to_gguf import _run_here\n"
            "for job in json.loads(sys.argv[1]): _run_here(*job)")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (model directory, its GGUF), each family as published."""
    if ENGINES["llamacpp"].missing_runtime():
        pytest.skip("llama-cpp-python is not installed here")
    folder = tmp_path_factory.mktemp("llamacpp_moe")
    models = {family: write_tiny_family(folder / family, family, **PUBLISHED.get(family, {})) for family in FAMILIES}
    files = converted(models, folder)
    return {name: (models[name], files[name]) for name in models}


def run(model_dir: Path, gguf: Path):
    return tracer.run(model_dir, tokens=TOKENS, candidate=f"llamacpp:{gguf}", variant=CELL, greedy=0, progress=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_matches_llamacpp_with_every_token_routed_alike(tiny, family):
    model_dir, gguf = tiny[family]
    result = run(model_dir, gguf)
    assert result.verdict == "match", (result.first_divergence, result.notes)
    count = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    layers = result.routing.layers
    # every layer's every token: the same experts in the same order; k of them, not all E (warm-up off)
    assert len(layers) == count and all(layer.k == 2 and set(layer.status) == {AGREE} for layer in layers)
    assert result.routing.agreement == 1.0 and result.routing.counts()["flips"] == 0
    compared = {p.point: p for p in result.points}
    # each routing point of each layer compared: the indices (T, k) by the routing diff, the others by value
    for layer in range(count):
        for sub in ROUTING:
            assert compared[layer_point(layer, sub)].missing_on is None, layer_point(layer, sub)
        indices = compared[layer_point(layer, TOP_K_INDEX)]
        assert indices.shape == (len(TOKENS), 2) and indices.reason.startswith("integer ids")
    assert result.routing.weight_max_abs < 1e-6


def test_a_corrupted_expert_is_found_at_its_layers_experts(tiny, tmp_path):
    import gguf  # gguf-py: to change one expert's tensor in place

    model_dir, original = tiny["mixtral"]
    picked = tracer.record(model_dir, TOKENS, engine="hf", progress=False).tensors[layer_point(1, TOP_K_INDEX)]
    expert = int(picked[0, 0])  # the first token's first expert in layer 1: a corrupted one is used
    broken = tmp_path / "broken.gguf"
    shutil.copyfile(original, broken)
    reader = gguf.GGUFReader(broken, "r+")
    gate = next(tensor for tensor in reader.tensors if tensor.name == "blk.1.ffn_gate_exps.weight")
    rows = gate.data[expert]  # (n_ff, C) of that expert, a view of the file
    rows[:] = np.flip(rows, axis=-1)  # its gate projection's columns reversed
    reader.data.flush()
    result = run(model_dir, broken)
    assert result.first_divergence.point == layer_point(1, EXPERTS), result.first_divergence
    # the routing up to that layer is untouched: its router reads the layer's input, before the experts
    assert all(set(layer.status) == {AGREE} for layer in result.routing.layers[:2])


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_micro_batches_join_every_routing_point(tiny, family):
    """n_ubatch=3: the 7-token prompt in graphs of 3, 3 and 1 tokens; each graph's last step of the weights' chain
    and of each biased projection kept once (Qwen2-MoE's q/k/v biases), a 1-token graph's weights read as (1, k)
    and its per-head q/k norms (Qwen3-MoE) as one row: the same match as the whole prompt's."""
    model_dir, gguf = tiny[family]
    result = tracer.run(model_dir, tokens=TOKENS, candidate=f"llamacpp:{gguf}", variant=CELL + ",n_ubatch=3",
                        greedy=0, progress=False)
    assert result.verdict == "match", result.first_divergence
    assert result.routing.agreement == 1.0 and result.routing.counts()["tokens"] == 2 * len(TOKENS)
