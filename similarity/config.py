"""The similarity stage's configurations: one frozen dataclass per command, the single
source of its flags, run ids and recorded hparams.

>>> cfg = SimilarityConfig(cache="cache.zarr", dataset="digits", results_path="r.parquet")
>>> cfg.measures
('cka_linear', 'cka_debiased', 'cka_rbf', 'rsa_spearman')
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from featcache.core import configs
from featcache.core.configs import Interval, OneOf, flag
from featcache.core.layers import LAYER_PARTS
from featcache.core.memory import parse_memory
from featcache.errors import ConfigError
from featcache.similarity.measures import RDM_METHODS
from featcache.similarity.registry import MEASURES

__all__ = ["MEASURES", "AuditConfig", "SimilarityConfig"]


#: the measures layer-by-layer CKA computes (the streamed linear ones; minibatch CKA by --minibatch)
LAYER_MEASURES = ("cka_linear", "cka_debiased")

#: widest RBF bandwidths: past them every kernel entry rounds to 1 (a constant kernel, no CKA)
#: and the squared bandwidth overflows a float
MAX_RBF_THRESHOLD = 1000
MAX_RBF_SIGMA = 1e150


def _csv(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def _measures(text: str) -> tuple[str, ...]:
    got = _csv(text)
    bad = [m for m in got if m not in MEASURES]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"--measures takes a comma-separated subset of {','.join(MEASURES)}")
    return got


def _measures_help() -> str:
    """The ``--measures`` help as the registry is now (a measure registered later is in it)."""
    return f"comma-separated subset of {','.join(MEASURES)}"


def _backbones(value: Any) -> tuple[str, ...] | None:
    if value is None or value == "all":
        return None
    bb = _csv(value) if isinstance(value, str) else tuple(str(v) for v in value)
    return None if bb in ((), ("all",)) else tuple(dict.fromkeys(bb))


@dataclass(frozen=True)
class SimilarityConfig:
    """CKA and RSA between every pair of backbones on one split (``featcache similarity``).

    ``backbones=None``: every backbone holding the split. Linear and debiased CKA stream the
    rows (any N); RBF CKA uses every row when the ``[n, n]`` Gram matrices fit in
    ``max_memory`` and google-research's minibatch estimator on a random sample otherwise;
    RSA compares RDMs of at most the rows that fit (a random sample, seeded by ``seed``).
    """

    cache: str = flag(help="feature cache root (local dir or fsspec URL)", required=True)
    dataset: str = flag(help="dataset key in the store", required=True)
    backbones: tuple[str, ...] | None = flag(None, "backbones; None = all", cli=False)
    split: str = flag("test", "split whose rows are compared")
    kind: str = flag("pooled", "feature kind in the store")
    measures: tuple[str, ...] = flag(help=_measures_help, type=_measures, default_factory=lambda: tuple(MEASURES))
    rbf_threshold: float = flag(
        1.0,
        "RBF bandwidth as a fraction of the median distance (google-research's gram_rbf)",
        type=float,
        check=Interval(float, 0, MAX_RBF_THRESHOLD, open_lo=True),
    )
    rbf_sigma: float | None = flag(
        None,
        "a fixed RBF bandwidth instead of the median heuristic",
        type=float,
        check=Interval(float, 0, MAX_RBF_SIGMA, open_lo=True),
    )
    rdm: str = flag("correlation", lambda: f"RSA dissimilarity: {RDM_METHODS.help(', or ')}", check=OneOf(*RDM_METHODS))
    max_memory: str = flag("2GB", "memory bound for blocks, Gram matrices and RDMs")
    seed: int = flag(0, "seed of the row samples of RBF CKA (large N) and RSA", type=int, check=Interval(int, 0))
    layers: str | None = flag(
        None,
        "layer-by-layer CKA: every stored layer kind (layer{i}_*) of each backbone against every layer of the "
        "others and of itself: all, or a comma list of layer indices (negative: from the last stored layer); "
        "linear and debiased CKA only",
    )
    layer_part: str = flag(
        "auto",
        "which part of each layer (--layers): auto (cls, else avg, else mean) or one of " + ", ".join(LAYER_PARTS),
        check=OneOf("auto", *LAYER_PARTS),
    )
    minibatch: int | None = flag(
        None,
        "with --layers: also minibatch CKA (Nguyen et al. 2021) over minibatches of N consecutive rows (an "
        "estimator of its own: the ratio of averaged unbiased HSICs, not the full-data CKA)",
        type=int,
        check=Interval(int, 4),
        metavar="N",
    )
    results_path: str | None = flag(
        None, "results parquet to append to (pairs already there are skipped unless --force)", name="--results"
    )
    force: bool = flag(False, "recompute pairs already in the results table", action="store_true")
    progress: bool = flag(True, "no progress bars (implied by -q)", negate="--no-progress")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cache", os.fspath(self.cache))
        set_(self, "backbones", _backbones(self.backbones))
        ms = _csv(self.measures) if isinstance(self.measures, str) else tuple(self.measures)
        bad = [m for m in ms if m not in MEASURES]
        if bad or not ms:
            raise ConfigError(f"measures {bad or ms!r} are invalid: choose from {tuple(MEASURES)}")
        set_(self, "measures", tuple(dict.fromkeys(ms)))
        if self.results_path is not None:
            set_(self, "results_path", os.fspath(self.results_path))
        if self.backbones is not None and len(self.backbones) < (1 if self.layers is not None else 2):
            raise ConfigError(
                "similarity compares pairs: give at least two backbones (--backbones a,b) or --all "
                "(with --layers, one backbone is compared with itself)"
            )
        configs.check_fields(self)
        parse_memory(self.max_memory)
        if self.layers is None and self.minibatch is not None:
            raise ConfigError("--minibatch N is minibatch CKA between layers: give --layers all (or a list) with it")
        if self.layers is not None and not self.layer_measures:
            raise ConfigError(
                f"--layers computes {', '.join(LAYER_MEASURES)}; --measures {','.join(self.measures)} names neither"
            )

    @property
    def layer_measures(self) -> tuple[str, ...]:
        """The measures a ``--layers`` run computes: the chosen ones among :data:`LAYER_MEASURES`."""
        return tuple(m for m in self.measures if m in LAYER_MEASURES)

    @property
    def memory(self) -> int:
        return parse_memory(self.max_memory)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument(
            "--backbones", help="comma-separated backbone keys (at least two; with --layers one: its own layer grid)"
        )
        who.add_argument("--all", action="store_true", help="every backbone that holds the split")
        configs.add_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimilarityConfig:
        return configs.from_namespace(cls, args, backbones=None if args.all else args.backbones)

    def hparams(self, measure: str) -> dict[str, Any]:
        """The options a ``measure`` row depends on (recorded in its hparams)."""
        return {"feature_kind": self.kind, **MEASURES.resolve(measure).hparams(self)}


@dataclass(frozen=True)
class AuditConfig:
    """Train/test near-duplicate audit of one backbone's features (``featcache audit``)."""

    cache: str = flag(help="feature cache root", required=True)
    dataset: str = flag(help="dataset key in the store", required=True)
    backbone: str = flag(help="backbone key in the store whose features are searched", required=True)
    out: str = flag(help="pairs table to write: .csv or .parquet", required=True)
    train_split: str = flag("train", "the split searched (the training rows)")
    query_splits: tuple[str, ...] = flag(
        ("test", "val"), "comma-separated splits audited (those absent are skipped)", type=_csv, name="--query"
    )
    kind: str = flag("pooled", "feature kind in the store")
    threshold: float | None = flag(
        None,
        "cosine above which a pair is listed (default: chosen from the nearest-neighbour distribution)",
        type=float,
    )
    k: int = flag(5, "nearest training rows kept per query row", type=int, check=Interval(int, 1, 1000))
    knn_k: int = flag(20, "k of the kNN classifier whose top-1 is recomputed", type=int, check=Interval(int, 1))
    data_root: str | None = flag(None, "dataset folder, for content hashes of the images (default: as extracted)")
    max_memory: str = flag("2GB", "memory bound for the similarity blocks")
    results_path: str | None = flag(None, "results parquet the audit's summary rows are appended to", name="--results")
    progress: bool = flag(True, "no progress bars (implied by -q)", negate="--no-progress")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cache", os.fspath(self.cache))
        set_(self, "out", os.fspath(self.out))
        qs = _csv(self.query_splits) if isinstance(self.query_splits, str) else tuple(self.query_splits)
        set_(self, "query_splits", qs)
        if not str(self.out).lower().endswith((".csv", ".parquet")):
            raise ConfigError(f"--out {self.out!r} is invalid: end it in .csv or .parquet")
        if self.threshold is not None and not -1.0 <= float(self.threshold) <= 1.0:
            raise ConfigError(f"--threshold {self.threshold!r} is invalid: a cosine lies in [-1, 1]")
        if self.train_split in qs:
            raise ConfigError(f"--query {','.join(qs)} includes the searched split {self.train_split!r}")
        configs.check_fields(self)
        parse_memory(self.max_memory)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        configs.add_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AuditConfig:
        return configs.from_namespace(cls, args)
