"""Fault injection around the chunks, a deterministic loop per case (the state machine's checks:
no traceback, nothing finished lost, repaired byte-identical where repairable):

* every metadata document kind of a store (root, the folders between units, a split, its
  ``ids``/``labels``, a feature group, its feature array and ``valid``/``error``/``done``)
  truncated, with a bit flipped in a key (zarr refuses it), with a value changed (zarr reads
  it: only the digest finds it) and with one seeded random bit flipped;
* the manifest of digests itself damaged, and a store written before digests;
* ENOSPC at each write ``verify --repair`` makes, and EACCES/ENOENT while verify walks the store.

With ``FEATCACHE_FAULT_FIGURES=FILE`` set, the counts quoted in docs/store.md are written to FILE.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from featcache.cli import main
from featcache.store import open_cache, write_features

SPLIT = "datasets/digits/train"
GROUP = "features/pix/digits/train"
#: node -> whether its writer records it (a digest and a copy of its attributes)
DOCS = {
    "": True,
    "datasets": False,
    "datasets/digits": False,
    SPLIT: True,
    f"{SPLIT}/ids": True,
    f"{SPLIT}/labels": True,
    "features": False,
    "features/pix": False,
    "features/pix/digits": False,
    GROUP: True,
    f"{GROUP}/pooled": True,
    f"{GROUP}/valid": True,
    f"{GROUP}/error": True,
    f"{GROUP}/done": True,
}
FIGURES: dict[str, int] = {}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from sklearn.datasets import load_digits

    d = load_digits()
    X, y = d.data[:128].astype(np.float32), d.target[:128]
    path = tmp_path_factory.mktemp("faults") / "ref.zarr"
    write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(len(y))],
        labels=y,
        class_names=[str(c) for c in d.target_names],
        chunk_rows=64,
    )
    return path, X


def _doc(path, node):
    return path / node / "zarr.json" if node else path / "zarr.json"


def _damages(raw: bytes, recorded: bool, rng: random.Random) -> dict[str, bytes]:
    out = {"truncated": raw[: len(raw) // 2]}
    key = b'"node_type"'
    i = raw.index(key) + 3
    out["key flipped"] = raw[:i] + bytes([raw[i] ^ 0x04]) + raw[i + 1 :]
    if recorded:  # a value zarr still reads: a digit of the shape, else a letter of an attribute
        j = raw.index(b'"shape"') + 12 if b'"shape"' in raw else raw.index(b'"attributes"') + 20
        while not chr(raw[j]).isalnum():
            j += 1
        c = ord("7") if chr(raw[j]).isdigit() and raw[j] != ord("7") else ord("x") if raw[j] != ord("x") else ord("y")
        out["value changed"] = raw[:j] + bytes([c]) + raw[j + 1 :]
    k = rng.randrange(len(raw) * 8)
    out["random bit flipped"] = raw[: k // 8] + bytes([raw[k // 8] ^ (1 << (k % 8))]) + raw[k // 8 + 1 :]
    return out


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out.out + out.err


def _count(name: str, n: int = 1) -> None:
    FIGURES[name] = FIGURES.get(name, 0) + n


@pytest.mark.slow
def test_metadata_damage_per_document_kind_is_named_and_rebuilt(ref, tmp_path, capsys):
    src, X = ref
    path = tmp_path / "c.zarr"
    shutil.copytree(src, path)
    rng = random.Random(25)
    for node, recorded in DOCS.items():
        doc = _doc(path, node)
        raw = doc.read_bytes()
        where = f"{node + '/' if node else ''}zarr.json (metadata of {node or 'the store root'})"
        for how, bad in _damages(raw, recorded, rng).items():
            doc.write_bytes(bad)
            _count("metadata damages tried")
            rc, out = _cli(capsys, "verify", str(path))
            assert rc == 1, (node, how, out)
            assert f"PROBLEM {where}: " in out, (node, how, out)
            _count("named")
            rc, out = _cli(capsys, "verify", "--repair", str(path))
            assert f"REPAIRED {where}: rebuilt from the store's own metadata" in out, (node, how, out)
            assert rc == 0, (node, how, out)  # everything repaired: success
            assert doc.read_bytes() == raw, (node, how)  # rebuilt exactly as its writer wrote it: the store
            _count("repaired byte-identical")  # is the reference again (checked once per kind below)
        assert _cli(capsys, "verify", str(path))[0] == 0, node
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)


@pytest.mark.slow
def test_damaged_digests_and_a_store_without_digests(ref, tmp_path, capsys):
    src, X = ref
    path = tmp_path / "c.zarr"
    shutil.copytree(src, path)
    man = path / ".featcache-manifest" / "features~pix~digits~train.json"
    raw = man.read_bytes()
    for how, bad in {"truncated": raw[:100], "value changed": raw.replace(b'"pix"', b'"pox"', 1)}.items():
        man.write_bytes(bad)
        _count("metadata damages tried")
        rc, out = _cli(capsys, "verify", str(path))
        assert rc == 1, out
        assert f"PROBLEM .featcache-manifest/features~pix~digits~train.json (metadata digests of {GROUP}): " in out
        _count("named")
        _cli(capsys, "verify", "--repair", str(path))
        assert man.read_bytes() == raw, how  # the documents were sound: the same digests again
        assert _cli(capsys, "verify", str(path))[0] == 0
        _count("repaired byte-identical")
    shutil.rmtree(path / ".featcache-manifest")  # written before digests: what is derivable, from config alone
    _written_before_digests(path)
    for node, derivable in {SPLIT: False, GROUP: False, f"{GROUP}/pooled": False, f"{GROUP}/done": True}.items():
        doc = _doc(path, node)
        raw = doc.read_bytes()
        doc.write_bytes(raw[: len(raw) // 2])
        _count("metadata damages tried")
        rc, out = _cli(capsys, "verify", "--repair", str(path))
        assert rc == (0 if derivable else 1), out  # 0: everything repaired
        assert f"PROBLEM {node}/zarr.json (metadata of {node}): not valid JSON" in out, out
        _count("named")
        if derivable:
            assert doc.read_bytes() == raw
            _count("repaired byte-identical")
        else:
            assert "the store was written before metadata digests, so no copy was kept): delete " in out, out
            _count("refused with a reason")
            doc.write_bytes(raw)
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)


def _written_before_digests(path) -> None:
    """A store as featcache wrote it before digests: no digest files, no root marker."""
    import zarr

    from featcache.store.manifest import DIGESTS_KEY

    shutil.rmtree(path / ".featcache-manifest", ignore_errors=True)
    del zarr.open_group(path, mode="a").attrs[DIGESTS_KEY]


def test_enospc_while_repairing_is_one_line(ref, tmp_path, capsys, monkeypatch):
    import errno

    import zarr.storage

    src, X = ref
    for node in (SPLIT, f"{GROUP}/pooled"):
        path = tmp_path / node.replace("/", "_")
        shutil.copytree(src, path)
        raw = _doc(path, node).read_bytes()
        _doc(path, node).write_bytes(raw[:10])

        async def full(self, key, value):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(zarr.storage.LocalStore, "set", full)
            rc, out = _cli(capsys, "verify", "--repair", str(path))
        _count("ENOSPC points tried")
        assert rc == 1, out
        assert f"error: no space left on the device of {path} while writing the rebuilt {node}/zarr.json" in out
        assert "another --cache" not in out, out  # extracting elsewhere would leave this store as it is
        assert "run the same `featcache verify --repair` again" in out, out
        assert _cli(capsys, "verify", "--repair", str(path))[0] == 0  # space freed: the same command, all repaired
        assert _doc(path, node).read_bytes() == raw
        assert _cli(capsys, "verify", str(path))[0] == 0
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)
        _count("ENOSPC resumed byte-identical")


def test_unlistable_and_vanishing_store_folders(ref, tmp_path, capsys, monkeypatch):
    src, _ = ref
    path = tmp_path / "c.zarr"
    shutil.copytree(src, path)
    real = os.scandir
    for err, name in ((PermissionError(13, "Permission denied"), "EACCES"), (FileNotFoundError(2, "gone"), "ENOENT")):

        def hostile(p, err=err):
            if str(p).endswith(os.path.join("features", "pix")):
                err.filename = str(p)
                raise err
            return real(p)

        with monkeypatch.context() as m:
            m.setattr(os, "scandir", hostile)
            rc, out = _cli(capsys, "verify", str(path))
        _count("walk errors tried")
        if name == "EACCES":
            assert rc == 1
            assert (
                "PROBLEM features/pix: cannot list this folder (Permission denied); nothing under it is checked" in out
            )
        else:  # a folder that vanished during the walk holds no nodes any more
            assert rc == 0, out
        _count("walk errors handled")


@pytest.fixture(scope="module", autouse=True)
def _figures():
    yield
    dest = os.environ.get("FEATCACHE_FAULT_FIGURES")
    if dest:
        old = json.loads(Path(dest).read_text()) if os.path.exists(dest) else {}
        for k, v in FIGURES.items():
            old[k] = old.get(k, 0) + v
        with open(dest, "w") as fh:
            json.dump(old, fh, indent=1, sort_keys=True)


# ---------------------------------------------------------------- issue 34: metadata that cannot lie
PAIR = ("features/r0/digits/train", "features/r1/digits/train")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two backbones' features of one split (r1's differ from r0's), 4 chunks each."""
    from sklearn.datasets import load_digits

    d = load_digits()
    X, y = d.data[:64].astype(np.float32), d.target[:64]
    path = tmp_path_factory.mktemp("pair") / "pair.zarr"
    for b, shift in (("r0", 0.0), ("r1", 100.0)):
        write_features(
            path,
            backbone=b,
            dataset="digits",
            split="train",
            X=X + shift,
            ids=[f"d{i}" for i in range(64)],
            labels=y,
            class_names=[str(c) for c in d.target_names],
            chunk_rows=16,
        )
    return path, X


def _fresh(pair, tmp_path, name="c.zarr"):
    path = tmp_path / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(pair[0], path)
    return path


def _swap(a, b) -> None:
    t = f"{a}.swap"
    os.rename(a, t)
    os.rename(b, a)
    os.rename(t, b)


def _load_or_error(path, backbone="r0"):
    from featcache.errors import FeatcacheError

    try:
        return open_cache(path).load(backbone, "digits", "train")
    except FeatcacheError as exc:
        return exc


@pytest.mark.slow
@pytest.mark.parametrize("what", ["group folders", "pooled chunk folders", "every chunk folder"])
def test_swapped_groups_are_named_and_never_load_as_the_other_backbone(pair, tmp_path, capsys, what):
    from featcache.errors import CorruptStoreError, IncompleteStoreError

    path = _fresh(pair, tmp_path)
    a, b = (path / g for g in PAIR)
    if what == "group folders":
        _swap(a, b)
    else:
        for arr in ("pooled",) if what == "pooled chunk folders" else ("pooled", "valid", "error", "done"):
            _swap(a / arr / "c", b / arr / "c")
    _count("swap attacks tried")
    got = _load_or_error(path)
    assert isinstance(got, CorruptStoreError), got  # before: r1's features, complete=True
    assert PAIR[0] in str(got), got
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 1, out
    assert f"PROBLEM {PAIR[0]}" in out, out
    assert f"PROBLEM {PAIR[1]}" in out, out
    _count("named")
    rc, out = _cli(capsys, "verify", "--repair", str(path))
    for backbone, shift in (("r0", 0.0), ("r1", 100.0)):  # after repair: refused, or the right features
        got = _load_or_error(path, backbone)
        if not isinstance(got, Exception):
            np.testing.assert_array_equal(got.X, pair[1] + shift)
        else:
            assert isinstance(got, IncompleteStoreError | CorruptStoreError), got
    assert _cli(capsys, "verify", str(path))[0] == 1  # never blessed: a re-extract must recompute them
    _count("refused (every chunk marked for recomputation)")


def test_old_summary_without_place_digests_still_loads_and_verify_says_what_it_cannot_check(pair, tmp_path, capsys):
    import zarr

    from featcache.store import manifest
    from featcache.store.summary import SUMMARY_KEY

    path = _fresh(pair, tmp_path)
    root = zarr.open_group(path, mode="r+")
    s = dict(root[PAIR[0]].attrs[SUMMARY_KEY])
    del s["arrays"], s["place"]
    root[PAIR[0]].attrs[SUMMARY_KEY] = s  # as featcache wrote summaries before this
    manifest.record(root, PAIR[0])
    np.testing.assert_array_equal(open_cache(path).load("r0", "digits", "train").X, pair[1])
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 0, out
    assert f"NOTE {PAIR[0]}: chunks not bound to their place (its summary was written before them)" in out


def _consistent_damages(path) -> dict[str, tuple[str, bytes]]:
    """Documents rewritten as valid JSON that zarr reads (or refuses), each with a plausible
    value: node -> (what, new bytes)."""
    g = PAIR[0]

    def edit(node, fn):
        doc = json.loads(_doc(path, node).read_bytes())
        fn(doc)
        return json.dumps(doc, indent=2).encode()

    def prov(field, value):
        return lambda d: d["attributes"]["featcache_provenance"].__setitem__(field, value)

    return {
        "valid fill_value": (f"{g}/valid", edit(f"{g}/valid", lambda d: d.__setitem__("fill_value", True))),
        "valid dtype uint8": (
            f"{g}/valid",
            edit(f"{g}/valid", lambda d: d.update(data_type="uint8", fill_value=0)),
        ),
        "done dtype bool": (f"{g}/done", edit(f"{g}/done", lambda d: d.update(data_type="bool", fill_value=False))),
        "pooled fill_value": (f"{g}/pooled", edit(f"{g}/pooled", lambda d: d.__setitem__("fill_value", 0.0))),
        "pooled dtype float16": (f"{g}/pooled", edit(f"{g}/pooled", lambda d: d.__setitem__("data_type", "float16"))),
        "pooled provenance model": (f"{g}/pooled", edit(f"{g}/pooled", prov("model_name", "other"))),
        "pooled attribute added": (
            f"{g}/pooled",
            edit(f"{g}/pooled", lambda d: d["attributes"].__setitem__("note", "x")),
        ),
        "group rows": (g, edit(g, lambda d: d["attributes"]["featcache_features"].__setitem__("n", 48))),
        "group backbone": (g, edit(g, lambda d: d["attributes"]["featcache_features"].__setitem__("backbone", "r1"))),
        "labels dtype int32": (
            f"{SPLIT}/labels",
            edit(f"{SPLIT}/labels", lambda d: d.__setitem__("data_type", "int32")),
        ),
        "split rows": (SPLIT, edit(SPLIT, lambda d: d["attributes"]["featcache_split"].__setitem__("n", 63))),
    }


@pytest.mark.slow
@pytest.mark.parametrize("digest", ["truncated", "deleted"])
def test_a_damaged_document_under_a_damaged_digest_is_never_recorded_as_truth(pair, tmp_path, capsys, digest):
    path = _fresh(pair, tmp_path, "ref.zarr")
    for how, (node, bad) in _consistent_damages(path).items():
        work = _fresh(pair, tmp_path)
        doc = _doc(work, node)
        raw = doc.read_bytes()
        doc.write_bytes(bad)
        from featcache.store.manifest import unit_of

        unit = unit_of(node) or ""
        man = work / ".featcache-manifest" / f"{unit.replace('/', '~')}.json"
        if digest == "truncated":
            man.write_bytes(man.read_bytes()[:100])
        else:
            man.unlink()
        _count("document + digest damages tried")
        rc, out = _cli(capsys, "verify", str(work))
        assert rc == 1, (how, out)
        assert f"{node}/zarr.json" in out, (how, out)  # before: unnoticed (named, or as the disagreeing side)
        _count("named")
        rc, out = _cli(capsys, "verify", "--repair", str(work))
        clean = _cli(capsys, "verify", str(work))[0] == 0
        if doc.read_bytes() == raw:  # rebuilt from the writer's constructors
            assert clean, (how, out)
            assert rc == 0, (how, out)
            _count("repaired byte-identical")
        else:  # refused: neither recorded nor called sound
            assert not clean, (how, out)
            assert rc == 1, (how, out)
            assert "disagree" in out or "not derivable" in out, (how, out)
            _count("refused with both named")
        got = _load_or_error(work)
        if not isinstance(got, Exception):
            np.testing.assert_array_equal(got.X, pair[1])
            assert doc.read_bytes() == raw, how


@pytest.mark.slow
def test_a_deleted_digest_file_is_named_and_recreated_from_agreeing_documents(pair, tmp_path, capsys):
    path = _fresh(pair, tmp_path)
    for unit in ("root", "datasets~digits~train", "features~r0~digits~train"):
        man = path / ".featcache-manifest" / f"{unit}.json"
        raw = man.read_bytes()
        man.unlink()
        _count("deleted digest files tried")
        rc, out = _cli(capsys, "verify", str(path))
        assert rc == 1, out  # before: "written before digests", exit 0
        assert f"PROBLEM .featcache-manifest/{unit}.json" in out, out
        assert "missing, though the store was written with digests" in out, out
        _count("named")
        rc, out = _cli(capsys, "verify", "--repair", str(path))
        assert rc == 0, out
        assert man.read_bytes() == raw
        _count("repaired byte-identical")


@pytest.mark.parametrize("node", [SPLIT, "features/r0/digits/train"])
def test_a_deleted_split_or_group_document_is_named_and_rebuilt(pair, tmp_path, capsys, node):
    path = _fresh(pair, tmp_path)
    doc = _doc(path, node)
    raw = doc.read_bytes()
    doc.unlink()
    _count("deleted documents tried")
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 1, out  # before: OK while load raised NotInStoreError
    assert f"PROBLEM {node}/zarr.json (metadata of {node}): missing (deleted after it was written" in out, out
    _count("named")
    cat = open_cache(path).catalog()
    assert not cat.filter(cat["backbone"] == "r0")["complete"].any()  # ls never lists it as fine
    rc, out = _cli(capsys, "verify", "--repair", str(path))
    assert rc == 0, out
    assert doc.read_bytes() == raw
    np.testing.assert_array_equal(open_cache(path).load("r0", "digits", "train").X, pair[1])
    _count("repaired byte-identical")


@pytest.mark.parametrize("folder", ["features", "features/r0", "features/r0/digits", PAIR[0]])
def test_a_bad_folder_document_hides_no_corrupt_chunk_below_it(pair, tmp_path, capsys, folder):
    path = _fresh(pair, tmp_path)
    _doc(path, folder).write_bytes(b'{"zarr_format": 3, "node')
    chunk = path / PAIR[0] / "pooled" / "c" / "2" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    _count("bad folder document + corrupt chunk tried")
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 1
    assert f"PROBLEM {folder}/zarr.json (metadata of {folder}): not valid JSON" in out, out
    assert f"PROBLEM {PAIR[0]}/pooled: chunk 2 (rows 32-47) unreadable" in out, out  # in the same run
    _count("both named in one run")


def test_a_load_during_overwrite_is_incomplete_never_missing(pair, tmp_path, monkeypatch):
    """A load that meets the group while ``--overwrite`` has removed its old arrays (replayed
    deterministically: the rewrite stops right there) says IncompleteStoreError."""
    from featcache.errors import IncompleteStoreError
    from featcache.store import FeatureCache, FeatureWriter

    path = _fresh(pair, tmp_path)
    writer = open_cache(path, "a")
    prov = writer.provenance("r0", "digits", "train")

    class Stop(Exception):
        pass

    def stop(self):
        raise Stop

    def rewrite_midway():
        with monkeypatch.context() as m:
            m.setattr(FeatureWriter, "_create", stop)
            with pytest.raises(Stop):
                FeatureWriter(writer, "r0", "digits", "train", {"pooled": prov}).prepare(overwrite=True)

    reader = open_cache(path)
    real = FeatureCache.group_meta
    calls = []

    def interleaved(self, *a):  # the load found the group; the rewrite starts before it reads on
        if not calls:
            calls.append(1)
            rewrite_midway()
        return real(self, *a)

    with monkeypatch.context() as m:
        m.setattr(FeatureCache, "group_meta", interleaved)
        with pytest.raises(IncompleteStoreError):  # before: KeyError 'pooled' / NotInStoreError
            reader.load("r0", "digits", "train")
    with pytest.raises(IncompleteStoreError):  # a load that starts now: the group is being created
        open_cache(path).load("r0", "digits", "train")
    _count("loads during --overwrite tried", 2)
    _count("IncompleteStoreError", 2)


def test_huge_chunk_rows_is_refused_before_anything_is_written(tmp_path, capsys):
    from featcache.errors import SchemaMismatchError

    path = tmp_path / "c.zarr"
    rc, out = _cli(
        capsys, "extract", "--model", "resnet18", "--weights", "random:0", "--data", "digits", "--split", "test",
        "--limit", "8", "--chunk-rows", "1000000000000", "--cache", str(path),
    )  # fmt: skip
    assert rc != 0
    assert "--chunk-rows 1000000000000 is invalid: must be at most 1048576 rows" in out, out
    assert not path.exists()
    with pytest.raises(SchemaMismatchError, match="chunk_rows 1000000000000 is out of range"):
        write_features(
            path,
            backbone="b",
            dataset="d",
            split="s",
            X=np.zeros((4, 2)),
            ids=list("abcd"),
            labels=[0] * 4,
            chunk_rows=10**12,
        )
    assert not (path / "datasets").exists()
    _count("flag bounds tried", 2)
    _count("refused before writing", 2)


def test_minor_fifo_short_results_table_and_repair_exit(tmp_path, caplog):
    from featcache.core.results import check_results_path, read_results
    from featcache.data.readers import open_dataset
    from featcache.errors import ResultsError

    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (4, 4)).save(root / "cat" / "ok.png")
    os.mkfifo(root / "cat" / "fifo.png")
    os.symlink("fifo.png", root / "cat" / "link.png")
    with caplog.at_level("WARNING"):
        (s,) = open_dataset(f"imagefolder:{root}").values()
    assert "fifo.png is not a regular file" in caplog.text  # before: silently no row
    assert "cat/fifo.png" not in s.ids.tolist()
    i = s.ids.tolist().index("cat/link.png")  # a link to it: an invalid row, never opened (no block)
    with pytest.raises(Exception, match="not a regular file"):
        s.load(i)
    for n in (0, 1):
        t = tmp_path / f"r{n}.parquet"
        t.write_bytes(b"P" * n)
        for fn in (check_results_path, read_results):
            with pytest.raises(ResultsError, match=f"is {n} bytes? long: an empty or truncated file"):
                fn(t)
    _count("minor cases tried", 4)
    _count("handled", 4)
