"""Dense evaluation from the cache (issue 57): semantic segmentation, depth and Hummingbird
dense k-NN from stored patch-token grids and the targets stored beside them.

- :func:`run_dense` (``featcache dense``): a dense protocol (``seg-linear`` and its DINOv2
  variants, ``depth-linear``, ``hummingbird``) for each backbone and seed, result rows
  ``kind="dense"`` in the shared results table; :class:`DenseConfig` its options.
- :mod:`featcache.dense.data`: where the rows come from (the store, or :class:`ArraySource`)
  and the :class:`DenseTask` a solver fits (selection split, held-out images).
- :mod:`featcache.dense.solvers`: the solver registry (:func:`register_dense_solver`).

>>> from featcache.dense import DenseConfig, run_dense
>>> cfg = DenseConfig(cache="cache.zarr", dataset="mosaics", backbones=("lite0",), results_path="r.parquet")
>>> df = run_dense(cfg)  # doctest: +SKIP
"""

from featcache.core.stagerun import register_stage
from featcache.dense.config import DenseConfig
from featcache.dense.data import ArraySource, DenseSource, StoreSource, build_task, take_rows
from featcache.dense.runner import STAGE, feature_kinds, run_dense
from featcache.dense.solvers import DENSE_SOLVERS, DenseEval, DenseFit, DenseTask, register_dense_solver

__all__ = [
    "DENSE_SOLVERS",
    "ArraySource",
    "DenseConfig",
    "DenseEval",
    "DenseFit",
    "DenseSource",
    "DenseTask",
    "StoreSource",
    "build_task",
    "feature_kinds",
    "register_dense_solver",
    "run_dense",
    "take_rows",
]

#: the built-in dense solvers, each imported on first use
register_dense_solver("seg-linear", "featcache.dense.seg:fit_seg_linear", note="DINOv3/DINOv2 linear segmentation head")
register_dense_solver(
    "hummingbird", "featcache.dense.hbird:hummingbird", note="dense k-NN label transfer (open-hummingbird-eval)"
)
register_dense_solver(
    "depth-linear", "featcache.dense.depth:fit_depth_linear", note="DINOv3's NYU / DINOv2's lin. 1, lin. 4 depth heads"
)

#: this stage's entry in the stage registry (the sweep runs its work items through it)
register_stage(STAGE)
