"""Rankings of backbones from results tables.

* :func:`linear_vs_finetune` - VTAB Figure 16: per task Kendall tau-b between the ranking under
  linear probing and under fine-tuning; per backbone the fine-tune gain and the fine-tune minus
  linear z-score (Battle of the Backbones, Figure 2).
* :func:`aggregate` - mean score, average rank, group-reweighted mean and BoB z-scores across
  settings, their Kendall agreement, and good/better/best tables.
* :func:`bootstrap_aggregate` - seeded paired bootstrap (tasks or seeds) for aggregate scores
  and for differences between backbones.
* :func:`calibration_summary`, :func:`efficiency_summary` - ECE/NLL and throughput per backbone
  (with the threads and load it was measured at: :func:`throughput_note`).
* :func:`random_baselines` - which backbones are random-init baselines (the one place that knows).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from featcache.analysis import stats
from featcache.analysis.tables import negate_lower_is_better, score_matrix
from featcache.errors import ResultsError

log = logging.getLogger(__name__)

#: elements per bootstrap chunk (bounds memory of the pairwise rank comparison)
_BOOT_CHUNK_ELEMS = 2e7
AGGREGATIONS = ("zscore", "mean", "avg_rank", "group_mean")
#: aggregation -> True when higher is better
HIGHER_IS_BETTER = {"zscore": True, "mean": True, "avg_rank": False, "group_mean": True}


class ItemAccess:
    """``r["name"]`` reads ``r.name``: the dict-style access the analysis results offered
    before they were dataclasses (``r.get(name)``, ``name in r`` and ``r.keys()`` too)."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def __getitem__(self, name: str):
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name: object) -> bool:
        return name in self.keys()

    def get(self, name: str, default=None):
        return getattr(self, name) if name in self.keys() else default


@dataclass(frozen=True)
class LinearVsFinetune(ItemAccess):
    """:func:`linear_vs_finetune`'s tables: ``per_task`` (task, tau, p_value, n_backbones,
    reason), ``per_backbone`` (mean gain and z change), ``pairs`` (task, backbone, linear,
    finetune, gain, z_linear, z_finetune, z_diff); the mean tau over ``n_tasks`` tasks where it
    is defined; ``missing``: what one side lacks."""

    per_task: Any
    per_backbone: Any
    pairs: Any
    mean_tau: float
    n_tasks: int
    missing: dict[str, list[str]]


def _pl():
    import polars as pl

    return pl


# ---------------------------------------------------------------------------------------------
# linear probing vs fine-tuning
# ---------------------------------------------------------------------------------------------


def linear_vs_finetune(
    reduced,
    *,
    metric: str = "top1",
    linear_kind: str = "probe",
    finetune_kind: str = "finetune",
    ddof: int = 0,
) -> LinearVsFinetune:
    """Compare the ranking of backbones under linear probing and under fine-tuning per task.

    ``reduced`` is a seed-reduced table (:func:`featcache.analysis.tables.reduce_seeds`).
    Returns a :class:`LinearVsFinetune`:
    ``per_task`` has task, tau, p_value, n_backbones, reason (why tau is NaN, else null);
    ``pairs`` the matched (task, backbone, linear, finetune, gain, z_linear, z_finetune, z_diff);
    ``per_backbone`` the mean gain and mean z difference over tasks. Tasks present on one
    side only are listed in ``missing`` (and logged), never dropped silently.
    """
    pl = _pl()
    pairs, tasks, missing = _paired_scores(reduced, metric, linear_kind, finetune_kind)
    rows = []
    zrows = []
    for task in tasks:
        row, z = _task_agreement(
            task, pairs.filter(pl.col("task") == task).sort("backbone"), ddof, linear_kind, finetune_kind
        )
        rows.append(row)
        zrows += z
    per_task = pl.DataFrame(
        rows,
        schema={"task": pl.Utf8, "tau": pl.Float64, "p_value": pl.Float64, "n_backbones": pl.Int64, "reason": pl.Utf8},
    )
    pairs_df = pl.DataFrame(
        zrows,
        schema={
            "task": pl.Utf8,
            "backbone": pl.Utf8,
            "linear": pl.Float64,
            "finetune": pl.Float64,
            "gain": pl.Float64,
            "z_linear": pl.Float64,
            "z_finetune": pl.Float64,
            "z_diff": pl.Float64,
        },
    ).with_columns(pl.col("z_linear", "z_finetune", "z_diff").fill_nan(None))
    per_backbone = (
        pairs_df.group_by("backbone")
        .agg(
            pl.col("gain").mean().alias("mean_gain"),
            pl.col("z_diff").mean().alias("mean_z_diff"),
            pl.len().alias("n_tasks"),
        )
        .sort("mean_z_diff", descending=True, nulls_last=True)
    )
    taus = per_task["tau"].to_numpy()
    valid = ~np.isnan(taus)
    return LinearVsFinetune(
        per_task,
        per_backbone,
        pairs_df,
        float(np.mean(taus[valid])) if valid.any() else float("nan"),
        int(valid.sum()),
        missing,
    )


def _paired_scores(reduced, metric: str, linear_kind: str, finetune_kind: str):
    """(task, backbone, linear, finetune) rows scored both ways, the tasks on both sides, and
    what is missing on one side (logged)."""
    pl = _pl()
    sub = reduced.filter(pl.col("metric") == metric)
    lin = sub.filter(pl.col("kind") == linear_kind).select("task", "backbone", pl.col("value").alias("linear"))
    ft = sub.filter(pl.col("kind") == finetune_kind).select("task", "backbone", pl.col("value").alias("finetune"))
    if lin.height == 0 or ft.height == 0:
        raise ResultsError(
            f"linear vs fine-tune needs {metric!r} rows of kind {linear_kind!r} and "
            f"{finetune_kind!r}; found {lin.height} and {ft.height}. Pass the fine-tuning table "
            "with --external (kind column or --external-kind finetune)"
        )
    lt, ftt = set(lin["task"].to_list()), set(ft["task"].to_list())
    missing = {
        f"{linear_kind}_only_tasks": sorted(lt - ftt),
        f"{finetune_kind}_only_tasks": sorted(ftt - lt),
    }
    pairs = lin.join(ft, on=["task", "backbone"], how="inner")
    unpaired = (
        lin.join(ft, on=["task", "backbone"], how="full", coalesce=True)
        .filter(pl.col("task").is_in(sorted(lt & ftt)))
        .filter(pl.col("linear").is_null() | pl.col("finetune").is_null())
    )
    missing["unpaired_backbones"] = [f"{r['task']}/{r['backbone']}" for r in unpaired.iter_rows(named=True)]
    for k, v in missing.items():
        if v:
            log.warning("linear vs fine-tune: %s: %s", k, ", ".join(v))
    return pairs, sorted(lt & ftt), missing


def _task_agreement(task: str, p, ddof: int, linear_kind: str, finetune_kind: str) -> tuple[dict, list[dict]]:
    """Kendall tau-b of one task's linear and fine-tune scores (NaN with a reason where it is
    undefined) and each backbone's gain and z-scores."""
    x = p["linear"].to_numpy().astype(float)
    y = p["finetune"].to_numpy().astype(float)
    n = len(x)
    reason = None
    if n < 2:
        reason = f"only {n} backbone(s) have both a linear and a fine-tune score"
    elif np.ptp(x) == 0:
        reason = f"linear scores are constant ({x[0]:g}) across {n} backbones"
    elif np.ptp(y) == 0:
        reason = f"fine-tune scores are constant ({y[0]:g}) across {n} backbones"
    if reason:
        tau = pv = float("nan")
        zl = zf = np.full(n, np.nan)
        log.warning("linear vs fine-tune on %s: tau is NaN: %s", task, reason)
    else:
        tau, pv = stats.kendall_tau_b(x, y)
        zl = stats.zscores(x, ddof=ddof, label=f"{linear_kind}:{task}")
        zf = stats.zscores(y, ddof=ddof, label=f"{finetune_kind}:{task}")
    row = {"task": task, "tau": tau, "p_value": pv, "n_backbones": n, "reason": reason}
    zrows = [
        {
            "task": task,
            "backbone": b,
            "linear": xl,
            "finetune": yf,
            "gain": yf - xl,
            "z_linear": a,
            "z_finetune": c,
            "z_diff": c - a,
        }
        for b, xl, yf, a, c in zip(p["backbone"].to_list(), x, y, zl, zf)
    ]
    return row, zrows


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------


@dataclass
class ScoreMatrix:
    """Backbone x setting matrix of one score per setting (higher is better)."""

    backbones: list[str]
    settings: list[str]
    values: np.ndarray  # [B, T]
    groups: list[str | None] = field(default_factory=list)  # per setting

    def frame(self):
        pl = _pl()
        data: dict[str, Any] = {"backbone": self.backbones}
        for j, s in enumerate(self.settings):
            data[s] = self.values[:, j]
        return pl.DataFrame(data).with_columns(pl.exclude("backbone").fill_nan(None))


def select_settings(
    reduced,
    *,
    metric: str = "top1",
    retrieval_metric: str = "map",
    kinds: Sequence[str] | None = None,
    groups: Mapping[str, str] | None = None,
) -> ScoreMatrix:
    """One metric per setting (``metric`` for probe/knn/finetune, ``retrieval_metric`` for
    retrieval), as a backbone x setting matrix. Lower-is-better metrics are negated."""
    pl = _pl()
    want = (pl.col("kind") == "retrieval") & (pl.col("metric") == retrieval_metric)
    want = want | ((pl.col("kind") != "retrieval") & (pl.col("metric") == metric))
    if kinds is not None:
        reduced = reduced.filter(pl.col("kind").is_in(list(kinds)))
    sub = reduced.filter(want)
    # a metric that matches none of a family's rows is a typo, not a reason to rank on the rest
    for is_ret, m in ((False, metric), (True, retrieval_metric)):
        fam = reduced.filter((pl.col("kind") == "retrieval") == is_ret)
        if fam.height and fam.filter(pl.col("metric") == m).height == 0:
            raise ResultsError(
                f"no {'retrieval' if is_ret else 'probe/knn/finetune'} rows with metric {m!r}; "
                f"those rows hold metrics {sorted(set(fam['metric'].to_list()))} "
                f"(choose with {'--retrieval-metric' if is_ret else '--metric'}, or restrict --kinds)"
            )
    if sub.height == 0:
        have = sorted(set(zip(reduced["kind"].to_list(), reduced["metric"].to_list())))
        raise ResultsError(
            f"no rows with metric {metric!r} (retrieval: {retrieval_metric!r}) "
            f"for kinds {list(kinds) if kinds else 'any'}; the tables hold (kind, metric) {have}"
        )
    sub = negate_lower_is_better(sub, metric, retrieval_metric)
    b, s, m = score_matrix(sub)
    g = {}
    for r in sub.select("setting", "dataset", "group").unique().iter_rows(named=True):
        grp = (groups or {}).get(r["dataset"], r["group"])
        g[r["setting"]] = grp
    return ScoreMatrix(b, s, m, [g.get(x) for x in s])


def _zscore_matrix(values: np.ndarray, ddof: int) -> np.ndarray:
    """Vectorised per-setting z-scores over the backbone axis (-2); NaN where undefined."""
    with np.errstate(invalid="ignore", divide="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mu = np.nanmean(values, axis=-2, keepdims=True)
            sd = np.nanstd(values, axis=-2, ddof=ddof, keepdims=True)
            rng_ = np.nanmax(values, axis=-2, keepdims=True) - np.nanmin(values, axis=-2, keepdims=True)
        sd = np.where((sd > 0) & (rng_ > 0), sd, np.nan)  # equal values: no z-score
        return (values - mu) / sd


def _aggregate_arrays(values: np.ndarray, group_codes: np.ndarray | None, ddof: int) -> dict[str, np.ndarray]:
    """All aggregations of a ``[..., B, T]`` array, vectorised over leading axes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = {
            "zscore": np.nanmean(_zscore_matrix(values, ddof), axis=-1),
            "mean": np.nanmean(values, axis=-1),
            "avg_rank": np.nanmean(stats.average_ranks(values), axis=-1),
        }
        if group_codes is not None:
            gm = []
            for g in np.unique(group_codes[group_codes >= 0]):
                sel = group_codes == g
                gm.append(
                    np.nanmean(np.where(sel, values, np.nan), axis=-1)
                    if sel.ndim > 1
                    else np.nanmean(values[..., sel], axis=-1)
                )
            out["group_mean"] = np.nanmean(np.stack(gm, axis=-1), axis=-1)
    return out


def _group_codes(sm: ScoreMatrix) -> tuple[np.ndarray | None, str | None]:
    gs = sm.groups
    if not gs or all(g is None for g in gs):
        return None, "no task groups given (add a 'group' column, or --group DATASET=GROUP / groups={dataset: group})"
    lacking = [s for s, g in zip(sm.settings, gs) if g is None]
    if lacking:
        raise ResultsError(
            f"task groups are given for some settings but not for {lacking}; give every task a "
            "group (the 'group' column, --group DATASET=GROUP or groups={dataset: group}) or none"
        )
    named = [g for g in gs if g is not None]  # every setting has one (refused above otherwise)
    names = sorted(set(named))
    return np.array([names.index(g) for g in named]), None


def aggregate(sm: ScoreMatrix, *, ddof: int = 0, on_constant: str = "error") -> dict[str, Any]:
    """Aggregate a backbone x setting matrix.

    Returns ``{"overall", "zscores", "ranks", "agreement", "top3", "dropped", "notes"}``.
    ``overall``: per backbone zscore (mean BoB z-score over settings), mean, avg_rank (1 =
    best), group_mean (each group counts equally; NaN when no groups), n_settings, sorted by
    z-score. A setting where every backbone scores the same (or fewer than two backbones have
    a value) is an error (``on_constant="error"``), or is dropped and reported
    (``on_constant="drop"``).
    """
    pl = _pl()
    if on_constant not in ("error", "drop"):
        raise ResultsError(f"on_constant must be 'error' or 'drop', got {on_constant!r}")
    keep, dropped = [], {}
    for j, s in enumerate(sm.settings):
        try:
            stats.zscores(sm.values[:, j], ddof=ddof, label=f"setting {s!r}")
            keep.append(j)
        except ResultsError as exc:
            if on_constant == "error":
                raise
            dropped[s] = str(exc)
            log.warning("dropping %s", exc)
    if not keep:
        raise ResultsError("no setting left to rank backbones on (all were constant)")
    sm = ScoreMatrix(
        sm.backbones,
        [sm.settings[j] for j in keep],
        sm.values[:, keep],
        [sm.groups[j] for j in keep] if sm.groups else [],
    )
    codes, note = _group_codes(sm)
    agg = _aggregate_arrays(sm.values, codes, ddof)
    notes = [note] if note else []
    overall = pl.DataFrame(
        {
            "backbone": sm.backbones,
            "zscore": agg["zscore"],
            "mean": agg["mean"],
            "avg_rank": agg["avg_rank"],
            "group_mean": agg.get("group_mean", np.full(len(sm.backbones), np.nan)),
            "n_settings": (~np.isnan(sm.values)).sum(axis=1),
        }
    ).with_columns(pl.col("group_mean").fill_nan(None))
    z = _zscore_matrix(sm.values, ddof)
    families = _family_means(sm, z)
    for g, (m, _) in families.items():  # VTAB: each group's mean beside the group-reweighted mean
        overall = overall.with_columns(pl.Series(f"mean[{g}]", m).fill_nan(None))
    overall = overall.sort("zscore", descending=True).with_row_index("position", offset=1)
    r = stats.average_ranks(sm.values)
    zdf = ScoreMatrix(sm.backbones, sm.settings, z).frame()
    rdf = ScoreMatrix(sm.backbones, sm.settings, r).frame()
    # agreement between aggregations (all turned into higher-is-better first)
    avail = [a for a in AGGREGATIONS if a in agg]
    rows = []
    for a, b in itertools.combinations(avail, 2):
        xa = agg[a] if HIGHER_IS_BETTER[a] else -agg[a]
        xb = agg[b] if HIGHER_IS_BETTER[b] else -agg[b]
        tau, p = stats.kendall_tau_b(xa, xb)
        rows.append(
            {"a": a, "b": b, "tau": tau, "p_value": p, "n_backbones": int((~np.isnan(xa) & ~np.isnan(xb)).sum())}
        )
    agreement = pl.DataFrame(
        rows, schema={"a": pl.Utf8, "b": pl.Utf8, "tau": pl.Float64, "p_value": pl.Float64, "n_backbones": pl.Int64}
    )
    return {
        "matrix": sm,
        "overall": overall,
        "zscores": zdf,
        "ranks": rdf,
        "agreement": agreement,
        "top3": top3(sm, overall, families),
        "dropped": dropped,
        "notes": notes,
    }


def _family_means(sm: ScoreMatrix, z: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per task group (VTAB's natural / specialized / structured, BoB's task families): each
    backbone's mean score and mean z-score over the group's settings. Empty without groups."""
    import warnings

    if not sm.groups or any(g is None for g in sm.groups):
        return {}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for g in sorted({g for g in sm.groups if g is not None}):  # all given (checked above)
            sel = np.array([x == g for x in sm.groups])
            out[g] = (np.nanmean(sm.values[:, sel], axis=1), np.nanmean(z[:, sel], axis=1))
    return out


def top3(sm: ScoreMatrix, overall=None, families: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None):
    """Good / better / best (third, second, first) per setting, per task group (BoB's top-3 per
    task family, by the mean z-score over the group's settings) and overall (by z-score)."""
    pl = _pl()
    rows = []

    def pick(names, scores):
        order = [i for i in np.argsort(-np.nan_to_num(scores, nan=-np.inf), kind="stable") if not np.isnan(scores[i])]
        top = [names[i] for i in order[:3]] + [None] * 3
        # ties among the top 3 are broken by name order; say so instead of hiding it
        tied = [
            f"{names[order[k]]} = {names[order[k + 1]]}"
            for k in range(min(3, len(order) - 1))
            if scores[order[k]] == scores[order[k + 1]]
        ]
        return {"best": top[0], "better": top[1], "good": top[2], "ties": "; ".join(tied) or None}

    for j, s in enumerate(sm.settings):
        rows.append({"task": s, **pick(sm.backbones, sm.values[:, j])})
    for g, (_, zg) in (families or {}).items():
        rows.append({"task": f"group {g} (z-score)", **pick(sm.backbones, zg)})
    if overall is not None:
        rows.append({"task": "overall (z-score)", **pick(overall["backbone"].to_list(), overall["zscore"].to_numpy())})
    return pl.DataFrame(
        rows, schema={"task": pl.Utf8, "best": pl.Utf8, "better": pl.Utf8, "good": pl.Utf8, "ties": pl.Utf8}
    )


def bootstrap_aggregate(
    sm: ScoreMatrix,
    *,
    reduced=None,
    resample: str = "tasks",
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    ddof: int = 0,
    seed_reduce: str | Mapping[str, str] = "median",
    pairs_for: Sequence[str] = ("zscore", "mean"),
    progress: bool = False,
) -> dict[str, Any]:
    """Seeded paired bootstrap of the aggregate scores and of differences between backbones
    (``progress``: a bar over the resamples, aggregated in chunks, then compared).

    ``resample="tasks"``: draw settings with replacement (the same draw for every backbone).
    ``resample="seeds"``: per setting, draw that setting's seeds with replacement (the same
    seed indices for every backbone), re-reduce (``seed_reduce``: median, mean, or a rule per
    setting) and re-aggregate; needs ``reduced``'s
    source rows, passed as ``reduced`` = the *unreduced* table with a ``setting`` column.
    Returns ``{"scores": (backbone, aggregation, estimate, lo, hi), "differences":
    (aggregation, a, b, diff, lo, hi, p_le_0), "agreement": (a, b, tau_mean, tau_lo, tau_hi)
    between aggregations across resamples}``. Same inputs and seed -> identical output.
    """
    pl = _pl()
    if resample not in ("tasks", "seeds"):
        raise ResultsError(f"resample must be 'tasks' or 'seeds', got {resample!r}")
    codes, _ = _group_codes(sm)
    rng = np.random.default_rng(seed)
    if resample == "tasks":
        boot_vals, boot_codes = _resample_tasks(sm, codes, rng, n_boot)
    else:
        boot_vals, boot_codes = _resample_seeds(sm, codes, rng, n_boot, reduced, seed_reduce), codes
    from featcache.core.progress import tqdm

    point = _aggregate_arrays(sm.values, codes, ddof)
    with tqdm(total=2 * n_boot, desc="bootstrap", unit="resample", disable=not progress, leave=False) as bar:
        boot = _aggregate_resamples(boot_vals, boot_codes, ddof, bar)
        agreement = _agreement_rows(boot, (1 - level) / 2, n_boot, bar)
    q = (1 - level) / 2
    schema_s = {"backbone": pl.Utf8, "aggregation": pl.Utf8, "estimate": pl.Float64, "lo": pl.Float64, "hi": pl.Float64}
    schema_d = {
        "aggregation": pl.Utf8,
        "a": pl.Utf8,
        "b": pl.Utf8,
        "diff": pl.Float64,
        "lo": pl.Float64,
        "hi": pl.Float64,
        "p_le_0": pl.Float64,
    }
    schema_a = {"a": pl.Utf8, "b": pl.Utf8, "tau_mean": pl.Float64, "tau_lo": pl.Float64, "tau_hi": pl.Float64}
    return {
        "scores": pl.DataFrame(_interval_rows(sm.backbones, point, boot, q), schema=schema_s),
        "differences": pl.DataFrame(_difference_rows(sm.backbones, point, boot, q, pairs_for), schema=schema_d),
        "agreement": pl.DataFrame(agreement, schema=schema_a),
        "resample": resample,
        "n_boot": n_boot,
        "seed": seed,
    }


def _resample_tasks(sm: ScoreMatrix, codes, rng, n_boot: int):
    """Settings drawn with replacement: ``[n_boot, B, T]`` values and the drawn group codes."""
    T = sm.values.shape[1]
    idx = rng.integers(0, T, size=(n_boot, T))
    boot_vals = np.moveaxis(sm.values[:, idx], 1, 0)  # [n_boot, B, T]
    boot_codes = None if codes is None else codes[idx][:, None, :]  # [n_boot, 1, T]: broadcast over B
    return boot_vals, boot_codes


def _resample_seeds(sm: ScoreMatrix, codes, rng, n_boot: int, reduced, seed_reduce) -> np.ndarray:
    """Per setting, that setting's seeds drawn with replacement and re-reduced by its rule
    (``seed_reduce``: ``median``/``mean``, or setting -> rule): ``[n_boot, B, T]``."""
    import warnings

    rules = [seed_reduce.get(s, "median") if isinstance(seed_reduce, Mapping) else seed_reduce for s in sm.settings]
    use_mean = np.array([r == "mean" for r in rules])  # [T], broadcast over [chunk, B, T]

    if reduced is None or "seed" not in reduced.columns:
        raise ResultsError("resample='seeds' needs the unreduced table (with a seed column)")
    B, T = sm.values.shape
    cube, _ = _seed_cube(reduced, sm)  # [B, T, S]
    counts = np.sum(np.any(~np.isnan(cube), axis=0), axis=-1)  # seeds per setting [T]
    if np.any(counts < 1):
        raise ResultsError("a setting has no seeds to resample")
    u = rng.random((n_boot, T, cube.shape[-1]))
    pick = np.minimum((u * counts[None, :, None]).astype(int), counts[None, :, None] - 1)
    bi = np.arange(B)[None, :, None, None]
    ti = np.arange(T)[None, None, :, None]
    boot_vals = np.empty((n_boot, B, T))
    gstep = max(1, int(_BOOT_CHUNK_ELEMS // max(1, B * T * cube.shape[-1])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for c0 in range(0, n_boot, gstep):
            g = cube[bi, ti, pick[c0 : c0 + gstep, None, :, :]]  # [chunk, B, T, S]
            boot_vals[c0 : c0 + gstep] = np.where(use_mean, np.nanmean(g, axis=-1), np.nanmedian(g, axis=-1))
    return boot_vals


def _aggregate_resamples(boot_vals: np.ndarray, boot_codes, ddof: int, bar=None) -> dict[str, np.ndarray]:
    """Every aggregation of every resample, chunked: average ranks compare every backbone pair
    (memory ~ B*B*T per resample)."""
    n_boot, B, T = boot_vals.shape
    step = max(1, int(_BOOT_CHUNK_ELEMS // max(1, B * B * T)))
    parts = []
    for c0 in range(0, n_boot, step):
        bc = boot_codes
        if bc is not None and bc.ndim == 3:
            bc = bc[c0 : c0 + step]
        parts.append(_aggregate_arrays(boot_vals[c0 : c0 + step], bc, ddof))
        if bar is not None:
            bar.update(min(step, n_boot - c0))
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def _interval_rows(backbones, point, boot, q: float) -> list[dict]:
    import warnings

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for a in point:
            lo = np.nanquantile(boot[a], q, axis=0)
            hi = np.nanquantile(boot[a], 1 - q, axis=0)
            for i, b in enumerate(backbones):
                rows.append({"backbone": b, "aggregation": a, "estimate": point[a][i], "lo": lo[i], "hi": hi[i]})
    return rows


def _difference_rows(backbones, point, boot, q: float, pairs_for) -> list[dict]:
    """Paired differences between every two backbones (same resamples for both)."""
    import warnings

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for a in pairs_for:
            if a not in point:
                continue
            for i, j in itertools.combinations(range(len(backbones)), 2):
                d = boot[a][:, i] - boot[a][:, j]
                rows.append(
                    {
                        "aggregation": a,
                        "a": backbones[i],
                        "b": backbones[j],
                        "diff": point[a][i] - point[a][j],
                        "lo": float(np.nanquantile(d, q)),
                        "hi": float(np.nanquantile(d, 1 - q)),
                        "p_le_0": float(np.nanmean(d <= 0)),
                    }
                )
    return rows


def _agreement_rows(boot, q: float, n_boot: int, bar=None) -> list[dict]:
    """Kendall tau-b between every two aggregations across resamples (VTAB Appendix E);
    ``bar`` advances by ``n_boot`` over all pairs."""
    rows = []
    pairs = list(itertools.combinations([k for k in AGGREGATIONS if k in boot], 2))
    for i, (a, b) in enumerate(pairs):
        sa = 1 if HIGHER_IS_BETTER[a] else -1
        sb = 1 if HIGHER_IS_BETTER[b] else -1
        taus = np.array(
            [stats.kendall_tau_b(sa * boot[a][k], sb * boot[b][k], method="asymptotic")[0] for k in range(n_boot)]
        )
        if bar is not None:
            bar.update(n_boot * (i + 1) // len(pairs) - n_boot * i // len(pairs))
        ok = ~np.isnan(taus)
        rows.append(
            {
                "a": a,
                "b": b,
                "tau_mean": float(taus[ok].mean()) if ok.any() else float("nan"),
                "tau_lo": float(np.quantile(taus[ok], q)) if ok.any() else float("nan"),
                "tau_hi": float(np.quantile(taus[ok], 1 - q)) if ok.any() else float("nan"),
            }
        )
    return rows


def _seed_cube(raw, sm: ScoreMatrix) -> tuple[np.ndarray, list]:
    """[B, T, S] array of per-seed values for the settings/backbones of ``sm`` (NaN padded);
    seed slot k of a setting is the k-th smallest seed seen in that setting."""
    pl = _pl()
    raw = raw.filter(pl.col("setting").is_in(sm.settings) & pl.col("backbone").is_in(sm.backbones))
    seeds_per = {s: sorted(set(raw.filter(pl.col("setting") == s)["seed"].to_list())) for s in sm.settings}
    S = max(1, max(len(v) for v in seeds_per.values()))
    cube = np.full((len(sm.backbones), len(sm.settings), S), np.nan)
    bi = {b: i for i, b in enumerate(sm.backbones)}
    si = {s: j for j, s in enumerate(sm.settings)}
    # keep only the ranked metric per setting: value must match the matrix's metric; the caller
    # passes rows already filtered to that metric
    for r in raw.iter_rows(named=True):
        s = r["setting"]
        cube[bi[r["backbone"]], si[s], seeds_per[s].index(r["seed"])] = r["value"]
    return cube, [seeds_per[s] for s in sm.settings]


# ---------------------------------------------------------------------------------------------
# calibration and efficiency
# ---------------------------------------------------------------------------------------------


def calibration_summary(reduced, *, accuracy_metric: str = "top1", metrics: Sequence[str] = ("ece", "nll")):
    """Per (task, backbone): accuracy with ECE and NLL (rows of kind probe/finetune), plus
    Pearson correlations of each calibration metric with accuracy per task.

    Returns ``(table, correlations)``; correlations has task, metric, r, p_value, n.
    """
    pl = _pl()
    from scipy.stats import pearsonr

    metrics = [m for m in metrics if m != accuracy_metric]
    want = [accuracy_metric, *metrics]
    sub = reduced.filter(pl.col("metric").is_in(want))
    if sub.filter(pl.col("metric").is_in(list(metrics))).height == 0:
        raise ResultsError(f"no calibration rows (metrics {list(metrics)}) in the results")
    table = sub.pivot(on="metric", index=["kind", "task", "backbone"], values="value").sort(["task", "backbone"])
    for m in want:
        if m not in table.columns:
            table = table.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
    table = table.select("kind", "task", "backbone", *want)
    rows = []
    for (kind, task), g in table.group_by(["kind", "task"], maintain_order=True):
        for m in metrics:
            gg = g.drop_nulls([accuracy_metric, m])
            if gg.height < 3 or np.ptp(gg[m].to_numpy()) == 0 or np.ptp(gg[accuracy_metric].to_numpy()) == 0:
                r = p = float("nan")
            else:
                res = pearsonr(gg[accuracy_metric].to_numpy(), gg[m].to_numpy())
                r, p = float(res.statistic), float(res.pvalue)  # pyright: ignore[reportAttributeAccessIssue]  # scipy's result class declares neither
            rows.append({"kind": kind, "task": task, "metric": m, "r": r, "p_value": p, "n": gg.height})
    corr = pl.DataFrame(
        rows,
        schema={
            "kind": pl.Utf8,
            "task": pl.Utf8,
            "metric": pl.Utf8,
            "r": pl.Float64,
            "p_value": pl.Float64,
            "n": pl.Int64,
        },
    )
    return table, corr


#: catalog columns that say how a throughput was measured (torch threads, 1-minute load
#: average when the extraction started); stores written before they were recorded lack them
THROUGHPUT_CONDITIONS = ("extract_threads", "load_avg")
#: two extractions whose load averages differ by at least this much ran on a differently busy
#: machine (about one more busy core): their throughputs are not comparable
LOAD_AVG_TOLERANCE = 1.0


def throughput_conditions(provenance):
    """Per backbone, how its throughput was measured: ``extract_threads`` (the distinct thread
    counts of its extractions, ``"2"`` or ``"1, 2"``) and ``load_avg`` (``"4.2"`` or the range
    ``"3.9 to 5.2"``), as text; ``"not recorded"`` where the catalog has no such value."""
    pl = _pl()

    def values(g, col: str) -> list[float]:
        if col not in g.columns:
            return []
        return [float(v) for v in g[col].cast(pl.Float64).drop_nulls().to_list() if v == v]

    rows = []
    for (b,), g in provenance.group_by(["backbone"], maintain_order=True):
        t, ld = values(g, "extract_threads"), values(g, "load_avg")
        lo, hi = (f"{min(ld):.1f}", f"{max(ld):.1f}") if ld else ("", "")
        rows.append(
            {
                "backbone": b,
                "extract_threads": ", ".join(str(int(x)) for x in sorted(set(t))) or "not recorded",
                "load_avg": ("not recorded" if not ld else lo if lo == hi else f"{lo} to {hi}"),
            }
        )
    return pl.DataFrame(rows, schema={"backbone": pl.Utf8, "extract_threads": pl.Utf8, "load_avg": pl.Utf8})


def throughput_note(provenance) -> tuple[str, bool]:
    """Whether the throughputs of different backbones in ``provenance`` (a catalog with
    ``images_per_s`` and, from newer stores, :data:`THROUGHPUT_CONDITIONS`) can be compared: a
    throughput depends on the torch threads and on the machine's load, not on the backbone alone.
    Returns the sentence the report prints and whether they are comparable."""
    pl = _pl()
    rows = provenance.filter(pl.col("images_per_s").is_not_null())
    have = [c for c in THROUGHPUT_CONDITIONS if c in rows.columns]
    cond = rows.select("backbone", *[pl.col(c).cast(pl.Float64) for c in have])
    recorded = cond.drop_nulls().filter(~pl.any_horizontal(pl.col(c).is_nan() for c in have)) if have else cond.clear()
    missing = sorted(set(cond["backbone"].to_list()) - set(recorded["backbone"].to_list()))
    if len(have) < len(THROUGHPUT_CONDITIONS) or recorded.height == 0:
        return (
            "Threads and machine load were not recorded for these extractions (stores written before "
            "featcache recorded them): each throughput depends on them as much as on the backbone, so the "
            "throughputs of different backbones are not comparable."
        ), False
    out = []
    if missing:
        out.append(
            f"Threads and machine load were not recorded for {', '.join(missing)}: its throughput is not "
            "comparable with the others'."
        )
    comparable = not missing
    threads = sorted({int(t) for t in recorded["extract_threads"].to_list()})
    loads = recorded["load_avg"]
    spread = float(loads.max() - loads.min())
    if len(threads) > 1 or spread >= LOAD_AVG_TOLERANCE:
        comparable = False
        what = []
        if len(threads) > 1:
            what.append(f"thread counts ({', '.join(map(str, threads))})")
        if spread >= LOAD_AVG_TOLERANCE:
            what.append(f"load averages ({loads.min():.1f} to {loads.max():.1f})")
        out.append(
            f"The throughputs were measured at different {' and '.join(what)}, so they are not comparable "
            "between backbones (a busy machine or fewer threads slows any backbone); re-extract at one "
            "--threads on an idle machine to compare them."
        )
    elif recorded["backbone"].n_unique() > 1:
        out.append(
            f"Every throughput was measured at {threads[0]} thread(s) with a load average of "
            f"{loads.min():.1f} to {loads.max():.1f} (within {LOAD_AVG_TOLERANCE:g}): comparable."
        )
    return " ".join(out), comparable


def efficiency_summary(provenance, overall=None):
    """Throughput and peak memory per backbone from a provenance/catalog DataFrame passed by
    the caller (columns backbone, images_per_s, optionally peak_memory_bytes / peak_mem*), with
    the threads and load average it was measured at (:func:`throughput_conditions`).

    With ``overall`` (from :func:`aggregate`), adds the z-score and the Spearman correlation
    between throughput and z-score (BoB reports rho = -0.41). Returns ``(table, rho, p)``.
    """
    pl = _pl()
    if provenance is None or "backbone" not in provenance.columns or "images_per_s" not in provenance.columns:
        raise ResultsError("efficiency summary needs a DataFrame with columns backbone and images_per_s")
    mem_cols = [c for c in provenance.columns if c.startswith("peak_mem")]
    aggs = [pl.col("images_per_s").cast(pl.Float64).median().alias("images_per_s")]
    aggs += [pl.col(c).cast(pl.Float64).max().alias(c) for c in mem_cols]
    table = provenance.group_by("backbone").agg(aggs).sort("backbone")
    table = table.join(throughput_conditions(provenance), on="backbone", how="left")
    rho = p = float("nan")
    if overall is not None:
        table = table.join(overall.select("backbone", "zscore"), on="backbone", how="left")
        t = table.drop_nulls(["images_per_s", "zscore"])
        if t.height >= 3:
            from scipy.stats import spearmanr

            res = spearmanr(t["images_per_s"].to_numpy(), t["zscore"].to_numpy())
            rho, p = float(res.statistic), float(res.pvalue)  # pyright: ignore[reportAttributeAccessIssue]  # scipy's result class declares neither
    return table, rho, p


# ---------------------------------------------------------------------------------------------
# random-init baselines
# ---------------------------------------------------------------------------------------------

#: what the report appends to a random-init backbone's name wherever it is ranked
BASELINE_SUFFIX = " (random baseline)"
#: a store's ``weights`` of a seeded random init (``--weights random:SEED``) ...
_RANDOM_WEIGHTS = re.compile(r"random:\d+")
#: ... and the backbone key extract gives it without ``--backbone-name`` (``MODEL@randomSEED``)
_RANDOM_KEY = re.compile(r".+@random\d+")


def random_baselines(backbones: Sequence[str], catalog=None) -> set[str]:
    """The backbones of ``backbones`` whose weights are a seeded random init: the store
    catalog's ``weights`` where it names the backbone (``random:SEED``; it holds the weights
    whatever ``--backbone-name`` was), else the key extract gives them (``MODEL@randomSEED``).
    A results table records no weights, so without a catalog the key is all there is."""
    weights: dict[str, set[str]] = {}
    if catalog is not None and {"backbone", "weights"} <= set(catalog.columns):
        for b, w in catalog.select("backbone", "weights").iter_rows():
            if w:
                weights.setdefault(b, set()).add(str(w))
    out = set()
    for b in backbones:
        known = weights.get(b)
        random = all(_RANDOM_WEIGHTS.fullmatch(w) for w in known) if known else bool(_RANDOM_KEY.fullmatch(b))
        if random:
            out.add(b)
    return out


# ---------------------------------------------------------------------------------------------
# per-setting differences between backbones
# ---------------------------------------------------------------------------------------------

#: settings with at most this many paired seeds get the exact bootstrap (all S**S draws)
EXACT_SEED_DRAWS = 5


def setting_differences(
    rows,
    sm: ScoreMatrix,
    reference: str,
    *,
    rules: Mapping[str, str] | None = None,
    level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
):
    """Per setting, each backbone's score minus ``reference``'s with a paired seed bootstrap
    interval: the two backbones' seeds drawn with the same indices (seed k with seed k), each
    side reduced by the setting's rule (``rules``: setting -> median/mean), the difference's
    ``level`` quantiles. Up to :data:`EXACT_SEED_DRAWS` paired seeds every one of the S**S draws
    is used (the exact bootstrap), above that ``n_boot`` seeded draws. ``rows``: the unreduced
    rows of the ranked metric (setting, backbone, seed, value). With one paired seed there is
    nothing to resample: no interval, and ``interval`` says so."""
    pl = _pl()
    q = (1 - level) / 2
    ref = sm.backbones.index(reference)
    out = []
    for j, s in enumerate(sm.settings):
        sub = rows.filter(pl.col("setting") == s)
        per = {b: dict(zip(g["seed"].to_list(), g["value"].to_list())) for (b,), g in sub.group_by(["backbone"])}
        reduce = np.mean if (rules or {}).get(s, "median") == "mean" else np.median
        for i, b in enumerate(sm.backbones):
            if i == ref:
                continue
            common = sorted(set(per.get(b, {})) & set(per.get(reference, {})))
            row = {"setting": s, "backbone": b, "reference": reference, "diff": sm.values[i, j] - sm.values[ref, j]}
            row |= {"lo": None, "hi": None, "n_seeds": len(common)}
            if len(common) < 2:
                row["interval"] = f"none: {len(common)} paired seed(s), nothing to resample"
            else:
                a = np.array([per[b][k] for k in common])
                r = np.array([per[reference][k] for k in common])
                S = len(common)
                if S <= EXACT_SEED_DRAWS:
                    draws = np.array(list(itertools.product(range(S), repeat=S)))
                    row["interval"] = f"paired seed bootstrap, exact (all {S**S} draws of {S} seeds)"
                else:
                    draws = np.random.default_rng(seed).integers(0, S, size=(n_boot, S))
                    row["interval"] = f"paired seed bootstrap ({n_boot} draws of {S} seeds, seed {seed})"
                d = reduce(a[draws], axis=1) - reduce(r[draws], axis=1)
                row["lo"], row["hi"] = float(np.quantile(d, q)), float(np.quantile(d, 1 - q))
            out.append(row)
    schema = {
        "setting": pl.Utf8,
        "backbone": pl.Utf8,
        "reference": pl.Utf8,
        "diff": pl.Float64,
        "lo": pl.Float64,
        "hi": pl.Float64,
        "n_seeds": pl.Int64,
        "interval": pl.Utf8,
    }
    return pl.DataFrame(out, schema=schema)
