"""A made-up engine whose runtime computes Llama otherwise than transformers by its own design, and has no
OLMo-2 model: tracer's reimplementation with the RoPE base fixed at 500, whatever `rope_theta` says. Its
entry states the cells a later engine would (`tests/unit/test_engine_cells.py` registers it): a runtime
difference on llama at q_rope, olmo2 not in that runtime, every other family not traced yet.
"""

from __future__ import annotations

from tracer.engines.registry import Absent, Difference, EngineEntry
from tracer.engines.reimpl import ReimplEngine
from tracer.model.points import Q_ROPE
from tracer.reimpl.forward import Model

RUNTIME_THETA = 500.0
DIFFERENCE = Difference("llama", Q_ROPE, "", "its RoPE base is 500 whatever rope_theta says")
ENTRY = EngineEntry("drifted", __name__, "tracer's reimplementation with the RoPE base fixed at 500, by design",
                    families=(), differences=(DIFFERENCE,),
                    absent=(Absent("olmo2", "this runtime has no OLMo-2 model"),))


class DriftedEngine(ReimplEngine):
    entry = ENTRY


def load(source, variant, *, argument=None, device="cpu", stream=False) -> DriftedEngine:
    model = Model.from_dir(source.directory, {**variant, "theta": RUNTIME_THETA}, device=device)
    return DriftedEngine(model, source.name)
