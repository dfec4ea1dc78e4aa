"""The protocols' hyper-parameter grids: one frozen dataclass per solver family (the L-BFGS C
grid, SGD schedules, ELEVATER's search, LARS, DINOv2's linear heads, the attentive heads) and
the published instances the built-in protocols use. Every value enters run ids, so a grid is
the same floats on every machine (:func:`log_grid`)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from featcache.errors import InternalError

__all__ = [
    "BOB_LARS",
    "C_GRID",
    "DINOV2_C_GRID",
    "DINOV2_LINEAR",
    "ELEVATER_SGD",
    "SALMAN_SGD",
    "VTAB_LAST_DECAY",
    "VTAB_SGD",
    "AttentiveGrid",
    "CGrid",
    "Dinov2LinearGrid",
    "ElevaterGrid",
    "EpGrid",
    "Grid",
    "LarsGrid",
    "SGDGrid",
    "log_grid",
]


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
#: DINOv2's C grid (dinov2/eval/log_regression.py: ``10 ** torch.linspace(-6, 5, 45)``, float32):
#: the float32 exponents, each power rounded from its decimal value (float32 power kernels, too,
#: differ in the last bit between CPUs)
DINOV2_C_GRID = tuple(
    float(np.float32(float(Decimal(10) ** Decimal(float(e))))) for e in np.linspace(-6, 5, 45, dtype=np.float32)
)


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


@dataclass(frozen=True)
class EpGrid:
    """The efficient probe ``attentive:ep`` (arXiv 2506.10178; billpsomas/efficient-probing at
    b8f4fb8, ``main_linprobe.py:42-89`` defaults and ``util/lars.py``, ``util/lr_sched.py``): one
    head, LARS (momentum 0.9, trust 0.001, weight decay 0), lr = ``blr`` x batch / 256 (0.1 x
    4096 / 256 = 1.6), ``warmup_epochs`` of linear warmup then a half-cycle cosine to ``min_lr``,
    set every iteration, ``epochs`` epochs of ``batch_size`` rows (last partial batch dropped),
    ``num_queries`` queries; the best epoch on validation is reported (the reference: on
    ImageNet's val, which it reports; featcache: its val split, never test)."""

    variant: str = "ep"
    num_queries: int = 32
    blr: float = 0.1
    batch_size: int = 4096
    epochs: int = 90
    warmup_epochs: int = 10
    min_lr: float = 0.0
    weight_decay: float = 0.0
    momentum: float = 0.9
    trust_coefficient: float = 0.001


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


#: any protocol's grid
Grid = CGrid | SGDGrid | ElevaterGrid | LarsGrid | Dinov2LinearGrid | AttentiveGrid | EpGrid
