"""The CLI in a fresh process that does not pay torch's and transformers' imports each time.

A forkserver imports tracer's CLI and API, torch and transformers once and runs nothing; every call
forks a child from it that runs the `tracer` command's entry point with its own argv, environment
and stdout/stderr files, and exits with its code, as `python -m tracer` would. Each child starts
from the same clean state (nothing it does reaches the next), so a table of user errors checks what
a user sees without a new interpreter per row (docs/measured.md has the time it saves).
`tests/unit/test_cli.py` keeps a run of the real `python -m tracer` entry point.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

# What a run imports before it can fail: a name that does not import is skipped by the forkserver
# without a word, so `tests/unit/test_user_errors.py` checks that each of these imports.
PRELOAD = ["tracer.cli", "tracer.api", "torch", "transformers", "transformers.models.llama.modeling_llama",
           "tracer.engines.hf", "tracer.pipeline.commands", "safetensors.torch"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _child(args: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["tracer", *args]
    from tracer.cli import console_main

    code = console_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the interpreter would exit after `python -m tracer`, without multiprocessing's epilogue


class Started:
    """A running CLI child: `finish()` waits and gives (exit code, stdout bytes, stderr bytes)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self._folder = Path(tempfile.mkdtemp(prefix="tracer-cli-"))
        self._out, self._err = self._folder / "stdout", self._folder / "stderr"
        self._process = _context().Process(target=_child, args=(list(args), dict(os.environ if env is None else env),
                                                                 str(self._out), str(self._err)))
        self._process.start()

    def finish(self, timeout: float = 600) -> tuple[int, bytes, bytes]:
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            raise TimeoutError(f"the CLI child ran past {timeout} s")
        result = self._process.exitcode, self._out.read_bytes(), self._err.read_bytes()
        for path in (self._out, self._err):
            path.unlink()
        self._folder.rmdir()
        return result


def run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, bytes, bytes]:
    """`tracer ARGS` in a fresh child: (exit code, stdout bytes, stderr bytes)."""
    return Started(args, env).finish()
