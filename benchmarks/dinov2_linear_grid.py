"""Benchmark: ``dinov2-linear``'s joint 52-head pass vs single-head runs vs a bare PyTorch loop.

In one process, on the same in-memory ``[n, S, D]`` float32 tensors (S = 4 class-token slots +
the mean patch token; by default the ``dinov2-linear`` input of ``--cache`` when given, else
random features shaped like a ViT-S/14's, n = 5,000, D = 384, 10 classes), batch 128, the
reference's 13 lrs x n_last_blocks {1, 4} x avgpool:

1. featcache: :func:`~featcache.probes.dinov2_linear.train_joint`, all 52 heads per step;
2. single-head runs: the same loop with one head, for a sample of heads (one per input
   variant), scaled to 52 runs: the figure a grid of H heads must beat;
3. the bare PyTorch loop a user would write after ``dinov2/eval/linear.py``: 52 ``nn.Linear``
   in a ``ModuleDict`` on the same batches (indices from ``torch.randperm``), the summed
   cross-entropies, ``loss.backward()``, ``torch.optim.SGD`` (52 param groups, momentum 0.9)
   and ``CosineAnnealingLR``: featcache's time per epoch over it (target <= 1.2x);
4. a bare stacked loop (the same batched math as featcache with autograd, ``torch.randperm``
   batches and no bookkeeping): featcache's overhead over the plainest equivalent loop;
5. with ``--cache`` (or ``--write-store PATH``: random ``blocks:4`` + ``tokens`` [n, 256, D]
   written there first): the store's read rate (rows/s of :func:`load_linear_input`, which
   streams the tokens to their mean) over the heads' step rate (rows/s trained): above 1,
   reading is not the bottleneck.

Each arm runs ``--iters`` iterations ``--reps`` times, the arms interleaved (a change of load
hits them alike); medians are reported. Prints every figure as a ratio measured in this run, with peak RSS, ``lscpu``'s model, the
torch threads and ``uptime``'s load.

    python benchmarks/dinov2_linear_grid.py [--iters 200] [--threads 1] [--cache C --backbone B --dataset D]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import time

import numpy as np


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs"


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def featcache_run(X, y, specs, n_classes: int, iters: int, batch: int) -> float:
    """Seconds of ``iters`` joint steps of ``specs``' heads."""
    import torch

    from featcache.probes.dinov2_linear import JointHeads, train_joint

    heads = JointHeads(specs, X.shape[2], n_classes, torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    train_joint(heads, X, y, iters, batch, 0, 0.9)
    return time.perf_counter() - t0


def bare_loop(X, y, specs, n_classes: int, iters: int, batch: int) -> float:
    """Seconds of ``iters`` steps of the plain loop after dinov2's ``eval_linear``."""
    import torch
    import torch.nn as nn

    from featcache.probes.dinov2_linear import linear_input

    mods = nn.ModuleDict()
    groups = []
    for i, s in enumerate(specs):
        m = nn.Linear((s.n_blocks + int(s.avgpool)) * X.shape[2], n_classes)
        m.weight.data.normal_(0, 0.01)
        m.bias.data.zero_()
        mods[f"h{i}"] = m
        groups.append({"params": m.parameters(), "lr": s.lr})
    opt = torch.optim.SGD(groups, momentum=0.9, weight_decay=0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iters, eta_min=0)
    g = torch.Generator().manual_seed(0)
    perm, pos = torch.randperm(X.shape[0], generator=g), 0
    t0 = time.perf_counter()
    for _ in range(iters):
        if pos + batch > perm.numel():
            perm, pos = torch.randperm(X.shape[0], generator=g), 0
        idx = perm[pos : pos + batch]
        pos += batch
        xb, yb = X[idx], y[idx]
        loss = sum(
            nn.functional.cross_entropy(m(linear_input(xb, s.n_blocks, s.avgpool)), yb)
            for s, m in zip(specs, mods.values())
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return time.perf_counter() - t0


def bare_stacked(X, y, specs, n_classes: int, iters: int, batch: int) -> float:
    """Seconds of ``iters`` steps of a plain stacked loop (what featcache computes, without its
    sampler or bookkeeping): per variant one ``[H, C, d]`` weight with autograd, the summed
    cross-entropies, a momentum update with each head's closed-form cosine lr."""
    import math

    import torch

    from featcache.probes.dinov2_linear import linear_input

    variants = list(dict.fromkeys((s.n_blocks, s.avgpool) for s in specs))
    W, b, lr, buf = {}, {}, {}, {}
    for v in variants:
        hs = [s for s in specs if (s.n_blocks, s.avgpool) == v]
        d = (v[0] + int(v[1])) * X.shape[2]
        W[v] = (torch.randn(len(hs), n_classes, d) * 0.01).requires_grad_()
        b[v] = torch.zeros(len(hs), n_classes, requires_grad=True)
        lr[v] = torch.tensor([s.lr for s in hs])
        buf[v] = (torch.zeros_like(W[v]), torch.zeros_like(b[v]))
    g = torch.Generator().manual_seed(0)
    perm, pos = torch.randperm(X.shape[0], generator=g), 0
    t0 = time.perf_counter()
    for t in range(iters):
        if pos + batch > perm.numel():
            perm, pos = torch.randperm(X.shape[0], generator=g), 0
        idx = perm[pos : pos + batch]
        pos += batch
        xb, yb = X[idx], y[idx]
        f = 0.5 * (1 + math.cos(math.pi * t / iters))
        for v in variants:
            H, C, d = W[v].shape
            Z = torch.addmm(b[v].reshape(1, H * C), linear_input(xb, *v), W[v].reshape(H * C, d).T)
            loss = torch.nn.functional.cross_entropy(Z.view(-1, C), yb.repeat_interleave(H), reduction="sum") / batch
            gW, gb = torch.autograd.grad(loss, (W[v], b[v]))
            with torch.no_grad():
                buf[v][0].mul_(0.9).add_(gW)
                buf[v][1].mul_(0.9).add_(gb)
                W[v].sub_((lr[v] * f).view(H, 1, 1) * buf[v][0])
                b[v].sub_((lr[v] * f).view(H, 1) * buf[v][1])
    return time.perf_counter() - t0


def write_store(path: str, n: int, dim: int, tokens: int, classes: int) -> None:
    """A store with random ``blocks:4`` [n, 4, dim] and ``tokens`` [n, tokens, dim] (float16, the
    extract's dtype) of backbone ``rand``, dataset ``bench``, split train, via the writer API."""
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, n)
    cache = open_cache(path, "a")
    meta = ensure_split(
        cache,
        "bench",
        "train",
        np.array([f"r{i:07d}" for i in range(n)]),
        y,
        [str(c) for c in range(classes)],
        "random",
    )
    shapes = {"blocks:4": (4, dim), "tokens": (tokens, dim)}
    provs = {
        k: make_provenance(
            backbone="rand",
            dataset="bench",
            split="train",
            kind=k,
            dim=sh,
            n=n,
            dataset_fingerprint=meta.fingerprint,
            chunk_rows=256,
        )
        for k, sh in shapes.items()
    }
    w = FeatureWriter(cache, "rand", "bench", "train", provs).prepare()
    for i in w.pending_chunks():
        a, e = w.chunk_range(i)
        w.write_chunk(
            i, {k: rng.standard_normal((e - a, *sh), np.float32) for k, sh in shapes.items()}, np.ones(e - a, bool)
        )
    w.mark_complete()


def _inputs(args):
    """(X [n, S, D] float32 tensor, y, read seconds or None, source label)."""
    import torch

    if args.cache:
        from featcache.probes.dinov2_linear import load_linear_input
        from featcache.store import open_cache

        t0 = time.perf_counter()
        f = load_linear_input(open_cache(args.cache), args.backbone, args.dataset, "train")
        read = time.perf_counter() - t0
        X = np.ascontiguousarray(f.X, np.float32)
        y = np.unique(np.asarray(f.labels), return_inverse=True)[1]
        label = f"{args.backbone}/{args.dataset} train, input {f.input_info['input']}"
        return torch.from_numpy(X), torch.from_numpy(y.astype(np.int64)), read, label
    g = torch.Generator().manual_seed(0)
    X = torch.randn(args.n, 5, args.dim, generator=g)
    y = torch.randint(0, args.classes, (args.n,), generator=g)
    return X, y, None, f"random [{args.n}, 5, {args.dim}] float32"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50, help="training iterations per measured run")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every arm (medians reported)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--cache", default=None, help="a store with the dinov2-linear input kinds")
    ap.add_argument("--backbone", default=None)
    ap.add_argument("--dataset", default=None)
    ap.add_argument(
        "--write-store",
        default=None,
        help="first write random blocks:4 + tokens to this new store, then read it as --cache",
    )
    ap.add_argument(
        "--tokens", type=int, default=256, help="with --write-store: patch tokens per row (ViT-S/14 at 224 px: 256)"
    )
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    import torch

    from featcache.core.protocols import DINOV2_LINEAR
    from featcache.probes.dinov2_linear import head_specs

    torch.set_num_threads(args.threads)
    if args.write_store:
        write_store(args.write_store, args.n, args.dim, args.tokens, args.classes)
        args.cache, args.backbone, args.dataset = args.write_store, "rand", "bench"
    X, y, read_s, source = _inputs(args)
    n_cls = int(y.max()) + 1
    blocks = tuple(b for b in DINOV2_LINEAR.n_last_blocks if b <= X.shape[1] - 1)
    specs = head_specs(blocks, DINOV2_LINEAR.lrs, args.batch)
    featcache_run(X, y, specs, n_cls, 5, args.batch)  # warm-up (allocator, kernels)
    sample = [
        next(s for s in specs if (s.n_blocks, s.avgpool) == v)
        for v in dict.fromkeys((s.n_blocks, s.avgpool) for s in specs)
    ]
    arms = {
        "joint": lambda: featcache_run(X, y, specs, n_cls, args.iters, args.batch),
        "single": lambda: float(np.mean([featcache_run(X, y, [s], n_cls, args.iters, args.batch) for s in sample])),
        "bare": lambda: bare_loop(X, y, specs, n_cls, args.iters, args.batch),
        "stacked": lambda: bare_stacked(X, y, specs, n_cls, args.iters, args.batch),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.reps):  # the arms interleaved, so a change of load hits each alike
        for k, arm in arms.items():
            times[k].append(arm())
    joint, single, bare, stacked = (float(np.median(times[k])) for k in arms)
    per_epoch = X.shape[0] / args.batch  # iterations per pass over the rows
    fig = {
        "source": source,
        "heads": len(specs),
        "iters": args.iters,
        "reps": args.reps,
        "seconds_per_rep": times,
        "batch": args.batch,
        "threads": args.threads,
        "joint_s_per_iter": joint / args.iters,
        "single_head_s_per_iter": single / args.iters,
        "singles_over_joint": single * len(specs) / joint,
        "bare_s_per_iter": bare / args.iters,
        "featcache_over_bare": joint / bare,
        "bare_stacked_s_per_iter": stacked / args.iters,
        "featcache_over_bare_stacked": joint / stacked,
        "featcache_epoch_s": joint / args.iters * per_epoch,
        "bare_epoch_s": bare / args.iters * per_epoch,
        "peak_rss_mib": _peak_rss_mib(),
        "cpu": _cpu(),
        "load": _load(),
    }
    if read_s is not None:
        full = DINOV2_LINEAR.epochs * DINOV2_LINEAR.epoch_length * joint / args.iters
        fig["store_read_s"] = read_s
        fig["store_read_rows_per_s"] = X.shape[0] / read_s
        fig["heads_step_rows_per_s"] = args.batch * args.iters / joint
        fig["read_over_step"] = fig["store_read_rows_per_s"] / fig["heads_step_rows_per_s"]
        fig["default_schedule_train_s"] = full
        fig["read_share_of_default_run"] = read_s / (read_s + full)
    print(
        f"dinov2-linear grid, {source}; {len(specs)} heads, batch {args.batch}, {args.threads} thread(s), "
        f"medians of {args.reps} interleaved runs of {args.iters} iterations"
    )
    print(f"  CPU: {fig['cpu']}; load average: {fig['load']}")
    print(f"  joint pass ({len(specs)} heads): {fig['joint_s_per_iter'] * 1e3:.2f} ms/iter")
    print(
        f"  one head: {fig['single_head_s_per_iter'] * 1e3:.2f} ms/iter (mean of {len(sample)} sampled heads); "
        f"{len(specs)} single-head runs / joint = {fig['singles_over_joint']:.1f}x"
    )
    print(
        f"  bare PyTorch loop (ModuleDict of {len(specs)} nn.Linear, autograd, SGD, cosine): "
        f"{fig['bare_s_per_iter'] * 1e3:.2f} ms/iter; featcache / bare = {fig['featcache_over_bare']:.2f}x "
        f"(target <= 1.2x); per pass over {X.shape[0]} rows: {fig['featcache_epoch_s']:.2f} s vs {fig['bare_epoch_s']:.2f} s"
    )
    print(
        f"  bare stacked loop (per variant one [H, C, d] weight, autograd, momentum by hand): "
        f"{fig['bare_stacked_s_per_iter'] * 1e3:.2f} ms/iter; featcache / bare stacked = "
        f"{fig['featcache_over_bare_stacked']:.2f}x (target <= 1.2x)"
    )
    if read_s is not None:
        print(
            f"  store read (once, tokens streamed to their mean): {read_s:.1f} s, {fig['store_read_rows_per_s']:.0f} rows/s "
            f"vs heads' step {fig['heads_step_rows_per_s']:.0f} rows/s (read / step = {fig['read_over_step']:.2f}x); "
            f"the reference's 12,500 iterations: {full:.0f} s of training, the read {fig['read_share_of_default_run']:.1%} of the run"
        )
    print(f"  peak RSS {fig['peak_rss_mib']:.0f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(fig, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
