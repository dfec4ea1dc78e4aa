"""A load during an extract is a consistent snapshot (issue 26 item 1).

A writer *process* writes the row chunks of a feature group on command; the reader (this
process) is paused between the steps of its load, at the point under test, while the writer
writes the last chunk there. Whatever the window, the rows a load returns as valid are
exactly the rows its ``complete`` flag (and so its fingerprint) covers, with the features
the writer wrote; or the load says the store is incomplete.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.errors import IncompleteStoreError
from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache, write_features
from featcache.store.cache import FeatureCache

pytestmark = pytest.mark.slow  # loads raced against real extracting processes

N, CHUNK = 512, 32
N_CHUNKS = N // CHUNK


def _digits():
    d = load_digits()
    return d.data[:N].astype(np.float32), d.target[:N].astype(np.int64)


def _writer(path: str, go, ack, pause: float) -> None:
    """Create the group, then write chunks: ``go`` says how many (0: all remaining, each
    after ``pause`` seconds); ``ack`` gets the number of chunks done after each batch."""
    X, y = _digits()
    cache = open_cache(path, "a")
    ids = np.array([f"d{i}" for i in range(N)])
    meta = ensure_split(cache, "digits", "train", ids, y, [str(c) for c in range(10)], "array")
    prov = make_provenance(
        backbone="pix",
        dataset="digits",
        split="train",
        kind="pooled",
        dim=X.shape[1],
        n=N,
        dataset_fingerprint=meta.fingerprint,
        chunk_rows=CHUNK,
        dtype="float32",
    )
    w = FeatureWriter(cache, "pix", "digits", "train", {"pooled": prov}).prepare()
    todo = w.pending_chunks()
    ack.put(0)
    while todo:
        k = go.get(timeout=120)
        for _ in range(k or len(todo)):
            i = todo.pop(0)
            s, e = w.chunk_range(i)
            valid = np.ones(e - s, bool)
            valid[::7] = i % 2 == 0  # invalid rows too, in every other chunk
            w.write_chunk(i, {"pooled": X[s:e]}, valid, ["bad image"] * (e - s))
            time.sleep(pause if not k else 0)
        ack.put(N_CHUNKS - len(todo))
    w.mark_complete()
    ack.put(-1)


def _start_writer(path, pause: float = 0.0):
    ctx = mp.get_context("spawn")
    go, ack = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer, args=(str(path), go, ack, pause))
    proc.start()
    assert ack.get(timeout=120) == 0
    return proc, go, ack


def _check_snapshot(f) -> None:
    """The rows marked valid are the rows the load covers, holding the written features."""
    X, _ = _digits()
    assert np.isfinite(f.X[f.valid]).all()
    assert np.isnan(f.X[~f.valid]).all()
    assert np.array_equal(f.X[f.valid], X[f.valid])
    chunk_valid = np.zeros(N, bool)
    for i in range(N_CHUNKS):
        chunk_valid[i * CHUNK : (i + 1) * CHUNK] = (np.arange(CHUNK) % 7 != 0) | (i % 2 == 0)
    if f.complete:
        assert np.array_equal(f.valid, chunk_valid), "complete=True but rows are missing"
    else:
        assert (f.valid <= chunk_valid).all()


class _Paused:
    """A feature group whose ``[name]`` runs ``hook(name)`` first."""

    def __init__(self, g, hook):
        self._g, self._hook = g, hook

    def __getitem__(self, name):
        self._hook(name)
        return self._g[name]

    def __contains__(self, name):
        return name in self._g

    def __getattr__(self, attr):
        return getattr(self._g, attr)


@pytest.mark.parametrize(("window", "allow_partial"), [("valid", True), ("error", False), ("done#2", True)])
def test_last_chunk_written_inside_a_load(tmp_path, monkeypatch, window, allow_partial):
    """The writer writes the last chunk while the load is paused just before it reads
    ``window`` (``done#2``: the second read of the done markers)."""
    path = tmp_path / "s.zarr"
    proc, go, ack = _start_writer(path)
    go.put(N_CHUNKS - 1)
    assert ack.get(timeout=120) == N_CHUNKS - 1
    seen: dict[str, int] = {}
    fired = []

    def hook(name):
        seen[name] = seen.get(name, 0) + 1
        key = name if window != "done#2" else f"{name}#{seen[name]}"
        if not fired and seen.get("done") and key == window:
            fired.append(name)
            go.put(1)
            assert ack.get(timeout=120) == N_CHUNKS

    plain = FeatureCache._feature_group
    monkeypatch.setattr(FeatureCache, "_feature_group", lambda self, *a: _Paused(plain(self, *a), hook))
    try:
        f = open_cache(path, "r").load("pix", "digits", "train", allow_partial=allow_partial)
    except IncompleteStoreError:
        assert not allow_partial
    else:
        _check_snapshot(f)
    assert fired, f"the load never read {window}"
    assert ack.get(timeout=120) == -1
    proc.join(timeout=60)
    assert proc.exitcode == 0
    monkeypatch.undo()
    f = open_cache(path, "r").load("pix", "digits", "train")
    assert f.complete
    _check_snapshot(f)


def test_loads_during_an_extract_are_snapshots(tmp_path):
    """Loads in a loop while a writer process writes every chunk (the figure in
    docs/store.md): no load returns rows other than those it covers."""
    path = tmp_path / "s.zarr"
    proc, go, _ack = _start_writer(path, pause=0.15)
    go.put(0)
    reads = wrong = incomplete = 0
    while proc.is_alive() and reads < 400:
        try:
            f = open_cache(path, "r").load("pix", "digits", "train", allow_partial=True)
            _check_snapshot(f)
        except IncompleteStoreError:
            incomplete += 1  # a named refusal, not a wrong result
        except AssertionError:
            wrong += 1
        reads += 1
    proc.join(timeout=120)
    assert proc.exitcode == 0
    print(f"{reads} loads during an extract, {wrong} wrong, {incomplete} refused")
    assert reads >= 20
    assert wrong == 0


def test_group_being_created_is_incomplete_not_a_key_error(tmp_path):
    """Between the writer creating the group and writing its metadata (the last step of
    its create), a load names the state instead of raising KeyError."""
    X, y = _digits()
    ids = [f"d{i}" for i in range(N)]
    cache = write_features(tmp_path / "s.zarr", backbone="pix", dataset="digits", split="train", X=X, ids=ids, labels=y)
    cache.root.require_group("features/pix2/digits/train")
    r = open_cache(tmp_path / "s.zarr", "r")
    with pytest.raises(IncompleteStoreError, match="being created by an extract"):
        r.load("pix2", "digits", "train")
    assert r.kinds("pix2", "digits", "train") == []
