"""``featcache embed-captions`` + ``retrieve-text``: image->text and text->image recall@k equal
CLIP_benchmark's own computation (clip_benchmark/metrics/zeroshot_retrieval.py: ``evaluate``'s
positive-pair matrix over ``dataloader_with_indices``, ``recall_at_k`` through ``batchify``,
"any hit" > 0) on the same embeddings: real Fashion-MNIST images with made-up captions (one to
three per image), through a tiny random-weights open_clip model, from CLIP_benchmark's retrieval
export (``<split>/0.tar`` with ``.txt`` captions) and from a manifest with a caption column."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("open_clip")
pytest.importorskip("webdataset")

from model_source_fixtures import register_tiny_open_clip

from featcache.cli import main
from featcache.core.results import read_results
from featcache.data.readers import open_dataset
from featcache.retrieval.text import text_image_recall
from featcache.store import open_cache

N = 16
FM = ["T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]


# --- CLIP_benchmark clip_benchmark/metrics/zeroshot_retrieval.py (ported; amp and device dropped)
def dataloader_with_indices(dataloader):
    start = 0
    for x, y in dataloader:
        end = start + len(x)
        inds = torch.arange(start, end)
        yield x, y, inds
        start = end


def recall_at_k(scores, positive_pairs, k):
    nb_texts, nb_images = scores.shape
    topk_indices = torch.topk(scores, k, dim=1)[1]
    nb_positive = positive_pairs.sum(dim=1)
    topk_indices_onehot = torch.nn.functional.one_hot(topk_indices, num_classes=nb_images)
    positive_pairs_reshaped = positive_pairs.view(nb_texts, 1, nb_images)
    nb_true_positive = (topk_indices_onehot * positive_pairs_reshaped).sum(dim=(1, 2))
    return nb_true_positive / nb_positive


def batchify(func, X, Y, batch_size, *args, **kwargs):
    results = []
    for start in range(0, len(X), batch_size):
        end = start + batch_size
        results.append(func(X[start:end], Y[start:end], *args, **kwargs))
    return torch.cat(results)


def clip_benchmark_recall(batches, encode_text, recall_k_list):
    """``evaluate`` with the image embeddings given: ``batches`` of (image embeddings, captions)."""
    batch_images_emb_list, batch_texts_emb_list, texts_image_index = [], [], []
    for batch_images, batch_texts, inds in dataloader_with_indices(batches):
        batch_texts_image_index = [ind for ind, texts in zip(inds, batch_texts) for text in texts]
        batch_images_emb = F.normalize(batch_images, dim=-1)
        batch_texts_emb = F.normalize(encode_text([t for texts in batch_texts for t in texts]), dim=-1)
        batch_images_emb_list.append(batch_images_emb)
        batch_texts_emb_list.append(batch_texts_emb)
        texts_image_index.extend(batch_texts_image_index)
    batch_size = len(batch_images_emb_list[0])
    images_emb, texts_emb = torch.cat(batch_images_emb_list), torch.cat(batch_texts_emb_list)
    scores = texts_emb @ images_emb.t()
    positive_pairs = torch.zeros_like(scores, dtype=bool)
    positive_pairs[torch.arange(len(scores)), texts_image_index] = True
    metrics = {}
    for k in recall_k_list:
        t2i = (batchify(recall_at_k, scores, positive_pairs, batch_size, k=k) > 0).float().mean().item()
        i2t = (batchify(recall_at_k, scores.T, positive_pairs.T, batch_size, k=k) > 0).float().mean().item()
        metrics[f"image_retrieval_recall@{k}"], metrics[f"text_retrieval_recall@{k}"] = t2i, i2t
    return metrics


# ---------------------------------------------------------------------------------------------
def _captions(i: int, label: int) -> list[str]:
    out = [f"a photo of a {FM[label]}", f"picture number {i}"]
    return out + ([f"a small {FM[label]} on black"] if i % 3 == 0 else [])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tmp, open_clip arch, [(PIL image, captions)]) for N Fashion-MNIST test images."""
    tmp = tmp_path_factory.mktemp("captions")
    src = open_dataset("fashion-mnist")["test"]
    rows = [(src.load(i), _captions(i, int(src.labels[i]))) for i in range(N)]
    return tmp, register_tiny_open_clip(tmp / "oc"), rows


def _png(im) -> bytes:
    b = io.BytesIO()
    im.save(b, format="PNG")
    return b.getvalue()


def _clip_benchmark_export(root, rows) -> str:
    """webdataset_builder.convert_retrieval_dataset's layout: test/0.tar of png + txt, dataset_type.txt."""
    import webdataset as wds

    (root / "test").mkdir(parents=True)
    with wds.TarWriter(str(root / "test" / "0.tar")) as w:
        for i, (im, caps) in enumerate(rows):
            w.write({"__key__": f"s{i:07d}", "png": _png(im), "txt": "\n".join(caps)})
    (root / "test" / "nshards.txt").write_text("1\n")
    (root / "dataset_type.txt").write_text("retrieval\n")
    return str(root)


def _manifest(root, rows) -> str:
    import polars as pl

    root.mkdir(parents=True)
    for i, (im, _) in enumerate(rows):
        im.save(root / f"{i:03d}.png")
    paths = [f"{i:03d}.png" for i in range(len(rows))]
    pl.DataFrame({"path": paths, "caption": ["\n".join(c) for _, c in rows]}).write_csv(root / "m.csv")
    return str(root / "m.csv")


def _run(arch, data_spec, captions, cache, split, results):
    model = ["--model", f"open_clip:{arch}", "--weights", "random:0"]
    ex = ["extract", *model, "--data", data_spec, "--cache", cache, "--dataset-name", "caps"]
    assert main([*ex, "--backbone-name", "oc", "--no-progress", "--workers", "0"]) == 0
    emb = ["embed-captions", "--cache", cache, *model, "--dataset", "caps", "--split", split]
    assert main([*emb, "--captions", captions, "--backbone", "oc"]) == 0
    rt = ["retrieve-text", "--cache", cache, "--backbone", "oc", "--dataset", "caps", "--split", split]
    assert main([*rt, "--recall-k", "1,2,5", "--results", results]) == 0
    df = read_results(results)
    return dict(zip(df["metric"], df["value"])), open_cache(cache, "r").load("oc", "caps", split).X


def _reference(arch, rows, X):
    import open_clip

    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval()
    tok = open_clip.get_tokenizer(arch)
    batches = [(torch.from_numpy(X[i : i + 5]), [c for _, c in rows[i : i + 5]]) for i in range(0, len(rows), 5)]
    with torch.no_grad():
        return clip_benchmark_recall(batches, lambda t: model.encode_text(tok(t)), [1, 2, 5])


@pytest.mark.slow
def test_recall_equals_clip_benchmark_on_its_export_and_a_manifest(data):
    tmp, arch, rows = data
    spec = _clip_benchmark_export(tmp / "export", rows)
    ours, X = _run(arch, f"clip-benchmark:{spec}", spec, str(tmp / "a.zarr"), "test", str(tmp / "a.parquet"))
    ref = _reference(arch, rows, X)
    for k in (1, 2, 5):
        assert ours[f"t2i_recall@{k}"] == pytest.approx(ref[f"image_retrieval_recall@{k}"], abs=1e-6)
        assert ours[f"i2t_recall@{k}"] == pytest.approx(ref[f"text_retrieval_recall@{k}"], abs=1e-6)
    assert 0 < ours["t2i_recall@2"] < 1  # neither degenerate nor trivial
    df = read_results(str(tmp / "a.parquet"))
    assert set(df["kind"]) == {"retrieval"}
    assert set(df["protocol"]) == {"image-text"}
    assert dict(zip(df["metric"], df["n_eval"]))["t2i_recall@1"] == sum(len(c) for _, c in rows)

    # the same images and captions from a manifest with a caption column (several lines per cell)
    m = _manifest(tmp / "manifest", rows)
    ours_m, _ = _run(arch, f"manifest:{m}", m, str(tmp / "b.zarr"), "all", str(tmp / "b.parquet"))
    assert ours_m == pytest.approx(ours, abs=1e-6)


def test_captions_of_other_images_or_another_tower_are_refused(data, capsys):
    tmp, arch, rows = data
    cache = str(tmp / "b.zarr")  # the manifest store of the test above, or a fresh one
    m = _manifest(tmp / "manifest2", rows)
    if not (tmp / "b.zarr").exists():
        _run(arch, f"manifest:{m}", m, cache, "all", str(tmp / "b2.parquet"))
    model = ["--model", f"open_clip:{arch}"]
    emb = ["embed-captions", "--cache", cache, "--dataset", "caps", "--split", "all", "--backbone", "oc"]
    (tmp / "other.csv").write_text('id,caption\nnot-extracted.png,"a photo"\n')
    assert main([*emb, *model, "--weights", "random:0", "--captions", str(tmp / "other.csv")]) != 0
    assert "not in caps/all of the store" in capsys.readouterr().err
    assert main([*emb, *model, "--weights", "random:1", "--captions", m]) == 0
    capsys.readouterr()
    assert main(["retrieve-text", "--cache", cache, "--backbone", "oc", "--dataset", "caps", "--split", "all"]) != 0
    err = capsys.readouterr().err
    assert "another tower" in err
    assert "--weights random:0" in err


def test_text_image_recall_against_brute_force():
    """Any-hit recall by definition, with several captions per image (random embeddings)."""
    rng = np.random.default_rng(0)
    img, txt = rng.normal(size=(7, 4)), rng.normal(size=(15, 4))
    t_img = np.r_[np.arange(7), rng.integers(0, 7, 8)]
    got = text_image_recall(img, txt, t_img, [1, 3])
    s = (txt / np.linalg.norm(txt, axis=1, keepdims=True)) @ (img / np.linalg.norm(img, axis=1, keepdims=True)).T
    for k in (1, 3):
        t2i = np.mean([t_img[t] in set(np.argsort(-s[t])[:k]) for t in range(15)])
        i2t = np.mean([bool(set(np.argsort(-s[:, i])[:k]) & set(np.flatnonzero(t_img == i))) for i in range(7)])
        assert got[f"t2i_recall@{k}"] == t2i
        assert got[f"i2t_recall@{k}"] == i2t


DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _hf_captions(i: int) -> list[str]:
    """Captions, each unique, that the tiny HF tokenizer tells apart: its vocabulary is digit words
    and single digits (Fashion-MNIST's class names and two-digit numbers would be <unk>), and with
    its end-of-text id 2 HF's CLIP pools each caption at its highest token id (the legacy rule), so
    every caption ends in "9", the highest id it holds: each then pools over the whole caption."""
    a, b = DIGITS[i // 10], DIGITS[i % 10]
    out = [f"a photo of a {a} {b} 9", f"picture number {a} {b} 9"]
    return out + ([f"a small {a} {b} drawing 9"] if i % 3 == 0 else [])


@pytest.mark.slow
def test_hf_clip_text_tower_recall_equals_clip_benchmark(data):
    """The same recall through a Hugging Face CLIPModel (a tiny config saved with save_pretrained):
    captions through featcache's hf: text tower, against CLIP_benchmark's evaluate with HF's own
    ``get_text_features`` on the same image embeddings."""
    from model_source_fixtures import save_tiny_hf_clip
    from transformers import AutoTokenizer, CLIPModel

    tmp, _, rows = data
    rows = [(im, _hf_captions(i)) for i, (im, _) in enumerate(rows)]
    hf = str(save_tiny_hf_clip(tmp / "hf"))
    # the tiny config's eos id (CLIP's 49407) is outside its 1,000-word vocabulary: HF then pools
    # every caption at position 0 (the start token) and all text embeddings are equal; give it the
    # tokenizer's own ids
    cfg = CLIPModel.from_pretrained(hf).config
    cfg.text_config.bos_token_id, cfg.text_config.eos_token_id, cfg.text_config.pad_token_id = 1, 2, 0
    CLIPModel.from_pretrained(hf, config=cfg).save_pretrained(hf)
    m = _manifest(tmp / "hf-manifest", rows)
    cache, results = str(tmp / "hf.zarr"), str(tmp / "hf.parquet")
    model = ["--model", f"hf:{hf}", "--weights", "dir"]
    ex = ["extract", *model, "--data", f"manifest:{m}", "--cache", cache, "--dataset-name", "caps"]
    assert main([*ex, "--backbone-name", "hfc", "--no-progress", "--workers", "0"]) == 0
    emb = ["embed-captions", "--cache", cache, *model, "--dataset", "caps", "--split", "all"]
    assert main([*emb, "--captions", m, "--backbone", "hfc"]) == 0
    rt = ["retrieve-text", "--cache", cache, "--backbone", "hfc", "--dataset", "caps", "--split", "all"]
    assert main([*rt, "--recall-k", "1,2,5", "--results", results]) == 0
    df = read_results(results)
    ours = dict(zip(df["metric"], df["value"]))
    X = open_cache(cache, "r").load("hfc", "caps", "all").X

    ref_model = CLIPModel.from_pretrained(hf).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    texts = [c for _, caps in rows for c in caps]
    assert len(set(texts)) == len(texts)
    with torch.no_grad():  # transformers 5 returns the projected embedding as pooler_output
        out = ref_model.get_text_features(**tok(texts, padding=True, return_tensors="pt"))
        hf_emb = F.normalize(out if torch.is_tensor(out) else out.pooler_output, dim=-1).numpy()
    # 1. the stored caption embeddings are HF's own get_text_features, caption for caption
    emb, image_ids, _ = open_cache(cache, "r").load_caption_embeddings("caps", "all", "hfc")
    assert len(image_ids) == len(texts)
    np.testing.assert_allclose(emb / np.linalg.norm(emb, axis=1, keepdims=True), hf_emb, atol=1e-5)
    assert len({tuple(np.round(e, 6)) for e in hf_emb}) == len(texts)  # no two captions tie
    # 2. recall on those embeddings is CLIP_benchmark's (near-equal random-model scores would let
    # a 1e-7 difference between two text forwards reorder captions, so both sides use the stored ones)
    stored = dict(zip(texts, torch.from_numpy(emb)))
    batches = [(torch.from_numpy(X[i : i + 5]), [c for _, c in rows[i : i + 5]]) for i in range(0, len(rows), 5)]
    ref = clip_benchmark_recall(batches, lambda t: torch.stack([stored[c] for c in t]), [1, 2, 5])
    for k in (1, 2, 5):
        assert ours[f"t2i_recall@{k}"] == pytest.approx(ref[f"image_retrieval_recall@{k}"], abs=1e-6)
        assert ours[f"i2t_recall@{k}"] == pytest.approx(ref[f"text_retrieval_recall@{k}"], abs=1e-6)
    assert 0 < ours["i2t_recall@5"] < 1


@pytest.mark.slow
def test_rerun_skips_a_finished_run_unless_forced(data, tmp_path, monkeypatch, capsys):
    from featcache.retrieval.text import run_text_retrieval
    from featcache.store.cache import FeatureCache

    _, arch, rows = data
    m = _manifest(tmp_path / "manifest", rows)
    cache, results = str(tmp_path / "c.zarr"), str(tmp_path / "c.parquet")
    first, _ = _run(arch, f"manifest:{m}", m, cache, "all", results)
    loads = []
    real_load = FeatureCache.load
    monkeypatch.setattr(FeatureCache, "load", lambda *a, **k: loads.append(a[1:4]) or real_load(*a, **k))
    rt = ["retrieve-text", "--cache", cache, "--backbone", "oc", "--dataset", "caps", "--split", "all"]
    assert main([*rt, "--recall-k", "1,2,5", "--results", results]) == 0  # finished: no image feature read
    assert loads == []
    assert "t2i_recall@2" in capsys.readouterr().out
    again = run_text_retrieval(cache, "oc", "caps", "all", [1, 2, 5], results)
    assert dict(zip(again["metric"], again["value"])) == first
    assert loads == []
    forced = run_text_retrieval(cache, "oc", "caps", "all", [1, 2, 5], results, force=True)
    assert loads == [("oc", "caps", "all")]
    assert dict(zip(forced["metric"], forced["value"])) == pytest.approx(first, abs=0)
    other = run_text_retrieval(cache, "oc", "caps", "all", [1, 3], results)  # other ks: another run
    assert len(loads) == 2
    assert set(other["metric"]) == {"i2t_recall@1", "i2t_recall@3", "t2i_recall@1", "t2i_recall@3"}
    assert read_results(results).height == len(first) + 4
