"""The dense protocols (issue 57): stage ``dense`` (``featcache dense --protocol ...``), each
naming a dense solver of :data:`featcache.dense.solvers.DENSE_SOLVERS`."""

from __future__ import annotations

# ---------------------------------------------------------------- segmentation (seg-linear)

# ---------------------------------------------------------------- depth (depth-linear)

# ---------------------------------------------------------------- hummingbird
