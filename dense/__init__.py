"""Dense evaluation from the cache (issue 57): semantic segmentation, depth and Hummingbird
dense k-NN from stored patch-token grids and the targets stored beside them."""

from featcache.dense.solvers import DENSE_SOLVERS, DenseEval, DenseFit, DenseTask, register_dense_solver

__all__ = ["DENSE_SOLVERS", "DenseEval", "DenseFit", "DenseTask", "register_dense_solver"]
