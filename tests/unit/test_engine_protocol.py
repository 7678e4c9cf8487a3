"""Every engine answers to the `Engine` protocol (tracer/engines/base.py) with the methods its registry
entry declares (`draft` where `entry.draft`, `local_trace` where `entry.local_errors`, ...), and its
module's `load` returns the class its annotation names.

The engines cheap to build are built on a tiny model, in this process (an isolated engine as its child
builds it). The others are read from their class, what it defines plus what its `__init__` assigns to
`self`: the ONNX export takes seconds, and `IsolatedEngine`, the parent's handle on a child process,
starts a second interpreter.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from typing import get_type_hints

import pytest

from tests.conftest import write_tiny_llama
from tests.unit.test_matrix import ARGUMENTS
from tracer.core.errors import TracerError
from tracer.engines.base import Engine
from tracer.engines.isolated import IsolatedEngine
from tracer.engines.registry import ENGINES
from tracer.files.sources import resolve_source

# The protocol's methods only some engines have, and what in an entry declares each.
DECLARED_BY = {"draft": lambda entry: entry.draft, "local_trace": lambda entry: entry.local_errors,
               "routed_trace": lambda entry: entry.local_errors,  # the local run on the reference's routing
               "op_trace": lambda entry: "regime" in entry.kinds,  # the regime view's per-op run
               "decode": lambda entry: entry.decode,
               "local_step_trace": lambda entry: entry.local_errors and entry.decode}
READ_FROM_CLASS = {"onnx"}  # built in seconds (an export of the model)


def protocol_members() -> set[str]:
    methods = {name for name, value in vars(Engine).items() if inspect.isfunction(value) and not name.startswith("_")}
    return set(Engine.__annotations__) | methods


def declared(entry) -> set[str]:
    """What an engine of `entry` must have: the protocol, less the methods its entry does not declare."""
    return (protocol_members() - set(DECLARED_BY)) | {name for name, says in DECLARED_BY.items() if says(entry)}


def class_members(cls) -> set[str]:
    """What every instance of `cls` has: its class's attributes and what its `__init__` assigns to self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    assigned = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return set(dir(cls)) | assigned


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("protocol")
    return write_tiny_llama(folder / "model"), folder


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_has_the_protocol_and_what_its_entry_declares(name, tiny):
    entry = ENGINES[name]
    if entry.missing_runtime():
        pytest.skip(f"the {name} runtime is not installed here")
    load = importlib.import_module(entry.module).load
    engine_class = get_type_hints(load)["return"]
    members = class_members(engine_class)
    if name not in READ_FROM_CLASS:
        model_dir, folder = tiny
        argument = ARGUMENTS[name]("llama", model_dir, folder) if name in ARGUMENTS else None
        try:
            engine = load(resolve_source(model_dir), {}, argument=argument)
        except TracerError:  # a runtime this machine cannot run (candle's CPU flags, MLX without a backend)
            engine = None
        if engine is not None:
            assert isinstance(engine, engine_class) and engine.entry is entry
            members = set(dir(engine))
    assert sorted(declared(entry) - members) == []


def test_the_handle_on_a_child_process_has_what_every_isolated_engine_declares():
    isolated = [entry for entry in ENGINES.values() if entry.isolated]
    assert isolated
    members = class_members(IsolatedEngine)
    assert {entry.name: sorted(declared(entry) - members) for entry in isolated} == {e.name: [] for e in isolated}


def test_the_check_sees_a_method_an_entry_declares_and_an_engine_lacks():
    from tracer.engines.file import FileEngine

    assert set(DECLARED_BY) <= protocol_members()  # a method renamed in the protocol is renamed here
    members = class_members(FileEngine)
    assert "variant" in members  # assigned in __init__, not on the class
    assert declared(ENGINES["file"]) <= members
    assert declared(ENGINES["hf"]) - members == {"draft", "decode"}  # a file engine claiming them would fail
    assert {"local_trace", "op_trace"} <= declared(ENGINES["reimpl"])
