"""The dense protocols (issue 57): stage ``dense`` (``featcache dense --protocol ...``), each
naming a dense solver of :data:`featcache.dense.solvers.DENSE_SOLVERS`."""

from __future__ import annotations

# ---------------------------------------------------------------- segmentation (seg-linear)
from dataclasses import dataclass

from featcache.core.protocols.base import Protocol, register_protocol
from featcache.errors import ProtocolError


@dataclass(frozen=True)
class SegLinearGrid:
    """A linear segmentation head and its schedule (every value enters run ids).

    DINOv3 (``dinov3/eval/segmentation/configs/config-ade20k-linear-training.yaml``, commit
    6876159): AdamW lr 1e-3, wd 1e-3, betas (0.9, 0.999), WarmupOneCycleLR (1500 warm-up of
    40000 iterations from lr x 1e-6, then cosine to 0), batch 2 x 8 GPUs; its head
    (``models/heads/linear_head.py``) Dropout2d(0.1) -> BatchNorm -> 1x1 conv N(0, 0.01).
    ``epochs``: the passes over the cached training rows (every view) a run makes by default
    (a cache cannot draw a fresh crop at each of the reference's 40000 iterations); the
    warm-up keeps the reference's fraction of the schedule. ``blocks``: how many evenly spaced
    ``layer{i}_tokens`` kinds the head concatenates (1: the config's kind); ``dropout``: 0 for
    DINOv2's heads (BN then conv)."""

    lr: float = 1e-3
    weight_decay: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    batch_size: int = 16
    reference_iters: int = 40_000
    warmup_iters: int = 1_500
    warmup_ratio: float = 1e-6
    epochs: float = 10.0
    dropout: float = 0.1
    blocks: int = 1
    head: str = "dinov3"
    #: multi-scale test-time augmentation of DINOv2's "+ms" head: not cached (windows at one
    #: scale), recorded so a row says what it is
    ms_tta: bool = False


#: variant -> (note, grid) of ``seg-linear[:variant]``
SEG_LINEAR_VARIANTS = {
    None: ("DINOv3's linear head: Dropout2d(0.1), BN, 1x1 conv on the last block's patch tokens", SegLinearGrid()),
    "dinov2": ("DINOv2's linear head: BN then 1x1 conv, no dropout", SegLinearGrid(dropout=0.0, head="dinov2")),
    "dinov2-ms": (
        "DINOv2's +ms head: 4 evenly spaced blocks' tokens concatenated; multi-scale TTA not cached",
        SegLinearGrid(dropout=0.0, head="dinov2", blocks=4),
    ),
}


@register_protocol(
    "seg-linear",
    stage="dense",
    usage="seg-linear[:dinov2|:dinov2-ms]",
    note="linear segmentation head (DINOv3; :dinov2 BN+conv; :dinov2-ms 4 blocks): miou, macc, aacc",
)
def _seg_linear(arg: str | None) -> Protocol:
    if arg not in SEG_LINEAR_VARIANTS:
        variants = ", ".join(f"seg-linear:{v}" for v in SEG_LINEAR_VARIANTS if v)
        raise ProtocolError(f"unknown seg-linear variant {arg!r}: choose seg-linear, {variants}")
    spec = "seg-linear" if arg is None else f"seg-linear:{arg}"
    grid = SEG_LINEAR_VARIANTS[arg][1]
    return Protocol(spec=spec, name="seg-linear", stage="dense", split="full", solver="seg-linear", grid=grid)  # type: ignore[arg-type]


# ---------------------------------------------------------------- depth (depth-linear)


@dataclass(frozen=True)
class DepthLinearGrid:
    """A linear depth head's recipe (every value enters run ids). The defaults are dinov3's
    ``dinov3/eval/depth/configs/config-nyu.yaml``: AdamW lr 3e-4, betas (0.9, 0.99), weight decay
    1e-4, gradient norm clipped to 35, ``WarmupOneCycleLR`` over ``iterations`` (38400) with
    ``warmup_iters`` (12800) and final_div_factor 1000, batch 2 x 8 GPUs, 256 linear bins over
    ``min_depth``..``max_depth`` m, SigLoss (warm-up 100 steps). ``variant``: ``dinov3`` (patch
    tokens of the last block, BatchNorm, N(0, 0.01)) or ``dinov2`` (the class token concatenated,
    ``blocks`` blocks upsampled 4x, no BatchNorm, + ``grad_weight`` x the gradient loss).
    ``max_depth`` None: the dataset's depth range (else NYU's 10 m; DINOv2's hub head fixes 80)."""

    variant: str = "dinov3"
    blocks: int = 1
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 1e-4
    iterations: int = 38400
    warmup_iters: int = 12800
    final_div_factor: float = 1000.0
    batch_size: int = 16
    clip: float = 35.0
    n_bins: int = 256
    min_depth: float = 1e-3
    max_depth: float | None = None
    grad_weight: float = 0.0
    sigloss_warmup: int = 100
    #: config-nyu.yaml ``eval_mask: NYU_EIGEN`` (scaled to the map's size, as make_valid_mask
    #: does), or ``full``
    eval_crop: str = "eigen"
    #: config-nyu.yaml ``eval.use_tta``: flip averaging on test where ``@flip`` rows are stored
    #: (the reference's periodic validation runs without it)
    tta: bool = True

    @property
    def reads_cls(self) -> bool:
        """Whether the head reads each block's class token beside its patch tokens (DINOv2's)."""
        return self.variant == "dinov2"


#: the variant after ``depth-linear:`` -> its grid
DEPTH_GRIDS = {
    "": DepthLinearGrid(),
    "dinov2-lin1": DepthLinearGrid(variant="dinov2", blocks=1, grad_weight=0.5),
    "dinov2-lin4": DepthLinearGrid(variant="dinov2", blocks=4, grad_weight=0.5),
}


@register_protocol(
    "depth-linear",
    stage="dense",
    usage="depth-linear[:dinov2-lin1|:dinov2-lin4]",
    note="linear depth head on token grids: DINOv3's NYU head; DINOv2's lin. 1 / lin. 4",
)
def depth_linear(arg: str | None) -> Protocol:
    """DINOv3's NYU linear depth head (``depth-linear``) and DINOv2's ``lin. 1`` / ``lin. 4``
    (``depth-linear:dinov2-lin1``, ``depth-linear:dinov2-lin4``), all fitted by the dense solver
    ``depth-linear``."""
    key = arg or ""
    if key not in DEPTH_GRIDS:
        raise ProtocolError(
            f"unknown depth-linear variant {arg!r}: write depth-linear, depth-linear:dinov2-lin1 "
            "or depth-linear:dinov2-lin4"
        )
    spec = "depth-linear" + (f":{key}" if key else "")
    grid = DEPTH_GRIDS[key]
    return Protocol(spec=spec, name="depth-linear", stage="dense", split="full", solver="depth-linear", grid=grid)  # type: ignore[arg-type]


# ---------------------------------------------------------------- hummingbird


@dataclass(frozen=True)
class HbirdGrid:
    """Hummingbird's settings (vpariza/open-hummingbird-eval ``hbird_evaluation`` defaults): ``k``
    neighbours, the softmax ``temperature`` over their cosines (its ``beta``), the bounded
    ``memory_size`` (None: every training patch of every stored view) and ``batch_size`` (images
    per draw of the bounded sampling and per query block). One point: nothing is selected."""

    k: int = 30
    temperature: float = 0.02
    memory_size: int | None = None
    batch_size: int = 64


@register_protocol(
    "hummingbird",
    stage="dense",
    note="dense k-NN label transfer from the stored training views (open-hummingbird-eval): hbird_miou",
)
def _hummingbird(arg: str | None) -> Protocol:
    if arg is not None:
        raise ProtocolError(f"protocol 'hummingbird' takes no argument, got hummingbird:{arg}")
    return Protocol(
        spec="hummingbird",
        name="hummingbird",
        stage="dense",
        split="full",
        solver="hummingbird",
        grid=HbirdGrid(),  # type: ignore[arg-type]  # a dense grid, outside the probes' Grid union
    )
