"""``python:MODULE:CALLABLE``: a user factory returning an ``nn.Module`` whose output is the
``pooled`` feature, or ``(module, transform[, width])`` or a dict with keys ``model``,
``transform``, ``width``. Without a transform, timm's default eval data config (ImageNet
mean/std, 224 px) is used. ``ExtractConfig(model=<nn.Module>)`` goes through :func:`from_module`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from featcache.errors import BackboneError
from featcache.models import sources as S

KINDS = ("pooled",)


def _default_transform(input_size: Any = None, pre_resize: Any = None, resize: Any = None) -> tuple[Any, dict]:
    """timm's default eval transform (ImageNet mean/std, 224 px, or ``input_size``), which
    featcache builds for a module that brings none, and its data config."""
    from timm.data.config import resolve_data_config
    from timm.data.constants import DEFAULT_CROP_PCT

    from featcache.models.model import make_data_config, make_transform

    cfg = make_data_config(
        resolve_data_config(args={"crop_pct": DEFAULT_CROP_PCT}),
        input_size=input_size,
        pre_resize=pre_resize,
        resize=resize,
    )
    return make_transform(cfg), cfg


def _unpack(obj: Any) -> tuple[Any, Any, int | None]:
    if isinstance(obj, Mapping):
        return obj.get("model"), obj.get("transform"), obj.get("width")
    if isinstance(obj, tuple):
        padded = (*obj, None, None)
        return padded[0], padded[1], padded[2]
    return obj, None, None


def _check_module(model: Any, name: str) -> None:
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise BackboneError(f"{name} must give an nn.Module (or (module, transform)); got {type(model).__name__}")
    if type(model).forward is nn.Module.forward:
        raise BackboneError(f"{name}: {type(model).__name__} has no forward(); it must return a [B, D] tensor")


def from_module(
    obj: Any,
    weights: str,
    *,
    device: str = "cpu",
    trainable: bool = False,
    name: str = "",
    seed: int | None = None,
    input_size: Any = None,
    pre_resize: Any = None,
    resize: Any = None,
    **_: Any,
):
    model, transform, _width = _unpack(obj)
    label = f"python:{name}" if name else "the model"
    _check_module(model, label)
    name = name or type(model).__name__
    source = "python" if ":" in name else "module"
    more: dict[str, Any] = {}
    if transform is None:
        transform, tcfg = _default_transform(input_size, pre_resize, resize)
        more = {
            "preprocess": "featcache (timm default eval config)",
            **{k: tcfg[k] for k in ("crop_pct", "mean", "std")},
        }
        if tcfg.get("pre_resize"):
            more["pre_resize"] = tcfg["pre_resize"]
        if tcfg.get("resize"):
            more["resize"] = tcfg["resize"]
        input_size = tcfg["input_size"]
    elif input_size is not None or pre_resize is not None or resize not in (None, "timm"):
        raise BackboneError(
            f"{label} brings its own transform, so --input-size/--pre-resize/--resize do not apply; "
            "drop the option or change the factory's transform"
        )
    if seed is not None:  # the factory ran seeded: record the seed, hash the weights it made
        sha, tag, wfile = S.state_sha256(model), f"@random{seed}", None
    elif weights not in ("timm", "module"):
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
        input_size=input_size,
        module_class=f"{type(model).__module__}.{type(model).__qualname__}",
        **more,
    )


def _import(mod: str, name: str) -> Any:
    """Module ``mod``: a dotted import name, or a ``.py`` file path (imported under its stem)."""
    import importlib.util
    import sys
    from pathlib import Path

    if mod.endswith(".py") or "/" in mod or "\\" in mod:
        path = Path(mod).expanduser()
        if not path.is_file():
            raise BackboneError(
                f"python:{name}: no file {str(path)!r} (give python:FILE.py:CALLABLE or MODULE:CALLABLE)"
            )
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise BackboneError(f"python:{name}: cannot import {str(path)!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)  # picklable classes for DataLoader workers
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(mod)


def _call(factory: Any, name: str, seed: int | None) -> Any:
    """The factory's result; whatever it raises (or exits with) becomes one line."""
    if not callable(factory):
        raise BackboneError(f"python:{name} is a {type(factory).__name__}, not a callable returning an nn.Module")
    try:
        return S.seeded(seed, factory)
    except BaseException as exc:  # SystemExit (builtins:exit) and KeyboardInterrupt included
        if isinstance(exc, KeyboardInterrupt):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise BackboneError(
            f"python:{name} raised {type(exc).__name__} ({first}) when called with no arguments; "
            "name a factory that takes none and returns an nn.Module"
        ) from None


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **kw: Any) -> Any:
    """``python:MODULE:CALLABLE`` / ``python:FILE.py:CALLABLE``: runs the named code (imports
    the module, calls the factory), so name only code you trust."""
    mod, sep, attr = name.rpartition(":")
    if not sep or not mod or not attr:
        raise BackboneError(
            f"--model python:{name} must be python:MODULE:CALLABLE or python:FILE.py:CALLABLE, e.g. python:mypkg.nets:make_net"
        )
    try:
        factory = getattr(_import(mod, name), attr)
    except (ImportError, AttributeError) as e:
        raise BackboneError(f"cannot load python:{name} ({e}); is {mod} importable (PYTHONPATH)?") from None
    seed = S.seed_of(weights, "python")
    obj = _call(factory, name, seed)
    return from_module(obj, weights, device=device, trainable=trainable, name=name, seed=seed, **kw)
