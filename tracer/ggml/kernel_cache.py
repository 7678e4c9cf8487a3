"""Where numba keeps tracer's compiled kernels: a folder named after the content of the code they
are compiled from, not after where that code lies.

numba's own cache sits beside the source (`__pycache__`) or under a folder named after its path, so a
new clone, a second virtual environment or a reinstalled wheel compiled every kernel again: 40 s of
one core on a 2-core EPYC before a first regime run (docs/measured.md). Here the folder is
`<numba's user cache>/tracer-kernels-<digest>` (NUMBA_CACHE_DIR, when set, in place of numba's user
cache), the digest covering every module of `tracer.ggml`: a kernel compiles in constants and inlined
functions from its neighbours (`fma32`, `QK_K`), and numba checks only the kernel's own file before
it reuses a compiled one. Inside, numba keys each entry as it does everywhere: the signature, the
CPU and its features, numba's version.

A folder that cannot be written leaves the kernels to numba's own locators.
"""

from __future__ import annotations

import os
from pathlib import Path

from numba.core import caching, config
from numba.misc.appdirs import AppDirs

from tracer.files.hashes import code_digest

PACKAGE = Path(__file__).resolve().parent  # tracer/ggml: the kernels and the code they compile in


def kernels_digest(folder: Path = PACKAGE) -> str:
    """16 hex digits of the digest of `folder`'s .py files, their names and contents."""
    return code_digest([("tracer.ggml", folder)])[:16]


DIGEST = kernels_digest()  # the code this process imported, as the kernels are compiled from it


def cache_folder() -> Path:
    """Where this tracer's kernels are compiled to."""
    root = config.CACHE_DIR or AppDirs(appname="numba", appauthor=False).user_cache_dir
    return Path(root) / f"tracer-kernels-{DIGEST}"


class ContentLocator(caching._CacheLocator):
    """numba's cache locator for functions defined in `tracer.ggml`; None (the next locator) for others."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno  # numba's disambiguator: the function's line
        self._cache_path = str(cache_folder())

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return DIGEST

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.isfile(py_file) or Path(py_file).resolve().parent != PACKAGE:
            return None
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:
            return None  # cannot be written: numba's own locators
        return locator


def install() -> None:
    """Put `ContentLocator` first among numba's locators (before any kernel is defined)."""
    locators = caching.CacheImpl._locator_classes
    if ContentLocator not in locators:
        locators.insert(0, ContentLocator)


install()
