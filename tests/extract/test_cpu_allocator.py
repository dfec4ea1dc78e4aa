"""extract/cpu.py: with the tuning, large freed buffers are reused instead of being
page-faulted in afresh (what made the CPU forward spend most of its time in the kernel)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")

SCRIPT = r"""
import ctypes, ctypes.util, resource
from featcache.core.allocator import tune_cpu_allocator
tuned = tune_cpu_allocator()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 2**20  # above glibc's largest mmap threshold (32 MB): one activation of a big batch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # touch every page, as a layer writing its output does
    libc.free(p)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_extra: dict[str, str]) -> tuple[bool, int]:
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


def test_tuned_allocator_reuses_freed_buffers():
    tuned, faults_tuned = _faults({"FEATCACHE_MALLOC": ""})
    off, faults_system = _faults({"FEATCACHE_MALLOC": "system"})
    if not tuned:
        pytest.skip("not glibc: mallopt unavailable")
    assert off is False
    pages = 64 * 2**20 // 4096
    assert faults_system >= 8 * pages  # every round maps its 64 MB afresh
    assert faults_tuned < 2 * pages  # the first round's pages are reused by the next nine


GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615"


def test_glibc_tunables_are_the_library_users_equivalent():
    """What featcache.core.allocator documents for library users: the same reuse, set from outside."""
    tuned, _ = _faults({"FEATCACHE_MALLOC": ""})
    if not tuned:
        pytest.skip("not glibc: mallopt unavailable")
    off, faults = _faults({"FEATCACHE_MALLOC": "system", "GLIBC_TUNABLES": GLIBC_TUNABLES})
    assert off is False
    assert faults < 2 * (64 * 2**20 // 4096)


def test_tuning_is_applied_once_and_reported():
    from featcache.core import allocator as cpu

    first = cpu.tune_cpu_allocator()
    assert cpu.tune_cpu_allocator() is first
