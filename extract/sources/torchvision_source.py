"""``torchvision:NAME``: a ``torchvision.models`` builder; the classifier replaced by
``Identity`` (``pooled`` = the pre-logits features), preprocessing from the default weights
enum's own ``transforms()`` (no weights are fetched for it). ``stageN_avg``: the spatial (or
token) mean of the N-th stage of the trunk (``layer1..layerK``, the children of ``features``,
``trunk_output`` or ``encoder.layers``; see :func:`stage_mean`), read with torchvision's own
``create_feature_extractor`` in the same forward as ``pooled``."""

from __future__ import annotations

from typing import Any

from featcache.errors import BackboneError
from featcache.extract import sources as S

_HEADS = ("fc", "classifier", "heads", "head")


def strip_head(model: Any) -> Any:
    """Replace the model's classifier attribute by ``Identity``."""
    import torch.nn as nn

    for attr in _HEADS:
        if isinstance(getattr(model, attr, None), nn.Module):
            setattr(model, attr, nn.Identity())
            return model
    raise BackboneError(f"cannot find the classifier of {type(model).__name__} (looked for {', '.join(_HEADS)})")


def stage_nodes(model: Any) -> list[str]:
    """The module paths of the model's trunk stages, in order (empty: none known)."""
    import torch.nn as nn

    if hasattr(model, "layer1"):
        n = 1
        while hasattr(model, f"layer{n + 1}"):
            n += 1
        return [f"layer{i}" for i in range(1, n + 1)]
    for path in ("features", "trunk_output", "encoder.layers"):
        mod = model.get_submodule(path) if _has(model, path) else None
        if isinstance(mod, nn.Sequential) and len(mod):
            return [f"{path}.{child}" for child, _ in mod.named_children()]
    return []


def _has(model: Any, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _extractor(model: Any, nodes: list[str]) -> Any:
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    output = get_graph_node_names(model)[1][-1]
    return create_feature_extractor(
        model, return_nodes={**{n: f"stage{i}_avg" for i, n in enumerate(nodes)}, output: "pooled"}
    ).eval()


def stage_mean(model: Any) -> Any:
    """A stage's mean over its spatial positions (``[B, C, H, W]``; Swin's ``[B, H, W, C]``)
    or its tokens (ViT ``[B, 1 + N, D]``: the class token left out, as timm's ``stageN_avg``)."""
    import torchvision

    swin = isinstance(model, torchvision.models.SwinTransformer)
    vit = isinstance(model, torchvision.models.VisionTransformer)

    def avg(t: Any) -> Any:
        if t.ndim == 4:
            return t.mean(dim=(1, 2) if swin else (2, 3))
        return (t[:, 1:] if vit else t).mean(dim=1)

    return avg


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **_: Any) -> Any:
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except ValueError:
        raise BackboneError(f"unknown torchvision model {name!r}; see torchvision.models.list_models()") from None
    transform = enum.DEFAULT.transforms()  # pyright: ignore[reportAttributeAccessIssue]  # each weights enum has DEFAULT, the WeightsEnum base not
    seed = S.seed_of(weights, "torchvision")
    model = strip_head(S.seeded(seed, lambda: torchvision.models.get_model(name, weights=None)))
    sha, tag, wfile = S.load_weights(model, weights, "torchvision", name)
    crop = transform.crop_size
    size = (3, int(crop[0]), int(crop[-1]))

    nodes = stage_nodes(model)
    kinds = ("pooled", *(f"stage{i}_avg" for i in range(len(nodes))))
    extractor: list[Any] = []  # built on the first stage request (tracing takes a moment)
    avg = stage_mean(model)

    def features(x: Any, kinds_: Any) -> dict[str, Any]:
        S.check_kinds(kinds_, kinds, f"torchvision:{name}")
        if all(k == "pooled" for k in kinds_):
            return {"pooled": model(x)}
        if not extractor:
            extractor.append(_extractor(model, nodes))
        out = extractor[0](x)
        return {k: out["pooled"] if k == "pooled" else avg(out[k]) for k in kinds_}

    return S.finish(
        source="torchvision",
        name=name,
        model=model,
        transform=transform,
        weights=weights,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=kinds,
        library="torchvision",
        sha=sha,
        tag=tag,
        wfile=wfile,
        input_size=size,
        weights_enum=str(enum.DEFAULT),  # pyright: ignore[reportAttributeAccessIssue]  # as above
    )
