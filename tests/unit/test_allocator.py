"""The `tracer` command's allocator setting: a freed large block stays for the next op to reuse."""

import subprocess
import sys

import pytest

CHILD = """
import sys
import numpy as np
from tracer.core.allocator import reuse_freed_memory

def resident_mb():
    return int(next(line for line in open('/proc/self/status') if line.startswith('VmRSS')).split()[1]) // 1024

tuned = reuse_freed_memory() if sys.argv[1] == "tuned" else None
block = np.ones(25_000_000)  # 200 MB, every page touched
held = resident_mb()
del block
print(tuned, held, resident_mb())
"""


def freed(mode: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout
    tuned, held, after = out.split()
    return tuned, int(held), int(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.slow  # fresh processes, one per allocator setting
def test_a_freed_large_block_stays_in_the_heap_only_when_asked():
    tuned, held, after = freed("tuned")
    assert tuned == "True" and after > held - 50  # kept: the next (1, H, T, T) matrix reuses these pages
    tuned, held, after = freed("default")
    assert tuned == "None" and after < held - 150  # glibc's default: the block's mapping went back to the kernel
