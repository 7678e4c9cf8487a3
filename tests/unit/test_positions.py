"""Positions and the KV cache in the contract, on tiny random models: tokens run at absolute positions
(hf's `position_ids`, the reimplementation's `positions`), a prefill then a decode step with the cache
is the forward over all the tokens, the model is driven one block at a time by construction, and an
engine that cannot take positions refuses `--position-offset` in one line."""

from __future__ import annotations

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tests.families import write_tiny_family
from tracer.cli import main
from tracer.core.errors import TracerError
from tracer.engines.registry import ENGINES
from tracer.model.kv_cache import KVCache
from tracer.model.points import (
    CACHE_K,
    CACHE_POINTS,
    EMBED,
    INPUT_NORM,
    K_ROPE,
    LOGITS,
    O_PROJ,
    PROBS,
    Q_PROJ,
    Q_ROPE,
    SCORES,
    has_head_axis,
    is_causal,
    layer_point,
)
from tracer.reimpl.forward import Model
from tracer.traces.trace import Trace, TraceRecorder


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """A sliding window of 4 keys on every layer: the mask is a function of positions."""
    return write_tiny_family(tmp_path_factory.mktemp("mistral") / "m", "mistral")


def recorded(model: Model, tokens: list[int], **kwargs) -> dict[str, torch.Tensor]:
    recorder = TraceRecorder()
    model.forward(torch.tensor(tokens), recorder, **kwargs)
    return recorder.tensors


def last_position(point: str, tensor: torch.Tensor) -> torch.Tensor:
    """The rows of the last token: (1, X) for (T, X) points, (heads, 1, X) for per-head ones."""
    return tensor[:, -1:] if has_head_axis(point) else tensor[-1:]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_prefill_then_a_decode_step_with_the_cache_is_the_forward_over_every_token(family, llama_dir, mistral_dir):
    model = Model.from_dir(llama_dir if family == "llama" else mistral_dir)
    whole = recorded(model, TOKENS + [11])  # 8 tokens: past Mistral's window of 4
    cache = KVCache(model.spec.num_hidden_layers)
    recorded(model, TOKENS, cache=cache)
    assert cache.length == len(TOKENS)
    step = recorded(model, [11], cache=cache)  # position 7, after what the cache holds
    assert cache.length == len(TOKENS) + 1
    held = {layer_point(i, sub) for i in range(model.spec.num_hidden_layers) for sub in CACHE_POINTS}
    assert set(step) == set(whole) | held  # with a cache, a forward also records what the cache holds
    assert step[layer_point(0, CACHE_K)].shape[-2] == len(TOKENS) + 1
    for point, tensor in step.items():
        if point in held:
            continue
        expected = last_position(point, whole[point])
        if is_causal(point):
            assert tensor.shape == expected.shape  # the query attends to all 8 keys (a window masks some)
        assert float((tensor - expected).norm() / expected.norm()) < 2e-6, point  # f32 rounding (7.5e-7 at most here)
    for point in (EMBED, layer_point(0, INPUT_NORM)):  # row-wise ops on the same row: the same bits
        assert torch.equal(step[point], last_position(point, whole[point])), point
    # a one-row matmul may be BLAS's other kernel, summing in another order: f32 rounding (1.3e-7 here)
    q_proj = layer_point(0, Q_PROJ)
    assert float((step[q_proj] - whole[q_proj][-1:]).norm() / whole[q_proj][-1:].norm()) < 1e-6
    if family == "mistral":  # keys 4 or more positions back get no weight on the decoded row
        probs = step[layer_point(0, PROBS)][:, 0]  # (H, 8): the decoded query's row
        assert probs[:, :4].abs().max() == 0 and probs[:, 4:].min() > 0


def test_the_model_is_driven_one_block_at_a_time(llama_dir):
    model = Model.from_dir(llama_dir)
    tokens = torch.tensor(TOKENS)
    at = model.positions(torch.arange(1000, 1000 + len(TOKENS)))
    h = model.embed(tokens)
    for i in range(model.spec.num_hidden_layers):
        h = model.block(i, h, at)
    assert torch.equal(model.head(h)[0], model.forward(tokens, positions=torch.arange(1000, 1000 + len(TOKENS))))


def test_positions_move_rope_and_nothing_before_it(llama_dir):
    model = Model.from_dir(llama_dir)
    near, far = recorded(model, TOKENS), recorded(model, TOKENS, positions=torch.arange(1000, 1000 + len(TOKENS)))
    assert torch.equal(near[layer_point(0, Q_PROJ)], far[layer_point(0, Q_PROJ)])
    assert not torch.allclose(near[layer_point(0, Q_ROPE)], far[layer_point(0, Q_ROPE)])
    with pytest.raises(TracerError, match="2 positions for 7 tokens"):
        model.forward(torch.tensor(TOKENS), positions=torch.arange(2))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_hf_and_reimpl_match_at_every_point_at_far_positions(family, llama_dir, mistral_dir):
    folder = llama_dir if family == "llama" else mistral_dir
    result = tracer.run(folder, tokens=TOKENS, position_offset=100, greedy=3, progress=False)
    assert result.verdict == "match" and all(p.recorded for p in result.points)
    assert result.greedy.same_prefix == 3


def test_a_recorded_trace_says_its_first_position(llama_dir, tmp_path):
    trace = tracer.record(llama_dir, TOKENS, engine="reimpl", position_offset=100, progress=False)
    assert trace.meta.position_offset == 100
    assert Trace.load(trace.save(tmp_path / "t.safetensors")).meta.position_offset == 100
    assert tracer.record(llama_dir, TOKENS, engine="reimpl", progress=False).meta.position_offset is None
    hf = tracer.record(llama_dir, TOKENS, engine="hf", position_offset=100, progress=False)
    for point in (layer_point(1, K_ROPE), layer_point(1, SCORES), layer_point(1, O_PROJ), LOGITS):
        torch.testing.assert_close(hf[point], trace[point], rtol=1e-5, atol=1e-5, msg=point)
    with pytest.raises(TracerError, match="the traces were recorded at different positions: from 100 vs from 0"):
        tracer.compare(hf, tracer.record(llama_dir, TOKENS, engine="reimpl", progress=False))


def test_engines_without_positions_refuse_an_offset_in_one_line(llama_dir, capsys):
    code = main(["run", "--model", str(llama_dir), "--tokens", "1,2,3", "--candidate", "mlx", "--position-offset", "5",
                 "--no-report"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--position-offset 5: the mlx engine runs its tokens from position 0; engines that take positions: "
        + ", ".join(name for name, entry in ENGINES.items() if entry.positions))
    with pytest.raises(TracerError, match="--position-offset must be at least 0, got -1"):
        tracer.run(llama_dir, tokens=TOKENS, position_offset=-1, progress=False)
    with pytest.raises(TracerError, match="the prompt has 7 tokens from position 125; the model has 128 positions"):
        tracer.run(llama_dir, tokens=TOKENS, position_offset=125, progress=False)
