import pytest

from tracer import TracerError
from tracer.engines.registry import check_engine, engines_honouring
from tracer.model.knobs import KINDS, KNOBS, parse_variant


def test_parse_pairs_lists_and_dicts():
    assert parse_variant("theta=10000,attn=sdpa") == {"theta": 10000.0, "attn": "sdpa"}
    assert parse_variant(["theta=10000", "eps=1e-3"]) == {"theta": 10000.0, "eps": 1e-3}
    assert parse_variant({"theta": 10000}) == {"theta": 10000.0}
    assert parse_variant(None) == {} and parse_variant([]) == {}


@pytest.mark.parametrize("text, message", [
    ("thetta=10000", r"^unknown knob 'thetta' \(`tracer variants` lists every knob\); did you mean theta\?$"),
    ("rope=interleave", r"for knob 'rope'; did you mean interleaved\?$"),
    ("theta=abc", r"bad value 'abc' for knob 'theta'; expected a positive number"),
    ("theta=-5", r"bad value '-5' for knob 'theta'"),
    ("attn=flash", r"bad value 'flash' for knob 'attn'; expected eager \| sdpa"),
    ("theta", r"bad variant 'theta'; expected knob=value"),
    ("theta=1,theta=2", r"knob 'theta' is given twice"),
])
def test_bad_variants_are_one_clear_line(text, message):
    with pytest.raises(TracerError, match=message) as info:
        parse_variant(text)
    assert "\n" not in str(info.value)


def test_every_knob_names_engines_and_what_it_reproduces():
    for knob in KNOBS.values():
        assert engines_honouring(knob.name) and knob.reproduces and knob.accepted
        assert knob.kind in KINDS, knob.name


def test_engine_check_names_the_engines_that_can():
    check_engine({"theta": 1.0}, "hf")
    with pytest.raises(TracerError,
                       match="not honoured by the file engine; engines that honour it: hf, reimpl, llamacpp"):
        check_engine({"theta": 1.0}, "file")
