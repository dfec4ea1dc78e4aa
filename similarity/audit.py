"""``featcache audit``: test (and val) rows that are near-copies of training rows, found with one
backbone's cached features, and how much they move the kNN numbers.

For each query split: every row's nearest training rows by cosine (:func:`cosine_topk`); the
pairs above the threshold (given, or :func:`default_threshold` of the nearest-neighbour
cosines, drawn in ``<out>.nn.png``); exact duplicates by content hash where the images are
reachable (:mod:`.content`), with thumbnails of the closest pairs in ``<out>.pairs.png``; and
kNN / 1-NN top-1 with and without the flagged query rows. The pairs table goes to ``out``
(CSV or parquet: query_split, query_id, train_id, cosine, exact_content); with
``results_path`` the summary is appended as ``kind="audit"`` rows. What is checked before the
search (``--out``, the kind, non-finite features) and the collapsed-space test are in
:mod:`.audit_checks`.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import DataError
from featcache.similarity.audit_checks import (
    COLLAPSE_NN_COSINE,
    COLLAPSE_RANDOM_COSINE,
    check_finite,
    check_out,
    check_vector_kind,
    collapse,
    is_collapsed,
    write_pairs,
)
from featcache.similarity.config import AuditConfig
from featcache.similarity.content import content_hashes, image_source
from featcache.similarity.neighbours import cosine_topk, default_threshold, knn_top1, unit_rows
from featcache.similarity.streaming import take_rows

log = logging.getLogger(__name__)

__all__ = ["AuditReport", "run_audit"]


@dataclass
class _Split:
    name: str
    ids: np.ndarray
    labels: np.ndarray
    X: Any
    cos: np.ndarray  # [n, k] best first
    nbr: np.ndarray  # [n, k] training rows


@dataclass
class AuditReport:
    """What :func:`run_audit` found; :meth:`summary` is the CLI's text."""

    backbone: str
    dataset: str
    threshold: float
    threshold_rule: str
    pairs: Any  # polars DataFrame with PAIR_COLUMNS
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    exact_checked: bool = False
    files: list[str] = field(default_factory=list)

    @property
    def collapsed(self) -> bool:
        """Whether a query split's feature space is collapsed (:func:`.audit_checks.is_collapsed`)."""
        return any(m["collapsed"] for m in self.splits.values())

    def summary(self) -> str:
        lines = [
            f"{self.backbone}  {self.dataset}  threshold cosine >= {self.threshold:.4f} ({self.threshold_rule}); "
            f"exact duplicates {'checked by content hash' if self.exact_checked else 'not checked (images unreachable)'}"
        ]
        if self.collapsed:
            lines.append(collapse_warning(self))
        for s, m in self.splits.items():
            lines.append(
                f"  {s}: {m['n_flagged']} of {m['n']} rows flagged ({m['n_exact']} exact); "
                f"kNN top-1 {m['knn_top1']:.4f} -> {m['knn_top1_clean']:.4f} without them, "
                f"1-NN top-1 {m['nn1_top1']:.4f} -> {m['nn1_top1_clean']:.4f}"
            )
        lines += [f"  wrote {f}" for f in self.files]
        return "\n".join(lines)


def collapse_warning(report: AuditReport) -> str:
    """The one line that says a collapsed space's flags are no evidence."""
    m = next(m for m in report.splits.values() if m["collapsed"])
    return (
        f"  WARNING: collapsed feature space: median cosine {m['nn_cosine_median']:.4f} to the nearest training "
        f"row (>= {COLLAPSE_NN_COSINE}) and {m['random_pair_cosine']:.4f} between random pairs "
        f"(>= {COLLAPSE_RANDOM_COSINE}): unrelated images are as alike as near-copies here, so the flags "
        "below are not evidence of duplicates (audit a backbone with trained weights)"
    )


def _valid(f, cfg: AuditConfig) -> tuple[Any, np.ndarray, np.ndarray]:
    ok = np.asarray(f.valid, bool)
    if not ok.all():
        log.warning("%s/%s: %d invalid row(s) left out (images that failed)", f.dataset, f.split, int((~ok).sum()))
    idx = np.flatnonzero(ok)
    X = take_rows(f.X, idx)
    ids = np.asarray(f.ids).astype(str)[idx]
    check_finite(X, ids, f"{cfg.backbone}/{cfg.dataset}/{f.split} ({cfg.kind})", _block_rows(cfg))
    return X, ids, np.asarray(f.labels, np.int64)[idx]


def _block_rows(cfg: AuditConfig) -> int:
    from featcache.core.memory import parse_memory

    return int(min(16384, max(256, math.isqrt(parse_memory(cfg.max_memory) // 16))))


def _search(cfg: AuditConfig, cache, train_X) -> list[_Split]:
    held = {s for b, d, s in cache.entries() if b == cfg.backbone and d == cfg.dataset}
    todo = [s for s in cfg.query_splits if s in held]
    if not todo:
        raise DataError(
            f"{cfg.backbone}/{cfg.dataset} in {cfg.cache} holds none of the query splits {list(cfg.query_splits)} "
            f"(it holds {sorted(held)}); pass --query with one of them"
        )
    kk = max(cfg.k, cfg.knn_k)
    out = []
    for s in todo:
        check_vector_kind(cache, cfg.backbone, cfg.dataset, s, cfg.kind)
        f = cache.load(cfg.backbone, cfg.dataset, s, cfg.kind, lazy=True)
        X, ids, labels = _valid(f, cfg)
        cos, nbr = cosine_topk(X, train_X, kk, block_rows=_block_rows(cfg))
        out.append(_Split(s, ids, labels, X, cos, nbr))
        log.info("audit %s: %d query rows searched against %d training rows", s, len(ids), train_X.shape[0])
    return out


def _exact(cfg: AuditConfig, cache, train_ids: np.ndarray, splits: list[_Split]):
    """``{split: [(query row, train row), ...]}`` of identical image bytes, or None when the
    images are unreachable; and the sources (for thumbnails)."""
    tr_src = image_source(
        cache.split_meta(cfg.dataset, cfg.train_split).source, cfg.train_split, train_ids, cfg.data_root
    )
    if tr_src is None:
        log.info(
            "images of %s/%s are not reachable from the store's source record: no content hashes",
            cfg.dataset,
            cfg.train_split,
        )
        return None, {}
    by_hash: dict[str, list[int]] = {}
    for j, h in enumerate(content_hashes(tr_src, train_ids)):
        by_hash.setdefault(h, []).append(j)
    found, sources = {}, {cfg.train_split: tr_src}
    for sp in splits:
        src = image_source(cache.split_meta(cfg.dataset, sp.name).source, sp.name, sp.ids, cfg.data_root)
        if src is None:
            found[sp.name] = None
            continue
        sources[sp.name] = src
        found[sp.name] = [(i, j) for i, h in enumerate(content_hashes(src, sp.ids)) for j in by_hash.get(h, ())]
    return found, sources


def _pairs(sp: _Split, thr: float, k: int, exact, train_X, train_ids: np.ndarray) -> list[tuple]:
    near = {(int(i), int(sp.nbr[i, c])): float(sp.cos[i, c]) for i, c in zip(*np.nonzero(sp.cos[:, :k] >= thr))}
    ex = set(exact or ())
    missing = sorted(p for p in ex if p not in near)
    if missing:  # exact copies outside the top k (their features differ?): score them too
        q = unit_rows(np.asarray(take_rows(sp.X, [p[0] for p in missing])))
        g_rows = np.array([p[1] for p in missing])
        g = unit_rows(np.asarray(take_rows(train_X, g_rows)))
        near.update({p: float(c) for p, c in zip(missing, np.einsum("ij,ij->i", q, g))})
    known = exact is not None
    return [
        (sp.name, str(sp.ids[i]), str(train_ids[j]), c, ((i, j) in ex) if known else None)
        for (i, j), c in sorted(near.items(), key=lambda t: (-t[1], t[0]))
    ]


def _metrics(sp: _Split, flagged: np.ndarray, train_X, train_y: np.ndarray, cfg: AuditConfig, n_exact: int):
    keep = ~flagged
    m: dict[str, Any] = {"n": int(sp.ids.size), "n_flagged": int(flagged.sum()), "n_exact": n_exact}
    m["random_pair_cosine"] = collapse(sp.X, train_X)
    m["nn_cosine_median"] = float(np.median(sp.cos[:, 0]))
    m["collapsed"] = is_collapsed(m["nn_cosine_median"], m["random_pair_cosine"])
    for name, k in (("knn_top1", cfg.knn_k), ("nn1_top1", 1)):
        m[name] = knn_top1(sp.cos, sp.nbr, train_y, sp.labels, k)
        m[f"{name}_clean"] = (
            knn_top1(sp.cos[keep], sp.nbr[keep], train_y, sp.labels[keep], k) if keep.any() else float("nan")
        )
    return m


def run_audit(config: AuditConfig) -> AuditReport:
    """The near-duplicate audit of ``config`` (see the module docstring)."""
    import polars as pl

    from featcache.store import open_cache

    cfg = config
    check_out(cfg.out, cfg.results_path)  # --out the audit does not own fails before anything
    if cfg.results_path is not None:
        from featcache.core.results import check_results_path

        check_results_path(cfg.results_path)  # a bad --results fails before the search
    cache = open_cache(cfg.cache)
    check_vector_kind(cache, cfg.backbone, cfg.dataset, cfg.train_split, cfg.kind)
    tr = cache.load(cfg.backbone, cfg.dataset, cfg.train_split, cfg.kind, lazy=True)
    train_X, train_ids, train_y = _valid(tr, cfg)
    splits = _search(cfg, cache, train_X)
    for sp in splits:
        if list(cache.split_meta(cfg.dataset, sp.name).class_names) != list(tr.class_names):
            raise DataError(
                f"{sp.name} and {cfg.train_split} name their classes differently; kNN top-1 needs one class list"
            )
    nn1 = np.concatenate([sp.cos[:, 0] for sp in splits])
    thr, rule = (
        (float(cfg.threshold), "given")
        if cfg.threshold is not None
        else (default_threshold(nn1), "a tenth of the median nearest-neighbour distance")
    )
    exact, sources = _exact(cfg, cache, train_ids, splits)
    rows, report = [], AuditReport(cfg.backbone, cfg.dataset, thr, rule, None, exact_checked=exact is not None)
    for sp in splits:
        ex = None if exact is None else exact.get(sp.name)
        got = _pairs(sp, thr, cfg.k, ex, train_X, train_ids)
        rows += got
        flagged = np.isin(sp.ids, [r[1] for r in got])
        report.splits[sp.name] = _metrics(sp, flagged, train_X, train_y, cfg, len({i for i, _ in ex or ()}))
    if report.collapsed:
        log.warning(collapse_warning(report).strip())
    schema = {
        "query_split": pl.Utf8,
        "query_id": pl.Utf8,
        "train_id": pl.Utf8,
        "cosine": pl.Float64,
        "exact_content": pl.Boolean,
    }
    report.pairs = pl.DataFrame(rows, schema=schema, orient="row")
    report.files.append(write_pairs(report.pairs, Path(cfg.out)))
    report.files.append(_plot_nn(nn1, thr, rule, cfg, Path(cfg.out), report.collapsed))
    if sources and report.pairs.height:
        report.files.append(_plot_pairs(report.pairs, sources, cfg, Path(cfg.out)))
    if cfg.results_path is not None:
        _write_results(report, cfg)
    return report


def _atomic(out: Path, write) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)


def _plot_nn(nn1: np.ndarray, thr: float, rule: str, cfg: AuditConfig, out: Path, collapsed: bool = False) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    ax = fig.add_subplot()
    ax.hist(np.asarray(nn1, np.float64), bins=100, color="#4c72b0")  # float64: a collapsed space spans ~1e-7
    ax.set_yscale("log")
    ax.axvline(thr, color="#c44e52", linestyle="--", label=f"threshold {thr:.4f} ({rule})")
    ax.set_xlabel(f"cosine to the nearest {cfg.train_split} row ({cfg.backbone})")
    ax.set_ylabel("query rows")
    ax.set_title(
        f"{cfg.dataset}: nearest training neighbour of each query row"
        + ("\ncollapsed feature space: the flags are not evidence" if collapsed else ""),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _atomic(out.with_name(out.stem + ".nn.png"), lambda p: fig.savefig(p, format="png", dpi=110))


def _plot_pairs(pairs, sources: dict, cfg: AuditConfig, out: Path, n: int = 12) -> str:
    from matplotlib.figure import Figure

    top = pairs.head(n)
    fig = Figure(figsize=(2.2 * 2, 1.2 * top.height + 0.4))
    for r, row in enumerate(top.iter_rows(named=True)):
        for c, (split, i) in enumerate(((row["query_split"], row["query_id"]), (cfg.train_split, row["train_id"]))):
            ax = fig.add_subplot(top.height, 2, 2 * r + c + 1)
            src = sources.get(split)
            if src is not None:
                ax.imshow(src.pixels(i), cmap="gray")
            ax.set_axis_off()
            ax.set_title(f"{i}" + (f"  cos {row['cosine']:.4f}" if c == 0 else ""), fontsize=6)
    fig.tight_layout()
    return _atomic(out.with_name(out.stem + ".pairs.png"), lambda p: fig.savefig(p, format="png", dpi=110))


def _write_results(report: AuditReport, cfg: AuditConfig) -> None:
    from featcache.core.results import make_run_id
    from featcache.core.stagerun import write_rows

    rows = []
    for s, m in report.splits.items():
        hp = {
            "threshold": report.threshold,
            "rule": report.threshold_rule,
            "k": cfg.k,
            "knn_k": cfg.knn_k,
            **{k: m[k] for k in ("n_flagged", "n_exact")},
        }
        base = {
            "kind": "audit",
            "backbone": cfg.backbone,
            "dataset": cfg.dataset,
            "protocol": "near-duplicates",
            "train_split": cfg.train_split,
            "eval_split": s,
        }
        rid = make_run_id(**base, **hp, feature_kind=cfg.kind)
        # the recorded flag: the report warns beside a collapsed space's audit rows
        hp = {**hp, "collapsed": m["collapsed"], "collapse_rule": [COLLAPSE_NN_COSINE, COLLAPSE_RANDOM_COSINE]}
        metrics = ("knn_top1", "knn_top1_clean", "nn1_top1", "nn1_top1_clean", "nn_cosine_median", "random_pair_cosine")
        for metric in metrics:
            rows.append({**base, "run_id": rid, "metric": metric, "value": m[metric], "n_eval": m["n"], "hparams": hp})
        rows.append(
            {
                **base,
                "run_id": rid,
                "metric": "flagged_fraction",
                "value": m["n_flagged"] / max(1, m["n"]),
                "n_eval": m["n"],
                "hparams": hp,
            }
        )
    write_rows(cfg.results_path, rows)
