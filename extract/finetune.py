"""Fine-tuning runner: the fine-tune side of linear-vs-fine-tune rankings.

Trains the whole backbone plus a new, zero-initialised linear head on images and writes
``kind="finetune"`` rows into the tidy results table (:mod:`featcache.results`) with the
probes' metric names (``top1``, ``top5``, ``mean_per_class``, ``nll``, ``ece``) and the
probes' split and seed definitions (:mod:`featcache.splits`), so each fine-tune row pairs
with the probe row of the same backbone, dataset, protocol, eval split and seed.

Protocols
---------
``vtab1k-light`` (VTAB lightweight fine-tuning, PROTOCOLS.md section 1)
    1,000 stratified training examples per seed: 800 train / 200 val
    (:func:`featcache.splits.vtab1k_indices`, ``val_source="split-800-200"``) or the
    1,000 with the dataset's ``val`` split for selection (``"official-val"``). SGD with
    momentum 0.9, batch 512, no weight decay; lr in {0.1, 0.01} x {2,500, 10,000} steps,
    lr divided by 10 at 1/3, 2/3 and ``last_decay`` (default 0.9, the value the probes'
    ``vtab1k-sgd`` uses; the paper says only "shortly before the end") of the steps.
    The config with the best val top-1 (ties: first in the order steps, then lr) is
    retrained from the same initial weights on all 1,000 and tested once. Seeds 0, 1, 2;
    each seed's rows plus a median row (``seed=-1``). Rows carry ``protocol="vtab1k"``.
``full``
    All of train; selection on the dataset's ``val`` split, or on a stratified, seeded 10%
    of train (:func:`featcache.splits.full_holdout`), then a refit on train+val (or all of
    train) with the selected config. Same optimiser and grid. Rows carry ``protocol="full"``.

Pairing with probes
-------------------
The analysis stage names a task by dataset + protocol + eval split and pairs the
``probe`` and ``finetune`` kinds of one task and backbone. Fine-tune rows therefore carry
the *probe* protocol name in ``protocol`` (``vtab1k`` / ``full``, see :data:`PAIRS_WITH`),
the same ``train_split`` label (``train[1000]``, ``train``, ``train+val``), the same seed,
``shots=-1``, and the backbone key extract would store (``tf_efficientnet_lite0``,
``NAME@random0``...; override with ``backbone_name``). ``hparams`` records
``finetune_protocol`` (``vtab1k-light``) and ``pairs_with``.

Scaled-down runs (CPU)
----------------------
``steps``, ``lrs``, ``batch_size`` and ``input_size`` are options; any departure from the
published values sets ``hparams["scaled"] = true`` and lists them in ``scaled_from``.
A grid with a single config skips the selection run (``selection="single config"``).

Training details
----------------
``model.train()`` throughout training, so BatchNorm batch statistics and running averages
update (Salman et al.: only frozen-feature transfer freezes them) and the model's own
dropout applies. Preprocessing is the backbone's timm eval transform (as in extract; no
augmentation). Batches are full: an endless stream of seeded epoch permutations (epoch
``e`` of seed ``s`` uses ``numpy.random.default_rng([s, e])``), cut into ``batch_size``
slices; ``micro_batch`` splits each into gradient-accumulation chunks (loss scaled by the
full batch; BatchNorm then sees micro-batches). On CUDA the forward runs under bf16
autocast (``precision="auto"``) in channels-last layout; CPU runs in fp32.

Checkpoints and resume
----------------------
Every ``checkpoint_every`` steps and at the end of each training run, model, optimiser,
step and torch RNG state go (atomically) to ``checkpoint_dir/<run key>.pt``; finished
selection runs leave ``<run key>.json`` with their val score; final runs write their rows
to the results table and delete their checkpoint. Re-running the same command resumes:
seeds already in the table are skipped, finished selection runs are read back, and a
killed training run continues from its last checkpoint (logged "resuming ... from
checkpoint"). Data order is a function of (seed, step), so a resumed run sees the same
batches as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import BackboneError, DataError
from featcache.splits import VAL_SOURCES

log = logging.getLogger(__name__)

PROTOCOLS = ("vtab1k-light", "full")
#: fine-tune protocol -> the probe protocol whose rows it pairs with (written to ``protocol``)
PAIRS_WITH = {"vtab1k-light": "vtab1k", "full": "full"}
#: hparams keys the median-over-seeds rows copy from the seeds' rows
MEDIAN_CARRY = ("finetune_protocol", "pairs_with", "scaled", "val_source")
VTAB_STEPS = (2500, 10000)
VTAB_LRS = (0.1, 0.01)
VTAB_BATCH = 512
VTAB_MOMENTUM = 0.9
LAST_DECAY = 0.9
DEFAULT_SEEDS = {"vtab1k-light": (0, 1, 2), "full": (0,)}
DEFAULT_CHECKPOINT_EVERY = 250


# ------------------------------------------------------------------ schedule and batches
@dataclass(frozen=True)
class TrainConfig:
    """One SGD fine-tuning configuration."""

    lr: float
    steps: int
    batch_size: int
    milestones: tuple[int, ...]
    momentum: float = VTAB_MOMENTUM
    weight_decay: float = 0.0
    micro_batch: int | None = None


def milestones_for(steps: int, last_decay: float = LAST_DECAY) -> tuple[int, ...]:
    """Steps at which the lr is divided by 10: 1/3, 2/3 and ``last_decay`` of ``steps``."""
    return tuple(sorted({steps // 3, 2 * steps // 3, int(round(last_decay * steps))}))


def lr_at(step: int, lr: float, milestones: Sequence[int]) -> float:
    """Learning rate of (0-based) ``step``: ``lr * 0.1 ** #{m in milestones: m <= step}``
    (torch ``MultiStepLR`` semantics, as the probes' SGD head)."""
    return lr * 0.1 ** sum(1 for m in milestones if m <= step)


def batch_positions(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Positions (into the ``n`` training rows) of the batch of ``step``.

    The data stream is the concatenation of seeded epoch permutations
    (``default_rng([seed, epoch]).permutation(n)``); step ``s`` takes items
    ``[s * batch_size, (s + 1) * batch_size)`` of it, so every batch is full and the order
    depends only on (seed, step): resuming at any step reproduces the stream exactly.
    """
    start = step * batch_size
    out = []
    need = batch_size
    epoch, off = divmod(start, n)
    while need:
        perm = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
        take = perm[off : off + need]
        out.append(take)
        need -= take.size
        epoch, off = epoch + 1, 0
    return np.concatenate(out)


def make_configs(steps: Sequence[int], lrs: Sequence[float], batch_size: int, *,
                 last_decay: float = LAST_DECAY, momentum: float = VTAB_MOMENTUM,
                 weight_decay: float = 0.0, micro_batch: int | None = None) -> list[TrainConfig]:
    """The selection grid in its tie-break order: for each schedule length, for each lr."""
    return [TrainConfig(lr=float(lr), steps=int(s), batch_size=int(batch_size),
                        milestones=milestones_for(int(s), last_decay), momentum=float(momentum),
                        weight_decay=float(weight_decay), micro_batch=micro_batch)
            for s in steps for lr in lrs]


# ------------------------------------------------------------------ data
@dataclass
class _Split:
    """Rows of one split in canonical (id-sorted) order, labels in the train class order."""

    name: str
    source: Any  # SplitSource
    order: np.ndarray  # canonical position -> source row
    y: np.ndarray
    ids: np.ndarray
    fingerprint: str

    def load(self, pos: int):
        return self.source.load(int(self.order[pos]))


def _prepare_split(src, train_names: list[str]) -> _Split:
    from featcache.splits import canonical_order
    from featcache.store import dataset_fingerprint

    ids = np.asarray(src.ids).astype(str)
    order = canonical_order(ids)
    names = np.asarray(src.class_names, dtype=object)[np.asarray(src.labels)[order]]
    pos = {n: i for i, n in enumerate(train_names)}
    unknown = sorted({str(n) for n in names if n not in pos})
    if unknown:
        raise DataError(f"{src.dataset}/{src.split} has classes {unknown[:10]} that the train split "
                        "does not define; give splits with the same class list")
    y = np.fromiter((pos[n] for n in names), np.int64, count=names.size)
    fp = dataset_fingerprint(ids[order], y, train_names)
    return _Split(src.split, src, order, y, ids[order], fp)


class _Rows:
    """Map-style torch dataset over (split, canonical position) pairs -> (image tensor, label)."""

    def __init__(self, items: list[tuple[_Split, int]], transform):
        self.items = items
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        import torch

        sp, p = self.items[i]
        try:
            img = sp.load(p)
        except Exception as exc:  # a broken file: name it, never train on a placeholder
            raise DataError(f"{sp.source.dataset}/{sp.name}: cannot load image {sp.ids[p]!r}: {exc}; "
                            "fix or remove the file (extract records it as invalid)") from exc
        return self.transform(img), torch.tensor(int(sp.y[p]))


class _Pool:
    """Images a run trains or evaluates on, preprocessed once into a tensor when they fit in
    ``memory_limit`` bytes (float32), else loaded through a DataLoader per batch."""

    def __init__(self, items: list[tuple[_Split, int]], transform, shape, *, memory_limit: float,
                 workers: int, progress: bool, what: str):
        self.items = items
        self.transform = transform
        self.y = np.array([sp.y[p] for sp, p in items], np.int64)
        self.workers = workers
        nbytes = len(items) * int(np.prod(shape)) * 4
        self.X = None
        if nbytes <= memory_limit:
            self.X = self._materialise(shape, progress, what)
        else:
            log.info("%s: %d images (%.1f GB as float32) exceed memory_limit; loading per batch",
                     what, len(items), nbytes / 1e9)

    def _loader(self, batches):
        from torch.utils.data import DataLoader

        return DataLoader(_Rows(self.items, self.transform), batch_sampler=batches,
                          num_workers=self.workers, persistent_workers=False)

    def _materialise(self, shape, progress: bool, what: str):
        import torch
        from tqdm.auto import tqdm

        X = torch.empty((len(self.items), *shape), dtype=torch.float32)
        bs = 256
        batches = [list(range(i, min(i + bs, len(self.items)))) for i in range(0, len(self.items), bs)]
        for b, (x, _) in zip(batches, tqdm(self._loader(batches), total=len(batches),
                                            desc=f"preprocess {what}", disable=not progress)):
            X[b[0] : b[-1] + 1] = x
        return X

    def to(self, device: str) -> _Pool:
        """Move preprocessed images to ``device`` (a GPU then gathers its own batches)."""
        if self.X is not None and device.startswith("cuda"):
            self.X = self.X.to(device)
        return self

    def batches(self, index_lists: Sequence[np.ndarray]):
        """Yield (x, y) tensors for each list of pool positions (on the pool's device when
        preprocessed, else on CPU from the DataLoader)."""
        import torch

        if self.X is not None:
            for idx in index_lists:
                t = torch.from_numpy(np.asarray(idx, np.int64)).to(self.X.device)
                yield self.X[t], torch.from_numpy(self.y[np.asarray(idx)])
        else:
            yield from self._loader([list(map(int, i)) for i in index_lists])


# ------------------------------------------------------------------ model
class _Net:
    """Backbone (pooled features) + linear head as one torch module (built lazily)."""

    @staticmethod
    def build(backbone_model, feature_dim: int, n_classes: int):
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.backbone = backbone_model
                self.head = torch.nn.Linear(feature_dim, n_classes)
                torch.nn.init.zeros_(self.head.weight)
                torch.nn.init.zeros_(self.head.bias)

            def forward(self, x):
                return self.head(self.backbone(x))

        return Net()


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        log.info("no CUDA device: fine-tuning runs on CPU (fp32); use a scaled-down schedule")
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from featcache.errors import BackendUnavailableError

        raise BackendUnavailableError(f"device={device!r} requested but CUDA is not available; "
                                      "use device='cpu' or 'auto'")
    return str(device)


def _resolve_precision(precision: str, device: str) -> str:
    if precision not in ("auto", "fp32", "bf16"):
        raise BackboneError(f"precision must be auto, fp32 or bf16; got {precision!r}")
    if precision == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    return precision


def _autocast(device: str, precision: str):
    import contextlib

    import torch

    if precision == "bf16":
        return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu",
                              dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ checkpoints
def _atomic_torch_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_json(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)


def _key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass
class TrainResult:
    net: Any
    finite: bool
    seconds: float
    resumed_from: int | None = None
    losses: list[float] = field(default_factory=list)


def train_run(
    net,
    init_state: dict,
    pool: _Pool,
    positions: np.ndarray,
    cfg: TrainConfig,
    *,
    seed: int,
    device: str,
    precision: str,
    ckpt_path: Path | None,
    checkpoint_every: int,
    run_key: dict,
    progress: bool = True,
    desc: str = "finetune",
) -> TrainResult:
    """Fine-tune ``net`` (reset to ``init_state``) on pool rows ``positions`` with ``cfg``.

    Resumes from ``ckpt_path`` when it holds a checkpoint of the same ``run_key``.
    """
    import torch

    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):  # the caller's RNG state is left untouched
        return _train_run(net, init_state, pool, positions, cfg, seed=seed, device=device,
                          precision=precision, ckpt_path=ckpt_path,
                          checkpoint_every=checkpoint_every, run_key=run_key, progress=progress,
                          desc=desc)


def _train_run(net, init_state, pool, positions, cfg, *, seed, device, precision, ckpt_path,
               checkpoint_every, run_key, progress, desc) -> TrainResult:
    import torch
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    net.load_state_dict(init_state)
    net.to(device)
    if device.startswith("cuda"):
        net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    torch.manual_seed(int(hashlib.sha256(json.dumps(run_key, sort_keys=True, default=str).encode())
                          .hexdigest()[:8], 16))
    start, finite, resumed = 0, True, None
    losses: list[float] = []
    if ckpt_path is not None and ckpt_path.exists():
        try:
            ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # unreadable leftovers: start over, never crash on them
            log.warning("ignoring unreadable checkpoint %s (%s); training from step 0", ckpt_path, exc)
            ck = None
        if ck is not None and ck.get("key") == run_key:
            net.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            torch.set_rng_state(ck["rng"])
            if device.startswith("cuda") and ck.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(ck["cuda_rng"])
            start, finite, resumed = int(ck["step"]), bool(ck["finite"]), int(ck["step"])
            losses = list(ck.get("losses", []))
            log.info("resuming %s from checkpoint %s at step %d/%d", desc, ckpt_path, start, cfg.steps)
        elif ck is not None:
            log.warning("checkpoint %s belongs to another run definition; training from step 0",
                        ckpt_path)

    def save(step: int) -> None:
        if ckpt_path is None:
            return
        _atomic_torch_save({
            "key": run_key, "step": step, "finite": finite, "model": net.state_dict(),
            "optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "losses": losses,
            "cuda_rng": torch.cuda.get_rng_state() if device.startswith("cuda") else None,
        }, ckpt_path)
        log.info("checkpoint saved: %s step %d/%d -> %s", desc, step, cfg.steps, ckpt_path)

    n = positions.size
    B = cfg.batch_size
    mb = cfg.micro_batch or B
    net.train()  # BatchNorm statistics update during fine-tuning
    bar = tqdm(total=cfg.steps, initial=start, desc=desc, disable=not progress)
    step = start
    while step < cfg.steps and finite:
        stop = cfg.steps if ckpt_path is None else min(cfg.steps, (step // checkpoint_every + 1) * checkpoint_every)
        idx_lists = [positions[batch_positions(n, B, seed, s)] for s in range(step, stop)]
        chunks = [c for idx in idx_lists for c in np.array_split(idx, math.ceil(B / mb))]
        it = pool.batches(chunks)
        for s in range(step, stop):
            for g in opt.param_groups:
                g["lr"] = lr_at(s, cfg.lr, cfg.milestones)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(math.ceil(B / mb)):
                x, y = next(it)
                x = x.to(device, non_blocking=True)
                if device.startswith("cuda"):
                    x = x.contiguous(memory_format=torch.channels_last)
                y = y.to(device, non_blocking=True)
                with _autocast(device, precision):
                    logits = net(x)
                loss = torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum") / B
                loss.backward()
                total += float(loss.detach())
            if not math.isfinite(total):
                finite = False
                log.warning("%s diverged at step %d (lr=%g): loss %s", desc, s, cfg.lr, total)
                step = s + 1
                break
            opt.step()
            losses.append(total)
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", refresh=False)
            step = s + 1
        if step < cfg.steps and finite:
            save(step)
    bar.close()
    save(step)  # end of training: a kill before the rows are written skips retraining
    return TrainResult(net, finite, time.perf_counter() - t0, resumed, losses)


def predict_proba(net, pool: _Pool, positions: np.ndarray, *, device: str, precision: str,
                  batch_size: int = 256) -> np.ndarray:
    """Softmax probabilities ``[N, K]`` (float64) of ``net`` in eval mode."""
    import torch

    net.eval()
    out = []
    chunks = [positions[i : i + batch_size] for i in range(0, positions.size, batch_size)]
    with torch.inference_mode():
        for x, _ in pool.batches(chunks):
            x = x.to(device)
            if device.startswith("cuda"):
                x = x.contiguous(memory_format=torch.channels_last)
            with _autocast(device, precision):
                logits = net(x)
            out.append(torch.softmax(logits.float(), dim=1).double().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))


# ------------------------------------------------------------------ plans
@dataclass
class Plan:
    """What one seed trains, selects and refits on (pool positions)."""

    tr: np.ndarray
    va: np.ndarray
    fin: np.ndarray
    train_split: str
    info: dict[str, Any]


def make_plan(protocol: str, seed: int, train: _Split, val: _Split | None, val_source: str,
              offset_val: int) -> Plan:
    """Seeded split of ``protocol`` (identical to the probes' plan; see :mod:`featcache.splits`).

    Pool positions: train rows are ``0..n_train-1``, val rows ``offset_val + i``.
    """
    from featcache import splits as S

    y = train.y
    if protocol == "vtab1k-light":
        if val_source not in VAL_SOURCES:
            raise DataError(f"val_source must be one of {VAL_SOURCES}, got {val_source!r}")
        label = f"{train.name}[{S.VTAB_TOTAL}]"
        if val_source == "official-val":
            if val is None:
                raise DataError("val_source='official-val' needs a 'val' split in the dataset; "
                                "use val_source='split-800-200'")
            idx = S.stratified_sample(y, S.VTAB_TOTAL, seed)
            return Plan(idx, offset_val + np.arange(val.y.size), idx, label,
                        {"val": "official", "val_split": val.name, "val_source": val_source})
        t, v = S.vtab1k_indices(y, seed)
        return Plan(t, v, np.sort(np.concatenate([t, v])), label,
                    {"val": "split-800-200", "val_source": val_source})
    if protocol == "full":
        allidx = np.arange(y.size)
        if val is not None:
            va = offset_val + np.arange(val.y.size)
            return Plan(allidx, va, np.concatenate([allidx, va]), f"{train.name}+{val.name}",
                        {"val": "official", "val_split": val.name})
        t, v = S.full_holdout(y, seed)
        return Plan(t, v, allidx, train.name,
                    {"val": f"holdout-{S.HOLDOUT_FRACTION:.0%}-of-{train.name}"})
    raise DataError(f"unknown fine-tuning protocol {protocol!r}; choose one of {PROTOCOLS}")


# ------------------------------------------------------------------ main entry
def _as_tuple(v, cast) -> tuple:
    if isinstance(v, (int, float, str)):
        v = str(v).split(",") if isinstance(v, str) else [v]
    return tuple(cast(x) for x in v)


def finetune(
    model: str,
    weights: str,
    data: str,
    protocol: str = "vtab1k-light",
    seeds: Sequence[int] | None = None,
    results_path: str | os.PathLike | None = None,
    *,
    steps: int | Sequence[int] = VTAB_STEPS,
    lrs: float | Sequence[float] = VTAB_LRS,
    batch_size: int = VTAB_BATCH,
    micro_batch: int | None = None,
    last_decay: float = LAST_DECAY,
    momentum: float = VTAB_MOMENTUM,
    weight_decay: float = 0.0,
    input_size: int | None = None,
    pre_resize: int | None = None,
    device: str = "auto",
    precision: str = "auto",
    eval_splits: str | Sequence[str] = ("test",),
    train_split: str = "train",
    val_split: str = "val",
    val_source: str = "split-800-200",
    dataset_name: str | None = None,
    backbone_name: str | None = None,
    limit: int | dict[str, int] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    workers: int = 0,
    memory_limit_gb: float = 4.0,
    force: bool = False,
    progress: bool = True,
):
    """Fine-tune ``model`` (timm name) with ``weights`` on data spec ``data``; returns the
    ``kind="finetune"`` rows of these runs (polars DataFrame in the results schema).

    ``protocol``: ``vtab1k-light`` or ``full``. ``seeds``: default (0, 1, 2) for
    vtab1k-light, (0,) for full. ``results_path``: parquet to append to (``None``: nothing is
    written and nothing resumes); seeds already in it are skipped unless ``force``.
    ``steps``/``lrs``/``batch_size``: the selection grid (published values by default; other
    values are recorded as a scaled-down protocol). ``micro_batch``: gradient accumulation
    chunk. ``checkpoint_dir``: default ``<results_path>.finetune-ckpt`` (none without a
    results path). ``limit``: first N rows of each split (or ``{split: N}``), as extract.
    """
    import polars as pl
    import torch

    from featcache.extract.backbones import create_backbone
    from featcache.extract.data import default_name, open_dataset
    from featcache.metrics import compute_all
    from featcache.results import (
        add_median_rows,
        append_results,
        existing_run_ids,
        make_run_id,
        read_results,
        rows_to_frame,
    )

    if protocol not in PROTOCOLS:
        raise DataError(f"unknown fine-tuning protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    steps_t = _as_tuple(steps, int)
    lrs_t = _as_tuple(lrs, float)
    if not steps_t or min(steps_t) < 1:
        raise DataError(f"steps must be positive integers, got {steps!r}")
    if not lrs_t or min(lrs_t) <= 0:
        raise DataError(f"learning rates must be positive, got {lrs!r}")
    if batch_size < 1 or (micro_batch is not None and not 1 <= micro_batch <= batch_size):
        raise DataError(f"need batch_size >= 1 and 1 <= micro_batch <= batch_size; got "
                        f"{batch_size} and {micro_batch}")
    if not 0 < last_decay < 1:
        raise DataError(f"last_decay must lie in (0, 1) (a fraction of the steps), got {last_decay}")
    if checkpoint_every < 1:
        raise DataError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    seeds_t = tuple(DEFAULT_SEEDS[protocol] if seeds is None else _as_tuple(seeds, int))
    if not seeds_t:
        raise DataError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
    eval_splits = [eval_splits] if isinstance(eval_splits, str) else list(eval_splits)

    dev = _resolve_device(device)
    if dev == "cpu":  # training allocates the same large activations every step
        from featcache.allocator import tune_cpu_allocator

        tune_cpu_allocator()
    prec = _resolve_precision(precision, dev)
    if prec == "bf16" and not dev.startswith("cuda"):
        log.info("bf16 autocast requested on CPU")

    # ---- data: canonical order, class order of the train split
    dname = dataset_name or default_name(data)
    splits = open_dataset(data, dname)
    if limit is not None:
        lim = limit if isinstance(limit, dict) else {s: int(limit) for s in splits}
        splits = {s: (src.subset(int(lim[s])) if s in lim else src) for s, src in splits.items()}
    if train_split not in splits:
        raise DataError(f"{data} has no split {train_split!r}; it has {sorted(splits)}")
    for es in eval_splits:
        if es not in splits:
            raise DataError(f"{data} has no split {es!r} to evaluate on (has {sorted(splits)}); "
                            "pass --eval-split with one of them")
    names = list(splits[train_split].class_names)
    tr = _prepare_split(splits[train_split], names)
    use_val = val_split in splits and not (protocol == "vtab1k-light" and val_source == "split-800-200")
    va = _prepare_split(splits[val_split], names) if use_val else None
    evs = {es: _prepare_split(splits[es], names) for es in eval_splits}
    for es, ev in evs.items():
        for other in [tr] + ([va] if va is not None else []):
            both = np.intersect1d(other.ids, ev.ids)
            if both.size:
                raise DataError(f"{both.size} sample ids occur in both {other.name!r} and {es!r} "
                                f"(e.g. {both[0]!r}); evaluating on training images is invalid")
    if np.unique(tr.y).size < 2:
        raise DataError(f"{dname}/{train_split} holds a single class; fine-tuning needs at least two")

    # ---- seeded plans (before the backbone loads: too little data fails fast)
    offset_val = tr.y.size
    plans = {s: make_plan(protocol, s, tr, va, val_source, offset_val) for s in seeds_t}

    # ---- backbone
    bb = create_backbone(model, weights, device="cpu", input_size=input_size,
                         pre_resize=pre_resize, trainable=True)
    bkey = backbone_name or bb.default_key
    net = _Net.build(bb.model, bb.feature_dim, len(names))
    init_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    shape = tuple(int(s) for s in bb.data_config["input_size"])
    cfgs = make_configs(steps_t, lrs_t, batch_size, last_decay=last_decay, momentum=momentum,
                        weight_decay=weight_decay, micro_batch=micro_batch)
    scaled_from = {k: ref for k, v, ref in (("steps", steps_t, VTAB_STEPS), ("lrs", lrs_t, VTAB_LRS),
                                             ("batch_size", batch_size, VTAB_BATCH),
                                             ("momentum", momentum, VTAB_MOMENTUM),
                                             ("weight_decay", weight_decay, 0.0)) if v != ref}
    if input_size is not None and input_size != 224:
        scaled_from["input_size"] = 224

    # ---- plans, pools
    options = dict(
        finetune_protocol=protocol, weights=weights, weights_sha256=bb.weights_sha256, model=model,
        steps=list(steps_t), lrs=list(lrs_t), batch_size=batch_size, micro_batch=micro_batch,
        last_decay=last_decay, momentum=momentum, weight_decay=weight_decay,
        data_config=_jsonable(bb.data_config), train_split=train_split, precision=prec,
        val_source=val_source if protocol == "vtab1k-light" else None, limit=limit,
    )
    fps = {tr.name: tr.fingerprint, **({va.name: va.fingerprint} if va else {}),
           **{es: ev.fingerprint for es, ev in evs.items()}}
    row_proto = PAIRS_WITH[protocol]
    run_ids = {}
    for s in seeds_t:
        for es in eval_splits:
            fp = "images:" + _combine(tr.fingerprint, va.fingerprint if va else "", evs[es].fingerprint)
            run_ids[(s, es)] = (make_run_id(kind="finetune", backbone=bkey, dataset=dname,
                                            protocol=row_proto, seed=s, eval_split=es,
                                            options=options, store_fingerprint=fp), fp)
    done = existing_run_ids(results_path) if results_path is not None and not force else set()
    todo = [s for s in seeds_t if not all(run_ids[(s, es)][0] in done for es in eval_splits)]
    for s in seeds_t:
        if s not in todo:
            log.info("skip %s/%s %s seed %d: already in %s (force=True reruns)", bkey, dname,
                     protocol, s, results_path)

    ckdir = None
    if checkpoint_dir is not None:
        ckdir = Path(checkpoint_dir)
    elif results_path is not None:
        ckdir = Path(f"{results_path}.finetune-ckpt")
    if ckdir is not None and todo:
        ckdir.mkdir(parents=True, exist_ok=True)

    new_rows: list[dict] = []
    if todo:
        items: list[tuple[_Split, int]] = [(tr, i) for i in range(tr.y.size)]
        if va is not None:
            items += [(va, i) for i in range(va.y.size)]
        need = np.unique(np.concatenate([np.concatenate([plans[s].tr, plans[s].va, plans[s].fin])
                                         for s in todo]))
        # pool over the rows any seed uses; plan positions are mapped into it
        pos_in_pool = np.full(len(items), -1, np.int64)
        pos_in_pool[need] = np.arange(need.size)
        limit_bytes = memory_limit_gb * 2**30
        pool = _Pool([items[i] for i in need], bb.transform, shape, memory_limit=limit_bytes,
                     workers=workers, progress=progress, what=f"{dname} train").to(dev)
        eval_pools = {es: _Pool([(ev, i) for i in range(ev.y.size)], bb.transform, shape,
                                memory_limit=limit_bytes, workers=workers, progress=progress,
                                what=f"{dname}/{es}") for es, ev in evs.items()}
        base_key = dict(options, backbone=bkey, dataset=dname, fingerprints=fps)
        for s in todo:
            plan = plans[s]
            cands = []
            ptr, pva, pfin = pos_in_pool[plan.tr], pos_in_pool[plan.va], pos_in_pool[plan.fin]
            if len(cfgs) == 1:
                best = 0
                cands.append(dict(lr=cfgs[0].lr, steps=cfgs[0].steps, val_top1=None))
            else:
                for ci, cfg in enumerate(cfgs):
                    key = dict(base_key, phase="select", seed=s, cfg=asdict(cfg),
                               rows=_hash_idx(plan.tr))
                    kh = _key_hash(key)
                    outcome = ckdir / f"{kh}.json" if ckdir is not None else None
                    if outcome is not None and outcome.exists() and not force:
                        rec = json.loads(outcome.read_text())
                        log.info("seed %d config %d/%d (lr=%g, steps=%d): finished earlier, "
                                 "val top1 %.4f", s, ci + 1, len(cfgs), cfg.lr, cfg.steps, rec["val_top1"])
                    else:
                        ck = ckdir / f"{kh}.pt" if ckdir is not None else None
                        if force and ck is not None and ck.exists():
                            ck.unlink()
                        res = train_run(net, init_state, pool, ptr, cfg, seed=s, device=dev,
                                        precision=prec, ckpt_path=ck, checkpoint_every=checkpoint_every,
                                        run_key=key, progress=progress,
                                        desc=f"{bkey} seed {s} select lr={cfg.lr:g} steps={cfg.steps}")
                        score = -1.0
                        if res.finite:
                            P = predict_proba(net, pool, pva, device=dev, precision=prec)
                            score = float(np.mean(P.argmax(1) == pool.y[pva]))
                        rec = {"val_top1": score, "finite": res.finite, "seconds": res.seconds}
                        if outcome is not None:
                            _atomic_json(rec, outcome)
                            if ck is not None and ck.exists():
                                ck.unlink()
                        log.info("seed %d config %d/%d (lr=%g, steps=%d): val top1 %.4f", s, ci + 1,
                                 len(cfgs), cfg.lr, cfg.steps, score)
                    cands.append(dict(lr=cfg.lr, steps=cfg.steps, val_top1=rec["val_top1"],
                                      finite=rec["finite"], seconds=rec.get("seconds")))
                scores = np.array([c["val_top1"] for c in cands], np.float64)
                best = int(np.flatnonzero(scores == scores.max())[0])
            cfg = cfgs[best]
            key = dict(base_key, phase="final", seed=s, cfg=asdict(cfg), rows=_hash_idx(plan.fin))
            ck = ckdir / f"{_key_hash(key)}.pt" if ckdir is not None else None
            if force and ck is not None and ck.exists():
                ck.unlink()
            res = train_run(net, init_state, pool, pfin, cfg, seed=s, device=dev, precision=prec,
                            ckpt_path=ck, checkpoint_every=checkpoint_every, run_key=key,
                            progress=progress, desc=f"{bkey} seed {s} final lr={cfg.lr:g} steps={cfg.steps}")
            secs = res.seconds + sum(c.get("seconds") or 0.0 for c in cands)
            hp = dict(options)
            hp.update(plan.info)
            hp.update(
                pairs_with={"kind": "probe", "protocol": row_proto,
                            "keys": ["backbone", "dataset", "protocol", "eval_split", "seed", "metric"]},
                lr=cfg.lr, steps=cfg.steps, milestones=list(cfg.milestones),
                selection=("single config" if len(cfgs) == 1
                           else "val top1 (ties: first config, order steps then lr)"),
                val_top1=cands[best]["val_top1"], candidates=cands, n_train=int(plan.tr.size),
                n_val=int(plan.va.size), n_train_final=int(plan.fin.size),
                scaled=bool(scaled_from), scaled_from=scaled_from,
                reference="VTAB lightweight: SGD m=0.9, batch 512, lr {0.1,0.01} x {2500,10000} steps",
                head_init="zeros", augmentation="none (timm eval transform)",
                batchnorm="train mode: batch statistics and running averages update",
                drop_rate=float(getattr(bb.model, "drop_rate", 0.0) or 0.0),
                data_order="full batches from seeded epoch permutations",
                device=dev, dataset_fingerprints=fps, final_loss=res.losses[-1] if res.losses else None,
            )
            for es, ev in evs.items():
                epool = eval_pools[es]
                if res.finite:
                    P = predict_proba(net, epool, np.arange(ev.y.size), device=dev, precision=prec)
                    vals = compute_all(ev.y, P)
                else:
                    vals = {m: float("nan") for m in ("top1", "top5", "mean_per_class", "nll", "ece")
                            if m != "top5" or len(names) > 5}
                rid, fp = run_ids[(s, es)]
                for m, v in vals.items():
                    new_rows.append(dict(
                        run_id=rid, kind="finetune", backbone=bkey, dataset=dname,
                        protocol=row_proto, train_split=plan.train_split, eval_split=es, shots=-1,
                        seed=s, metric=m, value=float(v), n_eval=int(ev.y.size), hparams=hp,
                        converged=bool(res.finite), fit_seconds=float(secs), store_fingerprint=fp))
                log.info("finetune %s %s %s seed %d %s: top1=%.4f (lr=%g, steps=%d)", bkey, dname,
                         protocol, s, es, vals.get("top1", float("nan")), cfg.lr, cfg.steps)
            if results_path is not None:  # rows of each finished seed are safe at once
                append_results(results_path, rows_to_frame([r for r in new_rows if r["seed"] == s]),
                               replace_runs=True)
            if ck is not None and ck.exists():
                ck.unlink()
            if ckdir is not None:  # selection outcomes of this seed are no longer needed
                for c in cfgs:
                    k = dict(base_key, phase="select", seed=s, cfg=asdict(c), rows=_hash_idx(plan.tr))
                    (ckdir / f"{_key_hash(k)}.json").unlink(missing_ok=True)
        del pool, eval_pools
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()

    wanted = [r for r, _ in run_ids.values()]
    if results_path is not None and Path(results_path).exists():
        out = read_results(results_path).filter(pl.col("run_id").is_in(wanted))
    else:
        out = rows_to_frame(new_rows)
    if len(seeds_t) >= 2 and out.height:
        out = add_median_rows(out, "finetune", results_path, carry=MEDIAN_CARRY)
    return out


def median_rows(frame, make_run_id) -> list[dict]:
    """VTAB reporting: per backbone, dataset, protocol, eval split and metric, the median
    over seeds (``seed=-1``), as the probes do (:func:`featcache.results.median_rows`)."""
    from featcache.results import median_rows as _median_rows

    return _median_rows(frame, "finetune", MEDIAN_CARRY, run_id=make_run_id)


def _combine(*fps: str) -> str:
    return hashlib.sha256("|".join(fps).encode()).hexdigest()[:16]


def _hash_idx(idx: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(idx, "<i8").tobytes()).hexdigest()[:16]


def _jsonable(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


__all__ = [
    "PROTOCOLS",
    "PAIRS_WITH",
    "TrainConfig",
    "finetune",
    "make_configs",
    "make_plan",
    "milestones_for",
    "lr_at",
    "batch_positions",
    "median_rows",
]
