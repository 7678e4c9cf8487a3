"""The real first-use conversion of the bundled GGUF (~10 s) after an interruption and under a
race, with every network connection refused.

Each `tracer run` runs in a fresh process on its own empty TRACER_CACHE, through a wrapper that
makes any socket connection or DNS lookup print "NETWORK ATTEMPT" and fail: a run on local files
must never reach for the network, converting included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracer.core.errors import TracerError
from tracer.files import sources
from tracer.files.convert import COMPLETE_MARKER
from tracer.files.sources import DEFAULT_DIRNAME

GUARDED_CLI = r"""
import socket, sys

def refuse(*args, **kwargs):
    print(f"NETWORK ATTEMPT {args!r}", file=sys.stderr, flush=True)
    raise OSError("tracer must not use the network")

socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse

from tracer.cli import main
sys.exit(main(sys.argv[1:]))
"""

# The cheapest command that resolves the default model (and so converts it): what is tested is the
# conversion under a kill and a race, which every command shares (`tracer.files.sources.resolve_model`);
# that hf and reimpl agree on the converted model is every other integration test's first step.
RUN = ["config"]
CONVERTING = "tracer: converting SmolLM2-135M-Instruct.Q4_1.gguf to f32"


@pytest.fixture(scope="module", autouse=True)
def bundled_gguf():
    try:
        return sources.bundled_gguf()
    except TracerError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def start_run(cache: Path, json_file: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["TRACER_CACHE"] = str(cache)
    # --json FILE, not -: progress stays on, and it is what says "converting".
    return subprocess.Popen([sys.executable, "-c", GUARDED_CLI, *RUN, "--json", str(json_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(process: subprocess.Popen, json_file: Path) -> tuple[dict, str]:
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err
    assert "NETWORK ATTEMPT" not in err, err
    return json.loads(json_file.read_text()), err


def test_killed_conversion_then_two_racing_runs_both_succeed_with_one_conversion(tmp_path):
    """Killed mid-conversion (kill -9: no cleanup runs), then two runs started together on that
    cache: both succeed, exactly one of them converts, and the dead run's leftovers are cleared."""
    cache = tmp_path / "cache"
    victim = start_run(cache, tmp_path / "victim.json")
    deadline = time.monotonic() + 600
    while not list(cache.glob(f".{DEFAULT_DIRNAME}.tmp-*")):  # the conversion has started
        assert victim.poll() is None and time.monotonic() < deadline, victim.communicate()
        time.sleep(0.1)
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=60)
    assert not (cache / DEFAULT_DIRNAME).exists()  # nothing half-converted where runs look
    assert list(cache.glob(f".{DEFAULT_DIRNAME}.tmp-*"))  # the dead run's temp folder is still there

    first, second = start_run(cache, tmp_path / "a.json"), start_run(cache, tmp_path / "b.json")
    (result_a, err_a), (result_b, err_b) = finish(first, tmp_path / "a.json"), finish(second, tmp_path / "b.json")
    for result in (result_a, result_b):  # each read the converted model's config.json
        assert result["readers"]["hf"]["error"] is None and "num_hidden_layers" in result["readers"]["hf"]["reads"]
    assert [CONVERTING in err for err in (err_a, err_b)].count(True) == 1
    assert (cache / DEFAULT_DIRNAME / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted([f".{DEFAULT_DIRNAME}.lock", DEFAULT_DIRNAME])
