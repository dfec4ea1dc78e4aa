"""What this CPU can compute fast: its vector ISA and whether bf16 matmuls run in hardware.

A bf16 forward on a CPU is worth running only where oneDNN has bf16 kernels in hardware:
``avx512_bf16`` (Cooper Lake and later) or AMX (``amx_bf16``, Sapphire Rapids and later).
Elsewhere oneDNN emulates bf16 through fp32 and runs slower than fp32, so the stages refuse
a bf16 request there (see :func:`bf16_support`). The flags come from ``/proc/cpuinfo`` (Linux);
without it, torch's own oneDNN check answers.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

BF16_FLAGS = ("amx_bf16", "avx512_bf16")

#: ``FEATCACHE_CPU_BF16=0`` treats this CPU as one without bf16 units: ``--precision auto``
#: computes fp32 and an explicit bf16 is refused, as on an AVX2 CPU. The test suite sets it, so
#: that its verdicts are the same on every CPU (tests of the bf16 paths set the flags themselves).
BF16_ENV = "FEATCACHE_CPU_BF16"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``), else ``platform.processor()``,
    else ``unknown``: the label benchmarks print beside their figures."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def bf16_flags() -> tuple[str, ...]:
    """The bf16 ISA extensions this CPU has (AMX first), from its flags or, without
    ``/proc/cpuinfo``, torch's oneDNN check (reported as ``avx512_bf16``); none where
    ``FEATCACHE_CPU_BF16=0``."""
    if os.environ.get(BF16_ENV, "1") == "0":
        return ()
    flags = cpu_flags()
    if flags:
        return tuple(f for f in BF16_FLAGS if f in flags)
    try:
        import torch

        return ("avx512_bf16",) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
    except (ImportError, AttributeError, RuntimeError):  # pragma: no cover - old or odd torch
        return ()


def cpu_isa() -> str:
    """This CPU's ISA as it decides a forward's bits and speed: torch's vector capability
    (``AVX512``, ``AVX2``, ...) plus the bf16 extensions, e.g. ``AVX512+amx_bf16+avx512_bf16``.
    Recorded in provenance; a resume compares it."""
    import torch

    return "+".join((torch.backends.cpu.get_cpu_capability(), *bf16_flags()))


def bf16_support() -> tuple[bool, str]:
    """(True, what runs it) where bf16 matmuls run in hardware, else (False, why not)."""
    have = bf16_flags()
    if have:
        return True, f"oneDNN bf16 kernels ({', '.join(have)})"
    return False, f"this CPU has neither {' nor '.join(BF16_FLAGS)}, so oneDNN would emulate bf16 slower than fp32"


def load_average() -> float | None:
    """The 1-minute load average (``os.getloadavg``), None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - not POSIX
        return None


def threads_for_load(threads: int | None, cpus: int, load: float | None = None) -> int | None:
    """Torch intra-op threads on a machine that may be busy: 1 when it is oversubscribed
    (1-minute load >= ``cpus`` > 1: an OpenMP team of 2 then spins on every barrier; extraction
    measured 17.4 img/s with 2 threads against 86.5 img/s with 1 at load 4-6 on 2 cores; a demo
    train step 9-17 s against 1.2 s), else ``threads`` unchanged. ``load``: measured here when None.

    >>> threads_for_load(2, 2, load=5.0), threads_for_load(2, 2, load=0.5), threads_for_load(None, 1, load=9.0)
    (1, 2, None)
    """
    load = load_average() if load is None else load
    if cpus > 1 and load is not None and load >= cpus:
        log.info("load %.1f on %d cores: running torch with 1 thread", load, cpus)
        return 1
    return threads
