"""Reading dense groups (issue 57): :func:`featcache.store.read_dense` pairs a group's tokens with
its targets and refuses, in one line, every way they could be paired wrongly; ``dense_groups``
lists a split's groups; ``iter_row_blocks`` cuts rows within a memory budget.

A real store is written once per module from Fashion-MNIST mosaics (see test_dense_targets.py):
``val`` (resize rows with full masks and image sizes), ``val@win`` (each mosaic's four 28 x 28
quadrant windows), ``val@flip`` (the rows flipped), ``train`` and two seeded crop views."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dense_targets import SEG_INFO, mosaics, tokens_of

from featcache.core.dense import WINDOW_FIELDS, DenseRows, Geometry
from featcache.errors import ConfigError, CorruptStoreError, NotInStoreError
from featcache.store import (
    FeatureWriter,
    dense_groups,
    ensure_split,
    iter_row_blocks,
    make_provenance,
    open_cache,
    read_dense,
    write_features,
)

N = 16
RESIZE = Geometry("resize", (56, 56), (4, 4), (56, 56))
WIN = Geometry("win", (28, 28), (2, 2), (28, 28), {"short_side": 56, "window": 28, "stride": 28})
FLIP = Geometry("flip", (56, 56), (4, 4), (56, 56))
DTYPES = {"tokens": "float16", "cls": "float16", "mask": "uint8", "full_mask": "uint8"}
DTYPES |= {"image_size": "int32", "window": "int32"}


def write_group(path, split, rows, geometry, *, ids, base=None, geometries=None, backbone="pix"):
    """``rows`` into the group ``split`` as a dense extract writes it (``geometries``: a kind's
    own geometry where a test makes them disagree)."""
    cache = open_cache(path, "a")
    n = len(ids)
    meta = ensure_split(cache, "mosaic", split, np.asarray(ids), np.zeros(n, np.int64), ["image"], "mosaics")
    provs = {}
    for k, x in rows.items():
        geom = (geometries or {}).get(k, geometry)
        extra = {"geometry": geom.record(), "dense": SEG_INFO.record()} if geom is not None else {}
        provs[k] = make_provenance(
            backbone=backbone, dataset="mosaic", split=split, kind=k, dim=x.shape[1:], n=n,
            dataset_fingerprint=meta.fingerprint, chunk_rows=4, dtype=DTYPES[k], extra=extra,
        )  # fmt: skip
    w = FeatureWriter(cache, backbone, "mosaic", split, provs).prepare()
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        w.write_chunk(i, {k: x[s:e] for k, x in rows.items()}, np.ones(e - s, bool))
    w.mark_complete()


def resize_rows(img, mask):
    size = np.tile(np.array([56, 56, 56, 56], np.int32), (len(img), 1))
    tok = tokens_of(img)
    return {"tokens": tok, "cls": tok.mean(axis=1), "mask": mask, "full_mask": mask, "image_size": size}


def window_rows(img, mask):
    """Each mosaic's four quadrants (row-major), the window table and ids ``{id}#w{j}``."""
    crops, masks, table, ids = [], [], [], []
    for r in range(len(img)):
        for j, (y0, x0) in enumerate([(0, 0), (0, 28), (28, 0), (28, 28)]):
            crops.append(img[r, y0 : y0 + 28, x0 : x0 + 28])
            masks.append(mask[r, y0 : y0 + 28, x0 : x0 + 28])
            table.append([r, y0, x0, 56, 56, 56, 56])
            ids.append(f"m{r}#w{j}")
    crops = np.stack(crops)
    rows = {"tokens": tokens_of(crops), "mask": np.stack(masks), "window": np.asarray(table, np.int32)}
    return rows, ids


def view_rows(img, mask, v: int):
    """Seeded 42 x 42 crops (view ``v``), the mask cropped identically."""
    rng = np.random.default_rng(v)
    ys, xs = rng.integers(0, 15, len(img)), rng.integers(0, 15, len(img))
    ci = np.stack([im[y : y + 42, x : x + 42] for im, y, x in zip(img, ys, xs, strict=True)])
    cm = np.stack([m[y : y + 42, x : x + 42] for m, y, x in zip(mask, ys, xs, strict=True)])
    geom = Geometry(f"view{v}", (42, 42), (3, 3), (42, 42), {"seed": v, "transform": "crop42"})
    return {"tokens": tokens_of(ci), "mask": cm}, geom


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense") / "c.zarr"
    img, mask = mosaics(N)
    tr_img, tr_mask = mosaics(N, offset=4 * N)
    ids, tr_ids = [f"m{i}" for i in range(N)], [f"t{i}" for i in range(N)]
    write_group(path, "val", resize_rows(img, mask), RESIZE, ids=ids)
    win, win_ids = window_rows(img, mask)
    write_group(path, "val@win", win, WIN, ids=win_ids)
    flipped = {"tokens": tokens_of(img[:, :, ::-1]), "mask": mask[:, :, ::-1]}
    write_group(path, "val@flip", flipped, FLIP, ids=ids)
    write_group(path, "train", {"tokens": tokens_of(tr_img), "mask": tr_mask}, RESIZE, ids=tr_ids)
    for v in (0, 1):
        rows, geom = view_rows(tr_img, tr_mask, v)
        write_group(path, f"train@view{v}", rows, geom, ids=tr_ids)
    write_features(  # a classification group of the same dataset: not a dense group
        path, backbone="pix", dataset="mosaic", split="plain", X=tokens_of(img).mean(axis=1), ids=ids,
        labels=np.zeros(N, np.int64), class_names=["image"],
    )  # fmt: skip
    return path, img, mask, win


def test_read_dense_pairs_each_rows_tokens_with_its_targets(dense_store):
    path, img, mask, _ = dense_store
    rows = read_dense(open_cache(path), "pix", "mosaic", "val", kinds=("tokens", "cls"))
    assert isinstance(rows, DenseRows)
    assert (rows.split, rows.geometry, rows.info, len(rows)) == ("val", RESIZE, SEG_INFO, N)
    assert list(rows.ids) == [f"m{i}" for i in range(N)]
    assert rows.valid.all()
    assert rows.kinds["tokens"].dtype == np.float16  # stored dtypes, read by row slices
    assert rows.target.dtype == np.uint8
    np.testing.assert_array_equal(rows.kinds["tokens"][3:9], tokens_of(img[3:9]).astype(np.float16))
    np.testing.assert_array_equal(rows.kinds["cls"][:2], tokens_of(img[:2]).mean(axis=1).astype(np.float16))
    np.testing.assert_array_equal(rows.target[3:9], mask[3:9])
    np.testing.assert_array_equal(rows.full["full_mask"][:], mask)
    np.testing.assert_array_equal(rows.tables["image_size"], np.tile([56, 56, 56, 56], (N, 1)))
    assert rows.target_valid is None
    assert set(rows.full) == {"full_mask"}


def test_windows_point_at_their_images_and_stitch_back_to_their_masks(dense_store):
    """Each window's target is its image's mask crop at the table's corner: stitching every
    window of an image gives its ``full_mask`` back."""
    path, _, mask, _ = dense_store
    rows = read_dense(open_cache(path), "pix", "mosaic", "val@win")
    assert (rows.geometry, len(rows)) == (WIN, 4 * N)
    table = rows.tables["window"]
    assert table.shape == (4 * N, len(WINDOW_FIELDS))
    stitched = np.full((N, 56, 56), 255, np.uint8)
    target = rows.target[:]
    for (r, y0, x0, *_), t in zip(table, target, strict=True):
        stitched[r, y0 : y0 + 28, x0 : x0 + 28] = t
    np.testing.assert_array_equal(stitched, mask)
    flip = read_dense(open_cache(path), "pix", "mosaic", "val@flip")
    np.testing.assert_array_equal(flip.target[:][:, :, ::-1], mask)


def test_dense_groups_lists_each_splits_groups_in_order(dense_store):
    groups = dense_groups(open_cache(dense_store[0]), "pix", "mosaic")
    assert groups == {"train": ["train", "train@view0", "train@view1"], "val": ["val", "val@win", "val@flip"]}
    views = [read_dense(open_cache(dense_store[0]), "pix", "mosaic", s) for s in groups["train"][1:]]
    assert [v.geometry.grid for v in views] == [(3, 3), (3, 3)]
    assert [v.geometry.params["seed"] for v in views] == [0, 1]
    assert dense_groups(open_cache(dense_store[0]), "other", "mosaic") == {}


@pytest.mark.parametrize(
    ("split", "kinds", "error", "says"),
    [
        ("val", ("pooled",), NotInStoreError, "pix/mosaic/val stores no pooled (it holds tokens, cls, mask"),
        ("val", ("mask",), ConfigError, "ask for one or more model kinds"),
        ("val", (), ConfigError, "ask for one or more model kinds"),
        ("val@view0", ("tokens",), NotInStoreError, "no dense group val@view0 for pix/mosaic"),
        ("train@win", ("tokens",), NotInStoreError, "re-run the dense extract of train with --windows"),
        ("plain", ("pooled",), NotInStoreError, "holds features (pooled) but no dense target (mask or depth)"),
    ],
)
def test_what_a_group_does_not_hold_is_named_in_one_line(dense_store, split, kinds, error, says):
    with pytest.raises(error, match=re.escape(says)) as exc:
        read_dense(open_cache(dense_store[0]), "pix", "mosaic", split, kinds=kinds)
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------- pairing refusals
def _bad_store(tmp_path, damage: str):
    """A store whose group ``val`` (or its windows/view) pairs tokens and targets wrongly."""
    path = tmp_path / "c.zarr"
    img, mask = mosaics(8)
    ids = [f"m{i}" for i in range(8)]
    rows = {"tokens": tokens_of(img), "mask": mask}
    if damage == "grid":
        write_group(path, "val", rows, Geometry("resize", (42, 42), (3, 3), (56, 56)), ids=ids)
    elif damage == "target size":
        write_group(path, "val", rows, Geometry("resize", (56, 56), (4, 4), (28, 28)), ids=ids)
    elif damage == "geometry":
        other = Geometry("resize", (56, 56), (4, 4), (56, 56), {"interpolation": "nearest"})
        write_group(path, "val", rows, RESIZE, ids=ids, geometries={"mask": other})
    elif damage == "no geometry":
        write_group(path, "val", rows, RESIZE, ids=ids, geometries={"tokens": None})
    else:
        write_group(path, "val", rows, RESIZE, ids=ids)
        win, win_ids = window_rows(img, mask)
        if damage == "view ids":
            write_group(path, "val@view0", rows, Geometry("view0", (56, 56), (4, 4), (56, 56)), ids=ids[::-1])
            return path, "val@view0"
        if damage == "window outside":
            win["window"][9, 0] = 8
        elif damage == "window id":
            win["window"][[4, 8], 0] = win["window"][[8, 4], 0]  # rows of images 1 and 2 swapped
        write_group(path, "val@win", win, WIN, ids=win_ids)
        return path, "val@win"
    return path, "val"


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("grid", "tokens: 16 tokens a row, but the recorded grid 3x3 gives 9"),
        ("target size", "mask: targets of (56, 56) a row, but the recorded geometry gives (28, 28)"),
        ("geometry", "mask records another geometry than tokens"),
        ("no geometry", "tokens records no dense geometry"),
        ("view ids", "val@view0: its ids are not val's"),
        ("window outside", "window row 9 points at image row 8, outside its base split's 8 rows"),
        ("window id", "window row 4 has id 'm1#w0' but points at image 'm2'"),
    ],
)
def test_a_target_paired_with_the_wrong_row_is_refused(tmp_path, damage, says):
    path, split = _bad_store(tmp_path, damage)
    with pytest.raises(CorruptStoreError, match=re.escape(says)) as exc:
        read_dense(open_cache(path), "pix", "mosaic", split)
    assert "\n" not in str(exc.value)
    assert "--overwrite" in str(exc.value)


# ---------------------------------------------------------------- row blocks
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 500),
    row=st.integers(1, 4096),
    budget=st.integers(1, 1 << 16),
    align=st.integers(1, 64),
)
def test_row_blocks_cover_every_row_once_within_the_budget(n, row, budget, align):
    if budget < row:
        with pytest.raises(ConfigError, match=f"cannot hold one row \\({row} bytes\\); raise it to at least {row}"):
            list(iter_row_blocks(n, row, budget, align=align))
        return
    blocks = list(iter_row_blocks(n, row, budget, align=align))
    assert [s for s, _ in blocks] == ([0, *(e for _, e in blocks[:-1])] if n else [])
    assert (blocks[-1][1] if blocks else 0) == n
    assert all((e - s) * row <= budget for s, e in blocks)
    if budget // row >= align:
        assert all((e - s) % align == 0 for s, e in blocks[:-1])


def test_verify_names_the_extract_flags_that_recompute_a_damaged_window_group(dense_store, tmp_path, capsys):
    """A damaged ``val@win`` chunk: the printed command re-runs the base split with ``--windows``
    and its recorded short side, over the base split's images (not the window rows)."""
    import shutil

    from featcache.cli import main

    path = tmp_path / "c.zarr"
    shutil.copytree(dense_store[0], path)
    chunk = path / "features/pix/mosaic/val@win/tokens/c/3/0/0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "val@win/tokens: chunk 3 (rows 12-15)" in out
    hint = "--split val --backbone-name pix --windows --window-short-side 56 "
    assert hint in out, out
    assert "--features tokens --limit 16 " in out, out


def test_a_published_dense_group_keeps_its_targets_and_reads_back_paired(tmp_path):
    """``publish --kinds tokens`` copies a dense group's targets with its tokens (a published
    group reads back through ``read_dense``); the Parquet mirror holds no target table."""
    import pyarrow.parquet as pq

    from featcache.store.publish import PublishConfig, publish
    from featcache.store.verify import verify

    path = tmp_path / "c.zarr"
    img, mask = mosaics(4)
    write_group(path, "val", resize_rows(img, mask), RESIZE, ids=[f"m{i}" for i in range(4)])
    win, win_ids = window_rows(img, mask)
    write_group(path, "val@win", win, WIN, ids=win_ids)
    out = publish(PublishConfig(str(path), str(tmp_path / "pub"), kinds=("tokens", "cls")))
    store = str(out / "store.zarr")
    assert verify(store) == []
    rows = read_dense(open_cache(store), "pix", "mosaic", "val@win")
    np.testing.assert_array_equal(rows.target[:], win["mask"])
    assert set(rows.tables) == {"window"}
    assert pq.read_schema(out / "data/pix--mosaic/val.parquet").names == ["id", "label", "valid", "cls"]
