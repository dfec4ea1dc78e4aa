"""The dense protocols (issue 57): stage ``dense`` (``featcache dense --protocol ...``), each
naming a dense solver of :data:`featcache.dense.solvers.DENSE_SOLVERS`."""

from __future__ import annotations

from dataclasses import dataclass

from featcache.core.protocols.base import register_fixed_protocol

# ---------------------------------------------------------------- segmentation (seg-linear)

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


register_fixed_protocol(
    "hummingbird",
    stage="dense",
    note="dense k-NN label transfer from the stored training views (open-hummingbird-eval), hbird_miou",
    split="full",
    solver="hummingbird",
    grid=HbirdGrid(),
    table_label="hummingbird",
)
