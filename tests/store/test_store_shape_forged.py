"""A feature array's ``shape`` (or row chunks) edited in its ``zarr.json`` with the group's
digests recorded again (issue 50, the adversarial round's "shape edited, digest re-recorded"):
before, ``verify`` printed a broadcast ValueError as its problem line, a re-extract ended in
a traceback (or said "already complete" of a group ``load`` refused), and ``verify --repair``
left it as it was. Now every command ends in one line naming the document, what differs and
what to run; ``verify --repair`` restores the document from the group metadata and
provenance (byte-identical, no chunk touched) where they agree, and changes nothing where
they do not; nothing written is lost."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from featcache.cli import main
from featcache.errors import CorruptStoreError
from featcache.store import open_cache, write_features

GROUP = "features/pix/digits/train"
N, DIM, CHUNK = 64, 64, 16


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from sklearn.datasets import load_digits

    d = load_digits()
    X, y = d.data[:N].astype(np.float32), d.target[:N]
    path = tmp_path_factory.mktemp("shape") / "ref.zarr"
    write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="train",
        X=X,
        ids=[f"d{i}" for i in range(N)],
        labels=y,
        class_names=[str(c) for c in d.target_names],
        chunk_rows=CHUNK,
    )
    return path, X


def _files(path: Path) -> dict[str, bytes]:
    """Every file of the store (locks are not data), by relative path."""
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and ".featcache-locks" not in p.parts and not p.name.endswith(".lock")
    }


def _forge(path: Path, group: str, kind: str, edit) -> None:
    """Edit the array's document, then record the group's digests again from the documents
    as they now are (what the writer does after it changed one: the forger's step)."""
    import zarr

    from featcache.store import manifest

    doc = path / group / kind / "zarr.json"
    d = json.loads(doc.read_bytes())
    edit(d)
    doc.write_text(json.dumps(d, indent=2))
    manifest.record(zarr.open_group(str(path), mode="r+"), group)


def _shape(rows=None, dim=None, chunk=None, inner=False):
    def edit(d):
        shape, chunks = d["shape"], d["chunk_grid"]["configuration"]["chunk_shape"]
        if rows is not None:
            shape[0] = rows
        if dim is not None:
            shape[-1] = dim
        if chunk is not None:
            chunks[0] = chunk
        if inner:
            shape.insert(1, 2)
            chunks.insert(1, 2)

    return edit


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out.out, out.err


CASES = {  # how -> (the edit, the shape and chunk rows the document then says)
    "fewer rows": (_shape(rows=N - CHUNK), (N - CHUNK, DIM), CHUNK),
    "more rows": (_shape(rows=N + CHUNK), (N + CHUNK, DIM), CHUNK),
    "narrower": (_shape(dim=DIM - 3), (N, DIM - 3), CHUNK),
    "wider": (_shape(dim=DIM + 3), (N, DIM + 3), CHUNK),
    "chunk rows": (_shape(chunk=2 * CHUNK), (N, DIM), 2 * CHUNK),
    "an inner dimension": (_shape(inner=True), (N, 2, DIM), CHUNK),
}


@pytest.mark.parametrize("how", list(CASES))
def test_forged_shape_is_one_line_everywhere_and_repair_restores_it(ref, tmp_path, capsys, how):
    src, X = ref
    path = tmp_path / "c.zarr"
    shutil.copytree(src, path)
    before = _files(path)
    edit, shape, chunk = CASES[how]
    _forge(path, GROUP, "pooled", edit)
    forged = _files(path)
    line = (
        f"{GROUP}/pooled/zarr.json: shape {shape} in chunks of {chunk} rows, but its group metadata and "
        f"provenance give ({N}, {DIM}) in chunks of {CHUNK} rows (changed after it was written); run "
        f"`featcache verify --repair {path}`: it restores the document from them (no chunk is touched or recomputed)"
    )
    rc, out, _ = _cli(capsys, "verify", str(path))
    assert rc == 1, out
    assert [ln for ln in out.splitlines() if ln.startswith("PROBLEM")] == [f"PROBLEM {line}"], out
    with pytest.raises(CorruptStoreError) as exc:  # before: a broadcast ValueError, or rows read misaligned
        open_cache(path).load("pix", "digits", "train")
    assert str(exc.value) == line
    assert _files(path) == forged  # reading changed nothing
    rc, out, _ = _cli(capsys, "verify", "--repair", str(path))
    assert rc == 0, out
    assert f"REPAIRED {GROUP}/pooled/zarr.json: shape ({N}, {DIM}) in chunks of {CHUNK} rows restored" in out, out
    assert f"{path}: 1 problem(s) repaired; it verifies OK now" in out, out
    assert _files(path) == before  # the document and its digests as the writer wrote them; no chunk touched
    np.testing.assert_array_equal(open_cache(path).load("pix", "digits", "train").X, X)


def test_forged_shape_and_provenance_are_refused_and_nothing_is_changed(ref, tmp_path, capsys):
    """The provenance edited to agree with the shape (its own digest recomputed): the group
    metadata and the provenance disagree, so nothing says which is right; repair writes nothing."""
    from featcache.store.schema import PROVENANCE_DIGEST_KEY, PROVENANCE_KEY, provenance_digest

    src, _ = ref
    path = tmp_path / "c.zarr"
    shutil.copytree(src, path)

    def edit(d):
        d["shape"][0] = N - CHUNK
        prov = d["attributes"][PROVENANCE_KEY]
        prov["n"] = N - CHUNK
        d["attributes"][PROVENANCE_DIGEST_KEY] = provenance_digest(prov)

    _forge(path, GROUP, "pooled", edit)
    forged = _files(path)
    line = (
        f"{GROUP}/pooled/zarr.json: shape ({N - CHUNK}, {DIM}) in chunks of {CHUNK} rows, but its group metadata "
        f"and provenance give ({N}, {DIM}) in chunks of {CHUNK} rows (changed after it was written); they "
        "disagree with each other or with the split too, so nothing says which is right: re-run the extract "
        "that wrote it with --overwrite"
    )
    for argv in (["verify"], ["verify", "--repair"]):
        rc, out, _ = _cli(capsys, *argv, str(path))
        assert rc == 1, out
        assert [ln for ln in out.splitlines() if ln.startswith("PROBLEM")] == [f"PROBLEM {line}"], out
        assert _files(path) == forged  # never recorded as truth, nothing marked or rewritten
    with pytest.raises(CorruptStoreError) as exc:
        open_cache(path).load("pix", "digits", "train")
    assert str(exc.value) == line


def _extract_argv(path) -> list[str]:
    argv = ["extract", "--model", "tf_efficientnet_lite0", "--weights", "random:0", "--data", "digits"]
    argv += ["--split", "test", "--limit", "32", "--input-size", "32", "--chunk-rows", "8", "--workers", "0"]
    return [*argv, "--no-progress", "--cache", str(path)]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fewer rows", "wider"])
def test_reextract_on_a_forged_shape_is_one_line_then_resumes_after_repair(tmp_path, capsys, how):
    """Before: a traceback (a broadcast ValueError while resuming), or "already complete,
    nothing to do" of a group ``load`` refuses."""
    key, group = "tf_efficientnet_lite0@random0", "features/tf_efficientnet_lite0@random0/digits/test"
    path = tmp_path / "c.zarr"
    assert _cli(capsys, *_extract_argv(path))[0] == 0
    X = open_cache(path).load(key, "digits", "test").X
    before = _files(path)
    edit = _shape(rows=24) if how == "fewer rows" else _shape(dim=1280 + 8)
    _forge(path, group, "pooled", edit)
    forged = _files(path)
    rc, out, err = _cli(capsys, *_extract_argv(path))
    assert rc == 1, out + err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1, err
    assert f"error: {group}/pooled/zarr.json: shape " in errors[0], err
    assert errors[0].endswith(
        f"run `featcache verify --repair {path}`: it restores the document from them (no chunk is touched or recomputed)"
    ), err
    assert "already complete" not in out + err
    assert _files(path) == forged  # the refused re-run wrote nothing
    assert _cli(capsys, "verify", "--repair", str(path))[0] == 0  # what the line says to run
    assert _files(path) == before
    rc, out, err = _cli(capsys, *_extract_argv(path))
    assert rc == 0, out + err
    assert "already complete (32 rows), nothing to do" in out
    np.testing.assert_array_equal(open_cache(path).load(key, "digits", "test").X, X)
