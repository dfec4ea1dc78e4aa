"""On-disk schemas: one frozen dataclass per zarr attribute document, validated on open.

Layout (schema version 1; readable with plain ``zarr.open_group``)::

    ROOT/                                   attrs["featcache"]        -> RootMeta
      datasets/<dataset>/<split>/           attrs["featcache_split"]  -> SplitMeta
          ids      [N]    string              stable sample ids (row order of every backbone)
          labels   [N]    int64               index into SplitMeta.class_names
      class_embeddings/<dataset>/<name>     [C, D] float32 (e.g. text embeddings per class)
      class_embeddings/<dataset>/<backbone>/<name>  a backbone's own; attrs["featcache_text"]
      caption_embeddings/<dataset>/<split>/<backbone>/  attrs["featcache_text"] on embeddings
          embeddings [T, D] float32           one row per caption (the text tower's output)
          image_ids  [T]    string            the id of each caption's image (several per image)
      features/<backbone>/<dataset>/<split>/ attrs["featcache_features"] -> FeatureGroupMeta
          <kind>   [N, *inner, D] float16|float32  e.g. ``pooled`` [N, D], ``blocks:4`` [N, 4, D],
                                              ``tokens`` [N, T, D]; attrs["featcache_provenance"]
                                              (a dense target kind has its own dtype: TARGET_DTYPES)
          valid    [N]    bool                False where the image failed to decode
          error    [N]    string              decode error text ("" when valid)
          done     [n_chunks] uint8           1 once row chunk i of every array is written
      .featcache-manifest/<part>.json         digests of the metadata documents (:mod:`.manifest`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from featcache.core.dense import (
    DEPTH_KIND,
    DEPTH_VALID_KIND,
    FULL_PREFIX,
    MASK_KIND,
    SIZE_KIND,
    WINDOW_KIND,
)
from featcache.errors import SchemaMismatchError

SCHEMA_VERSION = 1
ROOT_KEY = "featcache"
SPLIT_KEY = "featcache_split"
GROUP_KEY = "featcache_features"
PROVENANCE_KEY = "featcache_provenance"
#: what made a class-embedding matrix (tower, weights hash, templates), beside the array
TEXT_PROVENANCE_KEY = "featcache_text"
#: sha256 of the canonical JSON of the provenance document, written beside it by the writer
PROVENANCE_DIGEST_KEY = "featcache_provenance_sha256"

#: most rows of one stored chunk: every array of a group allocates a chunk of this many rows
#: in memory (1M rows of 2048 float32 features is 8 GiB); a larger flag is refused before
#: anything is written
MAX_CHUNK_ROWS = 1 << 20

#: the dtypes of a model's feature kinds (``--dtype``)
MODEL_DTYPES = ("float16", "float32")
#: the dtypes a dense target kind (:data:`featcache.core.dense.TARGET_KINDS`) is stored in: class
#: ids uint8/uint16, metres float32, a validity mask uint8, the small per-row tables int32
TARGET_DTYPES: dict[str, tuple[str, ...]] = {
    MASK_KIND: ("uint8", "uint16"),
    FULL_PREFIX + MASK_KIND: ("uint8", "uint16"),
    DEPTH_KIND: ("float32",),
    FULL_PREFIX + DEPTH_KIND: ("float32",),
    DEPTH_VALID_KIND: ("uint8",),
    FULL_PREFIX + DEPTH_VALID_KIND: ("uint8",),
    SIZE_KIND: ("int32",),
    WINDOW_KIND: ("int32",),
}


def kind_dtypes(kind: str) -> tuple[str, ...]:
    """The dtypes ``kind`` may be stored in: a target kind's own (:data:`TARGET_DTYPES`), else
    float16 or float32 (every model kind)."""
    return TARGET_DTYPES.get(kind, MODEL_DTYPES)


#: the ``extra`` entries of a dense kind's provenance that join its identity
DENSE_IDENTITY = ("geometry", "dense")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+=,:%-]*$")


#: names zarr (or featcache) uses itself inside a group
RESERVED_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata", ".", ".."})


def check_name(what: str, name: str) -> str:
    """Backbone, dataset, split and kind names become zarr path segments."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SchemaMismatchError(
            f"invalid {what} name {name!r}: use letters, digits and _ . @ + = , : % - (no '/', no leading dot or dash)"
        )
    if name in RESERVED_NAMES or name.lower().endswith(".json"):
        raise SchemaMismatchError(
            f"invalid {what} name {name!r}: {sorted(RESERVED_NAMES)} and names ending in '.json' are "
            "reserved by the store; choose another name (e.g. --dataset-name / --backbone-name)"
        )
    return name


def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cast(Any, cls))  # the schema mixin is only used on dataclasses


class _Schema:
    """Mixin: to/from plain-JSON attrs with strict validation."""

    _attr_key: str = ""

    def to_attrs(self) -> dict[str, Any]:
        return dataclasses.asdict(cast(Any, self))  # the mixin is only used on dataclasses

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any], where: str = ""):
        if not isinstance(attrs, dict):
            raise SchemaMismatchError(f"{where}: featcache metadata missing or not a mapping")
        version = attrs.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SchemaMismatchError(
                f"{where}: schema version {version!r} is not supported by this featcache "
                f"(expects {SCHEMA_VERSION}); upgrade featcache or re-extract into a new cache"
            )
        names = {f.name for f in _fields(cls)}
        required = {
            f.name
            for f in _fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = required - set(attrs)
        unknown = set(attrs) - names
        if missing or unknown:
            raise SchemaMismatchError(
                f"{where}: metadata does not match schema {cls.__name__} v{SCHEMA_VERSION} "
                f"(missing {sorted(missing)}, unknown {sorted(unknown)}); the store was written "
                "by another tool or version"
            )
        kwargs = dict(attrs)
        for f in _fields(cls):
            if f.name in kwargs and isinstance(kwargs[f.name], list) and f.type in _TUPLE_TYPES:
                kwargs[f.name] = tuple(kwargs[f.name])
            if f.name in kwargs and not _type_ok(f.type, kwargs[f.name]):
                raise SchemaMismatchError(
                    f"{where}: metadata field {f.name!r} = {kwargs[f.name]!r} is not of type {f.type}; "
                    "the document is damaged (`featcache verify` names the damage)"
                )
        obj = cls(**kwargs)
        obj._check_values(where)
        return obj

    def _check_values(self, where: str) -> None:
        """Per-schema value checks beyond types (overridden where a schema has any)."""


_TUPLE_TYPES = ("tuple[str, ...]", "tuple[int, ...]")

_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bool": (bool,),
    "float | None": (int, float, type(None)),
    "int | None": (int, type(None)),
    "str | None": (str, type(None)),
    "dict[str, Any]": (dict,),
    "tuple[str, ...]": (tuple,),
    "tuple[int, ...]": (tuple, int),
}


def _type_ok(annotation: object, value: Any) -> bool:
    want = _TYPES.get(str(annotation))
    if want is None:
        return True
    if isinstance(value, bool) and bool not in want:
        return False  # JSON true is not a row count
    if want == (tuple,):
        return isinstance(value, tuple) and all(isinstance(x, str) for x in value)
    if want == (tuple, int):
        return isinstance(value, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    return isinstance(value, want)


def provenance_digest(attrs: dict[str, Any]) -> str:
    """sha256 of a provenance document's canonical JSON (key order and tuples/lists do not matter)."""
    return hashlib.sha256(json.dumps(_jsonable(attrs), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


_DEVICE_RE = re.compile(r"^(|cpu|mps|cuda(:\d+)?)$")


@dataclass(frozen=True)
class RootMeta(_Schema):
    schema_version: int
    featcache_version: str
    created: str
    layout: str = "featcache-v1: datasets/<dataset>/<split>, features/<backbone>/<dataset>/<split>"


@dataclass(frozen=True)
class SplitMeta(_Schema):
    """One dataset split: what rows mean. Shared by every backbone's features."""

    schema_version: int
    dataset: str
    split: str
    n: int
    class_names: tuple[str, ...]
    fingerprint: str
    source: str
    created: str

    def to_attrs(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["class_names"] = list(self.class_names)
        return d


@dataclass(frozen=True)
class FeatureProvenance(_Schema):
    """Provenance of one feature array (one backbone x dataset x split x kind)."""

    schema_version: int
    backbone: str
    model_name: str
    weights_source: str
    weights_sha256: str
    timm_version: str
    torch_version: str
    featcache_version: str
    data_config: dict[str, Any]
    kind: str
    pooling: str
    dim: int
    dtype: str
    dataset: str
    split: str
    dataset_fingerprint: str
    n: int
    chunk_rows: int
    device: str = ""
    batch_size: int = 0
    amp: str = "none"
    channels_last: bool = False
    images_per_s: float | None = None
    peak_memory_mb: float | None = None
    n_invalid: int | None = None
    created: str = ""
    completed: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: the axes between rows and ``dim`` (``blocks:4``: ``(4,)``, ``tokens``: ``(T,)``); ``()`` for a
    #: ``[N, D]`` kind, and then absent from the attrs, so older stores' documents, digests and
    #: fingerprints are unchanged
    inner: tuple[int, ...] = ()
    #: a per-layer kind's origin (issue 56): ``{"index", "part", "module", "norm", "norm_module",
    #: "via"}``, e.g. ``module="blocks.3"``, ``norm=True``; ``{}`` for every other kind, and then
    #: absent from the attrs (older stores' documents, digests and fingerprints are unchanged)
    layer: dict[str, Any] = field(default_factory=dict)

    #: fields that define *what* the features are; a re-run must match them to resume
    IDENTITY = (
        "model_name",
        "weights_sha256",
        "data_config",
        "kind",
        "pooling",
        "dim",
        "dtype",
        "dataset_fingerprint",
        "n",
        "chunk_rows",
    )

    def __post_init__(self) -> None:
        if isinstance(self.inner, (list, tuple)) and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in self.inner
        ):
            object.__setattr__(self, "inner", tuple(int(x) for x in self.inner))

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row: ``(*inner, dim)``."""
        return (*self.inner, self.dim)

    def to_attrs(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.inner:
            d["inner"] = list(self.inner)
        else:
            del d["inner"]  # a [N, D] kind's document is the one written before inner existed
        if not self.layer:
            del d["layer"]  # likewise: only a per-layer kind records where it came from
        return d

    def _check_values(self, where: str) -> None:
        bad = []
        if not isinstance(self.inner, tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in self.inner
        ):
            bad.append(f"inner {self.inner!r} (a list of positive ints: the axes between rows and dim)")
        if self.dtype not in kind_dtypes(self.kind):
            which = f" for target kind {self.kind!r}" if self.kind in TARGET_DTYPES else ""
            bad.append(f"dtype {self.dtype!r} ({' or '.join(kind_dtypes(self.kind))}{which})")
        if not _DEVICE_RE.match(self.device):
            bad.append(f"device {self.device!r} (cpu, cuda, cuda:N or mps)")
        for name, lo in (("dim", 1), ("n", 0), ("chunk_rows", 1), ("batch_size", 0)):
            if getattr(self, name) < lo:
                bad.append(f"{name} {getattr(self, name)} (>= {lo})")
        if self.n_invalid is not None and not 0 <= self.n_invalid <= self.n:
            bad.append(f"n_invalid {self.n_invalid} (0..n={self.n})")
        if bad:
            raise SchemaMismatchError(
                f"{where}: provenance has impossible values: {'; '.join(bad)}; the document is damaged "
                "(`featcache verify` names the damage; re-extract with --overwrite to rewrite it)"
            )

    def identity(self) -> dict[str, Any]:
        """The IDENTITY fields, plus ``inner`` where it is not empty (so a ``[N, D]`` kind's
        identity, and every fingerprint made from it, is the one before ``inner`` existed), and a
        dense kind's ``extra["geometry"]`` / ``extra["dense"]`` where recorded (a resume with
        other windows, views or target reductions is refused; other kinds' identity unchanged)."""
        out = {k: _jsonable(getattr(self, k)) for k in self.IDENTITY}
        if self.inner:
            out["inner"] = list(self.inner)
        if self.layer:
            out["layer"] = _jsonable(self.layer)
        for key in DENSE_IDENTITY:  # a dense row's geometry and targets' meaning (issue 57)
            if isinstance(self.extra, dict) and self.extra.get(key) is not None:
                out[key] = _jsonable(self.extra[key])
        return out

    def differences(self, other: FeatureProvenance) -> dict[str, tuple[Any, Any]]:
        a, b = self.identity(), other.identity()
        keys = [*a, *(k for k in b if k not in a)]  # only ``inner``/``layer`` may be absent on one side
        return {k: (a.get(k, []), b.get(k, [])) for k in keys if a.get(k, []) != b.get(k, [])}


@dataclass(frozen=True)
class FeatureGroupMeta(_Schema):
    schema_version: int
    backbone: str
    dataset: str
    split: str
    n: int
    chunk_rows: int
    n_chunks: int
    kinds: tuple[str, ...]
    created: str

    def to_attrs(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kinds"] = list(self.kinds)
        return d


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v
