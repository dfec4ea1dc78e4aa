"""``torchvision:NAME``: a ``torchvision.models`` builder; the classifier replaced by
``Identity`` (``pooled`` = the pre-logits features), preprocessing from the default weights
enum's own ``transforms()`` (no weights are fetched for it)."""

from __future__ import annotations

from typing import Any

from featcache.errors import BackboneError
from featcache.extract import sources as S

KINDS = ("pooled",)
_HEADS = ("fc", "classifier", "heads", "head")


def strip_head(model: Any) -> Any:
    """Replace the model's classifier attribute by ``Identity``."""
    import torch.nn as nn

    for attr in _HEADS:
        if isinstance(getattr(model, attr, None), nn.Module):
            setattr(model, attr, nn.Identity())
            return model
    raise BackboneError(f"cannot find the classifier of {type(model).__name__} (looked for {', '.join(_HEADS)})")


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **_: Any) -> Any:
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except ValueError:
        raise BackboneError(f"unknown torchvision model {name!r}; see torchvision.models.list_models()") from None
    transform = enum.DEFAULT.transforms()
    seed = S.seed_of(weights, "torchvision")
    model = strip_head(S.seeded(seed, lambda: torchvision.models.get_model(name, weights=None)))
    sha, tag, wfile = S.load_weights(model, weights, "torchvision", name)
    crop = transform.crop_size
    size = (3, int(crop[0]), int(crop[-1]))

    def features(x: Any, kinds: Any) -> dict[str, Any]:
        S.check_kinds(kinds, KINDS, f"torchvision:{name}")
        return {"pooled": model(x)}

    return S.finish(
        source="torchvision",
        name=name,
        model=model,
        transform=transform,
        weights=weights,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=KINDS,
        library="torchvision",
        sha=sha,
        tag=tag,
        wfile=wfile,
        input_size=size,
        weights_enum=str(enum.DEFAULT),
    )
