"""The dense protocols (issue 57): stage ``dense`` (``featcache dense --protocol ...``), each
naming a dense solver of :data:`featcache.dense.solvers.DENSE_SOLVERS`."""

from __future__ import annotations

from dataclasses import dataclass

from featcache.core.protocols.base import Protocol, register_protocol
from featcache.errors import ProtocolError

# ---------------------------------------------------------------- segmentation (seg-linear)

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
