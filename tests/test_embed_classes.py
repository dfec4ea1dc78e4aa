"""``featcache embed-classes``: featcache's zero-shot logits equal open_clip's own zero-shot
classifier (open_clip ``zero_shot_classifier.build_zero_shot_classifier``, run here on the
same model) to 1e-5 on real images (digits), for an open_clip model and an HF CLIPModel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("open_clip")
pytest.importorskip("transformers")

from model_source_fixtures import register_tiny_open_clip, save_tiny_hf_clip

from featcache.cli import main
from featcache.extract import ExtractConfig, extract
from featcache.probes.elevater import zeroshot_logits
from featcache.store import open_cache

N = 40


class _HFAsOpenClip:
    """HF CLIPModel behind open_clip's ``encode_text(tokens, normalize=True)`` interface."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def tokenizer(self, texts):
        return self.tok(texts, padding=True, return_tensors="pt")

    def encode_text(self, batch, normalize=False):
        out = self.model.get_text_features(**batch)
        out = out if torch.is_tensor(out) else out.pooler_output
        return torch.nn.functional.normalize(out, dim=-1) if normalize else out


def _image_features(model_spec, weights, cache, key):
    extract(
        ExtractConfig(
            model_spec,
            weights,
            "digits",
            cache=cache,
            splits=("test",),
            limit=N,
            batch_size=N,
            dtype="float32",
            progress=False,
            device="cpu",
            backbone_name=key,
        )
    )
    return open_cache(cache, "r").load(key, "digits", "test").X


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    return register_tiny_open_clip(tmp / "oc"), save_tiny_hf_clip(tmp / "hfclip")


def test_open_clip_zeroshot_equals_open_clip(tiny, tmp_path, capsys):
    import open_clip

    arch = tiny[0]
    cache = str(tmp_path / "c.zarr")
    X = _image_features(f"open_clip:{arch}", "random:0", cache, "oc")
    rc = main(
        [
            "embed-classes",
            "--cache",
            cache,
            "--model",
            f"open_clip:{arch}",
            "--weights",
            "random:0",
            "--dataset",
            "digits",
            "--backbone",
            "oc",
            "--templates",
            "clip-imagenet",
        ]
    )
    assert rc == 0
    text = open_cache(cache, "r").load_class_embeddings("digits", backbone="oc")
    ours = zeroshot_logits(X, text)

    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval()
    names = [str(i) for i in range(10)]
    clf = open_clip.build_zero_shot_classifier(
        model, open_clip.get_tokenizer(arch), names, open_clip.OPENAI_IMAGENET_TEMPLATES, device="cpu"
    )
    img = torch.nn.functional.normalize(torch.from_numpy(X), dim=-1)
    theirs = (img @ clf).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert np.ptp(theirs) > 1e-3  # not a degenerate (all-equal) classifier

    # another template set over the same store is refused with the difference
    rc = main(
        [
            "embed-classes",
            "--cache",
            cache,
            "--model",
            f"open_clip:{arch}",
            "--weights",
            "random:0",
            "--dataset",
            "digits",
            "--backbone",
            "oc",
            "--templates",
            "simple",
        ]
    )
    assert rc != 0
    assert "templates_sha256" in capsys.readouterr().err


def test_hf_clip_zeroshot_equals_open_clip_classifier(tiny, tmp_path):
    import open_clip
    from transformers import AutoTokenizer, CLIPModel

    d = tiny[1]
    cache = str(tmp_path / "c.zarr")
    X = _image_features(f"hf:{d}", "dir", cache, "hf")
    tmpl = tmp_path / "templates.txt"
    tmpl.write_text("a photo of a {c}.\na drawing of the number {}.\n")
    assert (
        main(
            [
                "embed-classes",
                "--cache",
                cache,
                "--model",
                f"hf:{d}",
                "--dataset",
                "digits",
                "--backbone",
                "hf",
                "--templates",
                str(tmpl),
            ]
        )
        == 0
    )
    ours = zeroshot_logits(X, open_cache(cache, "r").load_class_embeddings("digits", backbone="hf"))

    hf = _HFAsOpenClip(CLIPModel.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d))
    clf = open_clip.build_zero_shot_classifier(
        hf, hf.tokenizer, [str(i) for i in range(10)], ["a photo of a {}.", "a drawing of the number {}."]
    )
    theirs = (torch.nn.functional.normalize(torch.from_numpy(X), dim=-1) @ clf).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert np.ptp(theirs) > 1e-3
