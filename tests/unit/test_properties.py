"""Property tests: hostile input never escapes as anything but TracerError; the metrics' invariants.

- The variant parser, on arbitrary text, returns a valid variant or raises TracerError.
- Trace loading, on randomly damaged trace files, returns a Trace or raises TracerError.
- A trace against itself is exact; relative L2 does not change when both sides are scaled;
  NaN never compares as a match, whatever the tolerance.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tracer.comparison.diff import compare, compare_point
from tracer.comparison.result import Tolerance
from tracer.core.errors import TracerError
from tracer.model.knobs import KNOBS, parse_variant
from tracer.traces.trace import MANIFEST_KEY, Trace, TraceMeta

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text that looks like variants: knob names, separators, numbers, junk.
variant_text = st.lists(
    st.one_of(st.sampled_from([*KNOBS, "=", ",", " ", "1e4", "-1", "nan", "inf", "0", "sdpa", "f16", "==", "=,"]),
              st.text(max_size=6)),
    max_size=8,
).map("".join)


def check_variant(variant) -> None:
    assert isinstance(variant, dict)
    for name, value in variant.items():
        assert name in KNOBS
        assert KNOBS[name].parse(str(value)) == value  # the parsed value is one the knob accepts


@FAST
@given(st.one_of(st.text(), variant_text))
@example("theta=10000,theta=1")
@example("theta=nan")
@example("=")
@example("theta=1e999")
def test_variant_parser_on_any_text_gives_a_variant_or_tracer_error(text):
    try:
        variant = parse_variant(text)
    except TracerError as exc:
        assert "\n" not in str(exc)  # one line for the CLI
        return
    check_variant(variant)


@FAST
@given(st.one_of(st.lists(st.one_of(st.text(), variant_text), max_size=4),
                 st.dictionaries(st.one_of(st.sampled_from(list(KNOBS)), st.text(max_size=5)),
                                 st.one_of(st.text(max_size=8), st.floats(), st.integers(), st.none()), max_size=4)))
def test_variant_parser_on_lists_and_dicts_gives_a_variant_or_tracer_error(spec):
    try:
        variant = parse_variant(spec)
    except TracerError:
        return
    check_variant(variant)


# --- trace files ------------------------------------------------------------------------------

POINTS = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0", "model.norm", "lm_head"]


@functools.lru_cache(maxsize=1)
def good_trace_bytes() -> bytes:
    generator = torch.Generator().manual_seed(0)
    trace = Trace({p: torch.randn(3, 4, generator=generator) for p in POINTS},
                  TraceMeta(engine="reimpl", variant={"theta": 500.0}, tokens=[1, 2, 3], num_layers=1))
    with tempfile.TemporaryDirectory() as folder:
        path = trace.save(os.path.join(folder, "t.safetensors"))
        return path.read_bytes()


def load_bytes(data: bytes):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.safetensors")
        with open(path, "wb") as handle:
            handle.write(data)
        return Trace.load(path)


def loads_or_says_why(data: bytes) -> None:
    try:
        trace = load_bytes(data)
    except TracerError as exc:
        assert "\n" not in str(exc)
        return
    # What loads must be usable: labelled, comparable with itself.
    assert isinstance(trace.label, str)
    compare(trace, trace)


def test_the_undamaged_file_loads():
    trace = load_bytes(good_trace_bytes())
    assert trace.points == POINTS and trace.tokens == [1, 2, 3] and trace.label == "reimpl[theta=500]"


@FAST
@given(st.data())
def test_truncated_trace_files_give_tracer_error(data):
    whole = good_trace_bytes()
    cut = data.draw(st.integers(0, len(whole) - 1))
    loads_or_says_why(whole[:cut])


@FAST
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8))
def test_trace_files_with_flipped_bytes_load_or_give_tracer_error(flips):
    data = bytearray(good_trace_bytes())
    header_end = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    for position, value in flips:
        data[position % header_end] = value  # damage the length and the JSON header, where parsing happens
    loads_or_says_why(bytes(data))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
manifests = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={"format": json_values, "points": st.one_of(json_values, st.just(POINTS)),
                                        "meta": st.one_of(json_values, st.fixed_dictionaries(
                                            {}, optional={"tokens": json_values, "variant": json_values,
                                                          "engine": json_values, "not_recorded": json_values,
                                                          "num_layers": st.one_of(json_values, st.just(10**12))}))}),
)


@FAST
@given(st.one_of(manifests.map(json.dumps), st.text(max_size=30)))
def test_trace_files_with_any_manifest_load_or_give_tracer_error(manifest_text):
    generator = torch.Generator().manual_seed(1)
    tensors = {p: torch.randn(2, 3, generator=generator) for p in POINTS}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.safetensors")
        save_file(tensors, path, metadata={MANIFEST_KEY: manifest_text})
        with open(path, "rb") as handle:
            loads_or_says_why(handle.read())


# --- metric invariants ------------------------------------------------------------------------

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
# Values away from the subnormal range, so that scaling by powers of two is exact.
normal = finite.filter(lambda x: x == 0 or abs(x) > 1e-6)


@st.composite
def tensor_pairs(draw, elements=finite):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    values = st.lists(elements, min_size=rows * cols, max_size=rows * cols)
    ref = torch.tensor(draw(values), dtype=torch.float32).reshape(rows, cols)
    cand = torch.tensor(draw(values), dtype=torch.float32).reshape(rows, cols)
    return ref, cand


@FAST
@given(tensor_pairs())
def test_a_trace_against_itself_is_exact(pair):
    ref, _ = pair
    trace = Trace({"model.embed_tokens": ref, "model.layers.0": ref * 2}, TraceMeta(engine="x", tokens=[1]))
    result = compare(trace, trace)
    assert result.verdict == "match" and result.first_divergence is None and result.first_nonfinite is None
    assert all(p.rel_l2 == 0 and p.max_abs == 0 for p in result.points)


@FAST
@given(tensor_pairs(normal), st.integers(-20, 20))
def test_relative_l2_is_scale_invariant(pair, exponent):
    ref, cand = pair
    scale = 2.0 ** exponent  # exact in binary floating point, so the invariance must be exact too
    tolerance = Tolerance()
    plain = compare_point("model.layers.0", ref, cand, tolerance)
    scaled = compare_point("model.layers.0", ref * scale, cand * scale, tolerance)
    assert scaled.rel_l2 == plain.rel_l2 or (math.isinf(plain.rel_l2) and math.isinf(scaled.rel_l2))
    assert scaled.diverged == plain.diverged


@FAST
@given(tensor_pairs(), st.data(), st.sampled_from(["reference", "candidate", "both"]),
       st.sampled_from([Tolerance(), Tolerance(rel_l2=math.inf), Tolerance(atol=1e30), Tolerance(rtol=1e30)]))
def test_nan_never_compares_as_a_match(pair, data, where, tolerance):
    ref, cand = (t.clone() for t in pair)
    row, col = data.draw(st.integers(0, ref.shape[0] - 1)), data.draw(st.integers(0, ref.shape[1] - 1))
    if where in ("reference", "both"):
        ref[row, col] = math.nan
    if where in ("candidate", "both"):
        cand[row, col] = math.nan
    point = compare_point("model.layers.0", ref, cand, tolerance)
    assert point.diverged
    result = compare(Trace({"model.layers.0": ref}, TraceMeta(tokens=[1])),
                     Trace({"model.layers.0": cand}, TraceMeta(tokens=[1])), tolerance)
    assert result.verdict == "diverged" and result.first_nonfinite["side"] == where
    json.loads(result.to_json(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
