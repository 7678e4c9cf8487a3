"""An engine whose runtime dies in native code on demand, for the isolation tests
(`tracer.engines.isolated`): the variant says how `record` ends.

- {"die": "segfault"}: reads address 0 through ctypes (SIGSEGV), after a line on stderr;
- {"die": "abort"}: libc abort() after a ggml-like message (SIGABRT);
- {"die": "exit"}: the process exits with code 3;
- {"die": "error"}: a TracerError (not a death: the engine's own one-line error);
- anything else: a trace of one point, as a healthy engine would.

{"echo": NAME} adds "echoed": the child's value of the variable NAME when the engine loaded; {"cwd": True}
replaces it with the child's working folder then.

torch is imported only on the healthy path, so a child that is to die starts in a blink.
"""

from __future__ import annotations

import ctypes
import os
import sys

from tracer.core.errors import TracerError
from tracer.engines.registry import EngineEntry

ENTRY = EngineEntry("crashy", "tests.crash_engine", "dies on demand", draft=True, isolated=True)


class CrashEngine:
    entry, name, device = ENTRY, ENTRY.name, "cpu"
    vocab_size, max_positions = 100, 64

    def __init__(self, variant: dict):
        self.variant = variant if "echo" not in variant else {**variant, "echoed": os.environ.get(variant["echo"])}
        if variant.get("cwd"):
            self.variant = {**variant, "cwd": os.getcwd()}

    def record(self, tokens, recorder=None):
        how = self.variant.get("die")
        if how == "segfault":
            print("crash_engine: about to read address 0", file=sys.stderr, flush=True)
            ctypes.string_at(0)
        if how == "abort":
            os.write(2, b"crash_engine.c:12: GGML_ASSERT(n_embd_head == n_rot) failed\n")
            ctypes.CDLL(None).abort()
        if how == "exit":
            os._exit(3)
        if how == "error":
            raise TracerError("the crash engine refuses, in one line")
        import torch

        from tracer.engines.base import trace_meta
        from tracer.traces.trace import Trace, TraceRecorder

        recorder = recorder if recorder is not None else TraceRecorder()
        recorder("model.embed_tokens", torch.arange(len(tokens) * 4, dtype=torch.float32).reshape(1, len(tokens), 4))
        return Trace(recorder.tensors, trace_meta(self, "crash", tokens, "float32", {}))

    def logits(self, tokens):
        import torch

        return torch.zeros(len(tokens), self.vocab_size)

    def draft(self, tokens, steps):
        return [7] * steps


def load(source, variant, *, argument=None, device="cpu", stream=False):
    return CrashEngine(variant)
