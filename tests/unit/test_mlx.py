"""The mlx engine on tiny random models: mlx-lm's own forward, recorded through its module calls (Llamas; the
other families where mlx-lm's own code differs from transformers', beside what tests/unit/test_matrix.py holds)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import HUB_KEYS, WINDOW, with_hub_keys, write_tiny_family
from tracer import TracerError
from tracer.engines.load import resolve_and_load
from tracer.model.points import all_points, layer_point

FUSED = ("self_attn.scores", "self_attn.probs")


@pytest.fixture
def mlx():
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")


@pytest.fixture
def model(tiny_llama):
    return tiny_llama("m", rope_theta=500.0)


def test_a_missing_runtime_is_one_line_naming_the_extra(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # what find_spec says for a module not installed
    with pytest.raises(TracerError, match=r"^the mlx engine needs mlx-lm, which is not installed: "
                                          r"pip install -e '\.\[mlx\]'$"):
        tracer.record(tiny_llama(), TOKENS, engine="mlx")


SHAPES = {
    "gqa": {},
    "untied lm_head": dict(tie_word_embeddings=False),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "llama3 rope scaling": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 4}),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_point_but_the_fused_attention_matches_transformers(mlx, tiny_llama, shape):
    model = tiny_llama("m", rope_theta=500.0, **SHAPES[shape])
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine="mlx")
    result = tracer.compare(reference, candidate)
    assert result.verdict == "match"
    unobservable = {layer_point(i, sub) for i in range(2) for sub in FUSED}
    assert list(candidate.tensors) == [p for p in all_points(2) if p not in unobservable]  # execution order
    assert set(candidate.not_recorded) == unobservable
    assert "fused" in candidate.not_recorded["model.layers.0.self_attn.scores"]
    missing = [p for p in result.points if not p.recorded]
    assert {p.point for p in missing} == unobservable and not any(p.diverged for p in missing)
    # q/k after RoPE are (heads, T, D) like the reference's; context and act are o_proj's / down_proj's inputs
    assert candidate["model.layers.1.self_attn.q_rope"].shape == (4, len(TOKENS), 16)
    assert candidate["model.layers.1.self_attn.k_rope"].shape == (2, len(TOKENS), 16)
    worst = max(p.rel_l2 for p in result.points if p.recorded)
    assert 0 < worst < 1e-5
    assert candidate.meta.runtime["name"] == "mlx" and candidate.meta.runtime["version"]


def test_logits_are_an_unrecorded_forward_equal_to_the_recorded_one(mlx, model):
    engine = resolve_and_load("mlx", model, {})
    logits = engine.logits(TOKENS)
    assert logits.shape == (len(TOKENS), 97)
    assert torch.equal(logits, engine.record(TOKENS)["lm_head"])


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("f16", torch.float16)])
def test_dtype_knob_runs_mlx_in_that_dtype_and_diverges_at_the_embedding(mlx, model, dtype, torch_dtype):
    reference = tracer.record(model, TOKENS, engine="hf")
    candidate = tracer.record(model, TOKENS, engine="mlx", variant=f"dtype={dtype}")
    assert candidate["model.layers.0.input_layernorm"].dtype == torch_dtype and candidate.meta.dtype == str(
        torch_dtype).removeprefix("torch.")
    result = tracer.compare(reference, candidate)
    assert result.first_divergence.point == "model.embed_tokens"
    # the half-precision run is the same model: its logits stay close to the f32 ones
    assert result.logits.argmax_agree > 0.5


def test_half_precision_traces_agree_with_transformers_in_the_same_dtype(mlx, model):
    """bf16 on both sides: the embedding is the same lookup, so the first divergence moves downstream."""
    reference = tracer.record(model, TOKENS, engine="hf", variant="dtype=bf16")
    candidate = tracer.record(model, TOKENS, engine="mlx", variant="dtype=bf16")
    result = tracer.compare(reference, candidate)
    embed = next(p for p in result.points if p.point == "model.embed_tokens")
    assert embed.rel_l2 == 0


def test_recording_leaves_every_module_as_it_was_even_when_the_forward_raises(mlx, model):
    engine = resolve_and_load("mlx", model, {})
    classes = {path: type(module) for path, module in engine.model.named_modules()}
    engine.record(TOKENS)
    assert {path: type(module) for path, module in engine.model.named_modules()} == classes

    def failing(name, tensor):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        engine.record(TOKENS, recorder=failing)
    from tracer.engines.mlx import recording_calls

    with pytest.raises(ValueError, match="boom"):
        with recording_calls(engine.model, engine.family, lambda name, array: None):
            raise ValueError("boom")
    assert {path: type(module) for path, module in engine.model.named_modules()} == classes
    assert not any(cls.__name__.startswith("Recording") for cls in classes.values())


def test_a_transformers_5_config_runs_with_mlx_lms_default_theta_and_says_so(mlx, tiny_llama):
    """mlx-lm 0.32 reads only a top-level rope_theta: a config re-saved by transformers 5 (theta in
    rope_parameters) silently runs at 10000. tracer localizes it at q/k after RoPE and names the key."""
    model = tiny_llama("v5", rope_theta=500.0, rope_format="v5")
    result = tracer.run(model, tokens=TOKENS, candidate="mlx", greedy=0, progress=False)
    assert result.first_divergence.point == "model.layers.0.self_attn.q_rope"
    # hidden_act too: mlx-lm's Llama always runs SiLU
    assert "mlx: config keys not read: hidden_act, rope_parameters" in result.notes


def test_run_reports_the_runtime_and_the_fused_points_as_not_recorded(mlx, model, tmp_path):
    result = tracer.run(model, tokens=TOKENS, candidate="mlx", greedy=3, progress=False, out=tmp_path / "report")
    summary = result.to_dict()
    assert summary["verdict"] == "match"
    assert summary["candidate"]["runtime"]["name"] == "mlx"
    assert summary["greedy"]["same_prefix"] == 3
    assert sum(not p["recorded"] for p in summary["points"]) == 4
    page = (tmp_path / "report" / "report.html").read_text()
    assert f"mlx {summary['candidate']['runtime']['version']}" in page
    assert f"candidate runtime | mlx {summary['candidate']['runtime']['version']}" in (
        tmp_path / "report" / "summary.md").read_text()


@pytest.mark.parametrize("variant, message", [
    ("dtype=f64", r"the mlx engine runs dtype f32 \| bf16 \| f16, not f64"),
    ("theta=10", r"knob 'theta' is not honoured by the mlx engine; engines that honour it: hf, reimpl"),
])
def test_knobs_it_cannot_honour_are_one_line(mlx, model, variant, message):
    with pytest.raises(TracerError, match=message):
        tracer.record(model, TOKENS, engine="mlx", variant=variant)


def test_a_loaded_model_is_refused(mlx, model):
    from transformers import LlamaForCausalLM

    with pytest.raises(TracerError, match="pass a path, not a loaded model"):
        tracer.record(LlamaForCausalLM.from_pretrained(model), TOKENS, engine="mlx")


# ----------------------------------------------------------------------------- other families


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """Factory: family_dir(family, **config overrides) -> a tiny model of that family, written once per module."""
    root, written = tmp_path_factory.mktemp("families"), {}

    def make(family: str, **overrides) -> Path:
        key = f"{family}-{len(written)}" if overrides else family
        if overrides or family not in written:
            written[key] = write_tiny_family(root / key, family, **overrides)
        return written[key]

    return make


def traced(model: Path, tokens: list[int]):
    return tracer.compare(tracer.record(model, tokens, engine="hf"), tracer.record(model, tokens, engine="mlx"))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "phi3"])
def test_a_window_mlx_lm_never_applies_changes_nothing_within_it(mlx, family_dir, family):
    """mlx-lm runs these families without their sliding window (the matrix holds the longer prompt to the
    declared point): a prompt no longer than the window attends to the same keys, so every point matches."""
    assert traced(family_dir(family), TOKENS[:WINDOW]).verdict == "match"


def test_qwen2s_window_is_the_difference_behind_its_theta(mlx, family_dir):
    """With the theta mlx-lm runs (1e6), a tiny Qwen2 matches up to its first sliding layer (max_window_layers
    1: layer 1), where mlx-lm's qwen2.py, which has no window, attends to every key; within the window, all match."""
    model = family_dir("qwen2", rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    result = traced(model, TOKENS)
    assert result.first_divergence.point == "model.layers.1.self_attn.context", result.first_divergence
    assert all(not p.diverged for p in result.points if p.point.startswith("model.layers.0."))
    assert traced(model, TOKENS[:WINDOW]).verdict == "match"


def test_gemma3s_embedding_differs_by_mlx_lms_bf16_rounding_of_its_scale(mlx, family_dir):
    reference = tracer.record(family_dir("gemma3"), TOKENS, engine="hf")
    candidate = tracer.record(family_dir("gemma3"), TOKENS, engine="mlx")
    scale = 48 ** 0.5  # sqrt(hidden_size): bf16 holds 6.9375, not 6.9282
    rounded = torch.tensor(scale).bfloat16().item()
    assert rounded != scale
    torch.testing.assert_close(candidate["model.embed_tokens"], reference["model.embed_tokens"] * (rounded / scale),
                               rtol=1e-6, atol=0)


def test_mlx_lms_own_forward_failing_is_one_line_naming_its_source_line(mlx, family_dir, tmp_path):
    """A Gemma 3 config without sliding_window_pattern (transformers 5 writes only `_sliding_window_pattern`)
    runs mlx-lm's default period of 6, whose global layer a 3-layer model lacks: mlx-lm indexes past it."""
    model = shutil.copytree(family_dir("gemma3"), tmp_path / "gemma3")
    config = json.loads((model / "config.json").read_text())
    del config["sliding_window_pattern"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(TracerError, match=r"^mlx-lm's forward failed in gemma3_text\.py:\d+ \(IndexError: "
                                          r"list index out of range\)$"):
        tracer.record(model, TOKENS, engine="mlx")


# ----------------------------------------------------------------------------- mixtures of experts

# family -> the tiny model on which mlx-lm runs what transformers runs: Mixtral without a window (mlx-lm's
# mixtral.py has none), Qwen2-MoE with every layer sparse (its qwen2_moe.py reads no mlp_only_layers) and the theta
# it runs (it reads no rope_parameters), Qwen3-MoE with the keys the hub's configs carry (its qwen3_moe.py
# requires num_experts and a top-level rope_theta)
MOE = {"mixtral": dict(sliding_window=None),
       "qwen2_moe": dict(mlp_only_layers=[], rope_parameters={"rope_theta": 1e6, "rope_type": "default"}),
       "qwen3_moe": {}, "olmoe": {}}


@pytest.fixture(scope="module")
def moe_traces(tmp_path_factory):
    """family -> (its tiny model as in MOE, the hf trace, the mlx trace), each recorded once per module."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    root, traces = tmp_path_factory.mktemp("moe"), {}

    def make(family: str):
        if family not in traces:
            model = write_tiny_family(root / family, family, **MOE[family])
            model = with_hub_keys(model, family) if family in HUB_KEYS else model
            traces[family] = (model, *(tracer.record(model, TOKENS, engine=engine) for engine in ("hf", "mlx")))
        return traces[family]

    return make


@pytest.mark.parametrize("family", MOE)
def test_mlx_lms_routing_matches_transformers_token_for_token(family, moe_traces):
    """Every point mlx-lm forms matches, and it sends every token of every layer to the reference's experts, in
    the reference's order (mlx-lm's argpartition order laid out by weight), with the same weights."""
    _, reference, candidate = moe_traces(family)
    result, layers = tracer.compare(reference, candidate), range(candidate.meta.num_layers)
    assert result.verdict == "match", result.first_divergence
    counts = result.routing.counts()
    assert counts["tokens"] == len(layers) * len(TOKENS) and counts["agree"] == counts["tokens"]
    assert counts["flips"] == counts["order_only"] == 0 and result.routing.weight_max_abs < 1e-6
    for layer in layers:
        index = candidate[layer_point(layer, "mlp.gate.top_k_index")]
        assert index.dtype == torch.int64 and index.shape == (len(TOKENS), 2)
        assert torch.equal(index, reference[layer_point(layer, "mlp.gate.top_k_index")])
    unseen = {p.point for p in result.points if p.missing_on == "candidate"}
    said = {point for point in candidate.not_recorded if not point.endswith(FUSED)}
    assert unseen == said | {layer_point(i, sub) for i in layers for sub in FUSED}
    # Mixtral's softmax is over the picked logits only: its scores over every expert are the one point unseen
    assert said == ({layer_point(i, "mlp.gate.scores") for i in layers} if family == "mixtral" else set())
    if family == "qwen2_moe":  # the shared expert after its sigmoid gate, recorded as the operand of mlx-lm's `+`
        assert all(layer_point(i, "mlp.shared_expert") in candidate for i in layers)


def test_a_dense_layer_beside_sparse_ones_records_the_dense_mlps_points(mlx, family_dir):
    """Qwen3-MoE's mlp_only_layers, which mlx-lm's qwen3_moe.py reads: layer 1 is a gated MLP on both sides."""
    model = with_hub_keys(family_dir("qwen3_moe", mlp_only_layers=[1]), "qwen3_moe")
    reference, candidate = (tracer.record(model, TOKENS, engine=engine) for engine in ("hf", "mlx"))
    layer1 = [point for point in candidate.points if point.startswith("model.layers.1.mlp")]
    assert layer1 == [point for point in reference.points if point.startswith("model.layers.1.mlp")]
    assert layer1 == [f"model.layers.1.mlp{sub}" for sub in (".gate_proj", ".up_proj", ".act", ".down_proj", "")]
    result = tracer.compare(reference, candidate)
    # layer 0 sparse, layer 1 dense: one layer's tokens routed
    assert result.verdict == "match" and result.routing.counts()["agree"] == result.routing.counts()["tokens"] == 7


def test_argpartitions_order_is_laid_out_as_top_k_returns_it(moe_traces, monkeypatch):
    """mlx-lm's qwen3_moe.py takes the last k of an ascending argpartition: left as it comes, every token's picks
    are the reverse of torch.topk's, an order-only difference on every token-layer, and a comparison of the
    weights slot by slot pairs one expert's weight with another's."""
    model, reference, _ = moe_traces("qwen3_moe")
    monkeypatch.setattr("tracer.engines.mlx.in_top_k_order", lambda tensors: None)
    raw = tracer.record(model, TOKENS, engine="mlx")
    result = tracer.compare(reference, raw)
    counts = result.routing.counts()
    assert counts["order_only"] == counts["tokens"] == raw.meta.num_layers * len(TOKENS) and counts["flips"] == 0
    assert torch.equal(raw["model.layers.0.mlp.gate.top_k_index"],
                       reference["model.layers.0.mlp.gate.top_k_index"].flip(-1))
    assert result.first_divergence.point == "model.layers.0.mlp.gate.top_k_weights"


def test_qwen2_moes_norm_topk_prob_is_not_read_the_experts_agree_the_weights_differ(mlx, family_dir):
    """norm_topk_prob true: transformers renormalizes the k weights, mlx-lm's qwen2_moe.py never does. The
    declared difference shows first, at layer 0's weights, while every token goes to the same experts."""
    model = family_dir("qwen2_moe", **MOE["qwen2_moe"], norm_topk_prob=True)
    result = tracer.run(model, tokens=TOKENS, candidate="mlx", greedy=0, progress=False)
    assert result.first_divergence.point == "model.layers.0.mlp.gate.top_k_weights"
    assert "norm_topk_prob" in result.first_divergence.hints[0]
    layer0 = result.routing.layers[0]
    assert layer0.count("agree") == len(TOKENS) and 0.1 < layer0.weight_max_abs < 0.5


def test_qwen2_moes_window_is_never_applied_by_mlx_lm(mlx, family_dir):
    """use_sliding_window: transformers slides Qwen2-MoE's even layers below max_window_layers (layer 0 here);
    mlx-lm's qwen2_moe.py has one causal mask. Fused attention: the context is the first point after it."""
    model = family_dir("qwen2_moe", **MOE["qwen2_moe"], use_sliding_window=True, sliding_window=WINDOW)
    result = tracer.run(model, tokens=TOKENS, candidate="mlx", greedy=0, progress=False)
    assert result.first_divergence.point == "model.layers.0.self_attn.context"
    assert "no sliding window" in result.first_divergence.hints[0]


def test_mlx_lms_qwen3_moe_cannot_load_the_config_transformers_5_writes(mlx, family_dir):
    """transformers 5 writes num_local_experts and rope_parameters; mlx-lm's qwen3_moe.py requires num_experts
    and rope_theta: its own error, in one line."""
    with pytest.raises(TracerError, match=r"^mlx-lm cannot load .*missing 2 required positional arguments: "
                                          r"'num_experts' and 'rope_theta'$"):
        tracer.record(family_dir("qwen3_moe"), TOKENS, engine="mlx")


def test_an_operation_mlx_lms_code_takes_off_the_plan_is_an_error_not_a_point_left_out(mlx):
    import mlx.core as mx

    from tracer.engines.mlx import Following

    recorded = {}
    outputs = Following(mx.ones((1, 3, 2, 4)), {"*": "weights", "*.sum": "experts"}, recorded.__setitem__, "switch_mlp")
    summed = (outputs * mx.full((1, 3, 2, 1), 0.5)).sum(axis=-2)
    assert isinstance(summed, mx.array) and set(recorded) == {"weights", "experts"}
    assert summed.tolist() == [[[1.0] * 4] * 3]
    with pytest.raises(TracerError, match=r"applied '\+' to the output of switch_mlp, where the mlx engine "
                                          r"expected \* then \*\.sum"):
        Following(mx.ones((1, 3, 2, 4)), {"*": "weights", "*.sum": "experts"}, recorded.__setitem__,
                  "switch_mlp") + 1
