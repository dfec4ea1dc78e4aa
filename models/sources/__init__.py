"""Model sources: where a backbone comes from (``--model SOURCE:NAME``).

A bare name (or ``timm:NAME``) is a timm model, built exactly as before; every other source
is one module here plus its :func:`register_source` entry:

``torchvision:NAME``
    a ``torchvision.models`` builder; preprocessing from the weights enum's ``transforms()``.
``open_clip:ARCH``
    open_clip's image tower (``encode_image``) with open_clip's own eval transform; its text
    tower embeds class names (``featcache embed-classes``).
``hf:DIR``
    a ``transformers`` model saved with ``save_pretrained`` (``CLIPModel``, ``Dinov2Model``,
    any ``AutoModel`` vision model) with the directory's image processor.
``python:MODULE:CALLABLE``
    a user factory returning an ``nn.Module`` (or ``(module, transform)``,
    ``(module, transform, width)`` or a dict with those keys).

In Python, ``ExtractConfig(model=<nn.Module>)`` uses the module itself.

Each source builds a :class:`~featcache.models.model.Backbone` whose ``features_fn``
computes the feature kinds it declares and whose ``data_config`` records the source, the
architecture, the library and its version (part of the stored identity, so a resume with
another source or library version is refused).
"""

from __future__ import annotations

import hashlib
import importlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from featcache.core.registry import Registry
from featcache.errors import BackboneError, ConfigError
from featcache.models.sources.tokens import check_kinds

SourceBuilder = Callable[..., Any]
#: what a source lists for ``featcache models``: ``(model, weights, cached)`` rows (``cached``
#: None: not known offline); it imports its library, so an ImportError means "not installed"
Lister = Callable[[], Iterator[tuple[str, str, "bool | None"]]]

__all__ = [
    "LISTINGS",
    "SOURCES",
    "Lister",
    "SourceBuilder",
    "SourceRules",
    "as_mapping",
    "builder",
    "check_kinds",
    "data_config",
    "finish",
    "input_size_of",
    "list_sources",
    "load_weights",
    "model_help",
    "parse_model",
    "register_source",
    "require",
    "seed_of",
    "seeded",
    "source_rules",
    "state_sha256",
    "store_key",
]
#: every model source but timm (the default, no prefix needed): its ``build``, imported when the
#: source is first used (so ``--help`` stays fast), with how the ``--model`` help names it
SOURCES: Registry[SourceBuilder] = Registry("model source", BackboneError)
#: the sources ``featcache models`` lists (timm first), each one's :data:`Lister`, imported on first use
LISTINGS: Registry[Lister] = Registry("model listing", ConfigError)
LISTINGS.register("timm", "featcache.models.backbones:list_pretrained")
_EXTRAS = {"open_clip": "clip", "hf": "hf"}
_KEY_BAD = re.compile(r"[^A-Za-z0-9_.@+=-]")


@dataclass(frozen=True)
class SourceRules:
    """What featcache does with a source's models outside its ``build``, kept on its registration.

    ``weights``: the weights a model named without them gets (a model list's ``MODEL`` line, a
    bare ``--model``): a string, a function of the model name (which may refuse with a
    :class:`ConfigError` saying what to name), or ``None``: none, the user names them (a
    ConfigError says so; never a silent default). ``preprocessing``: featcache builds the
    model's preprocessing, so ``input_size``, ``pre_resize`` and ``resize`` apply (and ``resize``
    is recorded with its features); else the source's library preprocesses and they are refused."""

    weights: str | Callable[[str], str] | None = None
    preprocessing: bool = False

    def default_weights(self, model: str) -> str:
        """The weights ``model`` gets when none are named, or a ConfigError saying to name them."""
        if self.weights is None:
            raise ConfigError(f"{model}: its model source has no default weights; name them (MODEL WEIGHTS)")
        return self.weights(model) if callable(self.weights) else self.weights


#: the rules of the models not built by a registered source: timm's (the default source) and an
#: ``nn.Module`` given in Python (``"module"``)
BUILTIN_RULES = {"timm": SourceRules("pretrained", preprocessing=True), "module": SourceRules(preprocessing=True)}


def source_rules(source: str) -> SourceRules:
    """The :class:`SourceRules` of ``source`` (as :func:`parse_model` names it)."""
    if source in BUILTIN_RULES:
        return BUILTIN_RULES[source]
    return SOURCES.entry(source).info


def register_source(
    name: str,
    module: str,
    *,
    usage: str | None = None,
    note: str = "",
    listing: str | None = None,
    weights: str | Callable[[str], str] | None = None,
    preprocessing: bool = False,
) -> None:
    """Register source ``name`` whose ``build(name, weights, device=...)`` lives in ``module``
    (imported only when the source is used, so ``--help`` stays fast). ``usage``: how the
    ``--model`` help names it (default ``NAME:MODEL``), ``note``: a short gloss there;
    ``listing``: ``"module:function"`` of its :data:`Lister` (``featcache models``; None: it
    lists nothing); ``weights`` and ``preprocessing``: its :class:`SourceRules` (default: no
    default weights, the library's own preprocessing). A name taken by another module is
    refused; the same module again is a no-op."""
    if name in BUILTIN_RULES:
        raise BackboneError(
            SOURCES.duplicate.format(kind=SOURCES.kind, name=name, by="featcache.models.backbones, the default source")
        )
    rules = SourceRules(weights, preprocessing)
    SOURCES.register(name, f"{module}:build", usage=usage or f"{name}:MODEL", note=note, info=rules)
    if listing is not None:
        LISTINGS.register(name, listing)


def model_help() -> str:
    """The ``--model`` help: timm's names, then every registered source's usage, ``|``-separated."""
    usages = [e.help() for e in SOURCES.entries()]
    return " | ".join(["timm model name (e.g. tf_efficientnet_lite0)", "timm:NAME", *usages]) + (
        "; in Python also an nn.Module"
    )


def list_sources() -> list[str]:
    """Registered model sources (``timm`` included)."""
    return sorted(["timm", *SOURCES])


def parse_model(model: Any) -> tuple[str, Any]:
    """``(source, name)`` of a ``--model`` value: ``"timm"`` for a bare name, ``"module"``
    for an ``nn.Module`` object."""
    if not isinstance(model, str):
        return "module", model
    prefix, sep, rest = model.partition(":")
    if sep and prefix == "timm":
        return "timm", rest
    if sep and prefix in SOURCES:
        if not rest:
            raise BackboneError(f"--model {model!r} names no model after '{prefix}:'")
        return prefix, rest
    if sep and prefix not in TIMM_PREFIXES:
        raise BackboneError(unknown_source(prefix))
    return "timm", model


#: ``--model`` prefixes timm itself reads (``hf-hub:ORG/NAME``, ``local-dir:DIR``)
TIMM_PREFIXES = ("hf-hub", "hf_hub", "local-dir")


def unknown_source(prefix: str) -> str:
    """One line: the unknown source, the registered ones and the close matches."""
    import difflib

    known = ["timm", *SOURCES]
    close = difflib.get_close_matches(prefix, [*known, *TIMM_PREFIXES], n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(f'{c}:' for c in close)}?" if close else ""
    return f"unknown model source {prefix!r} ({', '.join(known)}){hint}"


def close_names(name: str, names: Any, what: str, listing: str) -> str:
    """One line: ``name`` is not among ``names`` (a library's list), with close matches."""
    import difflib

    close = difflib.get_close_matches(name, list(names), n=6, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"see {listing}"
    return f"unknown {what} {name!r}; {hint}"


def builder(source: str) -> SourceBuilder:
    """The ``build`` function of a registered source (its module imported now)."""
    return SOURCES.resolve(source)


def require(module: str, source: str) -> Any:
    """Import an optional library, or one line naming the ``pip install`` to run."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = _EXTRAS.get(source)
        what = f"featcache[{extra}]" if extra else module
        raise BackboneError(f"model source {source!r} needs {module}: pip install '{what}'") from None


def store_key(source: str, name: str, weights_tag: str) -> str:
    """A store-safe default backbone key, e.g. ``open_clip-ViT-B-32@random0``."""
    return _KEY_BAD.sub("_", f"{source}-{name}") + weights_tag


def state_sha256(model: Any) -> str:
    """SHA-256 over a module's state dict (names, dtypes, shapes, bytes), in key order."""
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(-1).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def seed_of(weights: str, source: str) -> int | None:
    """The seed of a ``random:SEED`` weights string, else None."""
    if not weights.startswith("random:"):
        return None
    try:
        return int(weights.split(":", 1)[1])
    except ValueError:
        raise BackboneError(f"random weights need an integer seed, e.g. 'random:0'; got {weights!r}") from None


def load_weights(
    model: Any, weights: str, source: str, name: str, *, drop: tuple[str, ...] = ()
) -> tuple[str, str, str | None]:
    """Apply ``weights`` (a ``random:SEED`` model is built seeded by the caller; a checkpoint
    path is loaded strictly) -> ``(sha256, key tag, weights file)``. ``drop``: module paths
    replaced by ``Identity`` (a classifier) whose checkpoint keys are dropped, as timm drops
    the classifier of a ``num_classes=0`` model."""
    from pathlib import Path

    from featcache.models import weights as _w

    if seed_of(weights, source) is not None:
        seed = seed_of(weights, source)
        return hashlib.sha256(f"random:{seed}".encode()).hexdigest(), f"@random{seed}", None
    p = Path(weights).expanduser()
    if p.is_file():
        sha = _w.checked_sha256(p, f"--model {source}:{name} --weights {p}")
        sd = _w.unwrap_state_dict(_w.read_state_dict(p), str(p))
        sd = {k: v for k, v in sd.items() if not any(k == d or k.startswith(d + ".") for d in drop)}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise BackboneError(
                f"{p} does not fit {source}:{name} (missing {list(missing)[:5]}, unexpected "
                f"{list(unexpected)[:5]}); pass the checkpoint of this architecture"
            )
        return sha, f"@{p.stem}", str(p)
    raise BackboneError(
        f"{source}:{name} needs weights='random:SEED', a checkpoint file (.pth/.safetensors) or one of "
        f"the library's own weight names; got {weights!r}"
    )


def data_config(source: str, arch: str, library: str, input_size: Any, transform: Any, **more: Any) -> dict[str, Any]:
    """The recorded preprocessing and provenance of a non-timm backbone."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        lib_version = version(library)
    except PackageNotFoundError:
        lib_version = ""
    return {
        "source": source,
        "arch": arch,
        "library": library,
        "library_version": lib_version,
        "input_size": tuple(int(s) for s in input_size),
        "transform": repr(transform),
        **more,
    }


def seeded(seed: int | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``torch.manual_seed(seed)`` (global RNG restored), or plainly."""
    import torch

    if seed is None:
        return fn()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def input_size_of(transform: Any, default: int = 224) -> tuple[int, int, int]:
    """(3, H, W) from a transform's CenterCrop / Resize size."""
    for step in getattr(transform, "transforms", [transform]):
        size = getattr(step, "size", None) or getattr(step, "crop_size", None)
        if type(step).__name__ in ("CenterCrop", "ImageClassification") and size:
            s = size if isinstance(size, (list, tuple)) else (size, size)
            s = tuple(s) * (2 if len(s) == 1 else 1)
            return (3, int(s[0]), int(s[1]))
    return (3, default, default)


def as_mapping(obj: Any) -> Mapping[str, Any]:
    return obj if isinstance(obj, Mapping) else {}


def _open_clip_weights(model: str) -> str:
    """open_clip: an ``hf-hub:`` model's weights come with it (``timm``); any other names its tag."""
    if not model.startswith("open_clip:hf-hub:"):
        raise ConfigError(f"{model}: name its pretrained tag (see `featcache models --source open_clip`)")
    return "timm"


for _name, _usage, _note, _lists, _weights, _pre in (
    ("torchvision", "torchvision:NAME", "", True, "DEFAULT", False),
    ("open_clip", "open_clip:ARCH", "", True, _open_clip_weights, False),
    ("hf", "hf:DIR", "save_pretrained", True, "dir", False),
    ("python", "python:MODULE:CALLABLE", "an nn.Module factory", False, "pretrained", True),
):
    _module = f"featcache.models.sources.{_name}_source"
    register_source(
        _name,
        _module,
        usage=_usage,
        note=_note,
        listing=f"{_module}:list_models" if _lists else None,
        weights=_weights,
        preprocessing=_pre,
    )


def describe(out: Any) -> str:
    """What a forward returned, in a few words (``tuple``, ``4-D tensor [2, 8, 3, 3]``)."""
    import torch

    if torch.is_tensor(out):
        return f"{out.ndim}-D tensor {list(out.shape)}"
    return type(out).__name__


def probe_width(features_fn: Callable[[Any, Any], dict[str, Any]], x: Any, name: str) -> int:
    """The feature width from one forward of a 2-image batch, refusing in one line anything
    but a ``[B, D]`` tensor (a tuple, a dict, a feature map) and a forward that fails."""
    import torch

    try:
        out = features_fn(x, ["pooled"])["pooled"]
    except NotImplementedError as exc:  # nn.Module without forward
        raise BackboneError(f"{name} has no forward(); it must return a [B, D] tensor ({exc})") from None
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise BackboneError(
            f"{name} fails on a [2, {', '.join(map(str, x.shape[1:]))}] batch ({type(exc).__name__}: {first}); "
            "it must take preprocessed images of this size (--input-size: give one it takes) and return a [B, D] tensor"
        ) from None
    if not torch.is_tensor(out) or out.ndim != 2 or out.shape[0] != x.shape[0]:
        raise BackboneError(
            f"{name} must return a [B, D] tensor; got {describe(out)} (pool or flatten inside the module, "
            "e.g. return features.flatten(1), or return the tensor out of a tuple/dict)"
        )
    return int(out.shape[-1])


def finish(
    *,
    source: str,
    name: str,
    model: Any,
    transform: Any,
    weights: str,
    device: str,
    trainable: bool,
    features_fn: Callable[[Any, Any], dict[str, Any]],
    kinds: tuple[str, ...],
    library: str,
    sha: str,
    tag: str,
    wfile: str | None,
    text_tower: Any = None,
    input_size: Any = None,
    key_name: str | None = None,
    layers: Any = None,
    **more: Any,
) -> Any:
    """The :class:`Backbone` of a non-timm source: eval mode, ``requires_grad=trainable``,
    transform ``ToRGB`` + the library's own, feature width from one forward."""
    import torch
    from torchvision import transforms as T

    from featcache.models.model import Backbone, ToRGB, backbone_device

    dev = backbone_device(device)
    model = model.to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(trainable)
    size = tuple(input_size) if input_size is not None else input_size_of(transform)
    cfg = data_config(source, name, library, size, transform, **more)
    with torch.inference_mode():
        dim = probe_width(features_fn, torch.zeros((2, *size), device=dev), f"{source}:{name}")
    return Backbone(
        name=f"{source}:{name}",
        model=model,
        data_config=cfg,
        transform=T.Compose([ToRGB(), transform]),
        weights_source=weights,
        weights_sha256=sha,
        feature_dim=dim,
        default_key=store_key(source, key_name or name, tag),
        weights_file=wfile,
        device=dev,
        features_fn=features_fn,
        kinds=kinds,
        source=source,
        text_tower=text_tower,
        layers=layers,
    )
