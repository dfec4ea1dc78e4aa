"""CPU allocator tuning for the extraction and fine-tuning commands (not a stage: both use it).

glibc serves every allocation above ``M_MMAP_THRESHOLD`` (at most 32 MB) with a fresh
``mmap`` and returns it to the kernel on free. A CNN forward at batch 64 and 224 px allocates
activations of ~100 MB per layer, so every layer of every batch page-faults its output in
again: measured on the 2-core CI box (lite0, 224 px, 1 thread), 60 % of the forward's time
was kernel time (``sys`` 6.6 s vs ``user`` 4.5 s for 192 images, 2.5 M minor faults).
:func:`tune_cpu_allocator` makes glibc keep freed memory in its heap (``M_MMAP_MAX = 0``;
``M_TRIM_THRESHOLD = -1``: never hand the heap's free top back to the kernel, which a 1 GiB
threshold still did after the largest batches inside the pipeline), so the next batch
reuses it: the same forward then runs with ~0 s of kernel time and about 2x the images/s,
with identical numbers. This is the
effect PyTorch's CPU tuning guide gets from preloading jemalloc or tcmalloc, without a
preload.

Only the ``featcache extract`` and ``featcache finetune`` commands apply it: a library call
(``featcache.extract.extract``) changes nothing process-wide. Library users (a notebook, a
service) get the same effect for a whole process, without code, from glibc's tunables set
before Python starts::

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615 python ...

(``trim_threshold`` = SIZE_MAX: never trim; ``mmap_max=0`` alone is not enough), or by
preloading jemalloc/tcmalloc as PyTorch's CPU tuning guide suggests. The process then keeps
its peak heap until it exits.

Set ``FEATCACHE_MALLOC=system`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
TRIM_THRESHOLD = -1
_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Keep large freed CPU buffers in glibc's heap for reuse (once per process; called by the
    ``extract``/``finetune`` commands and the extraction benchmark, never by a library call).

    Returns whether the tuning is active. A no-op returning False off glibc (macOS, musl) or
    when ``FEATCACHE_MALLOC=system``. The process then keeps its peak heap mapped until it
    exits (an extraction's peak is a few batches of activations); the numbers computed do
    not change.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("FEATCACHE_MALLOC", "").lower() == "system":
        log.info("FEATCACHE_MALLOC=system: glibc allocator left as it is")
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.info("mallopt refused; glibc allocator left as it is")
        return False
    _tuned = True
    log.info("CPU forward: glibc keeps freed activation buffers for reuse (FEATCACHE_MALLOC=system turns this off)")
    return True
