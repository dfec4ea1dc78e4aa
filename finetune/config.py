"""The fine-tuning stage's config: one frozen dataclass, the single source of
``featcache finetune``'s flags, of the fine-tune run ids' options and of the hyper-parameters
recorded in result rows."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from featcache.core.configs import Interval, check_fields, flag, float_list, int_list, str_tuple
from featcache.data import format_help
from featcache.errors import ConfigError, DataError
from featcache.models import RESIZE_MODES, model_help, resize_help

if TYPE_CHECKING:
    from featcache.core.protocols import Protocol, SGDGrid

__all__ = ["DEFAULT_CHECKPOINT_EVERY", "VTAB_INPUT_SIZE", "FinetuneConfig", "FinetuneConfigError", "selection_metrics"]

DEFAULT_CHECKPOINT_EVERY = 250
#: the input resolution of the published protocol (other sizes are a scaled-down run)
VTAB_INPUT_SIZE = 224


def selection_metrics() -> tuple[str, ...]:
    """The task metrics a fine-tune selects on: those registered with ``finetune=True`` in
    :mod:`featcache.core.metrics` (the runner computes them on val; multi-label metrics are the
    probes')."""
    from featcache.core.metrics import finetune_metrics

    return finetune_metrics()


def _weights_help() -> str:
    from featcache.models import weights_help

    return weights_help() + " (hf:DIR: dir, its own weights; an nn.Module: module, as it is)"


def _protocol_help() -> str:
    from featcache.core.protocols import protocol_help

    return protocol_help("finetune")


def _as_tuple(v, cast) -> tuple:
    if isinstance(v, (int, float, str)):
        v = str(v).split(",") if isinstance(v, str) else [v]
    return tuple(cast(x) for x in v)


def parse_limit(s: str) -> int | dict[str, int]:
    """argparse type of ``--limit``: ``N`` (every split) or ``SPLIT=N[,SPLIT=N]``."""
    try:
        if "=" not in s:
            return int(s)
        out = {}
        for part in s.split(","):
            k, _, v = part.partition("=")
            out[k.strip()] = int(v)
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit takes N or SPLIT=N[,SPLIT=N], got {s!r}") from None


class FinetuneConfigError(ConfigError, DataError):
    """An invalid FinetuneConfig value (a ConfigError; still a DataError, as it was)."""


@dataclass(frozen=True)
class FinetuneConfig:
    """What ``featcache finetune`` / :func:`featcache.finetune.runner.finetune` runs.

    Grid fields left at ``None`` (``steps``, ``lrs``, ``batch_size``, ``last_decay``,
    ``momentum``, ``weight_decay``) and ``seeds`` take the protocol's values
    (:mod:`featcache.core.protocols`); any other value is recorded as a scaled-down protocol
    (``hparams["scaled_from"]``).
    """

    model: Any = flag(required=True, help=model_help)
    weights: str = flag("timm", _weights_help)
    data: str = flag(None, format_help, required=True)
    protocol: str = flag("vtab1k-light", _protocol_help)
    seeds: tuple[int, ...] | None = flag(
        None, "comma-separated seeds (default 0,1,2 for vtab1k-light, 0 for full)", type=int_list
    )
    results_path: str | None = flag(None, "results parquet to append to", name="--results", required=True)
    steps: tuple[int, ...] | None = flag(
        None, "schedule lengths searched (VTAB: 2500,10000; fewer = scaled-down run)", type=int_list
    )
    lrs: tuple[float, ...] | None = flag(None, "learning rates searched (VTAB: 0.1,0.01)", type=float_list)
    batch_size: int | None = flag(None, "SGD batch (VTAB: 512)", type=int)
    micro_batch: int | None = flag(
        None, "gradient-accumulation chunk when a full batch does not fit in memory", type=int
    )
    last_decay: float | None = flag(
        None,
        "fraction of the steps at which the third lr/10 drop happens "
        "(VTAB: 0.9; the paper says 'shortly before the end')",
        type=float,
    )
    momentum: float | None = flag(None, "SGD momentum (VTAB: 0.9)", type=float, check=Interval(float, 0, 1))
    weight_decay: float | None = flag(
        None, "0 for fine-tuning (VTAB); VTAB's from-scratch runs use 0.01 x lr", type=float, check=Interval(float, 0)
    )
    input_size: int | None = flag(None, "override the model's input resolution", type=int, check=Interval(int, 1))
    pre_resize: int | None = flag(
        None, "resize to NxN before the pipeline (Salman et al.: 32)", type=int, check=Interval(int, 1)
    )
    resize: str = flag("timm", resize_help, choices=list(RESIZE_MODES))
    device: str = flag("auto", "auto | cpu | cuda[:N]")
    precision: str = flag("auto", "auto: bf16 autocast on CUDA, fp32 on CPU", choices=["auto", "fp32", "bf16"])
    eval_splits: tuple[str, ...] = flag(
        ("test",), "split(s) to test on (repeatable; default test)", name="--eval-split", action="append"
    )
    train_split: str = flag("train")
    val_split: str = flag("val")
    val_source: str = flag(
        "split-800-200",
        "vtab1k-light selection data: the 200 held out of the 1000, or the dataset's val split",
        choices=["split-800-200", "official-val"],
    )
    dataset_name: str | None = flag(
        None,
        "dataset key written to the rows (default: derived from --data; must match the probe rows' dataset to pair)",
    )
    backbone_name: str | None = flag(
        None, "backbone key written to the rows (default as extract: NAME, NAME@random<SEED>, NAME@<ckpt stem>)"
    )
    limit: int | dict[str, int] | None = flag(
        None, "first N rows of every split, or SPLIT=N[,SPLIT=N]", type=parse_limit
    )
    checkpoint_dir: str | None = flag(None, "default: RESULTS.finetune-ckpt")
    checkpoint_every: int = flag(DEFAULT_CHECKPOINT_EVERY, "steps between checkpoints", type=int)
    workers: int | None = flag(
        None, "DataLoader workers (default: min(4, cpus))", type=int, check=Interval(int, 0, 256)
    )
    memory_limit_gb: float = flag(
        4.0,
        "preprocessed images (uint8) kept in memory, all pools together; "
        "pools beyond it stream from disk each batch (same numbers)",
        type=float,
    )
    metric: str | None = flag(
        None,
        "the task's metric: selects the config on val and is recorded as hparams.task_metric (default top1)",
        choices=selection_metrics,
    )
    force: bool = flag(False, "rerun seeds already in the results table", action="store_true")
    progress: bool = flag(True, "no progress bars", negate="--no-progress")

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.seeds is not None:
            put("seeds", _as_tuple(self.seeds, int))
        if self.steps is not None:
            put("steps", _as_tuple(self.steps, int))
        if self.lrs is not None:
            put("lrs", _as_tuple(self.lrs, float))
        put("eval_splits", str_tuple(self.eval_splits))
        for name in ("results_path", "checkpoint_dir"):
            if getattr(self, name) is not None:
                put(name, str(getattr(self, name)))

    def resolve(self) -> tuple[Protocol, FinetuneConfig]:
        """(protocol, config with the protocol's grid and seeds filled in), after checking
        every value (a clear error before any image is read)."""
        from featcache.core.protocols import get_protocol

        proto = get_protocol(self.protocol, "finetune")
        g = _sgd_grid(proto)
        out = replace(
            self,
            seeds=proto.seeds if self.seeds is None else self.seeds,
            steps=g.steps if self.steps is None else self.steps,
            lrs=g.lrs if self.lrs is None else self.lrs,
            batch_size=g.batch_size if self.batch_size is None else int(self.batch_size),
            last_decay=g.last_decay if self.last_decay is None else float(self.last_decay),
            momentum=g.momentum if self.momentum is None else float(self.momentum),
            weight_decay=g.weight_decay if self.weight_decay is None else float(self.weight_decay),
            workers=min(4, os.cpu_count() or 1) if self.workers is None else int(self.workers),
        )
        out._check()
        return proto, out

    def _check(self) -> None:
        check_fields(self)  # --momentum, --weight-decay, --input-size, --workers ... (one line naming the flag)
        if not self.data:
            raise FinetuneConfigError("no data given; pass a data spec, e.g. data='digits' (--data digits)")
        if self.metric is not None and self.metric not in selection_metrics():
            raise FinetuneConfigError(
                f"fine-tuning selects on {' or '.join(selection_metrics())}, not {self.metric!r} "
                "(multi-label tasks: use the probes)"
            )
        if self.resize not in RESIZE_MODES:
            *most, last = RESIZE_MODES
            raise FinetuneConfigError(f"resize must be {', '.join(most)} or {last}, got {self.resize!r}")
        if not self.steps or min(self.steps) < 1:
            raise FinetuneConfigError(f"steps must be positive integers, got {self.steps!r}")
        if not self.lrs or min(self.lrs) <= 0:
            raise FinetuneConfigError(f"--lrs: learning rates must be positive, got {self.lrs!r}")
        mb = self.micro_batch
        if self.batch_size is None or self.batch_size < 1 or (mb is not None and not 1 <= mb <= self.batch_size):
            raise FinetuneConfigError(
                f"need batch_size >= 1 and 1 <= micro_batch <= batch_size; got {self.batch_size} and {mb}"
            )
        if self.last_decay is None or not 0 < self.last_decay < 1:
            raise FinetuneConfigError(f"last_decay must lie in (0, 1) (a fraction of the steps), got {self.last_decay}")
        if self.checkpoint_every < 1:
            raise FinetuneConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not self.seeds:
            raise FinetuneConfigError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if not self.memory_limit_gb >= 0:  # NaN too
            raise FinetuneConfigError(
                f"memory_limit_gb must be >= 0 (0 streams every image from disk), got {self.memory_limit_gb}"
            )

    def run_options(self, proto: Protocol, backbone: Any, precision: str) -> dict[str, Any]:
        """Options that enter the run id and the recorded hparams (a resolved config, the
        built backbone and the resolved precision)."""
        return dict(
            finetune_protocol=proto.spec,
            weights=self.weights,
            weights_sha256=backbone.weights_sha256,
            model=self.model if isinstance(self.model, str) else backbone.name,
            steps=list(self.steps or ()),
            lrs=list(self.lrs or ()),
            batch_size=self.batch_size,
            micro_batch=self.micro_batch,
            last_decay=self.last_decay,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            data_config=_jsonable(backbone.data_config),
            train_split=self.train_split,
            precision=precision,
            val_source=self.val_source if proto.val_source_choice else None,
            limit=self.limit,
            **({"resize": self.resize} if self.resize != "timm" else {}),  # existing run ids stay
            **({"metric": self.metric} if self.metric not in (None, "top1") else {}),
            **_cpu_isa(backbone, precision),  # CPU bf16 only: existing run ids stay
        )

    def scaled_from(self, proto: Protocol) -> dict[str, Any]:
        """The published values this (resolved) config departs from."""
        g = _sgd_grid(proto)
        out = {
            k: ref
            for k, v, ref in (
                ("steps", self.steps, g.steps),
                ("lrs", self.lrs, g.lrs),
                ("batch_size", self.batch_size, g.batch_size),
                ("momentum", self.momentum, g.momentum),
                ("weight_decay", self.weight_decay, g.weight_decay),
            )
            if v != ref
        }
        if self.input_size is not None and self.input_size != VTAB_INPUT_SIZE:
            out["input_size"] = VTAB_INPUT_SIZE
        return out


def _jsonable(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def _cpu_isa(backbone, precision: str) -> dict[str, str]:
    """The CPU ISA of a bf16 run on CPU (its bits depend on the bf16 kernels), else nothing."""
    if precision != "bf16" or not str(getattr(backbone, "device", "")).startswith("cpu"):
        return {}
    from featcache.core.cpu import cpu_isa

    return {"cpu_isa": cpu_isa()}


def _sgd_grid(proto: Protocol) -> SGDGrid:
    """A fine-tuning protocol's SGD schedule (every registered one has one)."""
    from featcache.core.protocols import SGDGrid

    g = proto.grid
    if not isinstance(g, SGDGrid):
        raise FinetuneConfigError(f"fine-tuning protocol {proto.spec} has no SGD schedule (grid {type(g).__name__})")
    return g
