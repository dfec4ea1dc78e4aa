"""``python:MODULE:CALLABLE``: a user factory returning an ``nn.Module`` whose output is the
``pooled`` feature, or ``(module, transform[, width])`` or a dict with keys ``model``,
``transform``, ``width``. Without a transform, timm's default eval data config (ImageNet
mean/std, 224 px) is used. ``ExtractConfig(model=<nn.Module>)`` goes through :func:`from_module`."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from featcache.errors import BackboneError
from featcache.extract import sources as S

KINDS = ("pooled",)


def _default_transform() -> Any:
    from timm.data.config import resolve_data_config
    from timm.data.constants import DEFAULT_CROP_PCT

    from featcache.extract.model import make_transform

    return make_transform(resolve_data_config(args={"crop_pct": DEFAULT_CROP_PCT}))


def _unpack(obj: Any) -> tuple[Any, Any, int | None]:
    if isinstance(obj, Mapping):
        return obj.get("model"), obj.get("transform"), obj.get("width")
    if isinstance(obj, tuple):
        padded = (*obj, None, None)
        return padded[0], padded[1], padded[2]
    return obj, None, None


def from_module(obj: Any, weights: str, *, device: str = "cpu", trainable: bool = False, name: str = "", **_: Any):
    import torch.nn as nn

    model, transform, _width = _unpack(obj)
    if not isinstance(model, nn.Module):
        raise BackboneError(f"expected an nn.Module (or (module, transform)); got {type(model).__name__}")
    name = name or type(model).__name__
    source = "python" if ":" in name else "module"
    transform = transform or _default_transform()
    if weights not in ("timm", "module"):
        sha, tag, wfile = S.load_weights(model, weights, source, name)
    else:
        sha, tag, wfile = S.state_sha256(model), "", None
    tag = tag or f"@{sha[:8]}"

    def features(x: Any, kinds: Any) -> dict[str, Any]:
        S.check_kinds(kinds, KINDS, name)
        return {"pooled": model(x)}

    return S.finish(
        source=source,
        name=name,
        model=model,
        transform=transform,
        weights=weights,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=KINDS,
        library="torch",
        sha=sha,
        tag=tag,
        wfile=wfile,
        module_class=f"{type(model).__module__}.{type(model).__qualname__}",
    )


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **kw: Any) -> Any:
    mod, sep, attr = name.rpartition(":")
    if not sep or not mod:
        raise BackboneError(f"--model python:{name} must be python:MODULE:CALLABLE, e.g. python:mypkg.nets:make_net")
    try:
        factory = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise BackboneError(f"cannot load python:{name} ({e}); is {mod} importable (PYTHONPATH)?") from None
    seed = S.seed_of(weights, "python")
    obj = S.seeded(seed, factory)
    return from_module(obj, weights if seed is None else "module", device=device, trainable=trainable, name=name)
