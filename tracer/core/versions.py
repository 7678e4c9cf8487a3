"""The installed version of a distribution, looked up once per process.

`importlib.metadata` scans every installed distribution's metadata on each lookup (milliseconds each),
and cache keys, trace metadata and runtime facts ask for the same few versions on every run. No torch.
"""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def installed_version(distribution: str) -> str | None:
    """`distribution`'s version as installed (None where it is not)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
