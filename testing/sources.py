"""The contract of a model source (``--model NAME:...``), for a source written outside this
repository as for the built-in ones (tests/models/test_model_sources.py runs it on each)::

    from featcache.testing import check_source


    def test_my_source(tmp_path):
        ref = lambda x: my_library.load("tiny").eval()(x)  # the library's own forward
        check_source("mysrc:tiny", "random:0", ref, tmp_path / "c.zarr")

:func:`check_source` extracts a few images of a dataset through featcache (extract -> store),
loads them back and checks the store's key, shape and provenance, that a second run resumes
with nothing to compute, and that the features equal ``reference`` on the same preprocessed
batch (bit-identical on CPU fp32 unless a tolerance is given). Needs no pytest: each check is a
``numpy.testing`` assertion.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from featcache.models.model import Backbone
    from featcache.store import FeatureProvenance, Features

__all__ = ["SourceCheck", "check_source", "source_batch"]


@dataclass(frozen=True)
class SourceCheck:
    """What :func:`check_source` extracted: the backbone, its key in the store, the features
    loaded back and their provenance record."""

    backbone: Backbone
    key: str
    features: Features
    provenance: FeatureProvenance


def source_batch(backbone: Backbone, data: str = "digits", split: str = "test", n: int = 6) -> torch.Tensor:
    """The first ``n`` images of ``data``'s ``split`` through ``backbone``'s own transform, stacked
    (the batch featcache's extraction feeds the model)."""
    import torch

    from featcache.data import open_dataset

    src = open_dataset(data)[split]
    return torch.stack([backbone.transform(src.load(i)) for i in range(n)])


def check_source(
    model: Any,
    weights: str,
    reference: Callable[[torch.Tensor], torch.Tensor] | None,
    cache: str | os.PathLike,
    *,
    data: str = "digits",
    split: str = "test",
    n: int = 6,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> SourceCheck:
    """Extract ``n`` images of ``data``'s ``split`` with ``model`` (a ``--model`` spec or an
    ``nn.Module``) and ``weights`` into the new store ``cache`` on the CPU in float32, and check
    the round trip: one backbone key, the backbone's ``default_key``; features ``[n,
    feature_dim]``; the weights' digest and (for a source other than timm) the source, library
    version and model name in the provenance; a second run computes nothing; and, given
    ``reference`` (the library's own forward on a preprocessed batch), features equal to it
    (exactly, or within ``rtol``/``atol``). Raises ``AssertionError`` on a broken promise."""
    from featcache.extract import ExtractConfig, extract
    from featcache.models import create_backbone
    from featcache.store import open_cache

    cfg = ExtractConfig(
        model,
        weights,
        data,
        cache=os.fspath(cache),
        splits=(split,),
        limit=n,
        batch_size=n,
        dtype="float32",
        channels_last=False,
        progress=False,
        device="cpu",
        threads=1,
    )
    extract(cfg)
    bb = create_backbone(model, weights)
    fc = open_cache(cfg.cache, "r")
    keys = sorted({b for b, _, _ in fc.entries()})
    np.testing.assert_equal(keys, [bb.default_key], err_msg="the store's backbone key")
    f = fc.load(bb.default_key, data, split)
    np.testing.assert_equal(f.X.shape, (n, bb.feature_dim), err_msg="features [n, feature_dim]")
    prov = fc.provenance(bb.default_key, data, split, "pooled")
    np.testing.assert_equal(prov.weights_sha256, bb.weights_sha256, err_msg="the weights' digest")
    if bb.source != "timm":
        _check_source_provenance(bb, prov)
    if reference is not None:
        _check_reference(bb, f.X, reference, data, split, n, rtol, atol)
    np.testing.assert_equal(extract(cfg)[0].chunks_computed, 0, err_msg="a second run resumes with nothing to do")
    return SourceCheck(bb, bb.default_key, f, prov)


def _check_source_provenance(bb: Backbone, prov: FeatureProvenance) -> None:
    """The provenance names the source, its library's version and the model."""
    np.testing.assert_equal(prov.data_config.get("source"), bb.source, err_msg="data_config['source']")
    has_version = bool(prov.data_config.get("library_version"))
    np.testing.assert_equal(has_version, True, err_msg="data_config records the library version")
    np.testing.assert_equal(prov.model_name, bb.name, err_msg="the provenance's model name")


def _check_reference(
    bb: Backbone,
    got: np.ndarray,
    reference: Callable[[torch.Tensor], torch.Tensor],
    data: str,
    split: str,
    n: int,
    rtol: float,
    atol: float,
) -> None:
    """``got`` equals ``reference`` on the same preprocessed batch, computed on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            want = reference(source_batch(bb, data, split, n)).float().numpy()
    finally:
        torch.set_num_threads(threads)
    if rtol == 0 and atol == 0:
        np.testing.assert_array_equal(got, want, err_msg="features equal the library's own forward")
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg="features match the library's forward")
