"""Evaluation protocols as one registry: split plan, default seeds, hyper-parameter grid,
solver and pairing, for the probes (frozen features) and fine-tuning (images) alike.

Protocols are registered in the style of timm's ``register_model``: a factory decorated with
:func:`register_protocol` builds a frozen :class:`Protocol` from the spec's argument
(``fewshot:5`` calls the ``fewshot`` factory with ``"5"``); :func:`get_protocol` parses a
spec and :func:`list_protocols` names what is registered. Probe and fine-tune protocols live
in separate namespaces (``stage``), so ``full`` exists for both.

=============  ======  =====================================================================
spec           stage   meaning
=============  ======  =====================================================================
full           probe   DINOv2/Kornblith-style L-BFGS logistic regression on **standardised**
                       features (z-score with training statistics): C selected on
                       validation (the dataset's ``val`` split if it has one, else a
                       stratified, seeded 10% of train), refit on train+val, test once.
dinov2         probe   DINOv2's ``log_regression.py`` exactly: raw features, tol 1e-12,
                       max_iter 1000, its C grid, a plain random 10% (torch ``randperm``
                       seeded like ``torch.manual_seed(seed)``) unless the dataset has val.
fewshot:N      probe   ELEVATER's few-shot splits with the DINOv2-style L-BFGS C sweep (not
                       ELEVATER's search: see ``elevater-fewshot``): N examples per class
                       drawn from train (N counts *before* the 80/20 split), each class
                       split 80/20 (val = max(1, round(0.2 N)) per class) for selecting C,
                       refit on all N per class. N >= 2.
elevater-      probe   ELEVATER as published: the ``fewshot:N`` splits (or ``full``'s) with
fewshot:N,             its SGD search (:class:`ElevaterGrid`: 6 lrs x coarse-to-fine weight
elevater-full          decay, 10 epochs per trial, 50-epoch final run on train+val) on
                       L2-normalised features x logit scale 1/0.07; with
                       ``head_init`` the head starts from the L2-normalised class text
                       embeddings (ELEVATER's language init), else from zeros.
zeroshot       probe   the text head alone, no training (ELEVATER/CLIP zero-shot): logits =
                       normalised features . normalised class text embeddings
                       (``head_init``, default ``text``, stored per backbone x dataset).
vtab1k         probe   VTAB-1k as published: the first 800 of train and the first 200 of
                       the val source in the dataset's own order (the store's row order),
                       the same examples for every seed; select on the 200, retrain on the
                       1000. ``val_source``: ``split-800-200`` (default; val =
                       train[800:1000]) or ``official-val`` (val = val[:200]). Seeds 0, 1, 2
                       differ only in training randomness; each seed plus the median.
vtab1k-        probe   the earlier featcache rule: 1000 train examples drawn stratified per
stratified             seed, 800 / 200 stratified; ``official-val`` fits on the 1000 and
                       selects on the whole val split.
vtab1k-sgd     probe   VTAB-1k splits with the lightweight SGD schedule (batch 512, momentum
                       0.9, lr {0.1, 0.01} x {2500, 10000} steps, lr /10 at 1/3, 2/3 and
                       ``last_decay`` of the steps; no weight decay; every batch full, as
                       VTAB's ``drop_remainder`` and fine-tuning). VTAB Figure 16's linear
                       baseline: rows pair with fine-tune ``vtab1k-light``.
salman         probe   Salman et al.: SGD head, 150 epochs, batch 64, momentum 0.9, weight
                       decay 5e-4, lr {0.01, 0.001} selected on validation (as ``full``),
                       lr /10 every 50 epochs, refit on train+val.
bob-linear     probe   Battle of the Backbones' linear probe (bob-classification
                       ``linear_probe.py``, after MAE): BatchNorm (affine=False) + linear
                       head, LARS, 90 epochs, lr 0.1 x batch / 256 (batch 512), 10 warmup
                       epochs then cosine, no weight decay, on all of train; nothing is
                       selected; the last epoch is reported (BoB reports its best test epoch).
dinov2-linear  probe   DINOv2's ``eval/linear.py``: 52 linear heads (n_last_blocks {1, 4} x avgpool
                       {no, yes} x 13 lrs) trained jointly on the class tokens of the last
                       blocks (+ the mean patch token), SGD momentum 0.9, no weight decay,
                       cosine over 10 x 1250 iterations of batch 128, lr x batch / 256, heads
                       N(0, 0.01); the best head on val (the dataset's, else a seeded 10%
                       holdout) is reported on test without a refit (as the reference).
attentive:V    probe   attentive probes on ``tokens`` (V = ``vjepa``: V-JEPA's
                       AttentiveClassifier; ``aim``: AIM's AttentionPoolingClassifier): a
                       4 lr x 5 wd grid of heads trained together with V-JEPA's AdamW recipe
                       (cosine lr and wd, grad clip 1.0, 20 epochs), the best head chosen on
                       validation (as ``full``), reported on test without a refit.
subset:F%      probe   Battle of the Backbones: stratified F% of train (label distribution
                       kept, at least one example per class), then ``full`` on that subset.
vtab1k-light   fine-   VTAB lightweight fine-tuning on the ``vtab1k`` splits; SGD grid as
               tune    ``vtab1k-sgd``; rows pair with probe ``vtab1k-sgd`` (Figure 16).
full           fine-   all of train, the ``full`` probe splits; rows pair with probe ``full``.
               tune
=============  ======  =====================================================================

A plan (:meth:`Protocol.plan`) works on labels only, in the canonical order of
:mod:`featcache.core.splits`, and returns positions into ``train ++ val`` (val rows follow the
train rows), so a probe row and a fine-tune row of paired protocols train, select and refit
on exactly the same examples for every seed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from featcache.core.registry import Registry
from featcache.core.splits import (
    HOLDOUT_FRACTION,
    VAL_SOURCES,
    VTAB_TOTAL,
    VTAB_VAL,
    elevater_holdout,
    elevater_holdout_multilabel,
    fewshot_split,
    full_holdout,
    sample_per_class,
    stratified_sample,
    subset_indices,
    vtab1k_fixed,
    vtab1k_indices,
)
from featcache.errors import InternalError, ProtocolError, SplitError

__all__ = [
    "C_GRID",
    "STAGES",
    "VAL_SOURCES",
    "AttentiveGrid",
    "CGrid",
    "Dinov2LinearGrid",
    "ElevaterGrid",
    "LarsGrid",
    "Protocol",
    "SGDGrid",
    "SplitPlan",
    "get_protocol",
    "list_protocols",
    "pairs",
    "parse_protocol",
    "protocol_help",
    "protocol_usages",
    "register_protocol",
]

STAGES = ("probe", "finetune")


def log_grid(lo: int, hi: int, n: int) -> tuple[float, ...]:
    """``np.logspace(lo, hi, n)``, each value the float nearest the exact ``10 ** e``.

    numpy's power kernels differ in the last bit between CPUs (its AVX-512 path is not
    correctly rounded), and a grid's values enter run ids and the fits, so the grid is computed
    in decimal arithmetic (40 digits): the same floats on every machine."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 40
        step = (Decimal(hi) - Decimal(lo)) / (n - 1)
        return tuple(float(Decimal(10) ** (Decimal(lo) + step * i)) for i in range(n))


#: the L-BFGS probes' C grid (Kornblith et al. / DINOv2): 45 values log-spaced over 1e-6 .. 1e5
C_GRID = log_grid(-6, 5, 45)
#: split plans a protocol can name
SPLITS = (
    "full",
    "fewshot",
    "vtab1k",
    "vtab1k-stratified",
    "subset",
    "none",
    "dinov2",
    "elevater-full",
    "elevater-fewshot",
    "train",
    "no-refit",
)
#: DINOv2's C grid (dinov2/eval/log_regression.py: ``10 ** torch.linspace(-6, 5, 45)``, float32):
#: the float32 exponents, each power rounded from its decimal value (float32 power kernels, too,
#: differ in the last bit between CPUs)
DINOV2_C_GRID = tuple(
    float(np.float32(float(Decimal(10) ** Decimal(float(e))))) for e in np.linspace(-6, 5, 45, dtype=np.float32)
)


# ------------------------------------------------------------------ grids
@dataclass(frozen=True)
class CGrid:
    """L-BFGS logistic regression: inverse regularisation strengths searched on validation."""

    Cs: tuple[float, ...] = C_GRID
    #: solver settings the protocol fixes whatever the config says, e.g. DINOv2's
    #: ``(("standardize", False), ("tol", 1e-12), ("max_iter", 1000))``
    fixed: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class SGDGrid:
    """SGD schedule and grid. ``steps`` (fixed schedule lengths, VTAB) or ``epochs`` (the
    schedule follows each fit's data size, Salman et al.); lr divided by 10 at the
    :meth:`milestones`."""

    lrs: tuple[float, ...]
    batch_size: int
    momentum: float = 0.9
    weight_decay: float = 0.0
    steps: tuple[int, ...] | None = None
    epochs: int | None = None
    last_decay: float | None = None  # fraction of steps of the third lr drop (steps grids)
    drop_remainder: bool = False  # every batch full (VTAB; featcache's fine-tuning)
    #: epoch grids: the refit trains ``epochs`` passes over its own (larger) data, not the
    #: selection fits' step count (Salman et al.)
    refit_epochs: bool = False
    #: the head's start without head_init: "zeros" or "torch-default" (nn.Linear's default
    #: initialisation, seeded: Salman et al.'s fine_tunify.py builds a fresh nn.Linear)
    init: str = "zeros"
    #: schedule entries of the selected config recorded in the results row's hparams
    recorded: tuple[str, ...] = ("lr", "steps", "batch_size", "momentum", "weight_decay")

    @property
    def run_options(self) -> tuple[str, ...]:
        """The probe config's schedule options that enter run ids: the epoch count
        (epoch grids) or the schedule lengths and last lr drop (step grids)."""
        return ("sgd_epochs",) if self.epochs is not None else ("vtab_steps", "last_decay")

    def milestones(self, steps: int, last_decay: float | None = None) -> tuple[int, ...]:
        """Steps at which the lr drops: 1/3, 2/3 and ``last_decay`` of ``steps``."""
        ld = self.last_decay if last_decay is None else last_decay
        if ld is None:
            raise InternalError("milestones of an epochs grid need last_decay")
        return tuple(sorted({steps // 3, 2 * steps // 3, round(ld * steps)}))

    def decay_epochs(self, epochs: int | None = None) -> list[int]:
        """Epochs-based grids: lr /10 every ``epochs // 3`` epochs (at 1/3 and 2/3)."""
        e = self.epochs if epochs is None else epochs
        if e is None:
            raise InternalError("decay_epochs of a steps grid need epochs")
        step_e = max(1, e // 3)
        return [k * step_e for k in (1, 2) if k * step_e < e]


@dataclass(frozen=True)
class ElevaterGrid:
    """ELEVATER's image-classification linear-probe search (paper section 4.1; values from
    the public toolkit Elevater_Toolkit_IC, ``full_model_finetune.py``
    ``hyperparameter_sweep_lr`` / ``hyperparameter_sweep`` and ``config/default.py``): SGD
    (momentum 0.9, no Nesterov, constant lr, batch 64, channel BatchNorm, logit scale 1) over 6 learning rates log-spaced
    1e-6 .. 1e-1; for each, a coarse-to-fine weight-decay search over 97 values log-spaced
    1e-6 .. 1e6: the 7 coarse points (every 16th), then the neighbours at ``spans`` 8, 4,
    2, 1 around the best so far; ``search_epochs`` (10) per trial, the selected (lr, wd)
    retrained for ``final_epochs`` (50) on train+val."""

    lrs: tuple[float, ...] = log_grid(-6, -1, 6)  # the toolkit's np.logspace, the same on every CPU
    wds: tuple[float, ...] = log_grid(-6, 6, 97)
    coarse: tuple[int, ...] = tuple(range(0, 97, 16))
    spans: tuple[int, ...] = (8, 4, 2, 1)
    search_epochs: int = 10
    final_epochs: int = 50
    batch_size: int = 64  # the toolkit's feature loader (get_dataloader's default)
    momentum: float = 0.9
    nesterov: bool = False  # NESTEROV: False in every shipped model config
    features: str = "bn"  # USE_CHANNEL_BN default; "l2": L2-normalised x logit_scale
    logit_scale: float = 1.0  # LOGIT_SCALE_INIT 'none': exp(0)


@dataclass(frozen=True)
class LarsGrid:
    """Battle of the Backbones' linear probe (bob-classification ``linear_probe.py``, after
    MAE's ``main_linprobe.py``): BatchNorm1d(affine=False, eps 1e-6) + linear head, LARS
    (momentum 0.9, trust coefficient 0.001), lr = ``blr`` x batch / 256, ``warmup_epochs``
    of linear warmup then a half-cycle cosine to ``min_lr``, ``epochs`` epochs of
    ``batch_size`` rows (last partial batch dropped), no weight decay. Nothing is selected."""

    blr: float = 0.1
    batch_size: int = 512
    epochs: int = 90
    warmup_epochs: int = 10
    min_lr: float = 0.0
    weight_decay: float = 0.0
    momentum: float = 0.9
    trust_coefficient: float = 0.001
    bn_eps: float = 1e-6


@dataclass(frozen=True)
class Dinov2LinearGrid:
    """DINOv2's linear evaluation (``dinov2/eval/linear.py``: ``get_args_parser`` defaults,
    ``setup_linear_classifiers``, ``run_eval_linear``): one linear head per (n_last_blocks,
    avgpool, lr), all trained at once on the same batches; SGD (momentum 0.9, weight decay 0),
    each head's lr = lr x batch x world / 256 (world 1 here), ``CosineAnnealingLR`` to 0 over
    ``epochs x epoch_length`` iterations (an epoch is ``epoch_length`` iterations, not a pass
    over the data); heads' weight N(0, ``init_std``), bias 0."""

    lrs: tuple[float, ...] = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
    n_last_blocks: tuple[int, ...] = (1, 4)
    avgpool: tuple[bool, ...] = (False, True)
    batch_size: int = 128
    epochs: int = 10
    epoch_length: int = 1250
    momentum: float = 0.9
    weight_decay: float = 0.0
    init_std: float = 0.01
    sampler_seed: int = 0  # run_eval_linear's ``seed = 0`` for its ShardedInfiniteSampler


DINOV2_LINEAR = Dinov2LinearGrid()


#: the attentive probes' heads (:mod:`featcache.probes.attentive_modules`)
ATTENTIVE_VARIANTS = ("vjepa", "aim")


@dataclass(frozen=True)
class AttentiveGrid:
    """Attentive probes on tokens (:mod:`featcache.probes.attentive`): ``variant``'s head
    (``vjepa``: V-JEPA's AttentiveClassifier; ``aim``: AIM's AttentionPoolingClassifier), one
    per ``lrs`` x ``wds`` (V-JEPA 2's image-probe grid, 20 heads), trained together with V-JEPA's
    recipe: AdamW, lr cosine from each head's lr to ``final_lr`` after ``warmup_epochs`` (from
    ``start_lr``; None: the head's lr), weight decay cosine from each head's wd to ``final_wd``,
    gradient norm clipped to ``clip`` per head, ``epochs`` epochs of ``batch_size`` rows (V-JEPA:
    20 epochs, 16 x 64 GPUs); rows read in blocks of ``block_bytes`` float32 bytes."""

    variant: str
    lrs: tuple[float, ...] = (5e-4, 1e-3, 1.5e-3, 2e-3)
    wds: tuple[float, ...] = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
    epochs: int = 20
    batch_size: int = 1024
    warmup_epochs: float = 0.0
    start_lr: float | None = None
    final_lr: float = 0.0
    final_wd: float = 1e-6
    clip: float = 1.0
    block_bytes: int = 256 << 20


BOB_LARS = LarsGrid()
#: VTAB's third lr drop, at 90 % of the steps
VTAB_LAST_DECAY = 0.9
ELEVATER_SGD = ElevaterGrid()
VTAB_SGD = SGDGrid(
    lrs=(0.1, 0.01),
    batch_size=512,
    momentum=0.9,
    weight_decay=0.0,
    steps=(2500, 10000),
    last_decay=VTAB_LAST_DECAY,
    drop_remainder=True,
    recorded=("lr", "steps", "batch_size", "momentum", "weight_decay", "drop_remainder", "last_decay", "milestones"),
)
SALMAN_SGD = SGDGrid(
    lrs=(0.01, 0.001),
    batch_size=64,
    momentum=0.9,
    weight_decay=5e-4,
    epochs=150,
    refit_epochs=True,
    init="torch-default",
    recorded=("lr", "batch_size", "momentum", "weight_decay", "epochs", "lr_decay_epochs"),
)


# ------------------------------------------------------------------ plans
@dataclass
class SplitPlan:
    """Positions one seed trains on (``train``), selects on (``val``) and refits on
    (``final``). Positions index ``train ++ val``: ``i < n_train`` is train row ``i``,
    ``n_train + j`` is val row ``j``."""

    train: np.ndarray
    val: np.ndarray
    final: np.ndarray
    train_split: str  # the label recorded in result rows, e.g. "train[1000]", "train+val"
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Protocol:
    """A named evaluation protocol (build with :func:`get_protocol`)."""

    spec: str  # canonical text recorded in result rows, e.g. "fewshot:5", "subset:10%"
    name: str  # registry name, e.g. "fewshot"
    stage: str  # "probe" or "finetune"
    split: str  # split plan: one of SPLITS
    solver: str  # "lbfgs" or "sgd"
    grid: CGrid | SGDGrid | ElevaterGrid | LarsGrid | Dinov2LinearGrid | AttentiveGrid
    seeds: tuple[int, ...] = (0,)
    pairs_with: str | None = None  # the other stage's protocol with the same examples
    shots: int = -1  # examples per class, -1 = all
    fraction: float | None = None  # subset fraction
    median_over_seeds: bool = False  # report the median row (VTAB) beside each seed
    #: the plan takes its validation rows where the config's ``val_source`` says (VTAB-1k: 800/200
    #: of train or a val split); runs record the choice (run ids, hparams)
    val_source_choice: bool = False
    #: the order the plan takes its held-out rows in when not the canonical one (``"dataset"``:
    #: the dataset's own, as the ELEVATER toolkit does); runs record it in their run ids
    holdout_order: str | None = None
    #: the feature kind its runs read when the config leaves ``kind`` at ``pooled`` (the
    #: attentive probes: ``tokens``; a ``tokens@GxG`` kind named in the config is kept)
    kind: str | None = None

    @property
    def row_protocol(self) -> str:
        """The protocol name written to result rows: a fine-tune row carries the probe
        protocol it pairs with, so analysis matches them as one task."""
        return self.pairs_with if self.stage == "finetune" and self.pairs_with else self.spec

    def uses_val_split(self, val_source: str = "split-800-200") -> bool:
        """Whether the plan selects on the dataset's own ``val`` split when it has one."""
        if self.split in ("fewshot", "none", "elevater-full", "elevater-fewshot", "train"):
            return False
        return not (self.split.startswith("vtab1k") and val_source == "split-800-200")

    def plan(
        self,
        y: ArrayLike,
        seed: int,
        *,
        n_val: int | None = None,
        val_source: str = "split-800-200",
        train_name: str = "train",
        val_name: str = "val",
        rows: ArrayLike | None = None,
        val_rows: ArrayLike | None = None,
        label_matrix: ArrayLike | None = None,
    ) -> SplitPlan:
        """The seeded split of labels ``y`` (canonical order). ``n_val``: size of the
        dataset's val split when the caller has one (``None``: no val split). ``rows`` /
        ``val_rows``: each canonical position's row in the dataset's own order (the store's
        and the reader's row order), used by the fixed ``vtab1k`` subsets; ``None``: the
        positions are already in that order. ``label_matrix``: the train split's [n, C] 0/1
        multi-label targets in the same order, when it has them (the ``elevater-*`` plans
        take their validation rows from it, as the toolkit does; the others split on ``y``)."""
        y = np.asarray(y)
        rows = np.arange(y.size) if rows is None else np.asarray(rows)
        if n_val is not None and val_rows is None:
            val_rows = np.arange(n_val)
        planner = _PLANNERS[self.split]
        kw = {"rows": rows, "val_rows": val_rows}
        if label_matrix is not None:
            Y = np.asarray(label_matrix)
            if Y.ndim != 2 or Y.shape[0] != y.size:
                raise SplitError(f"label_matrix must be [{y.size}, C] like y; got shape {Y.shape}")
            kw["label_matrix"] = Y
        return planner(self, y, int(seed), n_val, val_source, train_name, val_name, **kw)


def _concat_val(idx: np.ndarray, n_train: int, n_val: int) -> np.ndarray:
    return np.concatenate([idx, n_train + np.arange(n_val)])


def _plan_full(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    idx = np.arange(y.size)
    label = train_name
    info: dict[str, Any] = {}
    if p.split == "subset":
        assert p.fraction is not None  # the subset protocol's parser sets it
        idx = subset_indices(y, p.fraction, seed)
        label = f"{train_name}[{p.spec}]"
        info["n_subset"] = int(idx.size)
    if n_val is not None:
        va = y.size + np.arange(n_val)
        info.update(val="official", val_split=val_name)
        return SplitPlan(idx, va, _concat_val(idx, y.size, n_val), f"{label}+{val_name}", info)
    t, v = full_holdout(y[idx], seed)
    info.update(val=f"holdout-{HOLDOUT_FRACTION:.0%}-of-{train_name}")
    return SplitPlan(idx[t], idx[v], idx, label, info)


def _plan_fewshot(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    t, v = fewshot_split(y, p.shots, seed)
    return SplitPlan(
        t,
        v,
        np.sort(np.concatenate([t, v])),
        f"{train_name}[{p.spec}]",
        {"val": "per-class-80/20", "shots_counted": "before-split"},
    )


#: the validation rule of the ``elevater-*`` plans on a label matrix (the toolkit's greedy fill)
ELEVATER_MULTILABEL_VAL = "greedy-ceil-20%-per-label"


def _elevater_val(pos: np.ndarray, y, rows, Y) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) of canonical positions ``pos`` by ELEVATER's rule, "first" taken in the
    dataset's own order (``rows``: each position's row there) as the toolkit walks its
    manifest: per class on ``y``, or the multi-label greedy fill on ``Y`` when given."""
    pos = pos[np.argsort(np.asarray(rows)[pos], kind="stable")]
    t, v = elevater_holdout(y[pos]) if Y is None else elevater_holdout_multilabel(Y[pos])
    return np.sort(pos[t]), np.sort(pos[v])


def _plan_elevater_full(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **kw) -> SplitPlan:
    """ELEVATER's full-data split: select on the first ceil(20%) per class of train in the
    dataset's own order (the toolkit's ``get_dataloader(val_split=0.2)``; a dataset val split
    is not used), refit on all of train. With a label matrix, the toolkit's multi-label rule
    (:func:`~featcache.core.splits.elevater_holdout_multilabel`)."""
    Y = kw.get("label_matrix")
    t, v = _elevater_val(np.arange(y.size), y, rows, Y)
    rule = "first-ceil-20%-per-class" if Y is None else ELEVATER_MULTILABEL_VAL
    return SplitPlan(t, v, np.arange(y.size), train_name, {"val": f"{rule}-of-{train_name}"})


def _plan_elevater_fewshot(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **kw) -> SplitPlan:
    """``fewshot`` as ELEVATER's ``linear_probe.py`` runs it: N = 1 draws 2 per class and
    does not merge train and val for the final run (MERGE_TRAIN_VAL_FINAL_RUN=False). With a
    label matrix, the N (or 2) per class drawn on ``y`` are split as the toolkit splits its
    few-shot subset: :func:`~featcache.core.splits.elevater_holdout_multilabel` over their rows."""
    Y = kw.get("label_matrix")
    if Y is not None:
        drawn = sample_per_class(y, max(p.shots, 2), seed)
        t, v = _elevater_val(drawn, y, rows, Y)
        info: dict[str, Any] = {"val": ELEVATER_MULTILABEL_VAL, "shots_counted": "before-split"}
        if p.shots == 1:
            info.update(shots_drawn=2, final="train only")
            return SplitPlan(t, v, t, f"{train_name}[{p.spec}]", info)
        return SplitPlan(t, v, drawn, f"{train_name}[{p.spec}]", info)
    if p.shots != 1:
        return _plan_fewshot(p, y, seed, n_val, val_source, train_name, val_name)
    t, v = fewshot_split(y, 2, seed)
    info = {"val": "per-class-80/20", "shots_counted": "before-split", "shots_drawn": 2, "final": "train only"}
    return SplitPlan(t, v, t, f"{train_name}[{p.spec}]", info)


def _check_val_source(val_source: str) -> None:
    if val_source not in VAL_SOURCES:
        raise SplitError(f"val_source must be one of {VAL_SOURCES}, got {val_source!r}")


def _plan_vtab1k(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, val_rows, **_) -> SplitPlan:
    """VTAB's fixed subsets (seed-independent): train[:800] + the first 200 of the val
    source (``split-800-200``: train[800:1000]; ``official-val``: val[:200])."""
    _check_val_source(val_source)
    n_tr = VTAB_TOTAL - VTAB_VAL
    if val_source == "official-val":
        if n_val is None:
            raise SplitError(
                "val_source='official-val' needs a 'val' split; extract it or use val_source='split-800-200'"
            )
        t, v = vtab1k_fixed(rows, val_rows)
        label, val = f"{train_name}[:{n_tr}]+{val_name}[:{VTAB_VAL}]", f"{val_name}[:{VTAB_VAL}]"
    else:
        t, v = vtab1k_fixed(rows)
        label, val = f"{train_name}[:{VTAB_TOTAL}]", f"{train_name}[{n_tr}:{VTAB_TOTAL}]"
    return SplitPlan(
        t, v, np.concatenate([t, v]), label, {"val": val, "val_source": val_source, "subset": "fixed, dataset order"}
    )


def _plan_none(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    e = np.zeros(0, np.int64)
    return SplitPlan(e, e, e, "none", {"trained": False})


def _plan_vtab1k_stratified(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    _check_val_source(val_source)
    label = f"{train_name}[{VTAB_TOTAL}]"
    if val_source == "official-val":
        idx = stratified_sample(y, VTAB_TOTAL, seed)
        if n_val is None:
            raise SplitError(
                "val_source='official-val' needs a 'val' split; extract it or use val_source='split-800-200'"
            )
        return SplitPlan(
            idx,
            y.size + np.arange(n_val),
            idx,
            label,
            {"val": "official", "val_split": val_name, "val_source": val_source},
        )
    t, v = vtab1k_indices(y, seed)
    return SplitPlan(t, v, np.sort(np.concatenate([t, v])), label, {"val": "split-800-200", "val_source": val_source})


def _plan_dinov2(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **_) -> SplitPlan:
    """DINOv2's ``eval_log_regression``: the dataset's val split when it has one (its
    ``finetune_dataset``), else a plain random 10 %: ``torch.manual_seed(seed)``,
    ``randperm(n)`` over the dataset's own row order, the first ``n // 10`` for selection."""
    if n_val is not None:
        return _plan_full(p, y, seed, n_val, val_source, train_name, val_name)
    import torch

    perm = torch.randperm(y.size, generator=torch.Generator().manual_seed(int(seed))).numpy()
    pos_of_row = np.empty(y.size, np.int64)
    pos_of_row[np.asarray(rows)] = np.arange(y.size)  # dataset row -> canonical position
    k = y.size // 10
    v, t = pos_of_row[perm[:k]], pos_of_row[perm[k:]]
    info = {"val": f"dinov2-random-{k}-of-{train_name}"}
    return SplitPlan(t, v, np.arange(y.size), train_name, info)


def _plan_train(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """All of train, nothing held out (a protocol that selects nothing: ``bob-linear``)."""
    e = np.zeros(0, np.int64)
    return SplitPlan(e, e, np.arange(y.size), train_name, {"val": "none (nothing is selected)"})


def _plan_no_refit(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """Train once and select on held-out rows, no refit (a grid of heads trained together:
    ``dinov2-linear``, as ``run_eval_linear`` evaluates the heads it trained, and the attentive
    probes): ``full``'s train and validation rows (the dataset's val split, else a stratified
    seeded 10% of train), the final fit being the train fit, so ``train_split`` names the rows
    actually trained on (``train``, or ``train[90%]`` beside a holdout)."""
    sp = _plan_full(p, y, seed, n_val, val_source, train_name, val_name)
    label = train_name if n_val is not None else f"{train_name}[{1 - HOLDOUT_FRACTION:.0%}]"
    return SplitPlan(sp.train, sp.val, sp.train, label, {**sp.info, "refit": "none"})


_PLANNERS: dict[str, Callable[..., SplitPlan]] = {
    "no-refit": _plan_no_refit,
    "train": _plan_train,
    "dinov2": _plan_dinov2,
    "full": _plan_full,
    "elevater-full": _plan_elevater_full,
    "elevater-fewshot": _plan_elevater_fewshot,
    "subset": _plan_full,
    "fewshot": _plan_fewshot,
    "vtab1k": _plan_vtab1k,
    "vtab1k-stratified": _plan_vtab1k_stratified,
    "none": _plan_none,
}


# ------------------------------------------------------------------ registry
#: stage -> its protocols: ``fn(arg: str | None) -> Protocol`` by name, with usage and note
PROTOCOLS: dict[str, Registry[Callable[[str | None], Protocol]]] = {
    s: Registry(f"{s} protocol", ProtocolError, idempotent=False) for s in STAGES
}


def _registry(stage: str) -> Registry[Callable[[str | None], Protocol]]:
    if stage not in STAGES:
        raise ProtocolError(f"stage must be one of {STAGES}, got {stage!r}")
    return PROTOCOLS[stage]


def register_protocol(name: str, *, stage: str = "probe", usage: str | None = None, note: str = "") -> Callable:
    """Decorator: register ``fn(arg: str | None) -> Protocol`` as protocol ``name`` of
    ``stage``. ``arg`` is the text after ``name:`` in a spec (``None`` when absent).
    ``usage``: how the help and errors name it (default ``name``; a parametrised protocol
    says its argument, e.g. ``fewshot:N (N >= 2)``); ``note``: a short gloss in the help."""
    return _registry(stage).register(name, usage=usage, note=note)


def list_protocols(stage: str = "probe") -> list[str]:
    """Registered protocol names of ``stage`` (parametrised ones without their argument)."""
    return sorted(_registry(stage))


def _parametrised(stage: str, name: str) -> bool:
    return PROTOCOLS[stage].entry(name).usage.startswith(f"{name}:")


def get_protocol(spec: str, stage: str = "probe") -> Protocol:
    """Build the protocol of ``spec`` (e.g. ``full``, ``fewshot:5``, ``subset:10%``)."""
    s = str(spec).strip().lower()
    name, sep, arg = s.partition(":")
    reg = _registry(stage)
    if name not in reg:
        word = "unknown fine-tuning protocol" if stage == "finetune" else "unknown protocol"
        raise ProtocolError(reg.unknown(name, spec=spec, what=word, known="choose one of"))
    return reg[name](arg if sep else None)


def parse_protocol(spec: str) -> Protocol:
    """A probe protocol by spec (``get_protocol(spec, "probe")``)."""
    return get_protocol(spec, "probe")


def pairs(stage: str = "finetune") -> dict[str, str | None]:
    """``{protocol of stage: the protocol of the other stage it pairs with}``."""
    return {n: get_protocol(n, stage).pairs_with for n in list_protocols(stage) if not _parametrised(stage, n)}


def protocol_usages(stage: str = "probe") -> list[str]:
    """How the help names each registered protocol of ``stage`` (``fewshot:N (N >= 2)``), in
    registration order."""
    return _registry(stage).usages()


def protocol_help(stage: str = "probe") -> str:
    """The ``--protocol`` help of ``stage``: every registered protocol's usage and note, in
    registration order, ``|``-separated (a fine-tune protocol also names its probe pair)."""
    out = []
    for e in _registry(stage).entries():
        note = e.note
        if stage == "finetune" and not _parametrised(stage, e.name) and get_protocol(e.name, stage).pairs_with:
            note = f"{note}; " * bool(note) + f"pairs with probe protocol {get_protocol(e.name, stage).pairs_with}"
        out.append(f"{e.usage} ({note})" if note else e.usage)
    return " | ".join(out)


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ProtocolError(f"protocol {name!r} takes no argument, got {name}:{arg}")


@register_protocol("full", note="z-scored features")
def full(arg: str | None = None) -> Protocol:
    _no_arg("full", arg)
    return Protocol(
        spec="full", name="full", stage="probe", split="full", solver="lbfgs", grid=CGrid(), pairs_with="full"
    )


@register_protocol("dinov2", note="raw features, DINOv2's exact selection")
def dinov2(arg: str | None = None) -> Protocol:
    """DINOv2's logistic regression as published: raw features (no standardisation), tol
    1e-12, at most 1000 iterations, its 45-value C grid, selection on a random 10 %."""
    _no_arg("dinov2", arg)
    grid = CGrid(DINOV2_C_GRID, fixed=(("standardize", False), ("tol", 1e-12), ("max_iter", 1000)))
    return Protocol(spec="dinov2", name="dinov2", stage="probe", split="dinov2", solver="lbfgs", grid=grid)


@register_protocol("fewshot", usage="fewshot:N (N >= 2)")
def fewshot(arg: str | None = None) -> Protocol:
    m = re.fullmatch(r"\d+", arg or "")
    if not m:
        raise ProtocolError(f"fewshot needs a shot count, e.g. fewshot:5 (got {arg!r})")
    n = int(m.group(0))
    if n < 2:
        raise ProtocolError(
            f"fewshot:{n} cannot work: the 80/20 per-class split for selecting C needs at "
            "least one training and one validation example per class, so N >= 2 "
            "(ELEVATER uses N = 5, 20, 50)"
        )
    return Protocol(
        spec=f"fewshot:{n}",
        name="fewshot",
        stage="probe",
        split="fewshot",
        solver="lbfgs",
        grid=CGrid(),
        seeds=(0, 1, 2),
        shots=n,
    )


def _shots(name: str, arg: str | None) -> int:
    m = re.fullmatch(r"\d+", arg or "")
    if not m:
        raise ProtocolError(f"{name} needs a shot count, e.g. {name}:5 (got {arg!r})")
    n = int(m.group(0))
    if n < 2:
        raise ProtocolError(
            f"{name}:{n} cannot work: the 80/20 per-class split for selecting hyper-parameters "
            "needs at least one training and one validation example per class, so N >= 2 "
            "(ELEVATER uses N = 5, 20, 50)"
        )
    return n


@register_protocol("elevater-fewshot", usage="elevater-fewshot:N (N >= 1)")
def elevater_fewshot(arg: str | None = None) -> Protocol:
    n = 1 if arg == "1" else _shots("elevater-fewshot", arg)  # N = 1: the toolkit draws 2
    return Protocol(
        spec=f"elevater-fewshot:{n}",
        name="elevater-fewshot",
        stage="probe",
        split="elevater-fewshot",
        solver="elevater",
        grid=ELEVATER_SGD,
        seeds=(0, 1, 2),
        shots=n,
    )


@register_protocol("elevater-full")
def elevater_full(arg: str | None = None) -> Protocol:
    _no_arg("elevater-full", arg)
    return Protocol(
        spec="elevater-full",
        name="elevater-full",
        stage="probe",
        split="elevater-full",
        solver="elevater",
        grid=ELEVATER_SGD,
        holdout_order="dataset",
    )


@register_protocol("zeroshot")
def zeroshot(arg: str | None = None) -> Protocol:
    _no_arg("zeroshot", arg)
    return Protocol(
        spec="zeroshot", name="zeroshot", stage="probe", split="none", solver="zeroshot", grid=CGrid(Cs=()), shots=0
    )


def _vtab1k(spec: str, arg: str | None, split: str, solver: str = "lbfgs", grid=None, **extra) -> Protocol:
    """A VTAB-1k probe protocol: three seeds, the median reported."""
    _no_arg(spec, arg)
    return Protocol(
        spec=spec,
        name=spec,
        stage="probe",
        split=split,
        solver=solver,
        grid=CGrid() if grid is None else grid,
        seeds=(0, 1, 2),
        median_over_seeds=True,
        val_source_choice=True,
        **extra,
    )


@register_protocol("vtab1k")
def vtab1k(arg: str | None = None) -> Protocol:
    return _vtab1k("vtab1k", arg, "vtab1k")


@register_protocol("vtab1k-stratified")
def vtab1k_stratified(arg: str | None = None) -> Protocol:
    return _vtab1k("vtab1k-stratified", arg, "vtab1k-stratified")


@register_protocol("vtab1k-sgd")
def vtab1k_sgd(arg: str | None = None) -> Protocol:
    return _vtab1k("vtab1k-sgd", arg, "vtab1k", solver="sgd", grid=VTAB_SGD, pairs_with="vtab1k-light")


@register_protocol("salman")
def salman(arg: str | None = None) -> Protocol:
    _no_arg("salman", arg)
    return Protocol(spec="salman", name="salman", stage="probe", split="full", solver="sgd", grid=SALMAN_SGD)


@register_protocol("bob-linear")
def bob_linear(arg: str | None = None) -> Protocol:
    """Battle of the Backbones' linear probe (:class:`LarsGrid`) trained on all of train."""
    _no_arg("bob-linear", arg)
    return Protocol(spec="bob-linear", name="bob-linear", stage="probe", split="train", solver="lars", grid=BOB_LARS)


@register_protocol("dinov2-linear", note="DINOv2's 52 jointly trained linear heads")
def dinov2_linear(arg: str | None = None) -> Protocol:
    """DINOv2's linear evaluation (:class:`Dinov2LinearGrid`) on the class tokens of the last
    blocks and the mean patch token (the ``dinov2-linear`` solver builds that input)."""
    _no_arg("dinov2-linear", arg)
    return Protocol(
        spec="dinov2-linear",
        name="dinov2-linear",
        stage="probe",
        split="no-refit",
        solver="dinov2-linear",
        grid=DINOV2_LINEAR,
    )


@register_protocol("attentive", usage="attentive:VARIANT (vjepa or aim)", note="a learned-query head grid on tokens")
def attentive(arg: str | None = None) -> Protocol:
    """Attentive probes on token features (:class:`AttentiveGrid`): V-JEPA's or AIM's head,
    a 4 lr x 5 wd grid trained together, the best head chosen on validation (the dataset's
    val split, else a stratified 10% of train, as ``full``), reported on test without a refit."""
    if arg not in ATTENTIVE_VARIANTS:
        raise ProtocolError(
            f"attentive needs a variant, one of {sorted(ATTENTIVE_VARIANTS)}: e.g. attentive:vjepa (got {arg!r})"
        )
    return Protocol(
        spec=f"attentive:{arg}",
        name="attentive",
        stage="probe",
        split="no-refit",
        solver="attentive",
        grid=AttentiveGrid(variant=arg),
        kind="tokens",
    )


@register_protocol("subset", usage="subset:F% (e.g. subset:1%, subset:10%)")
def subset(arg: str | None = None) -> Protocol:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", arg or "")
    if not m:
        raise ProtocolError(f"subset needs a percentage, e.g. subset:10% (got {arg!r})")
    pct = float(m.group(1))
    if not 0 < pct < 100:
        raise ProtocolError(f"subset fraction must lie in (0%, 100%), got subset:{arg}; use 'full' for all data")
    return Protocol(
        spec=f"subset:{m.group(1)}%",
        name="subset",
        stage="probe",
        split="subset",
        solver="lbfgs",
        grid=CGrid(),
        fraction=pct / 100,
    )


@register_protocol("vtab1k-light", stage="finetune", note="1000 examples, 800/200 selection, as in VTAB Fig. 16")
def vtab1k_light(arg: str | None = None) -> Protocol:
    _no_arg("vtab1k-light", arg)
    return Protocol(
        spec="vtab1k-light",
        name="vtab1k-light",
        stage="finetune",
        split="vtab1k",
        solver="sgd",
        grid=VTAB_SGD,
        seeds=(0, 1, 2),
        pairs_with="vtab1k-sgd",
        val_source_choice=True,
    )


@register_protocol("full", stage="finetune", note="all of train")
def full_finetune(arg: str | None = None) -> Protocol:
    _no_arg("full", arg)
    return Protocol(
        spec="full", name="full", stage="finetune", split="full", solver="sgd", grid=VTAB_SGD, pairs_with="full"
    )
