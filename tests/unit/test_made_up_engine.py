"""A made-up engine is one module: the test writes `made_up_engine.py` (tracer's reimplementation with
the RoPE base fixed at 500, a porting mistake on purpose) and the metadata of a package that declares it
under the entry-point group `tracer.engines`, puts both on the path, and changes no file of tracer's:
`tracer engines` lists it (without torch), `tracer.record(..., engine="tweaked")` records it, and
`tracer.run(..., candidate="tweaked")` finds its mistake where a wrong RoPE base shows first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tracer
from tests.conftest import TOKENS
from tracer.engines.registry import ENTRY_POINTS, parse_engine, unregister
from tracer.model.points import Q_ROPE, layer_point

MODULE = '''
    """tracer's reimplementation with the RoPE base fixed at 500: a made-up engine, registered here."""

    from tracer.engines.base import EngineBase, per_layer
    from tracer.engines.registry import EngineEntry, register

    ENTRY = register(EngineEntry("tweaked", __name__, "tracer's reimplementation with theta fixed at 500"))
    TWEAK = {"theta": 500.0}


    class TweakedEngine(EngineBase):
        entry = ENTRY

        def __init__(self, model, label):
            self.model, self.label, self.variant = model, label, {}
            self.vocab_size, self.max_positions = model.spec.vocab_size, model.spec.max_position_embeddings

        def record(self, tokens, recorder=None, *, positions=None):
            import torch

            from tracer.traces.trace import Trace, TraceRecorder

            self.first_position(tokens, positions)
            recorder = recorder if recorder is not None else TraceRecorder()
            self.model.forward(torch.tensor(tokens), recorder)
            layers = self.model.spec.num_hidden_layers
            meta = self.meta(tokens, "float32", per_layer(layers, self.model.not_recorded()), num_layers=layers,
                             family=self.model.spec.family)
            return Trace(recorder.tensors, meta)

        def logits(self, tokens, *, positions=None):
            import torch

            return self.model.forward(torch.tensor(tokens))


    def load(source, variant, *, argument=None, device="cpu", stream=False):
        from tracer.reimpl.forward import Model

        return TweakedEngine(Model.from_dir(source.directory, TWEAK, device=device), source.name)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A folder holding the engine's module and an installed package's metadata naming it."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "made_up_engine.py").write_text(textwrap.dedent(MODULE))
    metadata = folder / "made_up_engine-0.1.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: made-up-engine\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text(f"[{ENTRY_POINTS}]\ntweaked = made_up_engine\n")
    return folder


@pytest.fixture
def plugin(plugin_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_path))
    yield "tweaked"
    unregister("tweaked")
    sys.modules.pop("made_up_engine", None)


def test_tracer_engines_lists_it_without_torch(plugin_path):
    code = "import sys, tracer.cli; tracer.cli.main(['engines']); print('torch' in sys.modules)"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=environment).stdout
    assert "tweaked: tracer's reimplementation with theta fixed at 500" in out
    assert out.strip().splitlines()[-1] == "False"


def test_an_unknown_engine_is_still_refused(plugin):
    with pytest.raises(tracer.TracerError, match="unknown engine 'tweakd'.*tweaked"):
        parse_engine("tweakd")


def test_it_records_what_the_reimplementation_with_its_tweak_records(plugin, tiny_llama):
    model = tiny_llama()
    trace = tracer.record(model, TOKENS, engine=plugin, progress=False)
    expected = tracer.record(model, TOKENS, engine="reimpl", variant="theta=500", progress=False)
    assert trace.meta.engine == "tweaked" and list(trace) == list(expected)
    assert all(torch.equal(trace[point], expected[point]) for point in expected)


def test_a_run_finds_its_mistake_where_a_wrong_rope_base_shows(plugin, tiny_llama):
    result = tracer.run(tiny_llama(), tokens=TOKENS, candidate=plugin, greedy=0, progress=False)
    assert result.verdict == "diverged"
    assert result.first_divergence.point == layer_point(0, Q_ROPE)
    assert result.to_dict()["candidate"]["engine"] == "tweaked"
