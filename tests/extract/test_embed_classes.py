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
from featcache.probes.store_lookup import run_ids
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


def _image_features(model_spec, weights, cache, key, splits=("test",)):
    extract(
        ExtractConfig(
            model_spec,
            weights,
            "digits",
            cache=cache,
            splits=splits,
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


@pytest.mark.slow
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


@pytest.fixture(scope="module")
def oc_store(tiny, tmp_path_factory):
    """digits test images through the tiny open_clip (random:0) under key ``oc``, extracted once."""
    cache = str(tmp_path_factory.mktemp("ocstore") / "c.zarr")
    _image_features(f"open_clip:{tiny[0]}", "random:0", cache, "oc", splits=("train", "test"))
    return cache


def _store_copy(src, tmp_path):
    import shutil

    shutil.copytree(src, tmp_path / "c.zarr")
    return str(tmp_path / "c.zarr")


def _embed(cache, arch, *extra):
    argv = ["embed-classes", "--cache", cache, "--model", f"open_clip:{arch}", "--weights", "random:0"]
    return main([*argv, "--dataset", "digits", "--backbone", "oc", *extra])


def _elevater_text_features(model, tokenizer, class_names, templates):
    """Elevater_Toolkit_IC vision_benchmark/evaluation/feature.py extract_text_features, its loop
    (no knowledge sources): per class, format every template, encode, normalise, mean, renormalise."""
    zeroshot_weights = []
    with torch.no_grad():
        for classname in class_names:
            if type(classname) == list:  # noqa: E721 (as the toolkit writes it)
                classname = classname[0]
            texts = tokenizer([template.format(classname) for template in templates])
            class_embeddings = model.encode_text(texts)
            class_embeddings /= class_embeddings.norm(dim=-1, keepdim=True)
            class_embedding = class_embeddings.mean(dim=0)
            class_embedding /= class_embedding.norm()
            zeroshot_weights.append(class_embedding)
    return torch.stack(zeroshot_weights, dim=1).numpy()


#: Elevater_Toolkit_IC vision_benchmark/datasets/prompts.py: mnist_classes, mnist_templates
ELEVATER_MNIST = ([str(i) for i in range(10)], ['a photo of the number: "{}".'])


def test_elevater_templates_and_class_names_are_elevaters(tiny, oc_store, tmp_path):
    import open_clip

    from featcache.core.prompts import load_classnames, load_templates

    arch = tiny[0]
    cache = _store_copy(oc_store, tmp_path)
    # the store's digits are not an ELEVATER dataset: its templates fall back to ELEVATER's
    # default, its class names are not ELEVATER's, so the dataset is named
    assert _embed(cache, arch, "--templates", "elevater") != 0
    assert _embed(cache, arch, "--templates", "elevater", "--prompt-dataset", "mnist") == 0
    ours = open_cache(cache, "r").load_class_embeddings("digits", backbone="oc")
    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval()
    theirs = _elevater_text_features(model, open_clip.get_tokenizer(arch), *ELEVATER_MNIST).T
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    # the toolkit's own quirks: cifar-10 uses cifar100_templates; fer-2013 names are lists
    assert load_templates("elevater", "cifar-10") == load_templates("elevater", "cifar_100")
    assert len(load_templates("elevater", "cifar-10")) == 18
    assert load_classnames("elevater", "fer-2013")[:2] == ["angry", "disgusted"]
    # suite task names and aliases resolve (eurosat_clip is the toolkit's key)
    assert load_templates("elevater", "eurosat-clip")[0] == "a centered satellite photo of {}."
    assert load_templates("elevater", "unknown-set") == ["a photo of a {}"]  # its default


def _clip_benchmark_zero_shot_classifier(model, tokenizer, classnames, templates):
    """CLIP_benchmark clip_benchmark/metrics/zeroshot_classification.py zero_shot_classifier (amp off)."""
    zeroshot_weights = []
    with torch.no_grad():
        for classname in classnames:
            texts = tokenizer([template.format(c=classname) for template in templates])
            class_embedding = torch.nn.functional.normalize(model.encode_text(texts), dim=-1).mean(dim=0)
            class_embedding /= class_embedding.norm()
            zeroshot_weights.append(class_embedding)
    return torch.stack(zeroshot_weights, dim=1).numpy()


def test_clip_benchmark_classnames_and_templates_files(tiny, oc_store, tmp_path):
    """CLIP_benchmark's export layout: classnames.txt and zeroshot_classification_templates.txt ({c})."""
    import open_clip

    arch = tiny[0]
    cache = _store_copy(oc_store, tmp_path)
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    (tmp_path / "classnames.txt").write_text("\n".join(names) + "\n")
    tmpl = ["a photo of the number: {c}.", "a drawing of a {c}."]
    (tmp_path / "zeroshot_classification_templates.txt").write_text("\n".join(tmpl) + "\n")
    files = ["--templates", str(tmp_path / "zeroshot_classification_templates.txt")]
    assert _embed(cache, arch, *files, "--classnames", str(tmp_path / "classnames.txt")) == 0
    ours = open_cache(cache, "r").load_class_embeddings("digits", backbone="oc")
    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval()
    theirs = _clip_benchmark_zero_shot_classifier(model, open_clip.get_tokenizer(arch), names, tmpl).T
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    # a class-name file of another length is refused (the store's digits have 10 classes)
    (tmp_path / "short.txt").write_text("zero\none\n")
    assert _embed(cache, arch, *files, "--classnames", str(tmp_path / "short.txt"), "--overwrite") != 0


def test_zeroshot_refuses_embeddings_of_another_tower_or_template_set(tiny, oc_store, tmp_path, capsys):
    """probe --protocol zeroshot / --head-init text check what made the class embeddings."""
    arch = tiny[0]
    cache = _store_copy(oc_store, tmp_path)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a photo of the number {}.\n")
    b.write_text("a drawing of a {}.\n")
    res = str(tmp_path / "r.parquet")
    probe = ["probe", "--cache", cache, "--backbone", "oc", "--dataset", "digits"]
    probe += ["--protocol", "zeroshot", "--results", res, "--no-progress"]
    assert _embed(cache, arch, "--templates", str(a)) == 0
    assert main([*probe, "--templates", str(a)]) == 0
    capsys.readouterr()
    # another template set than asked: stored vs asked, and how to regenerate
    assert main([*probe, "--templates", str(b), "--force"]) != 0
    err = capsys.readouterr().err
    assert "templates: stored a.txt" in err
    assert "asked b.txt" in err
    assert "featcache embed-classes" in err
    # embeddings from another tower (random:1 weights) than the one that extracted `oc`
    argv = ["embed-classes", "--cache", cache, "--model", f"open_clip:{arch}", "--weights", "random:1"]
    assert main([*argv, "--dataset", "digits", "--backbone", "oc", "--templates", str(a), "--overwrite"]) == 0
    capsys.readouterr()
    for extra in ([], ["--protocol", "full", "--head-init", "text"]):
        assert main([*probe, "--force", *extra]) != 0
        err = capsys.readouterr().err
        assert "tower weights sha256: stored" in err
        assert "--weights random:0" in err  # the regeneration command names the features' weights


def test_zeroshot_is_a_protocol_row_and_a_report_setting(tiny, oc_store, tmp_path):
    """ELEVATER's zero-shot column: zeroshot rows (0 shots, nothing trained) beside the full
    probe's, a setting of their own in the report's tables (``probe:digits (zero-shot)``)."""
    import polars as pl

    from featcache.analysis.tables import load_table, merge_tables
    from featcache.core.results import read_results
    from featcache.probes import ProbeConfig, run_probes

    cache = _store_copy(oc_store, tmp_path)
    tmpl = tmp_path / "t.txt"
    tmpl.write_text("a photo of the number {}.\na drawing of a {}.\n")
    assert _embed(cache, tiny[0], "--templates", str(tmpl)) == 0
    res = str(tmp_path / "r.parquet")
    for proto in ("zeroshot", "full"):
        run_probes(ProbeConfig(cache, "oc", "digits", proto, results_path=res, Cs=(1.0,), progress=False))
    df = read_results(res)
    zs = df.filter(pl.col("protocol") == "zeroshot")
    assert zs.height > 0
    assert set(zs["shots"]) == {0}
    assert set(zs["train_split"]) == {"none"}
    merged, _ = merge_tables([load_table(df)])
    assert set(merged["setting"]) == {"probe:digits (zero-shot)", "probe:digits"}
    # the row says where its classifier came from: the tower (weights hash) and the template set
    import json

    from featcache.core.prompts import load_templates, templates_sha256

    src = json.loads(zs["hparams"][0])["class_embeddings"]
    feat = open_cache(cache, "r").provenance("oc", "digits", "test")
    assert src["weights_sha256"] == feat.weights_sha256
    assert src["tower"]
    assert src["name"] == "text"
    assert src["templates_sha256"] == templates_sha256(load_templates(str(tmpl), "digits"))
    assert src["n_templates"] == 2
    zcfg = ProbeConfig(cache, "oc", "digits", "zeroshot", results_path=res, progress=False)
    assert set(zs["run_id"]) == set(run_ids(zcfg).values())  # the ids run_probes gave them


def test_new_template_set_reruns_zeroshot_same_one_skips(tiny, oc_store, tmp_path):
    """The run id of a zero-shot (or text-initialised) run names the class embeddings it read:
    embeddings made again from another template set rerun without --force; made again from the
    same set, the run is skipped; a hand-written matrix (nothing recorded) keeps the plain id."""
    import json

    from featcache.core.results import read_results
    from featcache.probes import ProbeConfig, run_probes
    from featcache.store import write_class_embeddings

    cache = _store_copy(oc_store, tmp_path)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a photo of the number {}.\n")
    b.write_text("a drawing of a {}.\na photo of the number {}.\n")
    res = str(tmp_path / "r.parquet")
    zcfg = ProbeConfig(cache, "oc", "digits", "zeroshot", results_path=res, progress=False)

    def run():
        run_probes(zcfg)
        return read_results(res)

    assert _embed(cache, tiny[0], "--templates", str(a)) == 0
    first = run()
    ids_a = set(run_ids(zcfg).values())
    assert set(first["run_id"]) == ids_a
    assert _embed(cache, tiny[0], "--templates", str(a), "--overwrite") == 0  # same set again
    assert run().height == first.height  # skipped: same embeddings, same ids
    assert _embed(cache, tiny[0], "--templates", str(b), "--overwrite") == 0
    ids_b = set(run_ids(zcfg).values())
    assert ids_b.isdisjoint(ids_a)
    second = run()
    assert second.height == 2 * first.height  # reran without --force, the first rows kept
    n_templates = {
        r: json.loads(h)["class_embeddings"]["n_templates"] for r, h in second.select("run_id", "hparams").rows()
    }
    assert {n_templates[r] for r in ids_a} == {1}
    assert {n_templates[r] for r in ids_b} == {2}
    # a hand-written matrix: the run id is the one it always was, from the features alone
    from featcache.store import combine_fingerprints
    from featcache.store.cache import features_fingerprint

    c = open_cache(cache, "r")
    write_class_embeddings(cache, "digits", c.load_class_embeddings("digits", backbone="oc"), "mine", backbone="oc")
    hcfg = ProbeConfig(cache, "oc", "digits", "zeroshot", head_init="mine", progress=False)
    proto, rcfg = hcfg.resolve()
    split_fp = {
        s: features_fingerprint(c.provenance("oc", "digits", s).to_attrs(), c.split_meta("digits", s).fingerprint)
        for s in ("train", "test")
    }
    want = {
        rcfg.run_id(proto, "oc", seed, "test", combine_fingerprints(split_fp[rcfg.train_split], "", split_fp["test"]))
        for seed in rcfg.seeds
    }
    assert set(run_ids(hcfg).values()) == want


def test_multilabel_dataset_embeds_its_label_columns_and_zeroshot_ranks_them(tiny, oc_store, tmp_path):
    """A dataset with a label matrix (VOC-style): embed-classes embeds one prompt set per label
    column (not per single-label class), equal to CLIP_benchmark's zero_shot_classifier over the
    column names, and zeroshot scores every label on the toolkit's 11-point mAP."""
    import open_clip
    import polars as pl
    from scipy.special import softmax
    from vision_evaluation_ref import elevater_map_11_points

    from featcache.probes import ProbeConfig, run_probes
    from featcache.store.tasks import write_label_matrix, write_task_metric

    arch = tiny[0]
    cache = _store_copy(oc_store, tmp_path)
    cols = ["even", "large", "round"]
    c = open_cache(cache, "r")
    Ys = {}
    for split in ("train", "test"):
        d = c.split_rows("digits", split)[1]
        Ys[split] = np.stack([d % 2 == 0, d >= 5, np.isin(d, [0, 6, 8, 9])], 1)
        write_label_matrix(cache, "digits", split, Ys[split], cols)
    write_task_metric(cache, "digits", "map11_elevater")
    tmpl = ["a photo of something {c}.", "a {c} thing."]
    (tmp_path / "t.txt").write_text("\n".join(tmpl) + "\n")
    assert _embed(cache, arch, "--templates", str(tmp_path / "t.txt")) == 0
    ours = open_cache(cache, "r").load_class_embeddings("digits", backbone="oc")
    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval()
    theirs = _clip_benchmark_zero_shot_classifier(model, open_clip.get_tokenizer(arch), cols, tmpl).T
    assert ours.shape == (3, theirs.shape[1])
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    df = run_probes(ProbeConfig(cache, "oc", "digits", "zeroshot", progress=False))
    test = open_cache(cache, "r").load("oc", "digits", "test")  # the store's row order, as Ys
    X = np.asarray(test.X, np.float64)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    want = elevater_map_11_points(Ys["test"], softmax(100 * X @ theirs.T.astype(np.float64), axis=1))
    got = df.filter(pl.col("metric") == "map11_elevater")["value"][0]
    assert got == pytest.approx(want, abs=1e-6)
