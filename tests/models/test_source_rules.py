"""A model source's rules are part of its registration: the weights a model named without them
gets (none unless the source says: never a silent ``pretrained``) and whether featcache builds
its preprocessing (``input_size``/``pre_resize``/``resize`` apply and ``resize`` is recorded)."""

from __future__ import annotations

import importlib
import sys

import pytest

from featcache.errors import BackboneError, ConfigError
from featcache.extract import ExtractConfig
from featcache.models import catalog, sources
from featcache.models.backbones import create_backbone

PLUGIN = """
from featcache.models.sources import register_source

BUILT = []
NAMES = ("r46:tiny", "r47:tiny")


def build(name, weights, *, device="cpu", trainable=False, **sizes):
    BUILT.append((name, weights, sizes))
    return "a backbone"


register_source("r46", __name__)
register_source("r47", __name__, weights="random:0", preprocessing=True)
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "fc_r46_source.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with sources.SOURCES.restored():
        yield importlib.import_module("fc_r46_source")
    sys.modules.pop("fc_r46_source", None)


def test_a_source_registered_without_weights_has_none_to_default_to(plugin, tmp_path):
    models = tmp_path / "models.txt"
    models.write_text("r47:tiny\nr46:tiny random:1\n")
    assert catalog.read_list(str(models)) == [("r47:tiny", "random:0"), ("r46:tiny", "random:1")]
    models.write_text("r46:tiny\n")
    with pytest.raises(ConfigError, match=r"r46:tiny: its model source has no default weights; name them"):
        catalog.read_list(str(models))


def test_the_builtin_sources_keep_their_defaults():
    assert [catalog.default_weights(m) for m in ("lite0", "hf:d", "torchvision:r18", "open_clip:hf-hub:o/m")] == [
        "pretrained",
        "dir",
        "DEFAULT",
        "timm",
    ]
    assert catalog.default_weights("python:m:f") == "pretrained"
    with pytest.raises(ConfigError, match="name its pretrained tag"):
        catalog.default_weights("open_clip:ViT-B-32")


def test_preprocessing_rule_decides_which_sizes_a_source_takes(plugin, tmp_path):
    assert create_backbone("r47:tiny", "random:0", input_size=64) == "a backbone"
    assert plugin.BUILT[-1][:2] == ("tiny", "random:0")
    assert plugin.BUILT[-1][2]["input_size"] == 64
    with pytest.raises(BackboneError, match="input_size apply to timm models"):
        create_backbone("r46:tiny", "random:0", input_size=64)
    recorded = {
        m: ExtractConfig(m, "random:0", "digits", cache=str(tmp_path / "c.zarr")).recorded() for m in plugin.NAMES
    }
    assert "resize" in recorded["r47:tiny"]
    assert "resize" not in recorded["r46:tiny"]
