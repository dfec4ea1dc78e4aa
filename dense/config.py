"""The dense stage's config (``featcache dense``): one frozen dataclass, the single source of
the command's flags, of the dense run ids and of the options recorded in result rows.

>>> cfg = DenseConfig(cache="cache.zarr", dataset="mosaics", backbones=("lite0",))
>>> cfg.protocol, cfg.kind, cfg.seeds
('seg-linear', 'tokens', (0,))
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from featcache.core import configs
from featcache.core.configs import Interval, Matches, OneOf, flag, int_list, seed_tuple
from featcache.core.devices import PRECISIONS
from featcache.core.memory import parse_memory
from featcache.errors import ConfigError

if TYPE_CHECKING:
    from featcache.core.protocols import Protocol

__all__ = ["DenseConfig"]

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _protocol_help() -> str:
    from featcache.core.protocols import protocol_help

    return protocol_help("dense")


def _csv(value: Any) -> tuple[str, ...]:
    items = str(value).split(",") if isinstance(value, str) else [str(v) for v in value]
    return tuple(dict.fromkeys(t.strip() for t in items if t.strip()))


@dataclass(frozen=True)
class DenseConfig:
    """A dense protocol (``seg-linear``, ``depth-linear``, ``hummingbird`` and their variants)
    on one dataset's stored dense splits, for each backbone and seed.

    Selection and report: with ``val_split`` and ``test_split`` stored, the solver selects on
    ``val_split`` and reports ``test_split``; else it selects on a seeded 10% of the training
    images held out by id (their augmented views left out of training) and reports
    ``test_split`` where stored (NYU Depth v2 has no val), else ``val_split``. Never the
    best of the reported split. ``epochs`` / ``iterations`` / ``batch_size`` override the
    protocol's schedule (``None``: the protocol's); each enters the run ids."""

    cache: str = flag(help="feature cache root (local dir or fsspec URL)", required=True)
    dataset: str = flag(
        help="dataset key in the store (its dense splits: featcache extract --data ade20k:...)", required=True
    )
    backbones: tuple[str, ...] = flag(
        help="comma-separated backbone keys in the store", type=_csv, required=True, default_factory=tuple
    )
    protocol: str = flag("seg-linear", _protocol_help)
    kind: str = flag("tokens", "the patch-token kind the head reads (the -ms / lin.4 variants: layer{i}_tokens)")
    seeds: tuple[int, ...] = flag(help="comma-separated seeds", type=int_list, default_factory=lambda: (0,))
    epochs: float | None = flag(
        None,
        "passes over the cached training rows (every view) the schedule runs (default: the protocol's)",
        type=float,
        check=Interval(float, 0, 10_000, open_lo=True),
    )
    iterations: int | None = flag(
        None, "head updates, instead of --epochs (the reference: 40000 at batch 16)", type=int, check=Interval(int, 1)
    )
    batch_size: int | None = flag(
        None,
        "rows per head update (default: the protocol's, 16 = 2 x 8 GPUs as the reference)",
        type=int,
        check=Interval(int, 1, 1 << 20),
    )
    # hummingbird (branch h-dhbird): its memory bound and search index
    memory_size: int | None = flag(
        None,
        "hummingbird: patches kept in the memory, sampled class-balanced per image as open-hummingbird-eval "
        "does (default: every patch of every stored training view)",
        type=int,
        check=Interval(int, 1),
    )
    index: str = flag(
        "exact",
        "hummingbird's search: exact (FAISS IndexFlatIP) or a faiss.index_factory string (IVF1024,Flat, "
        "HNSW32, IVF1024,PQ32) for memories that outgrow RAM, as featcache retrieve --index spells it",
    )
    nprobe: int | None = flag(None, "IVF lists probed per query (--index IVF...)", type=int, check=Interval(int, 1))
    ef_search: int | None = flag(None, "HNSW efSearch (--index HNSW...)", type=int, check=Interval(int, 1))
    train_split: str = flag("train", "the split trained on (its @view{v} groups when stored)")
    val_split: str = flag("val", "the selection split (reported where no --test-split is stored)")
    test_split: str = flag("test", "the reported split, when stored")
    max_memory: str = flag("2GB", "memory bound for the rows a head holds (read in row blocks beyond it)")
    device: str = flag(
        "auto",
        "auto | cpu | cuda[:N] (auto: CUDA where available, else CPU, logged)",
        check=Matches(_DEVICE_RE, "choose auto, cpu, cuda or cuda:N"),
    )
    precision: str = flag(
        "fp32", "the head's compute precision (bf16 where the hardware has it)", check=OneOf(*PRECISIONS)
    )
    results_path: str | None = flag(
        None, "results parquet to append to (runs already there are skipped unless --force)", name="--results"
    )
    force: bool = flag(False, "rerun runs already in the results table", action="store_true")
    progress: bool = flag(True, "no progress bars (implied by -q)", negate="--no-progress")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cache", os.fspath(self.cache))
        set_(self, "backbones", _csv(self.backbones))
        set_(self, "seeds", seed_tuple(self.seeds, ConfigError))
        if self.results_path is not None:
            set_(self, "results_path", os.fspath(self.results_path))
        if not self.backbones:
            raise ConfigError("give at least one backbone: --backbones a,b (Python: backbones=('a',))")
        if not self.seeds:
            raise ConfigError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if self.epochs is not None and self.iterations is not None:
            raise ConfigError("--epochs and --iterations both set the schedule's length: give one")
        if len({self.train_split, self.val_split, self.test_split}) < 3:
            raise ConfigError("--train-split, --val-split and --test-split must name three different splits")
        configs.check_fields(self)
        parse_memory(self.max_memory)
        self._check_index()
        self.get_protocol()

    def _check_index(self) -> None:
        """hummingbird's --index / --nprobe / --ef-search: checked before any row is read."""
        from featcache.dense.hbird import EXACT, check_index

        object.__setattr__(self, "index", str(self.index).strip() or EXACT)
        if self.index == EXACT and (self.nprobe is not None or self.ef_search is not None):
            raise ConfigError("--nprobe / --ef-search need --index FACTORY (an IVF or HNSW index), not exact search")
        if self.index != EXACT:
            check_index(self.index)

    def get_protocol(self) -> Protocol:
        """The registered dense protocol ``self.protocol`` (unknown: a one-line error listing them)."""
        from featcache.core.protocols import get_protocol

        return get_protocol(self.protocol, stage="dense")

    @property
    def memory(self) -> int:
        return parse_memory(self.max_memory)

    def run_options(self) -> dict[str, Any]:
        """The options every run id of this config depends on (beside backbone, seed, store)."""
        return {
            "feature_kind": self.kind,
            "epochs": self.epochs,
            "iterations": self.iterations,
            "batch_size": self.batch_size,
            "splits": [self.train_split, self.val_split, self.test_split],
            "precision": self.precision,
            # hummingbird's options, only where set (the other protocols' run ids unchanged)
            **{k: v for k, v in self._hbird_options().items() if v not in (None, "exact")},
        }

    def _hbird_options(self) -> dict[str, Any]:
        return {
            "memory_size": self.memory_size,
            "index": self.index,
            "nprobe": self.nprobe,
            "ef_search": self.ef_search,
        }

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        configs.add_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DenseConfig:
        return configs.from_namespace(cls, args)
