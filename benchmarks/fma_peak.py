"""This CPU's fp32 FMA peak, measured: the ceiling the roofline tables divide by.

``lscpu`` gives the vector width but not the clock a VM runs at (it often hides "CPU max MHz",
and the boost clock is never listed) nor the number of FMA units, so a peak computed from it
rests on two guesses. This measures the peak instead: a C kernel (compiled here with ``gcc
-O2 -march=native -fopenmp``, once, into a temporary folder) runs ``ACC`` independent chains of
vector ``a = a * m + c`` on each of ``threads`` OpenMP threads, enough chains to hide the FMA
latency on every x86 core (4-5 cycles x up to 2 units), all in registers (12 chains + 2
constants fit AVX2's 16; with more, gcc spilled them and the rate halved), so nothing but the
FMA units limits it. FLOPs = threads x iterations x ``ACC`` x lanes x 2. The best of ``repeats``
timings counts (other processes only slow it down).

The kernel's result is checked: each chain converges to ``c / (1 - m)``, so the returned sum
must be ``threads x ACC x lanes x c / (1 - m)``; a compiler that skipped the loop fails that.

    python benchmarks/fma_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ACC = 12  # independent chains per thread: >= latency x units on every x86 core, and 12 + 2 <= 16 registers

SOURCE = r"""
#include <omp.h>
#if defined(__AVX512F__)
#define BYTES 64
#elif defined(__AVX__)
#define BYTES 32
#else
#define BYTES 16
#endif
typedef float vf __attribute__((vector_size(BYTES)));
int fma_lanes(void) { return BYTES / 4; }
/* ACC chains of a = a * m + c per thread, iters times; returns the sum of every lane of every
   chain of every thread, and the seconds the parallel region took in *secs. */
double fma_run(long iters, int threads, float m, float c, double *secs) {
    double total = 0.0, t0 = omp_get_wtime();
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        vf zero = {0}, a[ACC], vm = zero + m, vc = zero + c;  /* scalar + vector: a broadcast */
        for (int k = 0; k < ACC; k++) a[k] = zero + (float)k;
        for (long i = 0; i < iters; i++) {
            #pragma GCC unroll 12
            for (int k = 0; k < ACC; k++) a[k] = a[k] * vm + vc;
        }
        for (int k = 0; k < ACC; k++) for (int l = 0; l < BYTES / 4; l++) total += a[k][l];
    }
    *secs = omp_get_wtime() - t0;
    return total;
}
"""


class FmaPeakError(RuntimeError):
    """The kernel could not be built or gave a wrong result; the roofline falls back to lscpu."""


@dataclass(frozen=True)
class FmaPeak:
    """A measured fp32 peak: FLOP/s over ``threads`` threads, and the samples behind it."""

    flops: float
    threads: int
    lanes: int
    samples_gflops: tuple[float, ...]


def _library() -> ctypes.CDLL:
    """The compiled kernel, built once per source and compiler into the temporary folder."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise FmaPeakError("no C compiler (gcc/cc) on PATH: install gcc to measure the FMA peak")
    src = SOURCE.replace("ACC", str(ACC))
    tag = hashlib.sha256((src + gcc).encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"featcache-fma-{tag}.so"
    if not lib.exists():
        c_file = lib.with_suffix(".c")
        c_file.write_text(src)
        tmp = lib.with_suffix(".so.tmp")
        cmd = [
            gcc,
            "-O2",
            "-march=native",
            "-ffp-contract=fast",
            "-fopenmp",
            "-shared",
            "-fPIC",
            "-o",
            str(tmp),
            str(c_file),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FmaPeakError(f"building the FMA kernel failed: {done.stderr.strip()[:300]}")
        tmp.replace(lib)
    so = ctypes.CDLL(str(lib))
    so.fma_run.restype = ctypes.c_double
    so.fma_run.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.POINTER(ctypes.c_double)]
    so.fma_lanes.restype = ctypes.c_int
    return so


def measure_fma_peak(threads: int, seconds: float = 0.5, repeats: int = 5) -> FmaPeak:
    """The fp32 FMA peak over ``threads`` threads: best of ``repeats`` runs of ~``seconds`` each."""
    so = _library()
    lanes = so.fma_lanes()
    m, c = 0.5, 1.0  # every chain converges to c / (1 - m) = 2
    secs = ctypes.c_double()
    iters = 1_000_000
    so.fma_run(iters, threads, m, c, ctypes.byref(secs))  # warm-up, and the scale of `iters`
    iters = max(iters, int(iters * seconds / max(secs.value, 1e-6)))
    samples = []
    for _ in range(repeats):
        total = so.fma_run(iters, threads, m, c, ctypes.byref(secs))
        want = threads * ACC * lanes * c / (1 - m)
        if abs(total - want) > 1e-6 * want:
            raise FmaPeakError(f"the FMA kernel returned {total}, not {want}: its loop did not run as written")
        samples.append(threads * iters * ACC * lanes * 2 / secs.value / 1e9)
    return FmaPeak(max(samples) * 1e9, threads, lanes, tuple(round(s, 1) for s in samples))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for t in sorted({1, args.threads}):
        p = measure_fma_peak(t, args.seconds, args.repeats)
        print(
            f"{t} thread(s), {p.lanes} fp32 lanes: peak {p.flops / 1e9:.1f} GFLOP/s "
            f"({p.flops / 1e9 / t:.1f} per thread); samples {', '.join(map(str, p.samples_gflops))}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
