"""assert_traces_close on tiny models: silent on agreement, the localized finding on a fault."""

import pytest

import tracer
from tests.conftest import TOKENS
from tests.dumps import candle_dump, faulty_trace, save_dump
from tracer.core.errors import TracerError
from tracer.testing import assert_traces_close


@pytest.fixture
def traces(tiny_llama, tmp_path):
    model = tiny_llama()
    reference = tracer.record(model, TOKENS, engine="hf")
    faulty = faulty_trace(model, TOKENS, layer=1)
    return reference, faulty, tmp_path


def test_a_trace_is_close_to_itself_as_object_and_as_file(traces):
    reference, _, tmp = traces
    path = reference.save(tmp / "ref.safetensors")
    assert_traces_close(reference, reference)
    assert_traces_close(path, str(path))


def test_a_candle_dump_of_the_same_run_is_close(traces):
    reference, _, tmp = traces
    assert_traces_close(reference, save_dump(candle_dump(reference), tmp / "candle.safetensors", TOKENS))
    assert_traces_close(reference, candle_dump(reference))  # a dict name -> tensor, straight from a port


def test_the_failure_message_names_the_faulty_op_and_the_last_agreeing_one(traces):
    reference, faulty, tmp = traces
    dump = save_dump(candle_dump(faulty), tmp / "candle.safetensors", TOKENS, runtime="candle")
    with pytest.raises(AssertionError) as failure:
        assert_traces_close(reference, dump)
    message = str(failure.value)
    assert message.startswith("traces are not close")
    assert "first divergence: model.layers.1.mlp.down_proj" in message
    assert "agrees up to model.layers.1.mlp.up_proj (max rel_l2 0 over" in message  # upstream bitwise equal
    assert "holds only the last position at lm_head" in message


def test_tolerances_reach_the_comparison(traces):
    reference, faulty, _ = traces
    with pytest.raises(AssertionError):
        assert_traces_close(reference, faulty, atol=1e-3)
    assert_traces_close(reference, faulty, atol=1e3)


def test_different_tokens_are_an_error_not_a_failure(traces):
    reference, _, tmp = traces
    dump = save_dump(candle_dump(reference), tmp / "other.safetensors", [1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(TracerError, match="ran other token ids"):
        assert_traces_close(reference, dump)
