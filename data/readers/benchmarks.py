"""Readers for the layouts benchmark data is distributed in, read offline from a local copy.

==============================  ==============================================================
spec                            source
==============================  ==============================================================
``clip-benchmark:DIR``          CLIP_benchmark's WebDataset export of one task:
                                ``DIR/<split>/<n>.tar`` (shards in numeric order, members
                                ``s0000000.webp|png|jpg`` + ``.cls``), ``DIR/classnames.txt``
                                (one name per line, indexed by the ``.cls`` label) and
                                ``DIR/zeroshot_classification_templates.txt`` (kept in the
                                split's ``extra["templates"]``). Ids are ``<split>/<__key__>``
                                (the export restarts ``s%07d`` in every split). Multi-label
                                exports (``.npy`` label vectors) give the [N, C] label matrix.
``hf:PATH``                     Hugging Face ``datasets`` on disk, read with pyarrow (no
                                ``datasets`` import, never a download): a ``save_to_disk``
                                folder (``dataset_dict.json`` + one folder per split, or one
                                split with ``state.json``), a folder of ``<split>-*.parquet`` /
                                ``*-<split>.arrow`` files (hub or cache layout), or one file.
                                Image column: the ``Image`` feature (``{bytes, path}``); label:
                                the ``ClassLabel`` feature (its names are the classes), else
                                ``label``. Ids: an ``id`` column, else ``<split>-<row>``.
``vtab1k:DIR``                  the VTAB-1k file lists of one task: ``DIR/train800.txt``,
                                ``val200.txt``, ``train800val200.txt``, ``test.txt`` (whichever
                                exist; lines ``path label``, paths relative to DIR); each file
                                is a split, rows in file order. Ids are the listed paths.
==============================  ==============================================================
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from featcache.data.decode import PathLoader, decode_image
from featcache.data.readers.registry import register_format
from featcache.data.readers.webdataset import read_webdataset
from featcache.data.source import ReadOptions, SplitSource, StringColumn, escape_name, integer_classes
from featcache.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["VTAB1K_SPLIT_FILES", "clip_benchmark", "detect_spec", "huggingface", "vtab1k"]

VTAB1K_SPLIT_FILES = ("train800", "val200", "train800val200", "test")


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


# --------------------------------------------------------------------------- CLIP_benchmark wds
@register_format("clip-benchmark", "clip_benchmark", usage="clip-benchmark:DIR", note="CLIP_benchmark wds export")
def clip_benchmark(root: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """One task exported by CLIP_benchmark's ``webdataset_builder`` (see the module table)."""
    d = Path(root)
    split_dirs = sorted(p for p in d.iterdir() if p.is_dir() and any(p.glob("*.tar"))) if d.is_dir() else []
    if not split_dirs:
        raise DataError(
            f"{root} holds no <split>/*.tar shards; expected CLIP_benchmark's layout "
            "TASK/<split>/0.tar ... with TASK/classnames.txt"
        )
    cn = d / "classnames.txt"
    names = _lines(cn) if cn.is_file() else None
    tf = d / "zeroshot_classification_templates.txt"
    templates = _lines(tf) if tf.is_file() else []
    out = {}
    for sd in split_dirs:
        shards = sorted(sd.glob("*.tar"), key=_natural_key)
        parts = list(read_webdataset("::".join(str(s) for s in shards), name, options).values())
        if len(parts) != 1:
            raise DataError(f"{sd}: shards named for several splits; CLIP_benchmark names them 0.tar, 1.tar, ...")
        src = parts[0]
        src.split, src.source = sd.name, f"clip-benchmark:{d.resolve()}/{sd.name}"
        # the export restarts its s%07d keys in every split: ids unique per split (test/s0000000)
        src.ids = np.char.add(f"{sd.name}/", np.asarray(src.ids, str))
        multi = "label_matrix" in src.extra
        if names is not None:
            if multi and src.extra["label_matrix"].shape[1] != len(names):
                n_vec = src.extra["label_matrix"].shape[1]
                raise DataError(f"{sd}: .npy labels have {n_vec} entries but {cn} names {len(names)} classes")
            if len(src.class_names) > len(names):
                raise DataError(f"{sd}: label {len(src.class_names) - 1} but {cn} names only {len(names)} classes")
            src.class_names = list(names)
            if multi:
                src.extra["label_names"] = list(names)
        src.extra["templates"] = templates
        out[sd.name] = src
    if names is None:  # integer labels of every split share one class list
        k = max(len(s.class_names) for s in out.values())
        for s in out.values():
            s.class_names = [str(i) for i in range(k)]
            if "label_matrix" in s.extra:
                s.extra["label_names"] = list(s.class_names)
        log.warning("%s has no classnames.txt; classes are named by their integer label", root)
    return out


# --------------------------------------------------------------------------- Hugging Face on disk
_HF_SPLIT_RE = re.compile(r"^(?:.*-)?(train|validation|valid|val|test)(?:[-.].*)?$")


@register_format("hf", "huggingface", usage="hf:PATH", note="datasets on disk")
def huggingface(root: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """Hugging Face ``datasets`` saved or cached on disk (see the module table)."""
    files = _hf_split_files(Path(root))
    out = {}
    for split, paths in files.items():
        table, features = _hf_read([str(p) for p in paths])
        out[split] = _hf_source(table, features, paths, name, split, options)
    return out


def _hf_split_files(p: Path) -> dict[str, list[Path]]:
    """``{split: data files}`` of a save_to_disk folder, a hub/cache folder or one file."""
    if p.is_file():
        return {"all": [p]}
    if not p.is_dir():
        raise DataError(f"{p} does not exist; give a save_to_disk folder, a folder of parquet/arrow files or a file")
    dd = p / "dataset_dict.json"
    if dd.is_file():
        splits = json.loads(dd.read_text())["splits"]
        return {s: [f for fs in _hf_split_files(p / s).values() for f in fs] for s in splits}
    state = p / "state.json"
    if state.is_file():
        st = json.loads(state.read_text())
        return {st.get("_split") or "all": [p / f["filename"] for f in st["_data_files"]]}
    found = sorted([*p.rglob("*.parquet"), *p.rglob("*.arrow")], key=_natural_key)
    if not found:
        raise DataError(f"{p} holds no dataset_dict.json, state.json, *.parquet or *.arrow files")
    out: dict[str, list[Path]] = {}
    for f in found:
        m = _HF_SPLIT_RE.match(f.name.rsplit(".", 1)[0])
        out.setdefault(m.group(1) if m else "all", []).append(f)
    return out


def _hf_read(paths: list[str]):
    """One pyarrow table (memory-mapped for arrow files) and the ``datasets`` features."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for p in paths:
        try:
            if p.endswith(".parquet"):
                tables.append(pq.read_table(p, memory_map=True))
            else:
                with pa.memory_map(p) as src:
                    tables.append(pa.ipc.open_stream(src).read_all())
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read {p} as a Hugging Face arrow/parquet file: {exc}") from exc
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    meta = (table.schema.metadata or {}).get(b"huggingface")
    features = json.loads(meta).get("info", {}).get("features", {}) if meta else {}
    if not features:
        info = Path(paths[0]).parent / "dataset_info.json"
        features = json.loads(info.read_text()).get("features", {}) if info.is_file() else {}
    return table, features


def _hf_columns(table, features: dict[str, Any], where: str) -> tuple[str, str | None]:
    """The image column and the label column (None: no labels)."""
    import pyarrow as pa

    image = next((c for c, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image"), None)
    if image is None:
        image = next(
            (
                c
                for c in table.column_names
                if pa.types.is_struct(table.schema.field(c).type)
                and table.schema.field(c).type.get_field_index("bytes") >= 0
            ),
            None,
        )
    if image is None:
        raise DataError(
            f"{where}: no image column (an Image feature or a struct with 'bytes'); columns are {table.column_names}"
        )
    label = next((c for c, f in features.items() if isinstance(f, dict) and f.get("_type") == "ClassLabel"), None)
    if label is None:
        label = next((c for c in ("label", "labels", "fine_label") if c in table.column_names), None)
    return image, label


def _hf_source(table, features, paths, name: str, split: str, options: ReadOptions) -> SplitSource:
    where = f"hf {paths[0].parent}/{split}"
    image, label = _hf_columns(table, features, where)
    n = table.num_rows
    if label is None:
        labels, classes = np.zeros(n, np.int64), ["unlabeled"]
    else:
        col = table.column(label)
        if col.null_count:
            raise DataError(f"{where}: column {label!r} has empty labels")
        labels = np.asarray(col.to_numpy(), dtype=np.int64)
        names = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
        classes = list(names) if names else integer_classes(labels, where)
        if labels.size and (labels.min() < 0 or labels.max() >= len(classes)):
            raise DataError(f"{where}: label values outside 0..{len(classes) - 1} (e.g. -1 = unlabeled)")
    ids = (
        np.asarray(table.column("id").cast("string").to_pylist(), dtype=str)
        if "id" in table.column_names
        else np.array([f"{split}-{i:06d}" for i in range(n)])
    )
    loader = _HFImageLoader([str(p) for p in paths], image, Path(paths[0]).parent, options)
    return SplitSource(name, split, ids, labels, classes, loader, f"hf:{paths[0].parent.resolve()}/{split}")


class _HFImageLoader:
    """Row ``i``'s image from the ``{bytes, path}`` column; the table is (re)opened lazily in each
    process (memory-mapped), so the loader pickles to DataLoader workers as a few paths."""

    def __init__(self, paths: list[str], column: str, base: Path, options: ReadOptions):
        self.paths, self.column, self.base, self.options = paths, column, base, options
        self._col = None

    def __getstate__(self):
        return {**self.__dict__, "_col": None}

    def __call__(self, i: int):
        import io

        if self._col is None:
            self._col = _hf_read(self.paths)[0].column(self.column)
        cell = self._col[int(i)].as_py()
        if cell is None:
            raise DataError("row has no image")
        if cell.get("bytes"):
            return decode_image(io.BytesIO(cell["bytes"]), self.options)
        p = Path(cell.get("path") or "")
        return decode_image(str(p if p.is_absolute() else self.base / p), self.options)


# --------------------------------------------------------------------------- VTAB-1k file lists
@register_format("vtab1k", "vtab-1k", usage="vtab1k:DIR", note="train800.txt ...", official_val=("train800", "val200"))
def vtab1k(root: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """One task in the VTAB-1k file-list layout (see the module table)."""
    d = Path(root)
    files = [(s, d / f"{s}.txt") for s in VTAB1K_SPLIT_FILES if (d / f"{s}.txt").is_file()]
    if not files:
        raise DataError(
            f"{root} has none of {', '.join(s + '.txt' for s in VTAB1K_SPLIT_FILES)}; "
            "expected the VTAB-1k layout TASK/images/... with TASK/train800.txt etc."
        )
    parsed = {s: _path_label_lines(f) for s, f in files}
    all_labels = np.concatenate([lab for _, lab in parsed.values()])
    classes = integer_classes(all_labels, f"vtab1k {root}")
    base = str(d.resolve()).rstrip("/") + "/"
    out = {}
    for s, (paths, labels) in parsed.items():
        full = StringColumn.from_polars(_series([p if p.startswith("/") else base + p for p in paths]))
        out[s] = SplitSource(
            name,
            s,
            np.array([escape_name(p) for p in paths]),
            labels,
            classes,
            PathLoader(full, options),
            f"vtab1k:{d.resolve()}/{s}.txt",
            extra={"paths": full},
        )
    return out


def _series(values: list[str]):
    import polars as pl

    return pl.Series(values, dtype=pl.Utf8)


def _path_label_lines(f: Path) -> tuple[list[str], np.ndarray]:
    paths, labels = [], []
    for n, ln in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not ln.strip():
            continue
        path, _, lab = ln.strip().rpartition(" ")
        if not path or not re.fullmatch(r"\d+", lab):
            raise DataError(f"{f} line {n}: {ln.strip()!r} is not 'path label' with an integer label >= 0")
        paths.append(path.strip())
        labels.append(int(lab))
    if not paths:
        raise DataError(f"{f} lists no images")
    return paths, np.asarray(labels, np.int64)


# --------------------------------------------------------------------------- layout detection
def detect_spec(path: str | Path) -> str | None:
    """The data spec of a task folder (or manifest file) in any supported layout, else None:
    VTAB-1k file lists, CLIP_benchmark shards, Hugging Face on disk, an image folder, a manifest."""
    p = Path(path)
    for ext in (".csv", ".parquet"):
        if p.with_name(p.name + ext).is_file():
            return f"manifest:{p.with_name(p.name + ext)}"
    if not p.is_dir():
        return None
    if any((p / f"{s}.txt").is_file() for s in VTAB1K_SPLIT_FILES):
        return f"vtab1k:{p}"
    subdirs = [d for d in p.iterdir() if d.is_dir() and not d.name.startswith(".")]
    if any(any(d.glob("*.tar")) for d in subdirs):
        return f"clip-benchmark:{p}"
    shallow = ("*.parquet", "*/*.parquet", "*.arrow", "*/*.arrow")  # never walk a whole image tree
    if (
        (p / "dataset_dict.json").is_file()
        or (p / "state.json").is_file()
        or any(next(p.glob(g), None) for g in shallow)
    ):
        return f"hf:{p}"
    if (p / "manifest.csv").is_file():
        return f"manifest:{p / 'manifest.csv'}"
    if subdirs:
        return f"imagefolder:{p}"
    return None
