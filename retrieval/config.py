"""The retrieval stage's configuration: one frozen dataclass that defines the
``featcache retrieve`` flags, the run id of every row and the hparams recorded with it.

>>> from featcache.retrieval import RetrievalConfig, run_retrieval
>>> cfg = RetrievalConfig(cache="cache.zarr", dataset="digits", backbones=("tf_efficientnet_lite0",))
>>> df = run_retrieval(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from featcache.core import configs
from featcache.core.configs import flag, renamed_kwargs
from featcache.core.layers import LAYER_PARTS
from featcache.errors import ConfigError, DataError, UsageError
from featcache.retrieval.knn import KNN_KS, KNN_TEMPERATURE
from featcache.retrieval.prepared import METRICS  # the similarities the search computes
from featcache.retrieval.revisited import REVISITED_SETUPS
from featcache.retrieval.search import BACKENDS  # the search backends' registry

if TYPE_CHECKING:
    from featcache.retrieval.approx import IndexSpec

__all__ = [
    "BACKENDS",
    "BOB_TIE_POLICY",
    "DEFAULT_KS",
    "METRICS",
    "TIE_POLICY",
    "RetrievalConfig",
    "RetrievalConfigError",
]

DEFAULT_KS = (1, 5, 10, 100)
TIE_POLICY = "tie groups ranked as a block at their last position (sklearn AP convention)"
#: the order Battle of the Backbones' metrics (map_bob, mp@k, mrr_bob) are computed in
BOB_TIE_POLICY = "stable argsort of the negated similarity: exact ties in gallery order (BoB's code)"


class RetrievalConfigError(ConfigError, DataError):
    """An invalid RetrievalConfig value (a ConfigError; still a DataError, as it was)."""


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--k takes comma-separated integers like 1,5,10,100, got {text!r}") from exc
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k takes positive integers like 1,5,10,100, got {text!r}")
    return tuple(ks)


def check_ks(ks, what: str = "ks") -> tuple[int, ...]:
    """Sorted unique positive ints, or a DataError that says what is wrong."""
    try:
        out = sorted({int(k) for k in ks})
    except (TypeError, ValueError) as exc:
        raise RetrievalConfigError(f"{what} must be positive integers, got {ks!r}") from exc
    if not out or out[0] < 1:
        raise RetrievalConfigError(f"{what} must be positive integers, got {ks!r}")
    return tuple(out)


@renamed_kwargs(results="results_path")
@dataclass(frozen=True)
class RetrievalConfig:
    """Everything one retrieval run depends on. Build it in code or with :meth:`from_args`.

    ``backbones=None`` means every backbone of the store holding ``dataset``;
    ``gallery_split="same"`` is leave-one-out within ``query_split``. ``relevance``: a
    parquet/CSV table (query_id, gallery_id, relevance) with ``positive``/``junk`` values,
    or revisitop's ``easy``/``hard``/``junk`` (revisited Oxford/Paris; scored per setup in
    ``revisited``, with revisitop's trapezoidal AP beside the sklearn-style one).
    """

    cache: str = flag(help="feature cache root (local dir or fsspec URL)", required=True)
    dataset: str = flag(help="dataset key in the store", required=True)
    backbones: tuple[str, ...] | None = flag(None, "backbones; None = all", cli=False)
    query_split: str = flag(
        "test", "query split, e.g. test", name="--query", required=True, show_default=False, metavar="QUERY_SPLIT"
    )
    gallery_split: str = flag(
        "train",
        "gallery split, or 'same' for leave-one-out within --query",
        name="--gallery",
        required=True,
        show_default=False,
        metavar="GALLERY_SPLIT",
    )
    metric: str = flag("cosine", "similarity (default cosine)", show_default=False, choices=METRICS)
    ks: tuple[int, ...] = flag(
        DEFAULT_KS, "cut-offs for @k metrics (default 1,5,10,100)", name="--k", metavar="KS", type=_ks
    )
    relevance: str | None = flag(
        None,
        "parquet/CSV with query_id, gallery_id, relevance in {positive, junk} "
        "(or revisitop's {easy, hard, junk} for revisited Oxford/Paris)",
    )
    revisited: tuple[str, ...] = flag(
        ("medium", "hard"),
        "setups scored for an easy/hard/junk relevance file (repeatable; default medium and hard, as published)",
        action="append",
        choices=REVISITED_SETUPS,
    )
    full: bool = flag(
        True, "skip the full ranking: only @k metrics (and mrr@K) from a top-K search", negate="--top-k-only"
    )
    knn: bool = flag(True, "skip k-NN classification (k=10,20,100,200, T=0.07)", negate="--no-knn")
    knn_ks: tuple[int, ...] = flag(KNN_KS, "k values of the k-NN classifier", cli=False)
    temperature: float = flag(KNN_TEMPERATURE, "k-NN vote temperature", cli=False)
    max_memory: str | int = flag(
        "2GB", "memory bound for score blocks, and for the index with --index auto (default 2GB)", show_default=False
    )
    backend: str = flag("auto", "search backend", show_default=False, choices=BACKENDS.names)
    exact_scores: bool = flag(
        False,
        "full ranking: sum every score in float64 and round it once (bit-identical on every machine, "
        "block size and thread count; about twice the GEMM time) instead of one float32 GEMM, whose "
        "last-bit rounding may order near-equal scores differently",
        action="store_true",
    )
    kind: str = flag("pooled", "feature kind in the store (default pooled)", show_default=False)
    results_path: str | None = flag(
        None,
        "results parquet to append to (runs already there are skipped unless --force)",
        name="--results",
        required=True,
        metavar="RESULTS",
    )
    index: str = flag(
        "exact",
        "search with a FAISS index: an index_factory string (IVF4096,Flat, IVF4096,PQ64, HNSW32, "
        "OPQ64,IVF4096,PQ64 ...), 'auto' (autofaiss's choice within --max-memory, then --min-recall), "
        "or exact (default). Implies --top-k-only; adds index_recall@k and delta_* rows against exact search",
        show_default=False,
        metavar="FACTORY",
    )
    nprobe: int | None = flag(None, "IVF lists probed per query (--index IVF...)", type=int)
    ef_search: int | None = flag(None, "HNSW efSearch (--index HNSW...)", type=int)
    min_recall: float = flag(0.95, "--index auto: recall@k against exact search the index must reach", type=float)
    index_seed: int = flag(0, "seed of the index's training sample and the exact-comparison query sample", type=int)
    index_train: int | None = flag(None, "training rows of the index (default: autofaiss's 100 per IVF list)", type=int)
    index_dir: str | None = flag(None, "folder of stored indexes (default: <cache>.indexes beside the store)")
    recall_queries: int = flag(1000, "queries searched exactly too, for index_recall@k and delta_* rows", type=int)
    shards: int = flag(0, "search the gallery in this many shards on Dask workers (0: in this process)", type=int)
    scheduler: str | None = flag(None, "Dask scheduler address for --shards (default: a local cluster)")
    shard_processes: bool = flag(True, "local cluster workers are processes (False: threads)", cli=False)
    force: bool = flag(False, "re-run runs already in the results table", action="store_true")
    progress: bool = flag(True, "no progress bars (implied by -q)", negate="--no-progress")
    layers: str | None = flag(
        None,
        "layer sweep: run on each stored per-layer kind (all, or a comma list such as 1,4,-1), select the "
        "layer with --layer-val-split as the queries (never --query), report --query for it, record the curve",
    )
    layer_part: str = flag(
        "auto",
        "with --layers: the part of each layer read (auto: the first stored of cls, avg, mean, cls_raw, mean_raw)",
        choices=lambda: ["auto", *LAYER_PARTS],
    )
    layer_val_split: str = flag("val", "with --layers: the query split the layer is selected on (default val)")

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        if isinstance(self.backbones, str):
            set_(self, "backbones", None if self.backbones == "all" else (self.backbones,))
        elif self.backbones is not None:
            bb = tuple(self.backbones)
            set_(self, "backbones", None if bb in ((), ("all",)) else bb)
        set_(self, "cache", os.fspath(self.cache))
        if self.relevance is not None:
            set_(self, "relevance", os.fspath(self.relevance))
        if self.results_path is not None:
            set_(self, "results_path", os.fspath(self.results_path))
        set_(self, "ks", check_ks(self.ks))
        set_(self, "knn_ks", check_ks(self.knn_ks, "knn_ks"))
        if self.metric not in METRICS:
            raise RetrievalConfigError(f"unknown similarity {self.metric!r}; choose one of {METRICS}")
        if self.backend not in BACKENDS:
            raise RetrievalConfigError(BACKENDS.unknown(self.backend, what="unknown retrieval backend"))
        rv = (self.revisited,) if isinstance(self.revisited, str) else tuple(self.revisited)
        unknown = sorted(set(rv) - set(REVISITED_SETUPS))
        if not rv or unknown:
            raise RetrievalConfigError(f"revisited setups must be among {REVISITED_SETUPS}, got {rv!r}")
        set_(self, "revisited", tuple(dict.fromkeys(rv)))
        self._check_index()

    def _check_index(self) -> None:
        """--index / --shards: checked here (a bad factory string fails before any compute)."""
        from featcache.retrieval.index import AUTO, EXACT, check_factory

        set_ = object.__setattr__
        set_(self, "index", str(self.index).strip() or EXACT)
        if self.index not in (EXACT, AUTO):
            check_factory(self.index)
        if self.index == EXACT and (self.nprobe is not None or self.ef_search is not None):
            raise RetrievalConfigError("--nprobe / --ef-search need --index FACTORY (an IVF or HNSW index)")
        for name in ("nprobe", "ef_search", "index_train"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise RetrievalConfigError(f"{name} must be a positive integer, got {v!r}")
        if not 0.0 < float(self.min_recall) <= 1.0:
            raise RetrievalConfigError(f"min_recall must be in (0, 1], got {self.min_recall!r}")
        if int(self.recall_queries) < 1 or int(self.shards) < 0:
            raise RetrievalConfigError("recall_queries must be >= 1 and shards >= 0")
        from featcache.core.memory import parse_memory
        from featcache.retrieval.search import DEFAULT_MAX_MEMORY

        # --max-memory 1e400, 'lots': one line naming the flag before any compute
        parse_memory(self.max_memory, error=RetrievalConfigError, default=DEFAULT_MAX_MEMORY)

    @property
    def full_ranking(self) -> bool:
        """Whether the run ranks the whole gallery: ``full``, unless --index or --shards
        (both give top-k lists only: they imply --top-k-only)."""
        return bool(self.full) and self.index == "exact" and not self.shards

    def index_spec(self, k: int) -> IndexSpec | None:
        """The :class:`~featcache.retrieval.approx.IndexSpec` of this config (None: exact)."""
        from featcache.retrieval.approx import IndexSpec
        from featcache.retrieval.search import parse_memory

        if self.index == "exact":
            return None
        return IndexSpec(
            self.index,
            self.metric,
            self.nprobe,
            self.ef_search,
            self.index_seed,
            self.index_train,
            parse_memory(self.max_memory),
            float(self.min_recall),
            k,
            self.index_dir,
        )

    # ------------------------------------------------------------ CLI
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Register this config's flags (plus ``--backbone``/``--all``) on ``parser``."""
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument("--backbone", action="append", help="backbone key in the store (repeatable)")
        who.add_argument("--all", action="store_true", help="every backbone that holds the dataset")
        configs.add_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RetrievalConfig:
        """The config of a parsed ``featcache retrieve`` command line."""
        return configs.from_namespace(cls, args, backbones=None if args.all else tuple(args.backbone))

    def with_(self, **changes: Any) -> RetrievalConfig:
        """Deprecated: use :func:`dataclasses.replace` (``replace(config, **changes)``)."""
        warnings.warn(
            "RetrievalConfig.with_() is deprecated; use dataclasses.replace(config, ...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return replace(self, **changes)

    @property
    def results(self) -> str | None:
        """Deprecated: the results table is :attr:`results_path`."""
        warnings.warn("RetrievalConfig.results is deprecated; use .results_path", DeprecationWarning, stacklevel=2)
        return self.results_path

    # -------------------------------------------------- run ids, hparams
    @property
    def same_split(self) -> bool:
        return self.gallery_split == "same"

    def run_definition(self, backbone: str, protocol: str, relevance_sha: str, store: str) -> dict:
        """What identifies a retrieval run (its run id is the hash of this)."""
        d = {
            "kind": "retrieval",
            "backbone": backbone,
            "dataset": self.dataset,
            "protocol": protocol,
            "query": self.query_split,
            "gallery": self.gallery_split,
            "metric": self.metric,
            "ks": list(self.ks),
            "full": self.full_ranking,
            "relevance": relevance_sha,
            "feature_kind": self.kind,
            "store": store,
        }
        spec = self.index_spec(max(self.ks))
        if spec is not None:  # exact runs keep the ids they always had
            d["index"] = {**spec.definition(), "recall_queries": self.recall_queries}
        return d

    def knn_definition(self, backbone: str, k: int, store: str) -> dict:
        return {
            "kind": "knn",
            "backbone": backbone,
            "dataset": self.dataset,
            "protocol": f"knn-k{k}",
            "query": self.query_split,
            "gallery": self.gallery_split,
            "T": self.temperature,
            "feature_kind": self.kind,
            "store": store,
        }

    @staticmethod
    def pair_fingerprint(query_fp: str, gallery_fp: str) -> str:
        """The store fingerprint of a run: its query and gallery features' fingerprints."""
        import hashlib

        return hashlib.sha256((query_fp + "|" + gallery_fp).encode()).hexdigest()[:16]

    def run_ids(self, backbone: str, store_fingerprint: str) -> list[str]:
        """Run ids of the rows a semantic-relevance run of ``backbone`` writes (retrieval,
        then one per k-NN k), without reading features; with ``relevance`` set they also
        depend on that file, so this refuses (the stage computes them itself)."""
        from featcache.core.results import make_run_id

        if self.relevance is not None:
            raise DataError("run_ids() covers semantic relevance only (relevance=None)")
        ids = [make_run_id(**self.run_definition(backbone, "semantic", "", store_fingerprint))]
        if self.knn:
            ids += [make_run_id(**self.knn_definition(backbone, k, store_fingerprint)) for k in self.knn_ks]
        return ids

    def hparams(self, *, backend: str, relevance_sha: str, **measured: Any) -> dict:
        """Recorded hparams of a retrieval row: the config's settings plus what the run measured."""
        return {
            "similarity": self.metric,
            "gallery": self.gallery_split,
            "ks": list(self.ks),
            "full_ranking": self.full_ranking,
            "backend": backend,
            "tie_policy": TIE_POLICY,
            **({"bob_tie_policy": BOB_TIE_POLICY} if self.full else {}),
            **({"scores": "float64-rounded" if self.exact_scores else "float32"} if self.full_ranking else {}),
            "feature_kind": self.kind,
            **measured,
            "relevance_sha256": relevance_sha,
        }

    def knn_hparams(self, k: int, *, backend: str, n_gallery: int) -> dict:
        return {
            "k": k,
            "temperature": self.temperature,
            "similarity": "cosine",
            "gallery": self.gallery_split,
            "backend": backend,
            "tie_policy": TIE_POLICY,
            "feature_kind": self.kind,
            "n_gallery": n_gallery,
            "k_effective": int(min(k, n_gallery - (1 if self.same_split else 0))),
        }


def legacy_config(cache_path, backbones: str | Sequence[str] | None, dataset: str, *args, **kwargs) -> RetrievalConfig:
    """A :class:`RetrievalConfig` from :func:`run_retrieval`'s older keyword signature."""
    names = ("query_split", "gallery_split", "metric", "ks", "results_path", "knn")
    kw: dict[str, Any] = dict(zip(names, args))
    overlap = set(kw) & set(kwargs)
    if overlap:
        raise UsageError(f"run_retrieval() got multiple values for {sorted(overlap)}")
    kw.update(kwargs)
    bb = (backbones,) if isinstance(backbones, str) else None if backbones is None else tuple(backbones)
    return RetrievalConfig(cache=cache_path, dataset=dataset, backbones=bb, **kw)
