"""SIGKILL a running extraction once it has marked some chunks done (the kill/resume tests)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def marked_chunks(group: Path) -> int:
    """Chunks an extraction has marked done in store group ``features/KEY/DATASET/SPLIT``."""
    d = group / "done" / "c"
    return sum(1 for f in d.iterdir() if f.name.isdigit()) if d.is_dir() else 0


def kill_when(proc: Any, marked: Callable[[], int], min_done: int, extra_delay: float, timeout: float = 300) -> int:
    """SIGKILL ``proc`` (a ``subprocess.Popen`` or ``multiprocessing.Process``) once
    ``marked() >= min_done``, plus ``extra_delay`` seconds (so the kill lands anywhere:
    mid-forward, mid-write, between arrays). Returns the marks at the kill."""
    alive = proc.is_alive if hasattr(proc, "is_alive") else lambda: proc.poll() is None
    try:
        deadline = time.monotonic() + timeout
        while marked() < min_done and alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(extra_delay)
    finally:
        if alive():
            os.kill(proc.pid, signal.SIGKILL)
        (proc.join if hasattr(proc, "join") else proc.wait)()
    code = proc.exitcode if hasattr(proc, "exitcode") else proc.returncode
    assert code == -signal.SIGKILL, "the run finished before it could be killed; raise N"
    return marked()


ARRAYS = ("pooled", "valid", "error", "done")


def group_arrays(group: Path) -> dict[str, Any]:
    """The ``pooled``/``valid``/``error``/``done`` arrays of a store group, read with zarr."""
    import numpy as np
    import zarr

    g = zarr.open_group(str(group), mode="r")
    return {k: np.asarray(g[k][:]) for k in ARRAYS}


def chunk_bytes(group: Path) -> dict[str, bytes]:
    """Every chunk object of those arrays, by path: byte-identical stores have equal dicts."""
    return {
        str(f.relative_to(group)): f.read_bytes()
        for name in ARRAYS
        for f in sorted((group / name / "c").rglob("*"))
        if f.is_file()
    }
