"""Native runtimes fail alone: an engine whose runtime is native code runs in a child process.

llama.cpp, MLX and ONNX Runtime can abort in native code (a segfault, a `GGML_ASSERT`), which
no `try` catches: in tracer's own process that would end the run with no verdict, no message of
ours and maybe half a report. An engine whose registry entry says `isolated=True` is therefore
loaded by `load` below: a child process (`python -m tracer.engines.isolated`) imports the
engine's module and builds the real engine there, and the parent gets an `IsolatedEngine` that
forwards `record`, `logits`, `draft` and `decode` to it. If the child dies, the call raises one
`TracerError`: "the llamacpp engine died (SIGSEGV): <the last lines it wrote to stderr>".

Protocol: one JSON object per line on the child's stdin (requests) and on a copy of its
original stdout (replies); the child sends its own stdout to stderr at start, so nothing a
native library prints can break a reply. Tensors travel as safetensors files: `record` writes
into the caller's `DiskRecorder` folder directly (the spill folder of a long prompt), or one
file in a temporary folder that the parent reads back and deletes; `logits` one file too.
Errors the engine raises come back as messages: a `TracerError` is raised again as one, anything
else as a RuntimeError carrying the child's traceback.

An engine module may set `CHILD_ENVIRONMENT`: variables set in the child unless the user set
them; and `child_environment(variant)`: those a knob sets once per process (candle's threads), so
that a load asking for another value gets a child started with it. When the engine object ends
(`close`, or garbage), its child drops the engine and waits, one per environment, for the next
`load` in the same environment (tracer's own variables, which a child reads only when a call needs
them, do not count: each `load` brings the parent's, and its working folder): starting a child and
importing torch and the runtime there is ~1.5 s, which a notebook or a sweep that loads one
engine after another would pay each time. A child that died, or whose call was interrupted (its
reply still to come), is never reused; idle children end with tracer. Cost (measured on the
bundled SmolLM2, docs/engine-llamacpp.md): the first child's start, then each record's points
written and read back once.
"""

from __future__ import annotations

import atexit
import collections
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from pathlib import Path

from tracer.core.errors import TracerError, one_line
from tracer.engines.base import EngineBase, at_positions
from tracer.engines.registry import EngineEntry
from tracer.files.sources import ModelSource

STDERR_LINES = 6  # how much of a dead child's stderr its error message quotes
MESSAGE_LIMIT = 400  # characters of it, so the error stays one readable line


class Child:
    """A child process and the last lines it wrote to stderr (drained as it writes them)."""

    def __init__(self, environment: dict[str, str]):
        self.key = _environment_key(environment)
        self.answering = False  # a request was sent and its reply not read (a call interrupted)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tracer.engines.isolated"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=environment, bufsize=1,
        )
        self.stderr: collections.deque[str] = collections.deque(maxlen=200)
        self.reader = threading.Thread(target=_drain, args=(self.process.stderr, self.stderr), daemon=True)
        self.reader.start()

    def alive(self) -> bool:
        return self.process.poll() is None


# Variables a child takes on each load instead of at its start: tracer's own (read when a call needs them,
# such as TRACER_CACHE) and pytest's name of the running test. A child started under other values of these
# is still the same child; each `load` sets the parent's values of them there (`Server.load`).
PER_LOAD = ("TRACER_", "PYTEST_CURRENT_TEST")


def _per_load(name: str) -> bool:
    return name.startswith(PER_LOAD)


def _environment_key(environment: dict[str, str]) -> tuple:
    """What a child's environment is keyed by: every variable but those it takes on each load."""
    return tuple(sorted((name, value) for name, value in environment.items() if not _per_load(name)))


_IDLE: dict[tuple, Child] = {}  # environment -> a child whose engine ended, kept for the next load
_IDLE_LOCK = threading.Lock()
_EXITING = [False]


def _child(environment: dict[str, str]) -> Child:
    """An idle child started with this environment, else a new one."""
    key = _environment_key(environment)
    with _IDLE_LOCK:
        child = _IDLE.pop(key, None)
    if child is not None and child.alive():
        child.stderr.clear()  # its last words are about this engine only
        return child
    return Child(environment)


def _release(child: Child) -> None:
    """An engine ended: its child drops the engine and waits for the next load, or stops (at exit,
    or when a call was interrupted: its reply, still to come, would answer the next engine)."""
    if not child.alive():
        return
    if not _EXITING[0] and not child.answering:
        try:
            child.process.stdin.write(json.dumps({"op": "unload"}) + "\n")  # answered with no reply
            child.process.stdin.flush()
        except OSError:
            return
        with _IDLE_LOCK:
            replaced = _IDLE.get(child.key)
            _IDLE[child.key] = child
        if replaced is None:
            return
        child = replaced  # one idle child per environment
    _stop(child.process)


@atexit.register
def _stop_idle() -> None:
    _EXITING[0] = True
    with _IDLE_LOCK:
        idle = list(_IDLE.values())
        _IDLE.clear()
    for child in idle:
        _stop(child.process)


class IsolatedEngine(EngineBase):
    """The parent's handle on an engine running in a child process (its `entry` the engine's own)."""

    def __init__(self, entry: EngineEntry, child: Child):
        self.entry, self.child = entry, child
        self.process, self.stderr = child.process, child.stderr
        self._finalizer = weakref.finalize(self, _release, child)
        self.death: str | None = None
        self.variant: dict = {}

    # --- the Engine protocol ------------------------------------------------------------------

    def record(self, tokens: list[int], recorder=None, *, positions=None):
        offset = self.first_position(tokens, positions) or 0  # refused unless its entry takes positions
        from tracer.traces.spill import DiskRecorder  # torch: the child process starts without it
        from tracer.traces.trace import Trace, TraceMeta, TraceRecorder  # torch: the child process starts without it

        tokens = [int(t) for t in tokens]
        if isinstance(recorder, DiskRecorder):  # the child writes the points where the caller spills
            reply = self._call({"op": "record", "tokens": tokens, "offset": offset, "folder": str(recorder.folder)})
            recorder.files.update({point: Path(file) for point, file in reply["files"].items()})
            return Trace(recorder.tensors, TraceMeta.from_dict(reply["meta"]))
        recorder = recorder if recorder is not None else TraceRecorder()
        with tempfile.TemporaryDirectory(prefix="tracer-isolated-") as folder:
            reply = self._call({"op": "record", "tokens": tokens, "offset": offset,
                                "file": str(Path(folder) / "trace.safetensors")})
            for point, tensor in _read(reply["file"], reply["points"]):
                recorder(point, tensor[None])  # recorders take a batch dimension
        return Trace(recorder.tensors, TraceMeta.from_dict(reply["meta"]))

    def logits(self, tokens: list[int], *, positions=None):
        offset = self.first_position(tokens, positions) or 0
        with tempfile.TemporaryDirectory(prefix="tracer-isolated-") as folder:
            reply = self._call({"op": "logits", "tokens": [int(t) for t in tokens], "offset": offset,
                                "file": str(Path(folder) / "logits.safetensors")})
            if reply["file"] is None:
                return None
            return dict(_read(reply["file"], ["logits"]))["logits"]

    def draft(self, tokens: list[int], steps: int, *, positions=None) -> list[int]:
        offset = self.first_position(tokens, positions) or 0
        return self._call({"op": "draft", "tokens": [int(t) for t in tokens], "steps": int(steps),
                           "offset": offset})["tokens"]

    def decode(self, tokens: list[int], count: int, *, forced: list[int] | None = None, offset: int = 0):
        """The engine's own cached decode in the child; the trace and its steps come back as one file."""
        from tracer.traces.trace import Trace  # torch: the child process starts without it

        with tempfile.TemporaryDirectory(prefix="tracer-isolated-") as folder:
            reply = self._call({"op": "decode", "tokens": [int(t) for t in tokens], "count": int(count),
                                "forced": None if forced is None else [int(t) for t in forced], "offset": int(offset),
                                "file": str(Path(folder) / "decoded.safetensors")})
            return Trace.load(reply["file"])

    def close(self) -> None:
        """End the engine now (it also ends with this object): its child waits for the next load."""
        self._finalizer()

    # --- the child ----------------------------------------------------------------------------

    def _call(self, request: dict) -> dict:
        if self.death:
            raise TracerError(self.death)
        self.child.answering = True
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        self.child.answering = False  # not reached when the call is interrupted (KeyboardInterrupt)
        if not line:
            raise TracerError(self._died())
        reply = json.loads(line)
        if "error" in reply:
            if reply["kind"] == "TracerError":
                raise TracerError(reply["error"])
            raise RuntimeError(f"the {self.name} engine raised {reply['kind']} in its process: {reply['error']}\n"
                               f"{reply['traceback']}")
        return reply

    def _died(self) -> str:
        """The one line that says how the child ended, with the last words it wrote."""
        code = self.process.wait()
        self.child.reader.join(timeout=5)
        how = _signal_name(-code) if code < 0 else f"exit code {code}"
        words = " | ".join(list(self.stderr)[-STDERR_LINES:]) or "it wrote nothing to stderr"
        if len(words) > MESSAGE_LIMIT:
            words = "..." + words[-MESSAGE_LIMIT:]
        self.death = f"the {self.name} engine died ({how}): {words}"
        return self.death


def load(entry: EngineEntry, source: ModelSource, variant: dict, *, argument: str | None = None, device="cpu",
         stream: bool = False) -> IsolatedEngine:
    """Start a child process and build the engine `entry` names in it (same arguments as every
    engine's `load`). `source` must be a directory: a loaded model cannot cross processes."""
    if source.loaded:
        raise TracerError(f"the {entry.name} engine runs in its own process and needs a model path, not a loaded model")
    module = importlib.import_module(entry.module)
    environment = {**getattr(module, "CHILD_ENVIRONMENT", {}), **os.environ}
    if hasattr(module, "child_environment"):  # what the variant sets once per process: a child started with it
        environment.update(module.child_environment(variant))
    if hasattr(module, "parent_argument"):  # resolved here, so that what it says reaches the user's terminal
        argument = module.parent_argument(source, argument)
    engine = IsolatedEngine(entry, _child(environment))
    info = engine._call({
        "op": "load", "module": entry.module, "directory": str(source.directory),
        "variant": variant, "argument": argument, "device": str(device), "stream": stream, "path": sys.path,
        "environment": {name: value for name, value in environment.items() if _per_load(name)},
        "cwd": _working_folder(),  # a relative path means the same in the child as here, wherever it started
    })
    engine.variant, engine.device = info["variant"], info["device"]
    engine.vocab_size, engine.max_positions = info["vocab_size"], info["max_positions"]
    return engine


def _working_folder() -> str | None:
    """This process's working folder; None where it was deleted (no relative path can name a file then)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _drain(stream, lines: collections.deque) -> None:
    for line in stream:
        if line.strip():
            lines.append(line.strip())


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            process.stdin.close()  # the child's loop ends on EOF
            process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _read(file: str, points: list[str]):
    """(point, tensor) in `points`' order from one safetensors file, read into memory."""
    from safetensors.torch import load_file  # torch: the child process starts without it

    tensors = load_file(file)
    return [(point, tensors[point]) for point in points]


# --- the child's side -----------------------------------------------------------------------------


class Server:
    """The child: builds the engine, then answers requests until its stdin closes."""

    def __init__(self):
        self.engine = None

    def handle(self, request: dict) -> dict:
        return getattr(self, request["op"])(request)

    def unload(self, request: dict) -> None:
        """The parent's engine ended: drop this one (its model's memory) and wait for the next load.

        What survives the collection (the modules the load imported: torch's alone are 200,000
        objects) is frozen out of later ones, which would each walk it again (0.1 s a collection)."""
        if self.engine is None:
            return
        self.engine = None
        gc.collect()
        gc.freeze()

    def load(self, request: dict) -> dict:
        self.unload(request)
        sys.path[:0] = [p for p in request["path"] if p not in sys.path]
        for name in [name for name in os.environ if _per_load(name)]:
            del os.environ[name]
        os.environ.update(request["environment"])  # the parent's values now, not those the child started with
        if request["cwd"] is not None:
            os.chdir(request["cwd"])
        module = importlib.import_module(request["module"])
        source = ModelSource(Path(request["directory"]))  # resolved by the parent
        self.engine = module.load(source, request["variant"], argument=request["argument"],
                                  device=request["device"], stream=request["stream"])
        engine = self.engine
        return {"variant": dict(engine.variant), "device": str(engine.device), "vocab_size": engine.vocab_size,
                "max_positions": engine.max_positions}

    def record(self, request: dict) -> dict:
        from safetensors.torch import save_file  # torch: the child process starts without it

        from tracer.traces.spill import DiskRecorder  # torch: the child process starts without it
        from tracer.traces.trace import TraceRecorder  # torch: the child process starts without it

        at = _positions(request)
        if "folder" in request:
            recorder = DiskRecorder(request["folder"])
            trace = self.engine.record(request["tokens"], recorder, **at)
            return {"meta": trace.meta.to_dict(), "files": {point: str(file) for point, file in recorder.files.items()}}
        trace = self.engine.record(request["tokens"], TraceRecorder(), **at)
        save_file({point: tensor.contiguous() for point, tensor in trace.tensors.items()}, request["file"])
        return {"meta": trace.meta.to_dict(), "file": request["file"], "points": list(trace.tensors)}

    def logits(self, request: dict) -> dict:
        from safetensors.torch import save_file  # torch: the child process starts without it

        logits = self.engine.logits(request["tokens"], **_positions(request))
        if logits is None:
            return {"file": None}
        save_file({"logits": logits.contiguous()}, request["file"])
        return {"file": request["file"]}

    def draft(self, request: dict) -> dict:
        picks = self.engine.draft(request["tokens"], request["steps"], **_positions(request))
        return {"tokens": [int(t) for t in picks]}

    def decode(self, request: dict) -> dict:
        trace = self.engine.decode(request["tokens"], request["count"], forced=request["forced"],
                                   offset=request["offset"])
        return {"file": str(trace.save(request["file"]))}


def _positions(request: dict) -> dict:
    """The engine call's `positions` keyword for the request's offset (none at 0: every engine starts there)."""
    return at_positions(request.get("offset", 0), len(request["tokens"]))


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever native code prints to stdout lands in stderr, never inside a reply
    sys.stdout = sys.stderr
    server = Server()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "unload":  # no reply: the parent does not wait for it
            server.unload(request)
            continue
        try:
            reply = server.handle(request)
        except Exception as exc:  # noqa: BLE001 - every error goes back to the parent, which raises it
            ours = isinstance(exc, TracerError)
            reply = {"error": str(exc) if ours else one_line(exc),
                     "kind": "TracerError" if ours else type(exc).__name__,
                     "traceback": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve()
