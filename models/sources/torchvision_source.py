"""``torchvision:NAME``: a ``torchvision.models`` builder; the classifier replaced by
``Identity`` (``pooled`` = the pre-logits features), preprocessing from the weights enum's own
``transforms()`` (of the named weights, else ``DEFAULT``). ``--weights IMAGENET1K_V2`` (an enum
member) is downloaded by torchvision into torch hub's cache (``TORCH_HOME``). ``stageN_avg``: the spatial (or
token) mean of the N-th stage of the trunk (``layer1..layerK``, the children of ``features``,
``trunk_output`` or ``encoder.layers``; see :func:`stage_mean`), read with torchvision's own
``create_feature_extractor`` in the same forward as ``pooled``."""

from __future__ import annotations

from typing import Any

from featcache.errors import BackboneError, WeightsNotFoundError
from featcache.models import sources as S

_HEADS = ("fc", "classifier", "heads", "head")


def head_of(model: Any) -> str:
    """The attribute holding the model's classifier."""
    import torch.nn as nn

    for attr in _HEADS:
        if isinstance(getattr(model, attr, None), nn.Module):
            return attr
    raise BackboneError(f"cannot find the classifier of {type(model).__name__} (looked for {', '.join(_HEADS)})")


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


def _enum_weights(enum: Any, weights: str, name: str) -> Any:
    """The torchvision weights enum member ``weights`` names (``IMAGENET1K_V2``, ``DEFAULT``,
    ``ResNet50_Weights.IMAGENET1K_V2``), or None for random/checkpoint weights."""
    from pathlib import Path

    from featcache.models.weights import CHECKPOINT_SUFFIXES

    p = Path(weights).expanduser()
    if S.seed_of(weights, "torchvision") is not None or p.suffix in CHECKPOINT_SUFFIXES or p.exists():
        return None
    owner, _, tag = weights.rpartition(".")
    members = {m.name: m for m in enum}
    if owner in ("", enum.__name__) and (tag in members or tag == "DEFAULT"):
        return enum.DEFAULT if tag == "DEFAULT" else members[tag]
    raise BackboneError(
        f"torchvision:{name} has no weights {weights!r}; its {enum.__name__} offers {', '.join(members)} "
        "(or DEFAULT), else give random:SEED or a checkpoint file"
    )


def _download(member: Any, name: str, offline: bool) -> Any:
    """The enum's checkpoint through torch hub's own cache (``TORCH_HOME/hub/checkpoints``):
    ``member.get_state_dict`` downloads it unless cached; offline, only the cache is read."""
    import os

    import torch

    from featcache.models.sources import hub

    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(member.url))
    if not os.path.isfile(path):
        if hub.is_offline(offline):
            raise WeightsNotFoundError(
                f"torchvision:{name} weights {member} are not in torch hub's cache ({path}) and downloads are off "
                f"(--offline / HF_HUB_OFFLINE=1); on a connected machine run `featcache fetch-weights "
                f"--model torchvision:{name} --weights {member.name}` and copy TORCH_HOME here"
            )
        member.get_state_dict(progress=False, check_hash=True)
    return path


def build(
    name: str, weights: str, *, device: str = "cpu", trainable: bool = False, offline: bool = False, **_: Any
) -> Any:
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(name)
    except ValueError:
        raise BackboneError(
            S.close_names(
                name, torchvision.models.list_models(), "torchvision model", "torchvision.models.list_models()"
            )
        ) from None
    member = _enum_weights(enum, weights, name)
    transform = (member or enum.DEFAULT).transforms()  # pyright: ignore[reportAttributeAccessIssue]  # each weights enum has DEFAULT, the WeightsEnum base not
    seed = S.seed_of(weights, "torchvision")
    more: dict[str, Any] = {}
    if member is not None:  # torchvision's own builder with its weights (read from torch hub's cache)
        from featcache.models import weights as _w

        path = _download(member, name, offline)
        model = torchvision.models.get_model(name, weights=member)
        sha, tag, wfile = _w.file_sha256(path), f"@{member.name}", path
        more = {"weights_enum": str(member), "weights_url": member.url}
    else:
        model = S.seeded(seed, lambda: torchvision.models.get_model(name, weights=None))
    head = head_of(model)
    model = strip_head(model)
    if member is None:
        sha, tag, wfile = S.load_weights(model, weights, "torchvision", name, drop=(head,))
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
        **more,
    )
