"""The per-split extraction loop: DataLoader -> forward -> chunk buffers -> background writer."""

from __future__ import annotations

import functools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featcache.extract.batching import BackgroundWriter, BatchSampler, ImageRows, collate

log = logging.getLogger(__name__)


@dataclass
class SplitReport:
    """What one split's extraction did."""

    backbone: str
    dataset: str
    split: str
    n: int
    chunks_total: int
    chunks_computed: int
    n_invalid: int
    seconds: float
    images_per_s: float | None
    skipped: bool = False
    failures: list[tuple[str, str]] = field(default_factory=list)
    #: seconds of ``seconds`` spent building the backend (an engine's export, a compile)
    startup_s: float = 0.0


def _loader(src, bb, writer, chunks: list[int], cfg, workers: int):
    """(DataLoader over this rank's chunks, the fast preprocessing or None)."""
    from torch.utils.data import DataLoader

    from featcache.data.preprocess import split_transform

    cuda = bb.device.startswith("cuda")
    shape = tuple(bb.data_config["input_size"])
    collate_fn: Any = functools.partial(collate, channels_last=cfg.channels_last and not cuda, fast=None)
    if "dense_group" in src.extra:  # a dense group (featcache.extract.dense): normalised rows + targets
        from featcache.extract.dense import DenseImageRows, dense_collate

        fast, collate_fn = None, dense_collate
        ds = DenseImageRows(src, src.extra["dense_group"], shape)  # pyright: ignore[reportArgumentType]
    elif "view" in src.extra:  # an augmented view (featcache.extract.views): seeded per row
        from featcache.extract.views import ViewRows

        fast = src.extra["view"]
        ds = ViewRows(src, fast, shape)
    else:
        fast = split_transform(bb.transform)
        ds = ImageRows(src, bb.transform, shape, fast)
    if chunks:
        # open the source once in this process (e.g. decompress an IDX file, open a shard) so
        # forked workers inherit it instead of each redoing it; a broken first image is fine
        ds[writer.chunk_range(chunks[0])[0]]
    loader = DataLoader(
        ds,  # pyright: ignore[reportArgumentType]  # any len/getitem object works; torch types it as Dataset
        batch_sampler=BatchSampler(chunks, writer.chunk_rows, len(src), cfg.batch_size),
        num_workers=workers,
        collate_fn=collate_fn if fast is None else functools.partial(collate_fn, fast=None if cuda else fast),
        pin_memory=cuda,
        prefetch_factor=4 if workers > 0 else None,
        persistent_workers=False,
    )
    return loader, fast


def run_split(src, bb, fwd, writer, chunks: list[int], cfg, workers: int, amp_mode: str, rank: int) -> SplitReport:
    """Compute and write this rank's ``chunks`` of one split (``cfg``: the
    :class:`~featcache.extract.config.ExtractConfig`); unreadable images become invalid rows."""
    import torch

    channels_last = cfg.channels_last
    dev = bb.device
    cuda = dev.startswith("cuda")
    loader, fast = _loader(src, bb, writer, chunks, cfg, workers)
    n_rows = sum(writer.chunk_range(c)[1] - writer.chunk_range(c)[0] for c in chunks)
    bar = None
    if cfg.progress and rank == 0:
        from featcache.core.progress import tqdm

        bar = tqdm(total=n_rows, unit="img", desc=f"{writer.backbone} {src.dataset}/{src.split}", smoothing=0.1)
    bg = BackgroundWriter(writer, enabled=cfg.write)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp_mode)
    failures: list[tuple[str, str]] = []
    buf: dict[str, Any] = {}  # "f": {kind: [arrays]}, "ok": [arrays], "err": [lists]
    cur = None
    t_built = getattr(fwd, "stats", {}).get("build_s")  # built before this split (not in its time)
    t0 = time.perf_counter()

    def flush():
        feats = {k: np.concatenate(v) for k, v in buf["f"].items()}
        bg.put(cur, feats, np.concatenate(buf["ok"]), functools.reduce(operator.iadd, buf["err"], []))

    try:
        with torch.inference_mode():
            for batch in loader:
                rows, x, ok, errs = batch[:4]
                targets = batch[4] if len(batch) > 4 else {}  # a dense group's targets, numpy
                c = int(rows[0]) // writer.chunk_rows
                if cur is not None and c != cur:
                    flush()
                    buf = {}
                cur = c
                x = x.to(dev, non_blocking=cuda)
                if cuda and fast is not None:  # uint8 batch uploaded; normalised on the GPU
                    x = fast.normalize(x, channels_last)
                elif channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with torch.autocast("cuda" if cuda else "cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                    out = fwd(x)
                okn = ok.numpy()
                if not buf:
                    buf = {"f": {k: [] for k in out}, "ok": [], "err": []}
                    buf["f"].update({k: [] for k in targets})
                for k, v in out.items():
                    buf["f"][k].append(v.float().cpu().numpy())
                for k, v in targets.items():
                    buf["f"][k].append(v)
                buf["ok"].append(okn)
                buf["err"].append(list(errs))
                for r, e in zip(rows.tolist(), errs):
                    if e:
                        failures.append((str(src.ids[r]), e))
                if bar is not None:
                    bar.update(len(rows))
            if buf:
                flush()
    finally:
        bg.close()
        if bar is not None:
            bar.close()
    rep = _report(src, writer, chunks, n_rows, failures, time.perf_counter() - t0)
    rep.startup_s = float(getattr(fwd, "stats", {}).get("build_s", 0.0)) if t_built is None else 0.0
    return rep


def _report(src, writer, chunks, n_rows: int, failures: list[tuple[str, str]], secs: float) -> SplitReport:
    ips = n_rows / secs if secs > 0 else None
    for sid, err in failures[:20]:
        log.warning("unreadable image %s: %s", sid, err)
    if len(failures) > 20:
        log.warning("... and %d more unreadable images", len(failures) - 20)
    log.info(
        "%s %s/%s: %d rows in %d chunk(s), %d unreadable (valid=False, error text stored)",
        writer.backbone,
        src.dataset,
        src.split,
        n_rows,
        len(chunks),
        len(failures),
    )
    return SplitReport(
        writer.backbone,
        src.dataset,
        src.split,
        len(src),
        writer.n_chunks,
        len(chunks),
        len(failures),
        secs,
        ips,
        failures=failures,
    )
