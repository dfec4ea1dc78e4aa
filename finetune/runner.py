"""Fine-tuning runner: the fine-tune side of linear-vs-fine-tune rankings.

Trains the whole backbone plus a new, zero-initialised linear head on images and writes
``kind="finetune"`` rows into the tidy results table (:mod:`featcache.core.results`) with the
probes' metric names (``top1``, ``top5``, ``mean_per_class``, ``nll``, ``ece``) and the
probes' split plans and seeds (:mod:`featcache.core.protocols`), so each fine-tune row pairs
with the probe row of the same backbone, dataset, protocol, eval split and seed.

Protocols
---------
``vtab1k-light`` (VTAB lightweight fine-tuning, Zhai et al.'s VTAB paper; docs/protocols.md, VTAB)
    VTAB's fixed 1,000 training examples, the same for every seed (seeds vary only the
    training randomness): the first 800 of train and the first 200 of the val source in
    the dataset's own order, the reader's row order = the store's
    (:func:`featcache.core.splits.vtab1k_fixed`; ``val_source="split-800-200"``: train[800:1000];
    ``"official-val"``: val[:200]). SGD with
    momentum 0.9, batch 512, no weight decay; lr in {0.1, 0.01} x {2,500, 10,000} steps,
    lr divided by 10 at 1/3, 2/3 and ``last_decay`` (default 0.9, the value the probes'
    ``vtab1k-sgd`` uses; the paper says only "shortly before the end") of the steps.
    The config with the best val top-1 (ties: first in the order steps, then lr) is
    retrained from the same initial weights on all 1,000 and tested once. Seeds 0, 1, 2;
    each seed's rows plus a median row (``seed=-1``). Rows carry ``protocol="vtab1k-sgd"``.
``full``
    All of train; selection on the dataset's ``val`` split, or on a stratified, seeded 10%
    of train (:func:`featcache.core.splits.full_holdout`), then a refit on train+val (or all of
    train) with the selected config. Same optimiser and grid. Rows carry ``protocol="full"``.

Pairing with probes
-------------------
The analysis stage names a task by dataset + protocol + eval split and pairs the
``probe`` and ``finetune`` kinds of one task and backbone. Fine-tune rows therefore carry
the *probe* protocol name in ``protocol`` (``vtab1k-sgd`` / ``full``: ``Protocol.pairs_with``),
the same ``train_split`` label (``train[:1000]``, ``train``, ``train+val``), the same seed,
``shots=-1``, and the backbone key extract would store (``tf_efficientnet_lite0``,
``NAME@random0``...; override with ``backbone_name``). ``hparams`` records
``finetune_protocol`` (``vtab1k-light``) and ``pairs_with``.

Scaled-down runs (CPU)
----------------------
``steps``, ``lrs``, ``batch_size`` and ``input_size`` are :class:`FinetuneConfig` fields; any departure from the
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
autocast (``precision="auto"``) in channels-last layout; CPU runs in fp32 unless
``precision="bf16"`` on a CPU with bf16 hardware (the run id then records the CPU ISA).

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from featcache.core.protocols import Protocol, SplitPlan, get_protocol
from featcache.core.stagerun import check_disjoint, check_two_classes, collect, finished, pending, write_rows
from featcache.errors import DataError
from featcache.finetune.config import FinetuneConfig
from featcache.finetune.data import Pool, Split, prepare_split
from featcache.finetune.schedule import TrainConfig, make_configs
from featcache.finetune.train import (
    Net,
    atomic_json,
    eval_batch_size,
    key_hash,
    predict_proba,
    resolve_device,
    resolve_precision,
    train_run,
)
from featcache.store import combine_fingerprints

if TYPE_CHECKING:
    import polars as pl

__all__ = ["finetune", "make_plan"]

log = logging.getLogger(__name__)

METRIC_NAMES = ("top1", "top5", "mean_per_class", "nll", "ece")


# ------------------------------------------------------------------ plans
def make_plan(protocol: str | Protocol, seed: int, train: Split, val: Split | None, val_source: str) -> SplitPlan:
    """Seeded split of a fine-tune ``protocol`` (:meth:`featcache.core.protocols.Protocol.plan`,
    the paired probe protocol's plan). Positions: train rows ``0..n_train-1``, then the val
    rows (``n_train + i``), as in the training pool."""
    proto = protocol if isinstance(protocol, Protocol) else get_protocol(protocol, "finetune")
    return proto.plan(
        train.y,
        seed,
        n_val=None if val is None else val.y.size,
        val_source=val_source,
        train_name=train.name,
        val_name="val" if val is None else val.name,
        rows=train.order,
        val_rows=None if val is None else val.order,
    )


@dataclass
class _Data:
    """The dataset a run reads: splits in canonical order, labels in the train class order."""

    name: str
    train: Split
    val: Split | None
    evals: dict[str, Split]
    class_names: list[str]

    def fingerprints(self) -> dict[str, str]:
        return {
            self.train.name: self.train.fingerprint,
            **({self.val.name: self.val.fingerprint} if self.val else {}),
            **{es: ev.fingerprint for es, ev in self.evals.items()},
        }


def _open_data(cfg: FinetuneConfig, proto: Protocol) -> _Data:
    from featcache.data import default_name, open_dataset

    dname = cfg.dataset_name or default_name(cfg.data)
    splits = open_dataset(cfg.data, dname)
    if cfg.limit is not None:
        lim = cfg.limit if isinstance(cfg.limit, dict) else {s: int(cfg.limit) for s in splits}
        splits = {s: (src.subset(int(lim[s])) if s in lim else src) for s, src in splits.items()}
    if cfg.train_split not in splits:
        raise DataError(f"{cfg.data} has no split {cfg.train_split!r}; it has {sorted(splits)}")
    for es in cfg.eval_splits:
        if es not in splits:
            raise DataError(
                f"{cfg.data} has no split {es!r} to evaluate on (has {sorted(splits)}); "
                "pass --eval-split with one of them"
            )
    names = list(splits[cfg.train_split].class_names)
    tr = prepare_split(splits[cfg.train_split], names)
    use_val = cfg.val_split in splits and proto.uses_val_split(cfg.val_source)
    va = prepare_split(splits[cfg.val_split], names) if use_val else None
    evs = {es: prepare_split(splits[es], names) for es in cfg.eval_splits}
    for es, ev in evs.items():
        for other in [tr] + ([va] if va is not None else []):
            check_disjoint(other.name, other.ids, es, ev.ids)
    check_two_classes(tr.y, f"{dname}/{cfg.train_split}", "fine-tuning")
    return _Data(dname, tr, va, evs, names)


# ------------------------------------------------------------------ one run's state
@dataclass
class _Run:
    """Everything the per-seed steps share: config, model, pools, grid, checkpoints."""

    cfg: FinetuneConfig
    proto: Protocol
    data: _Data
    bkey: str
    net: Any
    init_state: dict
    grid: list[TrainConfig]
    options: dict[str, Any]
    scaled_from: dict[str, Any]
    device: str
    precision: str
    ckdir: Path | None
    drop_rate: float
    pool: Pool | None = None
    pos_in_pool: np.ndarray | None = None
    eval_pools: dict[str, Pool] | None = None
    transform: Any = None  # the backbone's eval transform
    shape: tuple[int, ...] = ()  # its input shape (C, H, W)

    @property
    def base_key(self) -> dict[str, Any]:
        return dict(self.options, backbone=self.bkey, dataset=self.data.name, fingerprints=self.data.fingerprints())

    def key(self, phase: str, seed: int, c: TrainConfig, rows: np.ndarray) -> dict[str, Any]:
        return dict(self.base_key, phase=phase, seed=seed, cfg=asdict(c), rows=_hash_idx(rows))

    def train(self, positions: np.ndarray, c: TrainConfig, seed: int, key: dict, ck: Path | None, desc: str):
        # _make_pools runs before any training
        assert self.pool is not None
        assert self.pos_in_pool is not None
        return train_run(
            self.net,
            self.init_state,
            self.pool,
            self.pos_in_pool[positions],
            c,
            seed=seed,
            device=self.device,
            precision=self.precision,
            ckpt_path=ck,
            checkpoint_every=self.cfg.checkpoint_every,
            run_key=key,
            progress=self.cfg.progress,
            desc=desc,
        )

    def proba(self, pool: Pool, positions: np.ndarray) -> np.ndarray:
        return predict_proba(self.net, pool, positions, device=self.device, precision=self.precision)


# ------------------------------------------------------------------ main entry
def finetune(config: FinetuneConfig) -> pl.DataFrame:
    """Fine-tune ``config.model`` with ``config.weights`` on ``config.data``; returns the
    ``kind="finetune"`` rows of these runs (polars DataFrame in the results schema).

    Seeds already in ``config.results_path`` are skipped unless ``config.force``; without a
    results path nothing is written and nothing resumes. Two or more seeds add the median
    row over seeds (``seed=-1``). The caller's process is left as it was (no allocator
    change: ``featcache finetune`` tunes the CPU allocator for its own process).
    """
    from featcache.core.results import check_results_path

    proto, cfg = config.resolve()
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)  # an unwritable table fails before any training
    dev = resolve_device(cfg.device)
    prec = resolve_precision(cfg.precision, dev)
    data = _open_data(cfg, proto)
    assert cfg.seeds is not None  # resolve() fills in the protocol's seeds
    # seeded plans before the backbone loads: too little data fails fast
    plans = {s: make_plan(proto, s, data.train, data.val, cfg.val_source) for s in cfg.seeds}
    run = _build(cfg, proto, data, dev, prec)
    run_ids = _run_ids(run)
    todo = cast(  # pending() returns keys of the mapping it is given: here the seeds
        "list[int]",
        pending(
            {s: [run_ids[(s, es)][0] for es in cfg.eval_splits] for s in cfg.seeds},
            finished(cfg.results_path, cfg.force),
            lambda s: f"{run.bkey}/{data.name} {proto.spec} seed {s}",
            cfg.results_path,
            log,
        ),
    )
    if run.ckdir is not None and todo:
        run.ckdir.mkdir(parents=True, exist_ok=True)
    new_rows: list[dict] = []
    if todo:
        _make_pools(run, plans, todo)
        for s in todo:
            new_rows += _finetune_seed(run, s, plans[s], run_ids)
        run.pool = run.eval_pools = None
        if dev.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    return collect("finetune", cfg.results_path, new_rows, [r for r, _ in run_ids.values()], append=False)


def _build(cfg: FinetuneConfig, proto: Protocol, data: _Data, dev: str, prec: str) -> _Run:
    import copy

    from featcache.models import create_backbone

    bb = create_backbone(  # any model source; an nn.Module is copied, the caller's stays as it is
        cfg.model if isinstance(cfg.model, str) else copy.deepcopy(cfg.model),
        cfg.weights,
        device="cpu",
        input_size=cfg.input_size,
        pre_resize=cfg.pre_resize,
        trainable=True,
        resize=None if cfg.resize == "timm" else cfg.resize,
    )
    net = Net.build(bb.model, bb.feature_dim, len(data.class_names), embed=_embed(bb))
    ckdir = None
    if cfg.checkpoint_dir is not None:
        ckdir = Path(cfg.checkpoint_dir)
    elif cfg.results_path is not None:
        ckdir = Path(f"{cfg.results_path}.finetune-ckpt")
    run = _Run(
        cfg,
        proto,
        data,
        cfg.backbone_name or bb.default_key,
        net,
        {k: v.detach().clone() for k, v in net.state_dict().items()},
        _grid(cfg),
        cfg.run_options(proto, bb, prec),
        cfg.scaled_from(proto),
        dev,
        prec,
        ckdir,
        float(getattr(bb.model, "drop_rate", 0.0) or 0.0),
        transform=bb.transform,
        shape=tuple(int(s) for s in bb.data_config["input_size"]),
    )
    return run


def _grid(cfg: FinetuneConfig) -> list[TrainConfig]:
    """The selection grid of a resolved config (resolve() fills each field left None with the
    protocol's value)."""
    assert cfg.steps is not None
    assert cfg.lrs is not None
    assert cfg.batch_size is not None
    assert cfg.last_decay is not None
    assert cfg.momentum is not None
    assert cfg.weight_decay is not None
    return make_configs(
        cfg.steps,
        cfg.lrs,
        cfg.batch_size,
        last_decay=cfg.last_decay,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        micro_batch=cfg.micro_batch,
    )


def _embed(bb):
    """The pooled-feature forward of a non-timm source (None: timm, the model's own output)."""
    if bb.features_fn is None:
        return None
    fn = bb.features_fn
    return lambda x: fn(x, ["pooled"])["pooled"]


def _run_ids(run: _Run) -> dict[tuple[int, str], tuple[str, str]]:
    from featcache.core.results import make_run_id

    d = run.data
    out = {}
    assert run.cfg.seeds is not None  # resolve() fills in the protocol's seeds
    for s in run.cfg.seeds:
        for es, ev in d.evals.items():
            fp = "images:" + combine_fingerprints(
                d.train.fingerprint, d.val.fingerprint if d.val else "", ev.fingerprint
            )
            out[(s, es)] = (
                make_run_id(
                    kind="finetune",
                    backbone=run.bkey,
                    dataset=d.name,
                    protocol=run.proto.row_protocol,
                    seed=s,
                    eval_split=es,
                    options=run.options,
                    store_fingerprint=fp,
                ),
                fp,
            )
    return out


def _make_pools(run: _Run, plans: dict[int, SplitPlan], todo: list[int]) -> None:
    """The training pool over the rows any seed uses (plan positions map into it) and one
    pool per eval split; together they hold at most ``memory_limit_gb`` (a pool that does
    not fit in what is left streams its images)."""
    d, cfg = run.data, run.cfg
    items: list[tuple[Split, int]] = [(d.train, i) for i in range(d.train.y.size)]
    if d.val is not None:
        items += [(d.val, i) for i in range(d.val.y.size)]
    need = np.unique(np.concatenate([np.concatenate([plans[s].train, plans[s].val, plans[s].final]) for s in todo]))
    run.pos_in_pool = np.full(len(items), -1, np.int64)
    run.pos_in_pool[need] = np.arange(need.size)
    budget = cfg.memory_limit_gb * 2**30  # shared by all pools: the train pool first
    kw = {"workers": cfg.workers, "progress": cfg.progress}
    run.pool = Pool(
        [items[i] for i in need], run.transform, run.shape, what=f"{d.name} train", memory_limit=budget, **kw
    ).to(run.device)
    budget -= run.pool.nbytes
    run.eval_pools = {}
    for es, ev in d.evals.items():
        p = Pool(
            [(ev, i) for i in range(ev.y.size)],
            run.transform,
            run.shape,
            what=f"{d.name}/{es}",
            memory_limit=budget,
            **kw,
        )
        budget -= p.nbytes
        run.eval_pools[es] = p


# ------------------------------------------------------------------ one seed
def _select(run: _Run, s: int, plan: SplitPlan) -> tuple[int, list[dict]]:
    """Train every grid config on the plan's train rows and score it on its val rows
    (finished configs are read back from their outcome file); (best index, candidates)."""
    grid = run.grid
    if len(grid) == 1:
        return 0, [{"lr": grid[0].lr, "steps": grid[0].steps, "val_top1": None}]
    cands = []
    for ci, c in enumerate(grid):
        key = run.key("select", s, c, plan.train)
        kh = key_hash(key)
        outcome = run.ckdir / f"{kh}.json" if run.ckdir is not None else None
        if outcome is not None and outcome.exists() and not run.cfg.force:
            rec = json.loads(outcome.read_text())
            log.info(
                "seed %d config %d/%d (lr=%g, steps=%d): finished earlier, val top1 %.4f",
                s,
                ci + 1,
                len(grid),
                c.lr,
                c.steps,
                rec["val_top1"],
            )
        else:
            rec = _select_one(run, s, plan, c, key, kh, outcome)
            log.info(
                "seed %d config %d/%d (lr=%g, steps=%d): val top1 %.4f",
                s,
                ci + 1,
                len(grid),
                c.lr,
                c.steps,
                rec["val_top1"],
            )
        cands.append(
            dict(
                lr=c.lr,
                steps=c.steps,
                val_top1=rec["val_top1"],
                finite=rec["finite"],
                seconds=rec.get("seconds"),
                **{k: rec[k] for k in (_val_key(run),) if k in rec and k != "val_top1"},
            )
        )
    scores = np.array([c.get(_val_key(run), c["val_top1"]) for c in cands], np.float64)
    return int(np.flatnonzero(scores == scores.max())[0]), cands


def _select_one(run: _Run, s: int, plan: SplitPlan, c: TrainConfig, key: dict, kh: str, outcome: Path | None) -> dict:
    ck = run.ckdir / f"{kh}.pt" if run.ckdir is not None else None
    if run.cfg.force and ck is not None and ck.exists():
        ck.unlink()
    res = run.train(plan.train, c, s, key, ck, f"{run.bkey} seed {s} select lr={c.lr:g} steps={c.steps}")
    # run.train above trained from both (_make_pools built them)
    assert run.pool is not None
    assert run.pos_in_pool is not None
    score = -1.0
    if res.finite:
        pva = run.pos_in_pool[plan.val]
        P = run.proba(run.pool, pva)
        score = float(np.mean(P.argmax(1) == run.pool.y[pva]))
    rec = {"val_top1": score, "finite": res.finite, "seconds": res.seconds}
    if _val_key(run) != "val_top1":  # the task's metric selects (val_top1 stays for the record)
        from featcache.core.metrics import METRICS

        assert run.cfg.metric is not None  # _val_key names it
        rec[_val_key(run)] = float(METRICS[run.cfg.metric](run.pool.y[pva], P)) if res.finite else -1.0
    if outcome is not None:
        atomic_json(rec, outcome)
        if ck is not None and ck.exists():
            ck.unlink()
    return rec


def _val_key(run: _Run) -> str:
    """The candidates' selection score: ``val_top1``, or ``val_<metric>`` of the task's metric."""
    return f"val_{run.cfg.metric or 'top1'}"


def _finetune_seed(run: _Run, s: int, plan: SplitPlan, run_ids) -> list[dict]:
    """Select, refit on the final rows, evaluate: one seed's rows (appended at once)."""
    best, cands = _select(run, s, plan)
    c = run.grid[best]
    key = run.key("final", s, c, plan.final)
    ck = run.ckdir / f"{key_hash(key)}.pt" if run.ckdir is not None else None
    if run.cfg.force and ck is not None and ck.exists():
        ck.unlink()
    res = run.train(plan.final, c, s, key, ck, f"{run.bkey} seed {s} final lr={c.lr:g} steps={c.steps}")
    secs = res.seconds + sum(x.get("seconds") or 0.0 for x in cands)
    hp = _hparams(run, plan, c, cands, best, res)
    rows = []
    for es, ev in run.data.evals.items():
        vals = _evaluate(run, es, ev, res.finite)
        rid, fp = run_ids[(s, es)]
        rows += [
            {
                "run_id": rid,
                "kind": "finetune",
                "backbone": run.bkey,
                "dataset": run.data.name,
                "protocol": run.proto.row_protocol,
                "train_split": plan.train_split,
                "eval_split": es,
                "shots": -1,
                "seed": s,
                "metric": m,
                "value": float(v),
                "n_eval": int(ev.y.size),
                "hparams": hp,
                "converged": bool(res.finite),
                "fit_seconds": float(secs),
                "store_fingerprint": fp,
            }
            for m, v in vals.items()
        ]
        log.info(
            "finetune %s %s %s seed %d %s: top1=%.4f (lr=%g, steps=%d)",
            run.bkey,
            run.data.name,
            run.proto.spec,
            s,
            es,
            vals.get("top1", float("nan")),
            c.lr,
            c.steps,
        )
    write_rows(run.cfg.results_path, rows)  # rows of each finished seed are safe at once
    if ck is not None and ck.exists():
        ck.unlink()
    if run.ckdir is not None:  # selection outcomes of this seed are no longer needed
        for g in run.grid:
            (run.ckdir / f"{key_hash(run.key('select', s, g, plan.train))}.json").unlink(missing_ok=True)
    return rows


def _evaluate(run: _Run, es: str, ev: Split, finite: bool) -> dict[str, float]:
    from featcache.core.metrics import compute_all

    if not finite:
        return {m: float("nan") for m in METRIC_NAMES if m != "top5" or len(run.data.class_names) > 5}
    assert run.eval_pools is not None  # _make_pools built them before any seed ran
    P = run.proba(run.eval_pools[es], np.arange(ev.y.size))
    return compute_all(ev.y, P)


def _hparams(run: _Run, plan: SplitPlan, c: TrainConfig, cands: list[dict], best: int, res) -> dict:
    hp = dict(run.options)
    hp.update(plan.info)
    hp.update(
        pairs_with={
            "kind": "probe",
            "protocol": run.proto.row_protocol,
            "keys": ["backbone", "dataset", "protocol", "eval_split", "seed", "metric"],
        },
        lr=c.lr,
        steps=c.steps,
        milestones=list(c.milestones),
        selection=(
            "single config"
            if len(run.grid) == 1
            else f"val {run.cfg.metric or 'top1'} (ties: first config, order steps then lr)"
        ),
        val_top1=cands[best]["val_top1"],
        candidates=cands,
        n_train=int(plan.train.size),
        n_val=int(plan.val.size),
        n_train_final=int(plan.final.size),
        scaled=bool(run.scaled_from),
        scaled_from=run.scaled_from,
        reference="VTAB lightweight: SGD m=0.9, batch 512, lr {0.1,0.01} x {2500,10000} steps",
        head_init="zeros",
        augmentation="none (timm eval transform)"
        if "source" not in run.options["data_config"]
        else f"none ({run.options['data_config']['source']}'s eval transform)",
        batchnorm="train mode: batch statistics and running averages update",
        drop_rate=run.drop_rate,
        eval_batch=eval_batch_size(run.device, int(np.prod(run.shape[1:]))),
        data_order="full batches from seeded epoch permutations",
        device=run.device,
        dataset_fingerprints=run.data.fingerprints(),
        final_loss=res.losses[-1] if res.losses else None,
    )
    if run.cfg.metric is not None:
        hp["task_metric"] = run.cfg.metric
    return hp


def _hash_idx(idx: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(idx, "<i8").tobytes()).hexdigest()[:16]
