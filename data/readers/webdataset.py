"""Reader of WebDataset tar shards: ``webdataset:PATTERN``.

Uncompressed tar shards, brace/glob pattern (``::`` joins several). A sample is the members
sharing a ``__key__``: one image (.jpg/.png/...), a label in ``.cls`` (int), ``.json``
(``label``) or ``.npy`` (a multi-label vector); no labels at all -> class ``unlabeled``.
Id = ``__key__``. Split = shard-name prefix (``train-000.tar`` -> ``train``, ``val``, ``test``),
else ``all``. Shards are indexed once (headers only) and read by byte offset, so chunks resume
and ranks shard like any source.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from featcache.data.decode import decode_image
from featcache.data.readers.registry import register_format
from featcache.data.source import ReadOptions, SplitSource, escape_name, integer_classes, integral_labels
from featcache.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["WDS_IMAGE_EXTS", "read_webdataset"]

WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff", "gif")
_WDS_SPLIT_RE = re.compile(r"^(train|val|valid|validation|test)(?=[-_.])")


class _TarMemberLoader:
    """Random access to image members of tar shards by (shard, byte offset, size).

    Keeps one open descriptor per shard (opened lazily, so it pickles to workers; reads use
    ``os.pread`` with explicit offsets, safe in forked workers sharing a descriptor)."""

    def __init__(
        self,
        shards: list[str],
        shard: np.ndarray,
        offset: np.ndarray,
        size: np.ndarray,
        options: ReadOptions | None = None,
    ):
        self.shards, self.shard, self.offset, self.size = shards, shard, offset, size
        self.options = options
        self._files: dict[int, Any] = {}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_files"] = {}
        return d

    def __call__(self, i: int):
        import io

        if self.size[i] < 0:
            raise DataError("sample has no image member (.jpg/.png/...)")
        s = int(self.shard[i])
        fd = self._files.get(s)
        if fd is None:
            fd = self._files[s] = os.open(self.shards[s], os.O_RDONLY)
        # pread: no shared file offset, so forked workers that inherit the descriptor never race
        data = os.pread(fd, int(self.size[i]), int(self.offset[i]))
        return decode_image(io.BytesIO(data), self.options)


def _wds_label(ext: str, payload: bytes):
    if ext == "npy":  # CLIP_benchmark's multi-label exports: one [C] vector per sample
        import io

        return np.load(io.BytesIO(payload), allow_pickle=False)
    if ext == "cls":
        return int(payload.decode().strip())
    import json

    d = json.loads(payload)
    for k in ("label", "cls", "class"):
        if k in d:
            return d[k]
    return None


def _wds_name(arg: str) -> str:
    return Path(arg.split("::")[0]).parent.name or "webdataset"


@register_format(
    "webdataset",
    "wds",
    usage="webdataset:PATTERN",
    missing="webdataset needs shards: --data 'webdataset:DIR/train-{000000..000009}.tar'",
    name_of=_wds_name,
)
def read_webdataset(pattern: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Index tar shards (headers and label members only) for random access by row.

    Samples are grouped webdataset-style (``__key__`` = member path without extensions, via
    ``webdataset``'s own key splitting); the id of a row is its ``__key__``. The split is the
    shard name's prefix (``train-000.tar`` -> ``train``; ``val``/``test`` likewise), else ``all``.
    """
    try:
        from webdataset.shardlists import expand_urls
        from webdataset.tariterators import base_plus_ext
    except ImportError as exc:
        raise DataError("--data webdataset:... needs the webdataset package: pip install 'featcache[bulk]'") from exc

    shards = _wds_shards(pattern, expand_urls)
    idx = _wds_index(shards, base_plus_ext)
    if not idx["keys"]:
        raise DataError(f"webdataset shards {shards[:3]} hold no samples")
    raw = idx.pop("raw_labels")
    matrix = _wds_label_matrix(raw, idx["keys"], pattern)
    if matrix is None:
        classes, labels_all = _wds_labels(raw, idx["keys"], pattern)
    else:  # multi-label: the [N, C] matrix; the label column holds each row's first class
        classes, labels_all = [str(c) for c in range(matrix.shape[1])], matrix.argmax(axis=1).astype(np.int64)
    ids_all = np.asarray(idx.pop("keys"), dtype=str)
    splits_arr = np.asarray(idx["split_of"])
    shard_a = np.frombuffer(idx["shard_i"], dtype=np.int32)
    off_a, size_a = np.frombuffer(idx["off"], dtype=np.int64), np.frombuffer(idx["size"], dtype=np.int64)
    out = {}
    for s in dict.fromkeys(idx["split_of"]):
        rows = np.flatnonzero(splits_arr == s)
        out[s] = SplitSource(
            name,
            s,
            ids_all[rows],
            labels_all[rows],
            classes,
            _TarMemberLoader(shards, shard_a[rows], off_a[rows], size_a[rows], options),
            f"webdataset:{pattern}",
            {} if matrix is None else {"label_matrix": matrix[rows], "label_names": classes},
        )
    return out


def _wds_label_matrix(raw_labels: list, keys: list[str], pattern: str) -> np.ndarray | None:
    """The [N, C] bool label matrix of ``.npy`` label members (CLIP_benchmark's multi-label
    exports), or None when no sample has one. Every sample needs a 1-D vector of one length C."""
    if not any(isinstance(v, np.ndarray) for v in raw_labels):
        return None
    vec = [v for v in raw_labels if isinstance(v, np.ndarray)]
    n_cls = vec[0].size
    for key, v in zip(keys, raw_labels):
        ok = isinstance(v, np.ndarray) and v.ndim == 1 and v.size == n_cls and v.dtype.kind in "biuf"
        if not ok or not np.all(np.isfinite(v)):
            got = "no .npy label" if not isinstance(v, np.ndarray) else f"a {v.dtype} array of shape {v.shape}"
            raise DataError(
                f"webdataset {pattern}: sample {key!r} has {got}; a multi-label export needs a .npy "
                f"vector of {n_cls} numbers (0/1) for every sample: re-export that sample or drop it"
            )
    return np.stack(vec) > 0


def _wds_shards(pattern: str, expand_urls) -> list[str]:
    """The local tar files a webdataset pattern names (brace ranges and globs expanded)."""
    shards = []
    for u in expand_urls(pattern):
        if any(ch in u for ch in "*?["):
            shards.extend(
                sorted(str(p) for p in Path().glob(u))
                if not os.path.isabs(u)
                else sorted(str(p) for p in Path("/").glob(u.lstrip("/")))
            )
        else:
            shards.append(u)
    if not shards:
        raise DataError(
            f"webdataset pattern {pattern!r} matches no shard; give e.g. 'data/train-{{000000..000009}}.tar'"
        )
    lost = [u for u in shards if not os.path.isfile(u)]
    if lost:
        raise DataError(
            f"webdataset shard(s) not found: {lost[:5]} (of {len(shards)}); only local .tar files are supported"
        )
    return shards


def _wds_index(shards: list[str], base_plus_ext) -> dict:
    """One entry per sample: key, split, shard, image member offset/size and raw label
    (compact ``array`` columns: a million-row index holds no per-row Python objects but keys)."""
    import tarfile
    from array import array

    idx = {"keys": [], "split_of": [], "shard_i": array("i"), "off": array("q"), "size": array("q"), "raw_labels": []}
    for si, path in enumerate(shards):
        m = _WDS_SPLIT_RE.match(Path(path).name)
        split = m.group(1) if m else "all"
        try:
            tf = tarfile.open(path, "r:")  # noqa: SIM115 - closed below
        except (tarfile.TarError, OSError) as exc:
            raise DataError(f"{path} is not a readable (uncompressed) tar shard: {exc}") from exc
        try:
            with tf:
                _wds_index_shard(tf, si, split, base_plus_ext, idx)
                end = tf.offset
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(
                f"{path}: tar shard is damaged or truncated ({type(exc).__name__}: {exc}); "
                "re-copy or re-write the shard"
            ) from exc
        _wds_check_sizes(path, si, idx, end)
    return idx


def _wds_check_sizes(path: str, si: int, idx: dict, end: int) -> None:
    """A shard cut inside its last member's data, or at a member boundary (no end-of-archive
    block left), reads as a clean end of archive in ``tarfile``: catch both."""
    total = os.path.getsize(path)
    if total < end + 512:
        raise DataError(
            f"{path}: tar shard is truncated (no end-of-archive block after byte {end}, file has "
            f"{total} bytes); re-copy or re-write the shard"
        )
    for k in range(len(idx["shard_i"]) - 1, -1, -1):
        if idx["shard_i"][k] != si:
            break
        if idx["size"][k] >= 0 and idx["off"][k] + idx["size"][k] > total:
            raise DataError(
                f"{path}: tar shard is truncated (member of sample {idx['keys'][k]!r} ends at byte "
                f"{idx['off'][k] + idx['size'][k]}, the file has {total}); re-copy or re-write the shard"
            )


def _wds_index_shard(tf, si: int, split: str, base_plus_ext, idx: dict) -> None:
    keys, split_of, shard_i, off, size, raw_labels = (
        idx[k] for k in ("keys", "split_of", "shard_i", "off", "size", "raw_labels")
    )
    path, cur = tf.name, None
    for mem in tf:
        if not mem.isfile():
            continue
        key, ext = base_plus_ext(mem.name)
        if key is None or Path(mem.name).name.startswith("__"):
            continue
        ext = ext.lower()
        if key != cur:
            cur = key
            keys.append(escape_name(key))
            split_of.append(split)
            shard_i.append(si)
            off.append(0)
            size.append(-1)
            raw_labels.append(None)
        if ext in WDS_IMAGE_EXTS and size[-1] < 0:
            off[-1], size[-1] = mem.offset_data, mem.size
        elif ext in ("cls", "json", "npy") and raw_labels[-1] is None:
            fh = tf.extractfile(mem)
            try:
                raw_labels[-1] = _wds_label(ext, fh.read())
            except (ValueError, UnicodeDecodeError, EOFError) as exc:
                raise DataError(f"{path}: cannot parse label member {mem.name}: {exc}") from exc


def _wds_labels(raw_labels: list, keys: list[str], pattern: str) -> tuple[list[str], np.ndarray]:
    """Class names and label indices of the samples' raw .cls/.json labels (integers >= 0
    or class-name strings; none at all: one class 'unlabeled')."""
    nolabel = sum(v is None for v in raw_labels)
    if nolabel == len(raw_labels):
        log.info("webdataset %s: no .cls/.json labels; all rows get class 'unlabeled'", pattern)
        return ["unlabeled"], np.zeros(len(keys), np.int64)
    if nolabel:
        first = keys[next(i for i, v in enumerate(raw_labels) if v is None)]
        raise DataError(f"webdataset {pattern}: {nolabel} samples lack a .cls/.json label (e.g. {first!r})")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw_labels):
        where = f"webdataset {pattern}"
        labels_all = (
            np.asarray(raw_labels, np.int64)
            if all(isinstance(v, int) for v in raw_labels)
            else integral_labels(np.asarray(raw_labels, np.float64), where)
        )
        return integer_classes(labels_all, where), labels_all
    if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in raw_labels):
        odd = next(v for v in raw_labels if isinstance(v, bool) or not isinstance(v, (int, str)))
        raise DataError(f"webdataset {pattern}: label {odd!r} is neither an integer >= 0 nor a class-name string")
    strs = [str(v) for v in raw_labels]
    classes = sorted(set(strs))
    index = {c: i for i, c in enumerate(classes)}
    return classes, np.fromiter((index[v] for v in strs), np.int64, len(strs))
