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
            assert doc.read_bytes() == raw, (node, how)  # rebuilt exactly as its writer wrote it: the store
            _count("repaired byte-identical")  # is the reference again (checked once per kind below)
        assert _cli(capsys, "verify", str(path))[0] == 0, node
        np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)


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
        assert rc == 1, out
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
        assert _cli(capsys, "verify", "--repair", str(path))[0] == 1  # space freed: the same command
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
