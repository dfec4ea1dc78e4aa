"""Contract test over every registered model source: extract -> store -> load round trip,
provenance, and features equal to the library's own forward on the same preprocessed batch
(bit-identical on CPU fp32), through the shipped :func:`featcache.testing.check_source` that a
source written outside this repository runs on itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from featcache.extract import ExtractConfig, extract
from featcache.models import create_backbone
from featcache.models.sources import list_sources
from featcache.store import open_cache
from featcache.testing import check_source, source_batch

pytest.importorskip("open_clip")
pytest.importorskip("transformers")

from model_source_fixtures import (
    USER_MODULE,
    register_tiny_open_clip,
    save_tiny_hf_clip,
    save_tiny_hf_dinov2,
)

N = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """source -> (model spec, weights, the library's own reference forward on a batch)."""
    import open_clip
    import torchvision
    from transformers import CLIPModel, Dinov2Model

    tmp = tmp_path_factory.mktemp("sources")
    oc = register_tiny_open_clip(tmp / "oc")
    clip_dir, dino_dir = save_tiny_hf_clip(tmp / "hfclip"), save_tiny_hf_dinov2(tmp / "dino")
    (tmp / "usermods").mkdir()
    (tmp / "usermods" / "featcache_user_net.py").write_text(USER_MODULE)
    import sys

    sys.path.insert(0, str(tmp / "usermods"))

    def tv_ref(x):
        torch.manual_seed(0)
        m = torchvision.models.get_model("resnet18", weights=None).eval()
        m.fc = torch.nn.Identity()
        return m(x)

    def oc_ref(x):
        torch.manual_seed(0)
        return open_clip.create_model(oc, pretrained=None).eval().encode_image(x)

    import featcache_user_net

    torch.manual_seed(1)
    user = featcache_user_net.make().eval()
    torch.manual_seed(2)
    user2 = featcache_user_net.make().eval()
    yield {
        "timm": ("timm:test_resnet", "random:0", None),
        "torchvision": ("torchvision:resnet18", "random:0", tv_ref),
        "open_clip": (f"open_clip:{oc}", "random:0", oc_ref),
        "hf": (
            f"hf:{clip_dir}",
            "dir",
            lambda x: _tensor(CLIPModel.from_pretrained(clip_dir).eval().get_image_features(pixel_values=x)),
        ),
        "hf-dinov2": (
            f"hf:{dino_dir}",
            "dir",
            lambda x: Dinov2Model.from_pretrained(dino_dir).eval()(pixel_values=x).pooler_output,
        ),
        "python": ("python:featcache_user_net:make", "random:2", lambda x: user2(x)),
        "module": (user, "timm", lambda x: user(x)),
    }
    sys.path.remove(str(tmp / "usermods"))
    sys.modules.pop("featcache_user_net", None)


def _tensor(out):
    """transformers >= 5 returns a model output whose pooler_output is the projected embedding."""
    return out if torch.is_tensor(out) else out.pooler_output


def _batch(bb, n=N):
    return source_batch(bb, "digits", "test", n)


def test_every_registered_source_is_covered(models):
    assert set(list_sources()) | {"module"} <= {k.split("-")[0] for k in models}


@pytest.mark.parametrize("source", ["timm", "torchvision", "open_clip", "hf", "hf-dinov2", "python", "module"])
def test_source_contract(models, source, tmp_path):
    """The shipped contract (featcache.testing.check_source): extract -> store -> load, provenance,
    resume, features bit-identical to the library's own forward."""
    spec, weights, ref = models[source]
    got = check_source(spec, weights, ref, tmp_path / "c.zarr", n=N)
    if source == "timm":  # timm:NAME is the bare name: same key, same provenance
        assert got.key == "test_resnet@random0"
        assert got.provenance.model_name == "test_resnet"


def test_resume_refuses_another_source(models, tmp_path):
    from featcache.errors import FeatcacheError

    cache = str(tmp_path / "c.zarr")
    base = {"data": "digits", "cache": cache, "splits": ("test",), "limit": N, "progress": False, "device": "cpu"}
    base["backbone_name"] = "bb"
    extract(ExtractConfig(models["python"][0], "random:2", **base))
    with pytest.raises(FeatcacheError, match=r"model_name|data_config"):
        extract(ExtractConfig(models["module"][0], "timm", **base))


def test_missing_extra_names_the_pip_install(monkeypatch):
    import sys

    from featcache.errors import BackboneError

    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip -> ImportError
    with pytest.raises(BackboneError, match=r"pip install 'featcache\[clip\]'"):
        create_backbone("open_clip:ViT-S-32", "random:0")


def test_timm_options_are_refused_for_other_sources(models):
    from featcache.errors import BackboneError

    with pytest.raises(BackboneError, match="input_size apply to timm models and to python: factories without"):
        create_backbone(models["torchvision"][0], "random:0", input_size=64)


@pytest.mark.slow
def test_user_module_probed_and_reported_beside_timm(models, tmp_path):
    """A user's module from the CLI (python:) and from Python (ExtractConfig(model=module)),
    probed beside a timm backbone, all three in one results table and one report."""
    import polars as pl

    from featcache.cli import main

    cache, res = str(tmp_path / "c.zarr"), str(tmp_path / "r.parquet")
    common = ["--data", "digits", "--cache", cache, "--limit", "60", "--no-progress", "--device", "cpu"]
    assert main(["extract", "--model", "python:featcache_user_net:make", "--weights", "random:2", *common]) == 0
    assert main(["extract", "--model", "test_resnet", "--weights", "random:0", "--input-size", "32", *common]) == 0
    extract(
        ExtractConfig(
            models["module"][0],
            "module",
            "digits",
            cache=cache,
            limit=60,
            progress=False,
            backbone_name="mine",
            device="cpu",
        )
    )
    assert main(["probe", "--cache", cache, "--all", "--dataset", "digits", "--results", res]) == 0
    got = set(pl.read_parquet(res)["backbone"].unique())
    assert got == {"python-featcache_user_net_make@" + _key_tag(cache), "test_resnet@random0", "mine"}
    from featcache.analysis import rank

    overall = rank(res, plots=False, n_boot=50)["overall"]  # ranked beside each other
    assert set(overall["backbone"]) == got
    out = tmp_path / "report.html"
    assert main(["report", "--results", res, "--cache", cache, "--out", str(out)]) == 0
    html = out.read_text()
    assert all(b in html for b in got)


def _key_tag(cache):
    (key,) = [b for b in open_cache(cache, "r").backbones() if b.startswith("python-")]
    return key.split("@", 1)[1]


def test_extract_help_imports_no_model_library():
    import subprocess
    import sys

    code = (
        "import sys; from featcache.cli import build_parser; build_parser().parse_args(['extract', '--model', 'x', "
        "'--cache', 'c']); print(sorted(m for m in ('open_clip', 'transformers', 'torchvision', 'timm', 'torch') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _stage_refs(models):
    """source -> (kinds to extract, the library's own intermediate features of a batch)."""
    import open_clip
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor
    from transformers import CLIPModel

    def tv(x):
        torch.manual_seed(0)
        m = torchvision.models.get_model("mobilenet_v3_small", weights=None).eval()
        m.classifier = torch.nn.Identity()
        out = create_feature_extractor(m, {"features.0": "a", "features.12": "b"})(x)
        return {"stage0_avg": out["a"].mean(dim=(2, 3)), "stage12_avg": out["b"].mean(dim=(2, 3)), "pooled": m(x)}

    def oc(x):
        torch.manual_seed(0)
        m = open_clip.create_model(models["open_clip"][0].split(":", 1)[1], pretrained=None).eval()
        a, b = m.visual.forward_intermediates(x, indices=[0, 1], intermediates_only=True)["image_intermediates"]
        return {"stage0_avg": a.mean(dim=(2, 3)), "stage1_avg": b.mean(dim=(2, 3))}  # NCHW: another sum order

    def hf(x):
        m = CLIPModel.from_pretrained(models["hf"][0].split(":", 1)[1]).eval()
        hs = m.vision_model(pixel_values=x, output_hidden_states=True).hidden_states
        return {"stage0_avg": hs[1][:, 1:].mean(dim=1), "stage1_avg": hs[2][:, 1:].mean(dim=1)}

    return {"torchvision": tv, "open_clip": oc, "hf": hf}


@pytest.mark.parametrize("source", ["torchvision", "open_clip", "hf"])
def test_stage_kinds_equal_the_librarys_intermediates(models, source, tmp_path):
    """Intermediate stages where the library exposes them (torchvision's
    create_feature_extractor, open_clip's forward_intermediates, HF hidden_states), extracted in
    the same forward as pooled, which stays what the library's own forward gives."""
    spec, weights, ref = models[source]
    if source == "torchvision":  # a small torchvision trunk with 13 stages (the children of features)
        spec, ref = "torchvision:mobilenet_v3_small", None
    want_fn = _stage_refs(models)[source]
    cache = str(tmp_path / "c.zarr")
    kinds = ("pooled", *sorted(k for k in want_fn(_batch(create_backbone(spec, weights), 1)) if k != "pooled"))
    base = {
        "splits": ("test",),
        "limit": N,
        "batch_size": N,
        "dtype": "float32",
        "progress": False,
        "channels_last": False,
    }
    extract(ExtractConfig(spec, weights, "digits", cache=cache, features=kinds, threads=1, device="cpu", **base))
    fc = open_cache(cache, "r")
    (key,) = {b for b, _, _ in fc.entries()}
    bb = create_backbone(spec, weights)
    assert set(kinds) <= set(bb.kinds)
    torch.set_num_threads(1)
    with torch.inference_mode():
        x = _batch(bb)
        want = {k: v.float().numpy() for k, v in want_fn(x).items()}
        if ref is not None:
            want["pooled"] = ref(x).float().numpy()
    for k in kinds:
        got = fc.load(key, "digits", "test", kind=k).X
        if source == "open_clip" and k != "pooled":
            np.testing.assert_allclose(got, want[k], rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, want[k])


def test_a_kind_a_source_lacks_names_what_it_offers(models, tmp_path):
    from featcache.errors import FeatcacheError

    base = {"cache": str(tmp_path / "c.zarr"), "splits": ("test",), "limit": N, "progress": False}
    with pytest.raises(FeatcacheError, match=r"offers pooled; not stage0_avg"):
        extract(ExtractConfig(models["module"][0], "module", "digits", features=("stage0_avg",), **base))
    with pytest.raises(
        FeatcacheError, match=r"offers pooled, stage0_avg, stage1_avg, stage2_avg, stage3_avg; not stage4"
    ):
        extract(ExtractConfig("torchvision:resnet18", "random:0", "digits", features=("stage4_avg",), **base))
    with pytest.raises(
        FeatcacheError,
        match=r"offers pooled, pooler, cls, tokens_mean, stage0_avg, stage1_avg, blocks:K, tokens, tokens@GxG; not",
    ):
        extract(ExtractConfig(models["hf"][0], "dir", "digits", features=("stage2_avg",), **base))
    with pytest.raises(FeatcacheError, match=r"stage3_avg; not tokens, blocks:2: choose from those"):  # issue 46 kinds
        extract(ExtractConfig("torchvision:resnet18", "random:0", "digits", features=("tokens", "blocks:2"), **base))
