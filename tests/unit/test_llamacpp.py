"""The llamacpp engine on a tiny random Llama written as a real GGUF (tests/tiny_gguf.py), and
the child-process isolation every native runtime runs behind (tracer.engines.isolated).

With an f32 file, an f32 KV cache and flash attention off, llama.cpp computes what transformers
computes: every point it records agrees at rounding level (measured here: rel_l2 at most 8.4e-7,
the embeddings exactly). The tests that need llama-cpp-python skip without it; CI installs it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

import tracer
from tests.conftest import TOKENS, write_tiny_llama
from tests.families import write_tiny_family
from tests.families import write_tiny_gguf as write_family_gguf
from tests.tiny_gguf import write_tiny_gguf
from tracer.comparison.diff import rel_l2_by_point
from tracer.core.errors import TracerError
from tracer.engines import isolated
from tracer.engines.registry import ENGINES, check_runtime
from tracer.files.sources import ModelSource
from tracer.model.families import FAMILIES
from tracer.model.points import MLP_ACT, Q_NORM, Q_ROPE, all_points, layer_point
from tracer.pipeline.greedy import continuation

EXACT = {"flash_attn": "off", "kv_cache": "f32", "threads": 1}
ROUNDING = 2e-6  # rel_l2 bound at every point of the f32 run (measured max 8.4e-7)
LAST_LAYER_ROWS = ("resid_mid", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.act",
                   "mlp.down_proj", "")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory, its f32 GGUF, the hf reference trace on TOKENS)."""
    folder = tmp_path_factory.mktemp("llamacpp")
    model_dir = write_tiny_llama(folder / "model")
    gguf = write_tiny_gguf(model_dir, folder / "tiny.gguf")
    return model_dir, gguf, tracer.record(model_dir, TOKENS, engine="hf", progress=False)


@pytest.fixture(scope="module")
def llamacpp():
    pytest.importorskip("llama_cpp")
    from tracer.engines import llamacpp

    return llamacpp


@pytest.fixture(scope="module")
def exact(tiny, llamacpp):
    """The in-process engine with every switch at its exact setting, and its trace on TOKENS."""
    model_dir, gguf, _ = tiny
    engine = llamacpp.load(ModelSource(model_dir), EXACT, argument=str(gguf))
    return engine, engine.record(TOKENS)


# --- what it records ---------------------------------------------------------------------------


def test_every_point_agrees_with_transformers_at_rounding_level(tiny, exact):
    _, _, reference = tiny
    _, trace = exact
    assert set(trace.tensors) == set(all_points(2)) and not trace.not_recorded  # all 37 points
    result = tracer.compare(reference, trace)
    worst = max(p.rel_l2 for p in result.points)
    assert result.verdict == "match" and worst < ROUNDING, worst
    assert torch.equal(trace["model.embed_tokens"], reference["model.embed_tokens"])  # get_rows copies f32
    assert torch.equal(trace["lm_head"].argmax(-1), reference["lm_head"].argmax(-1))


def test_repeated_names_are_told_apart_by_the_op_that_wrote_them(tiny, exact):
    """Qcur-0 is written by the matmul, a reshape and the RoPE: q_proj is the first, q_rope the last.
    RoPE at position 0 is the identity, so the two agree there and only there."""
    _, trace = exact
    q_proj, q_rope = trace["model.layers.0.self_attn.q_proj"], trace["model.layers.0.self_attn.q_rope"]
    heads, tokens, dim = q_rope.shape
    as_rows = q_rope.transpose(0, 1).reshape(tokens, heads * dim)  # (T, H·D)
    assert torch.equal(as_rows[0], q_proj[0])
    assert not torch.allclose(as_rows[1:], q_proj[1:], atol=1e-3)


def test_scores_are_kq_times_the_scale_on_the_prompts_keys(exact):
    _, trace = exact
    scores, probs = trace["model.layers.1.self_attn.scores"], trace["model.layers.1.self_attn.probs"]
    assert scores.shape == probs.shape == (4, len(TOKENS), len(TOKENS))  # the padded cache cells are gone
    mask = torch.ones(len(TOKENS), len(TOKENS), dtype=torch.bool).tril()
    recomputed = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    assert (recomputed - probs).abs().max() < 1e-6


def test_flash_attention_fuses_scores_and_probs_which_are_said_not_recorded(tiny, llamacpp):
    model_dir, gguf, reference = tiny
    trace = llamacpp.load(ModelSource(model_dir), {**EXACT, "flash_attn": "on"}, argument=str(gguf)).record(TOKENS)
    assert trace.meta.flash_attn == "on"
    fused = {p for p in all_points(2) if p.endswith(("self_attn.scores", "self_attn.probs"))}
    assert set(trace.not_recorded) == fused
    assert all(reason == llamacpp.FLASH_REASON for reason in trace.not_recorded.values())
    result = tracer.compare(reference, trace)
    assert all(p.missing_on == "candidate" for p in result.points if p.point in fused)
    # flash attention casts K and V to f16 even with an f32 cache: the context is rounded there
    context = next(p for p in result.points if p.point == "model.layers.0.self_attn.context")
    assert 1e-5 < context.rel_l2 < 1e-2


def test_an_f16_kv_cache_rounds_scores_and_nothing_before(tiny, exact, llamacpp):
    model_dir, gguf, _ = tiny
    f16 = llamacpp.load(ModelSource(model_dir), {**EXACT, "kv_cache": "f16"}, argument=str(gguf)).record(TOKENS)
    result = tracer.compare(exact[1], f16)
    rel = {p.point: p.rel_l2 for p in result.points}
    assert rel["model.layers.0.self_attn.k_rope"] == 0.0  # stored into the cache after it is recorded
    assert rel["model.layers.0.self_attn.scores"] > 1e-5
    assert result.first_divergence.point == "model.layers.0.self_attn.scores"


def test_threads_do_not_change_a_single_value(tiny, exact, llamacpp):
    model_dir, gguf, _ = tiny
    two = llamacpp.load(ModelSource(model_dir), {**EXACT, "threads": 2}, argument=str(gguf)).record(TOKENS)
    assert all(torch.equal(exact[1][p], two[p]) for p in exact[1].points)


def test_theta_changes_rope_and_nothing_upstream(tiny, exact, llamacpp):
    model_dir, gguf, _ = tiny
    theta = llamacpp.load(ModelSource(model_dir), {**EXACT, "theta": 500.0}, argument=str(gguf)).record(TOKENS)
    result = tracer.compare(exact[1], theta)
    upstream = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert all(torch.equal(exact[1][p], theta[p]) for p in upstream)
    assert result.first_divergence.point == "model.layers.0.self_attn.q_rope"
    assert theta.meta.variant == {**EXACT, "theta": 500.0}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_past_its_query_scale_differs_first_at_ggmls_gelu(family, llamacpp, tmp_path):
    """With the one query scale llama.cpp takes (query_pre_attn_scalar = head_dim), every point of the
    first layer before the MLP's activation agrees at rounding level (Gemma 2's soft-capped scores,
    Gemma 3's q/k norms, both sandwich norms), the activation differs by ggml's f16 GELU table, and in
    Gemma 3 layer 1, full in the config, is sliding in llama.cpp (its theta too)."""
    model = write_tiny_family(tmp_path / family, family, query_pre_attn_scalar=12)
    gguf = write_family_gguf(model, tmp_path / f"{family}.gguf", no_vocab=True)
    engine = llamacpp.load(ModelSource(model), EXACT, argument=str(gguf))
    errors = rel_l2_by_point(tracer.record(model, TOKENS, engine="hf", progress=False), engine.record(TOKENS))
    order = list(FAMILIES[family].sub_points())
    before = order[:order.index(MLP_ACT)]
    assert max(errors[layer_point(0, sub)] for sub in before) < ROUNDING, errors
    assert 1e-4 < errors[layer_point(0, MLP_ACT)] < 1e-3  # measured 2.8e-4 (Gemma 2), 3.6e-4 (Gemma 3)
    if family == "gemma3":  # rope theta 10000 where transformers takes 1e6: far beyond what layer 0 left
        assert errors[layer_point(1, Q_NORM)] < 1e-3 and errors[layer_point(1, Q_ROPE)] > 0.1


def test_last_layer_with_the_last_output_row_only_is_compared_on_that_row(tiny, llamacpp):
    """outputs="last" (what generation asks): llama.cpp's inp_out_ids keep one row from ffn_inp on."""
    model_dir, gguf, reference = tiny
    trace = llamacpp.load(ModelSource(model_dir), EXACT, argument=str(gguf), outputs="last").record(TOKENS)
    one_row = {f"model.layers.1.{sub}".rstrip(".") for sub in LAST_LAYER_ROWS} | {"model.norm", "lm_head"}
    assert {p for p, t in trace.tensors.items() if t.ndim == 2 and t.shape[0] == 1} == one_row
    assert set(trace.meta.sources) == one_row
    result = tracer.compare(reference, trace)
    assert result.verdict == "match" and max(p.rel_l2 for p in result.points) < ROUNDING
    assert any("only the last position" in note for note in result.notes)


def test_logits_and_the_cached_greedy_decode(tiny, exact, llamacpp):
    engine, trace = exact
    assert torch.equal(engine.logits(TOKENS), trace["lm_head"])
    steps = 6
    uncached = continuation(engine, TOKENS, steps)
    assert engine.draft(TOKENS, steps) == uncached  # a tiny f32 model: cache or not, same argmax


# --- which GGUF ---------------------------------------------------------------------------------


def test_the_gguf_a_directory_was_converted_from_is_found(tiny, llamacpp, tmp_path, monkeypatch):
    model_dir, gguf, _ = tiny
    converted = write_tiny_llama(tmp_path / "converted")
    config = json.loads((converted / "config.json").read_text())
    config["tracer_source"] = {"gguf_file": str(gguf.resolve()), "gguf_size": gguf.stat().st_size}
    (converted / "config.json").write_text(json.dumps(config))
    assert llamacpp.gguf_of(ModelSource(converted), None) == gguf.resolve()
    assert llamacpp.gguf_of(ModelSource(model_dir), str(gguf)) == gguf
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "cache"))  # a directory of its own: converted there
    assert llamacpp.gguf_of(ModelSource(model_dir), None).is_relative_to(tmp_path / "cache" / "gguf")
    with pytest.raises(TracerError, match="GGUF file not found"):
        llamacpp.gguf_of(ModelSource(model_dir), str(tmp_path / "nowhere.gguf"))
    (tmp_path / "not.gguf").write_text("hello")
    with pytest.raises(TracerError, match="not a GGUF file"):
        llamacpp.gguf_of(ModelSource(model_dir), str(tmp_path / "not.gguf"))


# --- registry, knobs, a missing runtime ---------------------------------------------------------


def test_a_missing_runtime_is_one_line_naming_the_extra(tiny, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(TracerError) as info:
        tracer.record(tiny[0], TOKENS, engine="llamacpp", progress=False)
    assert str(info.value) == ("the llamacpp engine needs llama-cpp-python, which is not installed: "
                               'CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" pip install '
                               "--no-cache-dir -e '.[llamacpp]' (compiles llama.cpp without AMX, about 5 minutes on 2 "
                               "cores)")
    with pytest.raises(TracerError):
        check_runtime(ENGINES["llamacpp"])


def test_knobs_llamacpp_cannot_honour_are_refused_before_anything_loads(tiny):
    with pytest.raises(TracerError, match="knob 'attn' is not honoured by the llamacpp engine"):
        tracer.record(tiny[0], TOKENS, engine="llamacpp", variant="attn=sdpa", progress=False)
    with pytest.raises(TracerError,
                       match=re.escape("bad value 'q4' for knob 'kv_cache'; expected f32 | f16 | bf16 | q8_0")):
        tracer.record(tiny[0], TOKENS, engine="llamacpp", variant="kv_cache=q4", progress=False)
    assert ENGINES["llamacpp"].honoured == ("theta", "kv_cache", "flash_attn", "threads", "n_ubatch")


def test_the_engines_tables_cover_exactly_the_knobs_values(llamacpp):
    from tracer.model.knobs import KNOBS

    assert set(llamacpp.KV_TYPES) == set(KNOBS["kv_cache"].values)
    assert set(llamacpp.FLASH_ATTN) == set(KNOBS["flash_attn"].values)


def test_a_context_llamacpp_refuses_is_one_line_with_its_reason(tiny, llamacpp):
    model_dir, gguf, _ = tiny
    engine = llamacpp.load(ModelSource(model_dir), {**EXACT, "kv_cache": "q8_0"}, argument=str(gguf))
    with pytest.raises(TracerError, match=r"llama.cpp cannot make a context .*kv_cache=q8_0.*: llama_init_from_model: "
                                          r"quantized V cache requires flash_attn to be enabled$") as info:
        engine.record(TOKENS)
    assert "\n" not in str(info.value)


# --- native runtimes fail alone -----------------------------------------------------------------

def crash_engine(variant):
    from tests.crash_engine import ENTRY

    return isolated.load(ENTRY, ModelSource(Path("unread")), variant)  # the crash engine reads no model


@pytest.mark.parametrize("how, said", [
    ("segfault", r"the crashy engine died \(SIGSEGV\): crash_engine: about to read address 0"),
    ("abort", r"the crashy engine died \(SIGABRT\): crash_engine.c:12: GGML_ASSERT\(n_embd_head == n_rot\) failed"),
    ("exit", r"the crashy engine died \(exit code 3\): it wrote nothing to stderr"),
])
def test_a_native_crash_in_the_child_is_one_line_and_tracer_lives_on(how, said):
    engine = crash_engine({"die": how})
    assert engine.draft([1, 2], 3) == [7, 7, 7]  # alive until it records
    with pytest.raises(TracerError, match=said) as info:
        engine.record([1, 2, 3])
    assert "\n" not in str(info.value)
    with pytest.raises(TracerError, match=said):  # dead stays dead, said the same way
        engine.logits([1, 2, 3])


def test_an_engine_error_in_the_child_is_its_own_line_and_the_child_lives_on():
    engine = crash_engine({"die": "error"})
    with pytest.raises(TracerError, match="^the crash engine refuses, in one line$"):
        engine.record([1, 2])
    healthy = crash_engine({})
    trace = healthy.record([1, 2])
    assert trace["model.embed_tokens"].shape == (2, 4) and trace.meta.engine == "crashy"
    assert healthy.logits([1, 2]).shape == (2, 100)


def test_an_ended_engines_child_serves_the_next_load_and_a_dead_one_never_does(monkeypatch):
    first = crash_engine({})
    pid = first.process.pid
    first.close()
    second = crash_engine({"die": "exit"})  # the same child, its first engine dropped
    assert second.process.pid == pid and second.variant == {"die": "exit"}
    assert second.draft([1], 2) == [7, 7]
    with pytest.raises(TracerError, match=r"died \(exit code 3\): it wrote nothing to stderr"):
        second.record([1, 2])
    del second
    third = crash_engine({})
    assert third.process.pid != pid and third.record([1, 2])["model.embed_tokens"].shape == (2, 4)
    monkeypatch.setenv("TEST_OTHER_ENVIRONMENT", "1")  # a child started with another environment is not it
    other = crash_engine({})
    assert other.process.pid != third.process.pid
    assert other._call({"op": "draft", "tokens": [1], "steps": 1}) == {"tokens": [7]}


def test_tracers_own_variables_reach_the_child_on_each_load_and_do_not_start_another(monkeypatch, tmp_path):
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "first"))
    first = crash_engine({"echo": "TRACER_CACHE"})
    pid = first.process.pid
    assert first.variant["echoed"] == str(tmp_path / "first")
    first.close()
    monkeypatch.setenv("TRACER_CACHE", str(tmp_path / "second"))
    second = crash_engine({"echo": "TRACER_CACHE"})
    assert second.process.pid == pid and second.variant["echoed"] == str(tmp_path / "second")
    second.close()
    monkeypatch.delenv("TRACER_CACHE")
    third = crash_engine({"echo": "TRACER_CACHE"})  # unset in the parent: unset in the child too
    assert third.process.pid == pid and third.variant["echoed"] is None
    third.close()
    monkeypatch.chdir(tmp_path)
    fourth = crash_engine({"cwd": True})  # and its working folder is the parent's at each load
    assert fourth.process.pid == pid and fourth.variant["cwd"] == str(tmp_path)
    fourth.close()
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # a working folder deleted under the parent: the child keeps its own
    fifth = crash_engine({"cwd": True})
    assert fifth.process.pid == pid and fifth.variant["cwd"] == str(tmp_path)


def test_a_child_whose_call_was_interrupted_is_not_reused():
    """Its reply is still to come: it would answer the next engine's first request."""
    class Interrupted:
        def readline(self):
            raise KeyboardInterrupt

    engine = crash_engine({})
    pid, replies = engine.process.pid, engine.process.stdout
    engine.process.stdout = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        engine.draft([1], 2)
    engine.process.stdout = replies
    engine.close()
    fresh = crash_engine({})
    assert fresh.process.pid != pid and fresh.draft([1], 2) == [7, 7]


def test_the_child_writes_a_spilled_trace_where_the_caller_spills(tmp_path):
    from tracer.traces.spill import DiskRecorder

    recorder = DiskRecorder(tmp_path / "side")
    trace = crash_engine({}).record([1, 2, 3], recorder)
    assert [f.parent for f in recorder.files.values()] == [tmp_path / "side"]
    assert torch.equal(trace["model.embed_tokens"], torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_llamacpp_aborting_on_a_corrupt_gguf_ends_the_run_with_its_assert(tiny, llamacpp, tmp_path):
    """A real GGML_ASSERT: llama.cpp loads a file whose value heads are smaller than its key heads,
    then aborts when it builds the graph. The run ends with one line and writes no report."""
    model_dir, _, _ = tiny
    bad = write_tiny_gguf(model_dir, tmp_path / "bad.gguf", value_length=8)
    out = tmp_path / "report"
    with pytest.raises(TracerError, match=r"the llamacpp engine died \(SIGABRT\): "
                                          r".*GGML_ASSERT\(n_embd_head == hparams.n_embd_head_k\(\)\) failed"):
        tracer.run(model_dir, tokens=TOKENS, candidate=f"llamacpp:{bad}", variant="threads=1", greedy=0,
                   noise_floor=False, out=out, progress=False)
    assert not out.exists()


def test_a_run_through_the_child_matches_and_shows_llamacpps_own_greedy(tiny, llamacpp):
    model_dir, gguf, _ = tiny
    result = tracer.run(model_dir, tokens=TOKENS, candidate=f"llamacpp:{gguf}",
                        variant="flash_attn=off,kv_cache=f32,threads=1", greedy=4, noise_floor=False, progress=False)
    assert result.verdict == "match", result.first_divergence
    summary = result.to_dict()
    assert summary["candidate"]["runtime"]["name"] == "llama.cpp"
    engine = llamacpp.load(ModelSource(model_dir), EXACT, argument=str(gguf))
    assert summary["greedy"]["candidate"] == engine.draft(TOKENS, 4)


@pytest.mark.parametrize("argv", [
    ["record", "--engine", "llamacpp:{bad}", "-o", "{tmp}/t.safetensors"],
    ["run", "--reference", "llamacpp:{bad}", "--no-report"],
])
def test_a_native_crash_as_record_or_reference_is_said_once(tiny, llamacpp, tmp_path, capfd, argv):
    from tracer.cli import main

    model_dir, _, _ = tiny
    bad = write_tiny_gguf(model_dir, tmp_path / "bad.gguf", value_length=8)
    args = [a.replace("{bad}", str(bad)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*args, "--model", str(model_dir), "--tokens", ",".join(map(str, TOKENS))]) == 2
    err = capfd.readouterr().err  # the child's own stderr too, not only Python's
    assert err.count("GGML_ASSERT") == 1 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "t.safetensors").exists()
