"""The on-disk feature cache (Zarr v3). Layout: :mod:`featcache.store.schema`.

Everything a stage needs is exported here; stages import ``featcache.store`` only, never one
of its submodules (``tests/contracts/test_store_api.py`` checks it), so the modules inside may move."""

from featcache.store.blocks import DEFAULT_BLOCK_MEMORY, block_bytes
from featcache.store.cache import FeatureCache, Features, open_cache
from featcache.store.cli import add_storage_option_argument, parse_storage_options
from featcache.store.dense import dense_groups, iter_row_blocks, read_dense
from featcache.store.fingerprints import combine_fingerprints, dataset_fingerprint
from featcache.store.locks import StoreLock, local_root
from featcache.store.rows import StoredRows
from featcache.store.schema import (
    MAX_CHUNK_ROWS,
    SCHEMA_VERSION,
    TEXT_PROVENANCE_KEY,
    FeatureProvenance,
    SplitMeta,
)
from featcache.store.space import no_space
from featcache.store.tasks import load_label_matrix, task_metric, write_label_matrix, write_task_metric
from featcache.store.verify import register_beside_check
from featcache.store.writer import FeatureWriter, make_provenance, write_features
from featcache.store.writing import (
    ensure_split,
    read_request,
    write_caption_embeddings,
    write_class_embeddings,
    write_request,
)

__all__ = [
    "DEFAULT_BLOCK_MEMORY",
    "MAX_CHUNK_ROWS",
    "SCHEMA_VERSION",
    "TEXT_PROVENANCE_KEY",
    "FeatureCache",
    "FeatureProvenance",
    "FeatureWriter",
    "Features",
    "SplitMeta",
    "StoreLock",
    "StoredRows",
    "add_storage_option_argument",
    "block_bytes",
    "combine_fingerprints",
    "dataset_fingerprint",
    "dense_groups",
    "ensure_split",
    "iter_row_blocks",
    "load_label_matrix",
    "local_root",
    "make_provenance",
    "no_space",
    "open_cache",
    "parse_storage_options",
    "read_dense",
    "read_request",
    "register_beside_check",
    "task_metric",
    "write_caption_embeddings",
    "write_class_embeddings",
    "write_features",
    "write_label_matrix",
    "write_request",
    "write_task_metric",
]
