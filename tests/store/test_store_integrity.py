"""Chunks that cannot be swapped or hidden (issue 50, items 3 and 4), each case as the round
reproduced it: damage the store by hand, run the user's command, assert its one line and that
nothing written changed.

* a complete group must have its summary (the digests binding its chunks to its place and
  backbone): without it, swapped ``pooled/c`` folders would load as the other backbone's rows;
  ``load`` refuses it itself, ``verify`` names it, ``verify --repair`` marks every chunk for
  recomputation (never records digests of the chunks as they are), and a re-run of the same
  write recomputes it instead of saying it is already complete;
* a feature array whose ``fill_value`` was edited would read a deleted chunk as features marked
  valid: the writer's fill values are checked on read, by ``verify`` and by the writer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from featcache.cli import main
from featcache.errors import CorruptStoreError, IncompleteStoreError
from featcache.store import open_cache, write_features

R0, R1 = "lite0@random0", "lite0@random1"
GROUPS = {b: f"features/{b}/digits/test" for b in (R0, R1)}
N, CHUNK = 64, 16


def _write(path, backbone: str, X: np.ndarray, y: np.ndarray) -> None:
    write_features(
        path,
        backbone=backbone,
        dataset="digits",
        split="test",
        X=X,
        ids=[f"t{i}" for i in range(N)],
        labels=y,
        class_names=[str(c) for c in range(10)],
        chunk_rows=CHUNK,
        weights_source=f"random:{backbone[-1]}",
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two backbones' features of one split (random1's differ from random0's), 4 chunks each."""
    from sklearn.datasets import load_digits

    d = load_digits()
    X, y = d.data[:N].astype(np.float32), d.target[:N]
    feats = {R0: X, R1: X + 100.0}
    path = tmp_path_factory.mktemp("pair") / "pair.zarr"
    for b, x in feats.items():
        _write(path, b, x, y)
    return path, feats, y


def _fresh(pair, tmp_path) -> Path:
    path = tmp_path / "c.zarr"
    shutil.copytree(pair[0], path)
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _edit(doc: Path, fn) -> None:
    meta = json.loads(doc.read_bytes())
    fn(meta)
    doc.write_bytes(json.dumps(meta, indent=2).encode())


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return rc, out.out + out.err


def _manifest(path: Path, backbone: str) -> Path:
    return path / ".featcache-manifest" / f"{GROUPS[backbone].replace('/', '~')}.json"


def _drop_summary(path: Path, backbone: str) -> None:
    _edit(path / GROUPS[backbone] / "zarr.json", lambda m: m["attributes"].pop("featcache_summary"))


def _rerecord(path: Path, backbone: str) -> None:
    """What re-recording the digest of a group does (the round used featcache's own function)."""
    from featcache.store import manifest

    manifest.record(zarr.open_group(path, mode="r+"), GROUPS[backbone])


def _swap(a: Path, b: Path) -> None:
    t = a.with_name(a.name + ".swap")
    os.rename(a, t)
    os.rename(b, a)
    os.rename(t, b)


def _unbind(path: Path, how: str) -> None:
    """Issue 50 item 3's three ways of taking both test groups' summaries away."""
    for b in (R0, R1):
        _drop_summary(path, b)
        if how == "digests deleted":
            _manifest(path, b).unlink()
        elif how == "digest re-recorded":
            _rerecord(path, b)
    if how == "every digest and the root attribute deleted":
        shutil.rmtree(path / ".featcache-manifest")
        _edit(path / "zarr.json", lambda m: m["attributes"].pop("featcache_digests"))


HOWS = ["digests deleted", "digest re-recorded", "every digest and the root attribute deleted"]


@pytest.mark.parametrize("how", HOWS)
def test_swapped_chunk_folders_of_unbound_groups_never_load_as_the_other_backbone(pair, tmp_path, capsys, how):
    path = _fresh(pair, tmp_path)
    _unbind(path, how)
    _swap(path / GROUPS[R0] / "pooled" / "c", path / GROUPS[R1] / "pooled" / "c")
    before = _files(path)
    with pytest.raises(CorruptStoreError) as got:  # before: random1's rows, complete=True
        open_cache(path).load(R0, "digits", "test")
    (line,) = str(got.value).splitlines()
    assert line.startswith(f"features/{R0}/digits/test: every row chunk is marked done but its summary"), line
    assert f"run `featcache verify --repair {path}` (it marks every chunk for recomputation)" in line, line
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 1, out  # before: only the digests were named, or OK
    for b in (R0, R1):
        assert f"PROBLEM features/{b}/digits/test: every row chunk is marked done but its summary" in out, out
    assert "is not complete yet" not in out, out
    assert _files(path) == before  # load and verify wrote nothing
    rc, out = _cli(capsys, "verify", "--repair", str(path))
    assert rc == 1, out  # before: exit 0, digests recorded again
    assert f"features/{R0}/digits/test: 4 chunk(s) [0, 1, 2, 3] -> re-run" in out, out
    for b in (R0, R1):
        attrs = zarr.open_group(path / GROUPS[b], mode="r").attrs
        assert "featcache_summary" not in attrs  # never re-digested as they are
        with pytest.raises(IncompleteStoreError, match="4 of 4 row chunks unfinished"):
            open_cache(path).load(b, "digits", "test")
    for b, x in pair[1].items():  # the same writes again recompute them
        _write(path, b, x, pair[2])
        np.testing.assert_array_equal(open_cache(path).load(b, "digits", "test").X, x)
    assert _cli(capsys, "verify", str(path))[0] == 0


@pytest.mark.parametrize("summary", ["dropped", "kept"])
def test_a_rerun_recomputes_a_group_load_refuses_instead_of_calling_it_complete(pair, tmp_path, summary):
    path = _fresh(pair, tmp_path)
    if summary == "dropped":
        _unbind(path, "digest re-recorded")
    _swap(path / GROUPS[R0] / "pooled" / "c", path / GROUPS[R1] / "pooled" / "c")
    with pytest.raises(CorruptStoreError):
        open_cache(path).load(R0, "digits", "test")
    for b, x in pair[1].items():  # before: nothing recomputed ("already complete"), then
        _write(path, b, x, pair[2])  # random1's rows blessed as random0's (summary dropped)
        np.testing.assert_array_equal(open_cache(path).load(b, "digits", "test").X, x)


def test_ls_says_an_unbound_complete_group_is_not_complete(pair, tmp_path):
    path = _fresh(pair, tmp_path)
    _unbind(path, "digest re-recorded")
    cat = open_cache(path).catalog()
    assert cat["complete"].to_list() == [False, False]


@pytest.mark.parametrize("fill", [0.0, 1.5])
def test_a_missing_chunk_behind_an_edited_fill_value_is_damage(pair, tmp_path, capsys, fill):
    path = _fresh(pair, tmp_path)
    pooled = path / GROUPS[R0] / "pooled"
    _edit(pooled / "zarr.json", lambda m: m.__setitem__("fill_value", fill))
    _rerecord(path, R0)  # the digest re-recorded
    (pooled / "c" / "3" / "0").unlink()  # chunk 3: rows 48-63
    before = _files(path)
    with pytest.raises(CorruptStoreError) as got:  # before: rows 48-63 as constant features marked valid
        open_cache(path).load(R0, "digits", "test")
    (line,) = str(got.value).splitlines()
    assert line.startswith(f"features/{R0}/digits/test/pooled: fill_value {fill!r} in its zarr.json"), line
    assert f"run `featcache verify --repair {path}`" in line, line
    with pytest.raises(CorruptStoreError, match="fill_value"):
        open_cache(path).load(R0, "digits", "test", allow_partial=True, lazy=True)
    rc, out = _cli(capsys, "verify", str(path))
    assert rc == 1, out  # before: OK
    assert (
        f"PROBLEM features/{R0}/digits/test/pooled: fill_value {fill!r} in its zarr.json, featcache writes NaN" in out
    )
    assert _files(path) == before
    rc, out = _cli(capsys, "verify", "--repair", str(path))
    assert rc == 1, out
    assert f"features/{R0}/digits/test: 4 chunk(s) [0, 1, 2, 3] -> re-run" in out, out
    _write(path, R0, pair[1][R0], pair[2])  # the re-run recreates the array with the writer's fill value
    np.testing.assert_array_equal(open_cache(path).load(R0, "digits", "test").X, pair[1][R0])
    assert np.isnan(zarr.open_array(pooled, mode="r").fill_value)
    assert _cli(capsys, "verify", str(path))[0] == 0


def test_an_edited_fill_value_is_recreated_by_a_plain_rerun(pair, tmp_path):
    path = _fresh(pair, tmp_path)
    pooled = path / GROUPS[R1] / "pooled"
    _edit(pooled / "zarr.json", lambda m: m.__setitem__("fill_value", 0.0))
    _rerecord(path, R1)
    (pooled / "c" / "0" / "0").unlink()
    _write(path, R1, pair[1][R1], pair[2])  # no --repair first: the writer checks the fill value too
    np.testing.assert_array_equal(open_cache(path).load(R1, "digits", "test").X, pair[1][R1])


# ---------------------------------------------------------------- issue 50 item 4: newcomer cases
def _interrupted(path: Path, X: np.ndarray, y: np.ndarray) -> None:
    """An extract killed after its second chunk: rows 16-31 written (row 20 unreadable), the rest not."""
    from featcache.store import FeatureWriter, ensure_split, make_provenance

    c = open_cache(path, "a")
    meta = ensure_split(c, "digits", "test", np.array([f"t{i}" for i in range(N)]), y, [str(i) for i in range(10)], "x")
    prov = make_provenance(
        backbone=R0,
        dataset="digits",
        split="test",
        kind="pooled",
        dim=X.shape[1],
        n=N,
        dataset_fingerprint=meta.fingerprint,
        chunk_rows=CHUNK,
        model_name="tf_efficientnet_lite0",
        weights_source="random:0",
        data_config={"input_size": [3, 112, 112]},
    )
    w = FeatureWriter(c, R0, "digits", "test", {"pooled": prov}).prepare()
    valid = np.ones(CHUNK, bool)
    valid[4] = False
    w.write_chunk(1, {"pooled": X[16:32]}, valid, ["decode error: truncated" if not v else "" for v in valid])
    w.release()  # killed


def test_ls_tells_rows_never_computed_from_unreadable_ones_and_how_to_resume(pair, tmp_path, capsys):
    path = tmp_path / "c.zarr"
    _interrupted(path, pair[1][R0], pair[2])
    before = _files(path)
    row = open_cache(path).catalog().row(0, named=True)
    assert (row["complete"], row["n_invalid"], row["n_not_computed"]) == (False, 1, 48)  # before: n_invalid 49
    rc, out = _cli(capsys, "ls", str(path))
    assert rc == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith(f"{R0}/digits/test:")]
    assert line.startswith(
        f"{R0}/digits/test: 48 of 64 rows not computed yet (an extract was interrupted, or is running): "
        "resume with `featcache extract --model tf_efficientnet_lite0 --weights random:0 "
    ), line
    assert f"--split test --backbone-name {R0} --input-size 112 --chunk-rows 16" in line, line
    assert _files(path) == before


def test_ls_names_a_damaged_group_and_what_to_run(pair, tmp_path, capsys):
    path = _fresh(pair, tmp_path)
    (path / GROUPS[R1] / "pooled" / "c" / "2" / "0").unlink()
    rc, out = _cli(capsys, "ls", str(path))
    assert rc == 0, out
    assert f"{R1}/digits/test: damaged; `featcache verify {path}` names what, and what to run" in out, out
    assert f"{R0}/digits/test:" not in out, out


def test_an_interrupted_extract_says_how_to_resume(tmp_path, capsys, monkeypatch):
    import featcache.extract.pipeline as pipeline

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "extract", interrupted)
    argv = ["extract", "--model", "tf_efficientnet_lite0", "--weights", "random:0", "--data", "digits"]
    capsys.readouterr()
    rc = main([*argv, "--cache", str(tmp_path / "c.zarr")])
    err = capsys.readouterr().err
    assert rc == 130
    assert err.strip() == (
        "interrupted: the chunks written so far are kept; run the same `featcache extract` command again to "
        "resume (`featcache ls` shows the rows not computed yet)"
    )
