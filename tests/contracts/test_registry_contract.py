"""Every registry refuses a second registration under a taken name (as protocols always did),
rather than silently replacing the first; every registered data format reads a real small
dataset and gives the images and labels the image-folder route gives."""

from __future__ import annotations

import gzip
import importlib
import io
import json
import re
import struct
import tarfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featcache.core.protocols import register_protocol
from featcache.core.registry import Registry
from featcache.data.readers import open_dataset
from featcache.data.readers.registry import FORMATS, register_format
from featcache.errors import BackboneError, ConfigError, DataError, FeatcacheError, ProtocolError
from featcache.models.backbones import list_weights_sources, register_weights_source


def _other(*args):  # a second function, never called
    raise AssertionError("not called")


@pytest.mark.parametrize("kind", sorted(FORMATS.names(aliases=True)))
def test_data_formats_refuse_duplicates(kind):
    first = FORMATS[kind]
    with pytest.raises(ConfigError, match=f"data format '{kind}' is already registered"):
        register_format(kind)(_other)
    assert FORMATS[kind] is first
    assert register_format(kind)(first.reader) is first.reader  # the same function again is harmless
    assert FORMATS[kind] is first


@pytest.mark.parametrize("scheme", list_weights_sources())
def test_weight_sources_refuse_duplicates(scheme):
    with pytest.raises(BackboneError, match=f"weights source '{scheme}' is already registered"):
        register_weights_source(scheme)(_other)


def test_protocols_refuse_duplicates():
    with pytest.raises(ProtocolError, match="already registered"):
        register_protocol("full")(_other)


def test_stages_refuse_duplicates():
    import featcache.probes  # noqa: F401  (registers the probe stage)
    from featcache.core.stagerun import STAGES, Stage, register_stage

    first = STAGES["probe"]
    with pytest.raises(ConfigError, match="a stage named 'probe' is already registered"):
        register_stage(Stage("probe", "json:dumps"))
    assert STAGES["probe"] is first


# --------------------------------------------------------------------------- data formats
# Every registered format reads a real small dataset written in its layout, and gives the
# images and labels the image-folder route gives for the same images. A format registered
# without a writer here fails test_every_format_has_a_contract_dataset.
DIGIT_CLASSES = (0, 1, 2)
FMNIST_CLASSES = (1, 2, 3)  # Trouser, Pullover, Dress: class names that can be folder names


def _digits_rows() -> dict[str, list[tuple[str, np.ndarray]]]:
    """{split: [(class name, uint8 image)]}: real sklearn digits, 3 train + 2 test per class."""
    from sklearn.datasets import load_digits

    d = load_digits()
    out: dict[str, list] = {"train": [], "test": []}
    for c in DIGIT_CLASSES:
        rows = np.flatnonzero(d.target == c)[:5]
        for j, r in enumerate(rows):
            img = (d.images[r] * (255.0 / 16.0)).round().astype(np.uint8)
            out["train" if j < 3 else "test"].append((str(c), img))
    return out


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _write_imagefolder(root: Path, rows) -> str:
    for split, items in rows.items():
        for i, (c, img) in enumerate(items):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(root / split / c / f"{i:03d}.png")
    return f"imagefolder:{root}"


def _write_manifest(root: Path, rows) -> str:
    lines = ["path,label,split"]
    for split, items in rows.items():
        for i, (c, img) in enumerate(items):
            (root / "img").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(root / "img" / f"{split}{i:03d}.png")
            lines.append(f"img/{split}{i:03d}.png,{c},{split}")
    (root / "m.csv").write_text("\n".join(lines) + "\n")
    return f"manifest:{root / 'm.csv'}"


def _write_webdataset(root: Path, rows) -> str:
    for split, items in rows.items():  # string labels in .json members
        members = {}
        for i, (c, img) in enumerate(items):
            members[f"{split}{i:04d}.png"] = _png(img)
            members[f"{split}{i:04d}.json"] = json.dumps({"label": c}).encode()
        _tar(root / f"{split}-000000.tar", members)
    return f"webdataset:{root}/{{train,test}}-000000.tar"


def _write_clip_benchmark(root: Path, rows) -> str:
    names = sorted({c for items in rows.values() for c, _ in items})
    for split, items in rows.items():  # integer .cls members, class names in classnames.txt
        members = {}
        for i, (c, img) in enumerate(items):
            members[f"s{i:07d}.png"] = _png(img)
            members[f"s{i:07d}.cls"] = str(names.index(c)).encode()
        _tar(root / split / "0.tar", members)
    (root / "classnames.txt").write_text("\n".join(names) + "\n")
    return f"clip-benchmark:{root}"


def _write_hf(root: Path, rows) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted({c for items in rows.values() for c, _ in items})
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names}}
    meta = {"huggingface": json.dumps({"info": {"features": features}})}
    (root / "data").mkdir(parents=True)
    for split, items in rows.items():
        img = pa.array(
            [{"bytes": _png(im), "path": f"{i}.png"} for i, (_, im) in enumerate(items)],
            pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
        lab = pa.array([names.index(c) for c, _ in items], pa.int64())
        table = pa.table({"image": img, "label": lab}).replace_schema_metadata(meta)
        pq.write_table(table, root / "data" / f"{split}-00000-of-00001.parquet")
    return f"hf:{root}"


def _write_vtab1k(root: Path, rows) -> str:
    for split, lst in (("train", "train800"), ("test", "test")):
        lines = []
        for i, (c, img) in enumerate(rows[split]):
            (root / "images").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(root / "images" / f"{split}{i:03d}.png")
            lines.append(f"images/{split}{i:03d}.png {c}")
        (root / f"{lst}.txt").write_text("\n".join(lines) + "\n")
    return f"vtab1k:{root}"


def _fmnist_rows() -> dict[str, list[tuple[str, np.ndarray]]]:
    """Real Fashion-MNIST test images (read from the IDX bytes directly), 3 train + 2 test per class."""
    from featcache.data.readers.folders import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR

    d = Path(FASHION_MNIST_DIR)
    if not (d / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    images = np.frombuffer(gzip.decompress((d / "t10k-images-idx3-ubyte.gz").read_bytes()), np.uint8, offset=16)
    labels = np.frombuffer(gzip.decompress((d / "t10k-labels-idx1-ubyte.gz").read_bytes()), np.uint8, offset=8)
    images = images.reshape(-1, 28, 28)
    out: dict[str, list] = {"train": [], "test": []}
    for c in FMNIST_CLASSES:
        for j, r in enumerate(np.flatnonzero(labels == c)[:5]):
            out["train" if j < 3 else "test"].append((FASHION_MNIST_CLASSES[c], images[r]))
    return out


def _write_fashion_mnist(root: Path, rows) -> str:
    from featcache.data.readers.folders import FASHION_MNIST_CLASSES

    root.mkdir(parents=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        imgs = np.stack([im for _, im in rows[split]])
        labs = np.array([FASHION_MNIST_CLASSES.index(c) for c, _ in rows[split]], np.uint8)
        head_i = struct.pack(">IIII", 0x803, len(imgs), 28, 28)
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(head_i + imgs.tobytes()))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", 0x801, len(labs)) + labs.tobytes())
        )
    return f"fashion-mnist:{root}"


def _digits_spec(root: Path, rows) -> str:
    return "digits"  # built in: nothing to write; _digits_full_rows are the rows it must give


def _digits_full_rows(n: int = 40) -> dict[str, list[tuple[str, np.ndarray]]]:
    """The first ``n`` rows of each split of sklearn's digits in the documented split
    (train_test_split, test_size 0.25, random_state 0, stratified; rows in index order)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    idx = np.arange(len(d.target))
    tr, te = train_test_split(idx, test_size=0.25, random_state=0, stratify=d.target)
    img = (d.images * (255.0 / 16.0)).round().astype(np.uint8)
    return {s: [(str(d.target[r]), img[r]) for r in sorted(rows)[:n]] for s, rows in (("train", tr), ("test", te))}


def _dense_rows(name: str) -> dict[str, list[tuple[str, np.ndarray]]]:
    """The digits rows under a dense dataset's one label (a dense reader's labels are all 0:
    its first class, here ``name``)."""
    return {s: [(name, img) for _, img in items] for s, items in _digits_rows().items()}


def _dense_pairs(root: Path, rows, image_path, mask_path, mask_dtype=np.uint8) -> None:
    """Write every row's image and an all-zero target of its size at the given paths."""
    for split, items in rows.items():
        for i, (_, img) in enumerate(items):
            for path, a in ((image_path(split, i), img), (mask_path(split, i), np.zeros(img.shape[:2], mask_dtype))):
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(a).save(path)


def _write_ade20k(root: Path, rows) -> str:
    base, folder = root / "ADEChallengeData2016", {"train": "training", "test": "validation"}
    _dense_pairs(
        root,
        rows,
        lambda s, i: base / "images" / folder[s] / f"ADE_{s}_{i:08d}.png",
        lambda s, i: base / "annotations" / folder[s] / f"ADE_{s}_{i:08d}.png",
    )
    return f"ade20k:{root}"


def _write_voc(root: Path, rows) -> str:
    _dense_pairs(
        root,
        rows,
        lambda s, i: root / "JPEGImages" / f"{s}_{i:06d}.png",
        lambda s, i: root / "SegmentationClass" / f"{s}_{i:06d}.png",
    )
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    for split, listing in (("train", "train"), ("test", "val")):
        ids = "".join(f"{split}_{i:06d}\n" for i in range(len(rows[split])))
        (root / "ImageSets" / "Segmentation" / f"{listing}.txt").write_text(ids)
    return f"voc:{root}"


def _write_cityscapes(root: Path, rows) -> str:
    _dense_pairs(
        root,
        rows,
        lambda s, i: root / "leftImg8bit" / s / "bonn" / f"bonn_{i:06d}_000019_leftImg8bit.png",
        lambda s, i: root / "gtFine" / s / "bonn" / f"bonn_{i:06d}_000019_gtFine_labelTrainIds.png",
    )
    return f"cityscapes:{root}"


def _write_segfolder(root: Path, rows) -> str:
    _dense_pairs(
        root, rows, lambda s, i: root / s / "images" / f"{i:03d}.png", lambda s, i: root / s / "masks" / f"{i:03d}.png"
    )
    return f"segfolder:{root}"  # no classes.txt: classes 0..the largest id (0)


def _write_nyuv2(root: Path, rows) -> str:
    _dense_pairs(
        root,
        rows,
        lambda s, i: root / s / "rgb" / f"{i:05d}.png",
        lambda s, i: root / s / "depth" / f"{i:05d}.png",
        np.uint16,
    )
    return f"nyuv2:{root}"


#: kind -> (the real rows, a writer of those rows in the format's layout, {format split: split})
CONTRACT = {
    "digits": (_digits_full_rows, _digits_spec, {"train": "train", "test": "test"}),
    "fashion-mnist": (_fmnist_rows, _write_fashion_mnist, {"train": "train", "test": "test"}),
    "imagefolder": (_digits_rows, _write_imagefolder, {"train": "train", "test": "test"}),
    "manifest": (_digits_rows, _write_manifest, {"train": "train", "test": "test"}),
    "webdataset": (_digits_rows, _write_webdataset, {"train": "train", "test": "test"}),
    "clip-benchmark": (_digits_rows, _write_clip_benchmark, {"train": "train", "test": "test"}),
    "hf": (_digits_rows, _write_hf, {"train": "train", "test": "test"}),
    "vtab1k": (_digits_rows, _write_vtab1k, {"train800": "train", "test": "test"}),
    "ade20k": (partial(_dense_rows, "wall"), _write_ade20k, {"train": "train", "val": "test"}),
    "voc": (partial(_dense_rows, "background"), _write_voc, {"train": "train", "val": "test"}),
    "cityscapes": (partial(_dense_rows, "road"), _write_cityscapes, {"train": "train", "test": "test"}),
    "segfolder": (partial(_dense_rows, "0"), _write_segfolder, {"train": "train", "test": "test"}),
    "nyuv2": (partial(_dense_rows, "scene"), _write_nyuv2, {"train": "train", "test": "test"}),
}


def _canonical_kinds() -> list[str]:
    return list(dict.fromkeys(f.kind for f in FORMATS.values()))


def test_every_format_has_a_contract_dataset():
    assert _canonical_kinds() == list(CONTRACT)


def _read(spec: str, splits: dict[str, str], first: int | None = None) -> dict[str, list[tuple[str, bytes]]]:
    """{split: [(class name, pixels)]} in the reader's row order (the ``first`` rows only,
    when given), with mode and id checks."""
    out = {}
    got = open_dataset(spec, "contract")
    assert sorted(got) == sorted(splits)
    for fsplit, split in splits.items():
        s = got[fsplit]
        assert s.dataset == "contract"
        assert len(s) == len(s.labels) == len(set(s.ids.tolist()))
        rows = []
        for i in range(min(len(s), first or len(s))):
            im = s.load(i)
            assert im.mode in ("L", "RGB")
            rows.append((s.class_names[int(s.labels[i])], np.asarray(im).tobytes()))
        out[split] = rows
    return out


@pytest.mark.parametrize("kind", list(CONTRACT))
def test_every_format_reads_what_the_image_folder_route_reads(kind, tmp_path):
    make_rows, write, splits = CONTRACT[kind]
    rows = make_rows()
    spec = write(tmp_path / "fmt", rows)
    via_folder = _read(_write_imagefolder(tmp_path / "folder", rows), {"train": "train", "test": "test"})
    got = _read(spec, splits, first=len(rows["train"]) if kind == "digits" else None)
    expected = {s: [(c, img.tobytes()) for c, img in r] for s, r in rows.items()}
    for split in ("train", "test"):
        assert sorted(via_folder[split]) == sorted(expected[split])  # the reference route reads the rows back
        if kind == "digits":  # built in, a prefix: its rows in the documented order
            got[split] = got[split][: len(expected[split])]
            assert got[split] == expected[split]
        assert sorted(got[split]) == sorted(via_folder[split]), (kind, split)


def test_data_help_and_errors_list_every_registered_format():
    """--data's help (extract and finetune) and the unknown-spec error are built from the registry."""
    from featcache.core.configs import help_of
    from featcache.errors import DataError
    from featcache.extract import ExtractConfig
    from featcache.finetune.config import FinetuneConfig

    helps = [help_of(c.__dataclass_fields__["data"]) for c in (ExtractConfig, FinetuneConfig)]
    with pytest.raises(DataError, match="unknown data spec") as err:
        open_dataset("no-such-format:x")
    for kind in _canonical_kinds():
        usage = FORMATS[kind].usage
        assert all(usage in h for h in helps), (kind, helps)
        assert usage in str(err.value)


# --------------------------------------------------------------------------- every registry
# One contract over every registry built on featcache.core.registry.Registry: each name (and
# alias) resolves, a lazy entry imports, a taken name is refused and the registry is left as
# it was, a near miss gets the close match, and the help lists every entry.
def _every_registry() -> dict[str, Registry]:
    import featcache.retrieval  # noqa: F401 - Battle of the Backbones' metrics register on import
    from featcache import cli
    from featcache.core import metrics, protocols, stagerun, tracking
    from featcache.models import backbones, sources
    from featcache.probes import solvers
    from featcache.retrieval import metrics as retrieval_metrics
    from featcache.similarity import measures, registry

    solvers.find_solvers()
    return {
        "probe protocol": protocols.PROTOCOLS["probe"],
        "finetune protocol": protocols.PROTOCOLS["finetune"],
        "probe solver": solvers.SOLVERS,
        "metric": metrics.METRICS,
        "retrieval metric": retrieval_metrics.RETRIEVAL_METRICS,
        "stage": stagerun.STAGES,
        "command": cli.COMMANDS,
        "data format": FORMATS,
        "model source": sources.SOURCES,
        "model listing": sources.LISTINGS,
        "weights source": backbones.WEIGHTS_SOURCES,
        "similarity measure": registry.MEASURES,
        "RDM method": measures.RDM_METHODS,
        "tracker": tracking.TRACKERS,
    }


REGISTRIES = [
    "probe protocol",
    "finetune protocol",
    "probe solver",
    "metric",
    "retrieval metric",
    "stage",
    "command",
    "data format",
    "model source",
    "model listing",
    "weights source",
    "similarity measure",
    "RDM method",
    "tracker",
]


def test_the_contract_covers_every_registry():
    assert sorted(_every_registry()) == sorted(REGISTRIES)
    assert all(isinstance(r, Registry) for r in _every_registry().values())


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_name_resolves_and_lazy_entries_import(kind):
    reg = _every_registry()[kind]
    assert len(reg) > 0
    assert reg.kind == kind
    for name in reg.names(aliases=True):
        entry = reg.entry(name)
        assert name == entry.name or name in entry.aliases
        assert reg.resolve(name) is reg[name] is entry.target
        if entry.spec is not None:  # registered as "module:attr": that attribute, imported now
            module, _, attr = entry.spec.partition(":")
            assert entry.loaded
            assert entry.target is getattr(importlib.import_module(module), attr)
    assert list(reg) == [e.name for e in reg.entries()]


def _typo(name: str, taken) -> str:
    """A near miss of ``name`` that is no registered name (its last letter doubled)."""
    typo = name + name[-1]
    return typo if typo not in taken else name[:-1]


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_registry_refuses_a_taken_name(kind):
    reg = _every_registry()[kind]
    for name in reg.names(aliases=True):
        before = reg.entry(name)
        with pytest.raises(reg.error, match=f"{re.escape(repr(name))} is already registered"):
            reg.register(name, _other)
        assert reg.entry(name) is before
    assert issubclass(reg.error, FeatcacheError)
    assert issubclass(reg.error, (ValueError, LookupError, TypeError))  # and the builtin


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_registry_names_the_close_match(kind):
    reg = _every_registry()[kind]
    for name in reg:
        typo = _typo(name, reg)
        with pytest.raises(reg.error) as err:
            reg.entry(typo)
        msg = str(err.value)
        assert msg.startswith(f"unknown {kind} {typo!r}; did you mean "), msg
        assert repr(name) in msg.split("?")[0], msg
        assert all(u in msg for u in reg.usages()), msg


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_registry_help_lists_every_entry(kind):
    reg = _every_registry()[kind]
    text = reg.help()
    for e in reg.entries():
        assert e.usage in text, (e, text)
        assert e.note in text, (e, text)
    assert text.count(" | ") == len(reg) - 1


def test_every_command_module_is_registered():
    """Each package's cli.py registers commands (a new stage cannot be forgotten)."""
    from featcache import cli

    root = Path(cli.__file__).parent
    packages = {p.parent.name for p in root.glob("*/cli.py")}
    assert {f"featcache.{p}.cli" for p in packages} == set(cli.command_modules())


def test_metric_direction_is_part_of_the_registration():
    """The analysis reads a metric's direction and kind from its registration: the sets it used
    to keep by hand, and a metric registered now."""
    from featcache.core import metrics

    assert metrics.lower_is_better() == {"nll", "ece", "ce", "loss", "cross_entropy"}
    assert metrics.proportion_metrics() == {"top1", "top5", "accuracy", "acc"}
    with metrics.METRICS.restored():
        metrics.register_metric("r45_err", metrics.nll, higher_is_better=False, aliases=("r45_e",))
        assert {"r45_err", "r45_e"} <= metrics.lower_is_better()
        assert metrics.metric_info("r45_e").higher_is_better is False
        with pytest.raises(ConfigError, match="higher must be better"):
            metrics.register_metric("r45_bad", metrics.nll, task=True, higher_is_better=False)
    assert "r45_err" not in metrics.lower_is_better()


# --------------------------------------------------------------------------- the class itself
def test_registry_decorator_lazy_aliases_and_undo():
    reg: Registry = Registry("widget", DataError)

    @reg.register("round", usage="round:R", note="a disc", aliases=("disc",))
    def round_(r):
        return r

    assert reg["round"] is reg["disc"] is round_
    assert list(reg) == ["round"]
    assert reg.register("round", round_) is round_  # the same object again: harmless
    reg.register("dumps", "json:dumps")
    assert not reg.entry("dumps").loaded  # nothing imported until looked up
    assert reg["dumps"] is json.dumps
    assert reg.entry("dumps").loaded
    assert reg.register("dumps", "json:dumps") == "json:dumps"  # the same module:attr again
    with pytest.raises(DataError, match=r"widget 'dumps' is already registered \(by json:dumps\)"):
        reg.register("dumps", "json:loads")
    with pytest.raises(DataError, match="register yours under another name"):
        reg.register("disc", len)  # an alias is taken too
    assert reg.help() == "round:R (a disc) | dumps"
    assert reg.unknown("rond") == "unknown widget 'rond'; did you mean 'round'? known: round:R, dumps"
    with pytest.raises(DataError, match="module:attr"):
        reg.register("bad", "json")
    with reg.restored():
        del reg["round"]
        reg["dumps"] = json.loads  # replaced outright, keeping its usage
        assert "disc" not in reg
        assert reg["dumps"] is json.loads
    assert reg["disc"] is round_
    assert reg["dumps"] is json.dumps
    strict = Registry("gadget", DataError, idempotent=False)
    strict.register("a", len)
    with pytest.raises(DataError, match="already registered"):
        strict.register("a", len)
    copy = strict.copy()
    copy.register("b", max)
    assert list(strict) == ["a"]
    assert list(copy) == ["a", "b"]
    with pytest.raises(TypeError, match="FeatcacheError"):
        Registry("thing", ValueError)


def test_a_source_lists_its_models_through_its_registration(tmp_path, monkeypatch):
    """``featcache models`` lists the sources registered with a listing (no second list in the
    catalog): one registered now is listed, offered in ``--source``'s help, then gone again."""
    from featcache.cli import build_parser
    from featcache.models import catalog, sources

    assert list(sources.LISTINGS) == ["timm", "torchvision", "open_clip", "hf"]
    (tmp_path / "r45_source.py").write_text(
        "def list_models():\n    yield 'r45:tiny', 'random:0', None\n    yield 'r45:big', 'random:0', True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with sources.SOURCES.restored(), sources.LISTINGS.restored():
        sources.register_source("r45", "r45_source", usage="r45:NAME", listing="r45_source:list_models")
        assert [(e.source, e.model, e.cached) for e in catalog.list_models("tiny", ["r45"])] == [
            ("r45", "r45:tiny", None)
        ]
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices
        (help_text,) = [a.help for a in sub["models"]._actions if a.dest == "source"]
        assert help_text.startswith("timm | torchvision | open_clip | hf | r45 ")
    assert "r45" not in sources.LISTINGS
    with pytest.raises(ConfigError, match="did you mean 'open_clip'"):
        list(catalog.list_models("*", ["opn_clip"]))


def test_reproducible_weights_is_a_field_of_the_weights_source(tmp_path):
    """The sweep fine-tunes only weights it can load again: a scheme registered as reproducible
    (the list it kept by hand: timm, random, package), or a checkpoint file that exists."""
    from featcache.models.backbones import WEIGHTS_SOURCES, register_weights_source, reproducible_weights

    assert [reproducible_weights(w) for w in ("timm", "pretrained", "random:0", "package:x")] == [
        True,
        False,
        True,
        True,
    ]
    (tmp_path / "w.pth").write_bytes(b"")
    assert reproducible_weights(str(tmp_path / "w.pth"))
    assert not reproducible_weights(str(tmp_path / "gone.pth"))
    with WEIGHTS_SOURCES.restored():
        register_weights_source("r45w", reproducible=True)(_other)
        register_weights_source("r45x")(_other)  # by default not reproducible
        assert reproducible_weights("r45w:key")
        assert not reproducible_weights("r45x:key")
    assert not reproducible_weights("r45w:key")
