"""The model cache under concurrency and interruption, with a stand-in build of a few seconds.

`tracer.files.convert.cached_build` is what converts the bundled GGUF once; here real processes race on
it with a build that records each time it runs, so "exactly once" is counted, not assumed. The
same on the real conversion is in tests/integration/test_cache_smollm2.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tracer.files.convert import COMPLETE_MARKER

# A child process: build `target` with a build that appends its pid to `runs`, writes half a file,
# and finishes it once the file `release` exists (the test decides when a build may end).
CHILD = r"""
import os, signal, sys, time
from pathlib import Path
from tracer.files.convert import cached_build

# Ctrl-C as a terminal delivers it, whatever the test worker's own state: a child inherits its parent's
# signal mask and an ignored SIGINT (once in a suite run, the interrupted child never saw the signal).
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGINT, signal.default_int_handler)

target, runs, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

def build(tmp):
    with open(runs, "a") as handle:
        handle.write(f"{os.getpid()}\n")
    (tmp / "model.safetensors").write_bytes(b"half")
    while not release.exists():
        time.sleep(0.02)
    (tmp / "model.safetensors").write_bytes(b"whole file")

print(cached_build(target, build, progress=True))
"""


def start(target: Path, runs: Path, release: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(target), str(runs), str(release)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def build_runs(runs: Path) -> list[str]:
    return runs.read_text().split() if runs.exists() else []


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_processes_racing_on_an_empty_cache_build_once_and_all_succeed(tmp_path):
    target, runs, release = tmp_path / "cache" / "model", tmp_path / "runs.txt", tmp_path / "release"
    racers = [start(target, runs, release) for _ in range(3)]
    wait_for(lambda: build_runs(runs))
    builder = int(build_runs(runs)[0])
    # The build is held open until both others have said they wait for it: a real race.
    for racer in racers:
        if racer.pid != builder:
            assert "waiting for another process preparing" in racer.stderr.readline()
    release.touch()
    outputs = [p.communicate(timeout=120) for p in racers]
    assert [p.returncode for p in racers] == [0, 0, 0], outputs
    assert all(out.strip() == str(target) for out, _ in outputs)
    assert build_runs(runs) == [str(builder)]  # one build: the waiters found it complete
    assert (target / "model.safetensors").read_bytes() == b"whole file" and (target / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]  # no temp folder left


def test_a_build_killed_midway_leaves_nothing_trusted_and_the_next_run_completes(tmp_path):
    target, runs, release = tmp_path / "cache" / "model", tmp_path / "runs.txt", tmp_path / "release"
    victim = start(target, runs, release)
    wait_for(lambda: any(target.parent.glob(".model.tmp-*/model.safetensors")))  # mid-build, file half written
    os.kill(victim.pid, signal.SIGKILL)  # no cleanup handler runs: the worst case
    victim.communicate(timeout=30)
    assert not target.exists()  # the half-built folder was never moved into place
    assert list(target.parent.glob(".model.tmp-*"))  # it is left behind as a temp folder

    release.touch()
    survivor = start(target, runs, release)
    out, err = survivor.communicate(timeout=60)  # the kernel dropped the dead holder's flock: no hang
    assert survivor.returncode == 0, err
    assert len(build_runs(runs)) == 2
    assert (target / "model.safetensors").read_bytes() == b"whole file"
    assert not list(target.parent.glob(".model.tmp-*"))  # the leftover was cleared under the lock


def test_an_interrupted_build_cleans_up_after_itself(tmp_path):
    """Ctrl-C (SIGINT -> KeyboardInterrupt) runs the cleanup: no temp folder, no target."""
    target, runs, release = tmp_path / "cache" / "model", tmp_path / "runs.txt", tmp_path / "release"
    victim = start(target, runs, release)
    wait_for(lambda: any(target.parent.glob(".model.tmp-*/model.safetensors")))
    victim.send_signal(signal.SIGINT)
    _, err = victim.communicate(timeout=30)
    assert victim.returncode != 0 and "KeyboardInterrupt" in err
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock"]
