"""Input sizes a model cannot take (issue 60): refused in one line before any image is read,
naming the sizes the model takes (timm's fixed patch embedding; any other model, whatever its
source, by one blank forward), and the store folder the failed job created is gone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from featcache.errors import BackboneError, ConfigError
from featcache.extract import ExtractConfig, extract
from featcache.models.sizes import fixed_input_size


@pytest.mark.parametrize("size", [32, 112])
@pytest.mark.parametrize("features", [("pooled",), ("pooled", "tokens")])
def test_a_vit_refuses_a_size_its_patch_embedding_cannot_take(tmp_path, size, features):
    cache = tmp_path / "s.zarr"
    cfg = ExtractConfig(
        "vit_tiny_patch16_224", "random:0", "digits", ["test"], str(cache), limit=8, input_size=size,
        features=features, progress=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=f"--input-size {size} is invalid: vit_tiny_patch16_224 takes 224 x 224") as e:
        extract(cfg)
    assert "\n" not in str(e.value)
    assert "dynamic_img_size" in str(e.value)
    assert not cache.exists()  # refused before the split's rows (or any image) were read


def test_dynamic_img_size_takes_any_size():
    import timm

    assert fixed_input_size(timm.create_model("vit_tiny_patch16_224", pretrained=False)) == (224, 224)
    dyn = timm.create_model("vit_tiny_patch16_224", pretrained=False, dynamic_img_size=True)
    assert fixed_input_size(dyn) is None
    assert fixed_input_size(timm.create_model("resnet18", pretrained=False)) is None  # a CNN


class _Flat32(nn.Module):
    """A model that takes 32 x 32 images only (a flattened linear layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3 * 32 * 32, 8)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_a_module_that_cannot_take_the_size_is_refused_in_one_line(tmp_path):
    """A source that cannot tell its sizes (an nn.Module, python:) is tried on a blank batch of the size."""
    cache = tmp_path / "m.zarr"
    kw = {"limit": 8, "progress": False, "threads": 1}
    with pytest.raises(
        BackboneError, match=r"fails on a \[2, 3, 48, 48\] batch .*--input-size: give one it takes"
    ) as e:
        extract(ExtractConfig(_Flat32(), "module", "digits", ["test"], str(cache), input_size=48, **kw))
    assert "\n" not in str(e.value)
    assert not cache.exists()
    (rep,) = extract(ExtractConfig(_Flat32(), "module", "digits", ["test"], str(cache), input_size=32, **kw))
    assert rep.n == 8


def test_a_failed_extract_leaves_no_store_it_created_and_keeps_one_that_existed(tmp_path):
    new = tmp_path / "a" / "b" / "new.zarr"
    kw = {"limit": 8, "input_size": 32, "progress": False, "threads": 1}
    with pytest.raises(Exception, match="unknown model"):
        extract(ExtractConfig("nosuchmodel_xyz", "random:0", "digits", ["test"], str(new), **kw))
    assert not (tmp_path / "a").exists()
    old = tmp_path / "old.zarr"
    extract(ExtractConfig("tf_efficientnet_lite0", "random:0", "digits", ["test"], str(old), **kw))
    before = sorted(p.name for p in old.iterdir())
    with pytest.raises(Exception, match="unknown model"):
        extract(ExtractConfig("nosuchmodel_xyz", "random:0", "digits", ["test"], str(old), **kw))
    assert sorted(p.name for p in old.iterdir()) == before
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing (empty) folder is not this job's to delete
    with pytest.raises(Exception, match="unknown model"):
        extract(ExtractConfig("nosuchmodel_xyz", "random:0", "digits", ["test"], str(empty), **kw))
    assert empty.is_dir()
