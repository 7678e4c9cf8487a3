"""Nothing from a downloaded file is executed, and nothing reaches for the network.

- safetensors only: no pickle, no `torch.load`, anywhere in tracer's sources;
- `trust_remote_code` never: not in the sources, and a model folder shipping its own Python
  (config.json `auto_map` -> a module that would leave a mark when imported) is run with
  transformers' own Llama, the module never imported;
- no network: a run on a local model with every socket connection refused makes no attempt.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

import tracer
from tests.conftest import TOKENS, write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("tracer", "hooks", "reports") for p in (ROOT / folder).rglob("*.py"))


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"tracer/traces/trace.py", "tracer/files/sources.py", "tracer/engines/hf.py",
            "reports/write.py"} <= names


@pytest.mark.parametrize("pattern", [
    r"\btorch\.load\b", r"\bimport (c?pickle|dill|joblib|marshal|shelve)\b", r"\bpickle\.\w", r"\bunpickl",
    r"\btrust_remote_code\b", r"(?<![.\w])(eval|exec)\(", r"weights_only\s*=\s*False",
])
def test_no_unsafe_loading_in_the_sources(pattern):
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES
            for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert hits == []


def test_a_model_folder_with_its_own_code_never_runs_it(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    marker = tmp_path / "EXECUTED"
    evil = f"open({str(marker)!r}, 'w').write('pwned')\n"
    for module in ("configuration_evil.py", "modeling_evil.py"):
        (model / module).write_text(evil)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))

    result = tracer.run(model, tokens=TOKENS, reference="hf", candidate="reimpl", greedy=0, progress=False)
    assert not marker.exists()
    assert result.verdict == "match"  # transformers' own LlamaForCausalLM ran, the same model as ours
    assert any("auto_map" in note for note in result.notes)  # the key was not silently skipped


@pytest.fixture
def no_network(monkeypatch):
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("tracer must not use the network")

    for target, name in ((socket.socket, "connect"), (socket.socket, "connect_ex"),
                         (socket, "create_connection"), (socket, "getaddrinfo")):
        monkeypatch.setattr(target, name, refuse)
    return attempts


def test_a_run_on_a_local_model_makes_no_connection_attempt(tmp_path, no_network, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    model = write_tiny_llama(tmp_path / "model")
    result = tracer.run(model, tokens=TOKENS, reference="hf", candidate="reimpl", variant="attn=sdpa", greedy=2,
                        out=tmp_path / "report", progress=False)
    assert result.verdict in ("match", "diverged") and (tmp_path / "report" / "report.html").is_file()
    trace = tracer.record(model, TOKENS, engine="hf", progress=False)
    assert len(trace) > 0
    assert no_network == []
