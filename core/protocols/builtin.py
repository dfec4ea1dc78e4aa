"""The built-in protocols (the table in :mod:`featcache.core.protocols`). A protocol without an
argument is one :func:`register_fixed_protocol` call; one with an argument (``fewshot:N``) a
factory under :func:`register_protocol` that parses it."""

from __future__ import annotations

import re
from typing import Any

from featcache.core.protocols.base import Protocol, register_fixed_protocol, register_protocol
from featcache.core.protocols.grids import (
    BOB_LARS,
    DINOV2_C_GRID,
    DINOV2_LINEAR,
    ELEVATER_SGD,
    SALMAN_SGD,
    VTAB_SGD,
    AttentiveGrid,
    CGrid,
    EpGrid,
)
from featcache.errors import ProtocolError

__all__: list[str] = []

#: what every VTAB-1k protocol shares: three seeds, the median reported, the val source chosen
VTAB1K = {"seeds": (0, 1, 2), "median_over_seeds": True, "val_source_choice": True}
#: ELEVATER's tables: the mean +/- std over the seeds
ELEVATER: dict[str, Any] = {"seed_rule": "mean"}

register_fixed_protocol(
    "full", note="z-scored features", split="full", solver="lbfgs", grid=CGrid(), pairs_with="full", table_label=""
)
register_fixed_protocol(
    "dinov2",
    note="raw features, DINOv2's exact selection",
    doc="DINOv2's logistic regression as published: raw features (no standardisation), tol 1e-12, at most "
    "1000 iterations, its 45-value C grid, selection on a random 10 %.",
    split="dinov2",
    solver="lbfgs",
    grid=CGrid(DINOV2_C_GRID, fixed=(("standardize", False), ("tol", 1e-12), ("max_iter", 1000))),
)


def _shots(name: str, arg: str | None, what: str = "hyper-parameters") -> int:
    """The shot count N >= 2 of ``name:N``."""
    m = re.fullmatch(r"\d+", arg or "")
    if not m:
        raise ProtocolError(f"{name} needs a shot count, e.g. {name}:5 (got {arg!r})")
    n = int(m.group(0))
    if n < 2:
        raise ProtocolError(
            f"{name}:{n} cannot work: the 80/20 per-class split for selecting {what} "
            "needs at least one training and one validation example per class, so N >= 2 "
            "(ELEVATER uses N = 5, 20, 50)"
        )
    return n


@register_protocol("fewshot", usage="fewshot:N (N >= 2)")
def fewshot(arg: str | None = None) -> Protocol:
    n = _shots("fewshot", arg, "C")
    return Protocol(f"fewshot:{n}", "fewshot", "probe", "fewshot", "lbfgs", CGrid(), seeds=(0, 1, 2), shots=n)


@register_protocol("elevater-fewshot", usage="elevater-fewshot:N (N >= 1)")
def elevater_fewshot(arg: str | None = None) -> Protocol:
    n = 1 if arg == "1" else _shots("elevater-fewshot", arg)  # N = 1: the toolkit draws 2
    name = "elevater-fewshot"
    return Protocol(f"{name}:{n}", name, "probe", name, "elevater", ELEVATER_SGD, seeds=(0, 1, 2), shots=n, **ELEVATER)


register_fixed_protocol(
    "elevater-full", split="elevater-full", solver="elevater", grid=ELEVATER_SGD, holdout_order="dataset", **ELEVATER
)
register_fixed_protocol(
    "zeroshot", split="none", solver="zeroshot", grid=CGrid(Cs=()), shots=0, table_label="zero-shot"
)
register_fixed_protocol("vtab1k", split="vtab1k", solver="lbfgs", grid=CGrid(), **VTAB1K)
register_fixed_protocol("vtab1k-stratified", split="vtab1k-stratified", solver="lbfgs", grid=CGrid(), **VTAB1K)
register_fixed_protocol("vtab1k-sgd", split="vtab1k", solver="sgd", grid=VTAB_SGD, pairs_with="vtab1k-light", **VTAB1K)
register_fixed_protocol("salman", split="full", solver="sgd", grid=SALMAN_SGD)
register_fixed_protocol(
    "bob-linear",
    doc="Battle of the Backbones' linear probe (LarsGrid) trained on all of train.",
    split="train",
    solver="lars",
    grid=BOB_LARS,
    layer_selection="val-split",  # it holds out nothing: a layer sweep selects on the val split
)
register_fixed_protocol(
    "dinov2-linear",
    note="DINOv2's 52 jointly trained linear heads",
    doc="DINOv2's linear evaluation (Dinov2LinearGrid) on the class tokens of the last blocks and the mean "
    "patch token (the dinov2-linear solver builds that input).",
    split="no-refit",
    solver="dinov2-linear",
    grid=DINOV2_LINEAR,
)


@register_protocol("attentive", usage="attentive:VARIANT (e.g. vjepa, aim)", note="a learned-query head grid on tokens")
def attentive(arg: str | None = None) -> Protocol:
    """Attentive probes on token features (:class:`AttentiveGrid`): a head variant (V-JEPA's,
    AIM's: the attentive solver's registry, which refuses one it does not build when the probe
    config is made), a 4 lr x 5 wd grid trained together, the best head chosen on validation
    (the dataset's val split, else a stratified 10% of train, as ``full``), reported on test
    without a refit."""
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", arg or ""):
        raise ProtocolError(f"attentive needs a head variant: e.g. attentive:vjepa or attentive:aim (got {arg!r})")
    assert arg is not None  # matched above
    if arg == "ep":  # the efficient probe: one head, LARS, its best epoch on val (probes/attentive_ep.py)
        return Protocol("attentive:ep", "attentive", "probe", "no-refit", "attentive-ep", EpGrid(), kind="tokens")
    grid = AttentiveGrid(variant=arg)
    return Protocol(f"attentive:{arg}", "attentive", "probe", "no-refit", "attentive", grid, kind="tokens")


@register_protocol("subset", usage="subset:F% (e.g. subset:1%, subset:10%)")
def subset(arg: str | None = None) -> Protocol:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", arg or "")
    if not m:
        raise ProtocolError(f"subset needs a percentage, e.g. subset:10% (got {arg!r})")
    pct = float(m.group(1))
    if not 0 < pct < 100:
        raise ProtocolError(f"subset fraction must lie in (0%, 100%), got subset:{arg}; use 'full' for all data")
    return Protocol(f"subset:{m.group(1)}%", "subset", "probe", "subset", "lbfgs", CGrid(), fraction=pct / 100)


register_fixed_protocol(
    "vtab1k-light",
    stage="finetune",
    note="1000 examples, 800/200 selection, as in VTAB Fig. 16",
    split="vtab1k",
    solver="sgd",
    grid=VTAB_SGD,
    seeds=(0, 1, 2),
    pairs_with="vtab1k-sgd",
    val_source_choice=True,
)
register_fixed_protocol(
    "full", stage="finetune", note="all of train", split="full", solver="sgd", grid=VTAB_SGD, pairs_with="full"
)
