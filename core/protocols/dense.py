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
