"""Bad input to the extract stage: each is refused with a one-line error before any work (the
store untouched), or becomes an invalid row; provenance records what was actually done."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image

from featcache.cli import main
from featcache.data.readers import open_dataset
from featcache.data.source import ReadOptions, escape_name
from featcache.errors import ConfigError, DataError, ProvenanceMismatchError
from featcache.extract import ExtractConfig, extract
from featcache.store import dataset_fingerprint, open_cache

LITE0 = "tf_efficientnet_lite0"


def _png(path: Path, size=(6, 4), mode="RGB", **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, 128 if mode != "RGB" else (10, 200, 30)).save(path, "PNG", **kw)
    return path


def _manifest(tmp_path: Path, labels) -> str:
    img = _png(tmp_path / "a.png")
    f = tmp_path / "m.csv"
    pl.DataFrame({"path": [img.name] * len(labels), "label": labels}).write_csv(f)
    return f"manifest:{f}"


# --------------------------------------------------------------------------- labels
def test_huge_integer_label_is_refused_without_building_classes(tmp_path):
    with pytest.raises(DataError, match=r"integer label 1000000000 would make 1000000001 classes for 2 rows"):
        open_dataset(_manifest(tmp_path, [0, 1_000_000_000]))


def test_negative_label_is_refused(tmp_path):
    with pytest.raises(DataError, match="label -1 is negative"):
        open_dataset(_manifest(tmp_path, [0, -1]))


def test_nan_and_fractional_labels_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"label nan \(row 2\) is not an integer"):
        open_dataset(_manifest(tmp_path, [1.0, float("nan")]))
    with pytest.raises(DataError, match=r"label 1.5 \(row 1\) is not an integer"):
        open_dataset(_manifest(tmp_path / "b", [1.5, 2.0]))


def test_integral_float_labels_are_integers(tmp_path):
    (s,) = open_dataset(_manifest(tmp_path, [1.0, 0.0, 2.0])).values()
    assert s.labels.dtype == np.int64
    assert s.labels.tolist() == [1, 0, 2]
    assert s.class_names == ["0", "1", "2"]


# --------------------------------------------------------------------------- file names
def test_non_utf8_file_name_gets_a_lossless_escaped_id(tmp_path):
    root = tmp_path / "folder"
    _png(root / "cat" / "ok.png")
    (root / "cat").mkdir(exist_ok=True)
    raw = os.path.join(os.fsencode(root / "cat"), b"caf\xe9.png")
    with open(raw, "wb") as fh:
        fh.write((root / "cat" / "ok.png").read_bytes())
    (s,) = open_dataset(f"imagefolder:{root}").values()
    assert sorted(s.ids.tolist()) == ["cat/caf\\xe9.png", "cat/ok.png"]
    assert len(dataset_fingerprint(s.ids, s.labels, s.class_names)) == 64  # no UnicodeEncodeError
    assert s.load(list(s.ids).index("cat/caf\\xe9.png")).size == (6, 4)
    # lossless: a literal backslash is escaped too, so no two names share an id
    assert escape_name("a\\xe9") == "a\\\\xe9" != escape_name(os.fsdecode(b"a\xe9"))
    assert escape_name("plain/name.png") == "plain/name.png"


def test_dangling_symlink_is_an_invalid_row(tmp_path):
    root = tmp_path / "folder"
    _png(root / "cat" / "ok.png")
    os.symlink(root / "cat" / "gone.png", root / "cat" / "link.png")
    (s,) = open_dataset(f"imagefolder:{root}").values()
    assert s.ids.tolist() == ["cat/link.png", "cat/ok.png"]
    with pytest.raises(FileNotFoundError):
        s.load(0)


def test_empty_class_folder_is_an_error_naming_it(tmp_path):
    root = tmp_path / "folder"
    _png(root / "cat" / "ok.png")
    (root / "dog").mkdir()
    with pytest.raises(DataError, match=r"class folder\(s\) without images: .*/dog; .*--allow-empty-classes"):
        open_dataset(f"imagefolder:{root}")
    (s,) = open_dataset(f"imagefolder:{root}", options=ReadOptions(allow_empty_classes=True)).values()
    assert s.class_names == ["cat", "dog"]


def test_error_texts_show_plain_paths(tmp_path):
    root = tmp_path / "folder"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "text.png").write_text("not an image")
    (s,) = open_dataset(f"imagefolder:{root}").values()
    with pytest.raises(OSError, match="cannot identify image file") as e:  # PIL.UnidentifiedImageError
        s.load(0)
    assert "np.str_" not in str(e.value)
    assert str(root) in str(e.value)


# --------------------------------------------------------------------------- decoding
def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    bomb = _png(tmp_path / "bomb.png", size=(12000, 12000), mode="1")  # ~18 KB, 144 M pixels
    assert bomb.stat().st_size < 100_000
    f = tmp_path / "m.csv"
    pl.DataFrame({"path": [bomb.name, _png(tmp_path / "ok.png").name], "label": [0, 1]}).write_csv(f)
    (s,) = open_dataset(f"manifest:{f}").values()
    with pytest.raises(DataError, match="12000x12000 = 144000000 pixels, above the limit of 89478485"):
        s.load(0)
    assert s.load(1).size == (6, 4)
    (small,) = open_dataset(f"manifest:{f}", options=ReadOptions(max_image_pixels=20)).values()
    with pytest.raises(DataError, match="above the limit of 20"):
        small.load(1)


def test_exif_orientation_is_applied_unless_disabled(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    img = Image.fromarray(np.arange(24, dtype=np.uint8).reshape(4, 6))
    f = tmp_path / "m.csv"
    img.save(tmp_path / "rot.png", exif=exif.tobytes())
    img.save(tmp_path / "plain.png")
    pl.DataFrame({"path": ["rot.png", "plain.png"], "label": [0, 0]}).write_csv(f)
    (s,) = open_dataset(f"manifest:{f}").values()
    rotated = s.load(0)
    assert rotated.size == (4, 6)
    np.testing.assert_array_equal(np.asarray(rotated), np.rot90(np.asarray(img), k=-1))
    np.testing.assert_array_equal(np.asarray(s.load(1)), np.asarray(img))  # no tag: untouched
    (raw,) = open_dataset(f"manifest:{f}", options=ReadOptions(exif_transpose=False)).values()
    np.testing.assert_array_equal(np.asarray(raw.load(0)), np.asarray(img))


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"limit": -5}, r"--limit -5 is invalid: must be a positive number of rows"),
        ({"limit": 0}, r"--limit 0 is invalid"),
        ({"limit": {"train": 0}}, r"--limit train=0 is invalid"),
        ({"chunk_rows": 0}, r"--chunk-rows 0 is invalid: must be an integer >= 1"),
        ({"batch_size": 0}, r"--batch-size 0 is invalid"),
        ({"threads": 0}, r"--threads 0 is invalid"),
        ({"max_image_pixels": 0}, r"--max-image-pixels 0 is invalid"),
        ({"amp": "int8"}, r"--precision int8 is invalid"),
        ({"dataset_name": "zarr.json"}, r"--dataset-name 'zarr.json' cannot be a store key"),
        ({"backbone_name": "a/b"}, r"--backbone-name 'a/b' cannot be a store key"),
        ({"device": "tpu"}, r"--device 'tpu' is invalid: choose auto, cpu, cuda or cuda:N"),
        ({"input_size": 100_000}, r"--input-size 100000 is invalid: must be at most 4096 pixels a side"),
        ({"pre_resize": 10_000}, r"--pre-resize 10000 is invalid"),
    ],
)
def test_bad_settings_are_refused_on_construction(kw, match):
    with pytest.raises(ConfigError, match=match):
        ExtractConfig(LITE0, "random:0", "digits", cache="never-created.zarr", **kw)


def test_cli_refuses_bad_limit_in_one_line_and_touches_nothing(tmp_path, capsys):
    cache = tmp_path / "c.zarr"
    rc = main(
        [
            "extract",
            "--model",
            LITE0,
            "--weights",
            "random:0",
            "--data",
            "digits",
            "--cache",
            str(cache),
            "--limit",
            "-5",
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0
    assert "--limit -5 is invalid" in err
    assert "Traceback" not in err
    assert not cache.exists()


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--features", "stage99_avg"], "stage99_avg: tf_efficientnet_lite0 has stages 0..4"),
        (["--device", "tpu"], "--device 'tpu' is invalid"),
        (["--input-size", "100000"], "--input-size 100000 is invalid"),
    ],
)
def test_cli_bad_feature_kind_device_and_size_are_one_line_errors(tmp_path, capsys, flags, want):
    cache = tmp_path / "c.zarr"
    argv = ["extract", "--model", LITE0, "--weights", "random:0", "--data", "digits", "--cache", str(cache)]
    rc = main([*argv, "--input-size", "32", "--limit", "8", *flags])
    err = capsys.readouterr().err
    assert rc == 1
    assert want in err
    assert "Traceback" not in err


def test_cli_flags_come_from_the_config():
    import argparse
    import dataclasses

    p = argparse.ArgumentParser()
    ExtractConfig.add_arguments(p)
    args = p.parse_args(
        [
            "--model",
            "m",
            "--data",
            "digits",
            "--cache",
            "c",
            "--precision",
            "fp32",
            "--no-channels-last",
            "--features",
            "pooled,cls",
            "--split",
            "test",
            "--threads",
            "3",
            "--no-exif-transpose",
            "--max-image-pixels",
            "1000",
            "--allow-empty-classes",
        ]
    )
    cfg = ExtractConfig.from_args(args)
    assert (cfg.amp, cfg.channels_last, cfg.features, cfg.splits, cfg.threads) == (
        "fp32",
        False,
        ("pooled", "cls"),
        ("test",),
        3,
    )
    assert (cfg.exif_transpose, cfg.max_image_pixels, cfg.allow_empty_classes) == (False, 1000, True)
    assert cfg.chunk_rows == 1024
    assert cfg.progress
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.limit = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- provenance, allocator
KW = {"limit": 16, "input_size": 32, "batch_size": 8, "chunk_rows": 8, "workers": 0, "device": "cpu", "progress": False}


def test_cpu_fp16_records_the_fp32_it_computes_and_leaves_the_allocator_alone(tmp_path, caplog, monkeypatch):
    import featcache.core.allocator as allocator

    def refuse():
        raise AssertionError("extract() must not tune the process allocator")

    monkeypatch.setattr(allocator, "tune_cpu_allocator", refuse)
    cache = str(tmp_path / "c.zarr")
    with caplog.at_level(logging.WARNING):
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, amp="fp16", threads=1, **KW))
    assert "applies on CUDA only" in caplog.text
    prov = open_cache(cache).provenance(f"{LITE0}@random0", "digits", "test")
    assert prov.amp == "none"
    assert prov.device == "cpu"
    assert prov.extra["precision_requested"] == "fp16"
    assert prov.extra["threads"] == 1
    assert prov.extra["exif_transpose"] is True


needs_bf16 = pytest.mark.skipif(
    not __import__("featcache.core.cpu").core.cpu.bf16_support()[0], reason="no CPU bf16 hardware"
)


@needs_bf16
def test_cpu_bf16_autocasts_and_records_precision_and_isa(tmp_path, caplog):
    """On a CPU with avx512_bf16/AMX, --precision bf16 computes in bf16: features close to the
    fp32 ones but not equal, provenance says bf16 and the ISA, one log line says which kernels."""
    from featcache.core.cpu import cpu_isa

    cache = str(tmp_path / "c.zarr")
    with caplog.at_level(logging.INFO, logger="featcache.extract"):
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, amp="bf16", threads=1, **KW))
    assert len([r for r in caplog.records if "bf16 autocast on cpu" in r.getMessage()]) == 1
    extract(
        ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, amp="fp32", threads=1, backbone_name="f32", **KW)
    )
    s = open_cache(cache)
    prov = s.provenance(f"{LITE0}@random0", "digits", "test")
    assert prov.amp == "bf16"
    assert prov.extra["cpu_isa"] == cpu_isa()
    assert "bf16" in prov.extra["cpu_isa"]
    assert s.provenance("f32", "digits", "test").amp == "none"
    a = s.load(f"{LITE0}@random0", "digits", "test").X.astype(np.float64)
    b = s.load("f32", "digits", "test").X.astype(np.float64)
    assert not np.array_equal(a, b)  # bf16 arithmetic really ran
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.99


def test_cpu_bf16_is_refused_on_a_cpu_without_bf16_hardware(tmp_path, monkeypatch):
    import featcache.core.cpu as fcpu

    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ())
    cache = tmp_path / "c.zarr"
    with pytest.raises(ConfigError, match=r"neither amx_bf16 nor avx512_bf16.*--precision fp32"):
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], str(cache), amp="bf16", threads=1, **KW))
    assert not cache.exists() or not open_cache(str(cache)).backbones()


@needs_bf16
def test_resume_refuses_another_precision_or_cpu_isa(tmp_path, monkeypatch):
    import featcache.core.cpu as fcpu

    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, threads=1, write=False, **KW))
    with pytest.raises(ProvenanceMismatchError, match=r"precision: stored='none' requested='bf16'"):
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, amp="bf16", threads=1, **KW))
    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ())
    with pytest.raises(ProvenanceMismatchError, match=r"cpu_isa: stored='\w+\+"):
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, threads=1, **KW))


def test_resume_keeps_recorded_threads_and_refuses_other_settings(tmp_path):
    cache = str(tmp_path / "c.zarr")
    key = f"{LITE0}@random0"
    # write=False: arrays and provenance are created, no chunk is written (an interrupted run)
    extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, threads=1, write=False, **KW))
    with pytest.raises(ProvenanceMismatchError, match=r"threads: stored=1 requested=2") as e:
        extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, threads=2, **KW))
    assert "--overwrite" in str(e.value)
    (rep,) = extract(ExtractConfig(LITE0, "random:0", "digits", ["test"], cache, **KW))  # threads: recorded
    assert rep.chunks_computed == 2
    assert open_cache(cache).provenance(key, "digits", "test").extra["threads"] == 1
