"""``open_clip:ARCH``: open_clip's image tower (``pooled`` = ``encode_image``, the projected
embedding zero-shot uses) with open_clip's own eval transform; the text tower
(``encode_text`` on open_clip's tokenizer) embeds class names. ``stageN_avg`` (a ViT image
tower): the mean of block N's patch tokens, from open_clip's own ``visual.forward_intermediates``
(whose ``image_features`` is then ``pooled``, the same forward). ``blocks:K``, ``tokens``,
``tokens@GxG`` (a class-token ViT tower): from the same ``forward_intermediates`` with its prefix
tokens, each block's output through the tower's final norm ``ln_post``
(:mod:`featcache.models.sources.tokens`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from featcache.core.layers import parse_layer_kind
from featcache.errors import BackboneError
from featcache.models import sources as S
from featcache.models.sources.layers import LayerSet, vit_layer_outputs
from featcache.models.sources.tokens import TOKEN_KINDS, check_blocks, grid_pool, parse_token_kind, token_grid


class OpenClipText:
    """open_clip's text tower: prompts -> ``encode_text`` embeddings (not normalised)."""

    def __init__(self, model: Any, tokenizer: Any, arch: str):
        self.model, self.tokenizer, self.name = model, tokenizer, f"open_clip:{arch}"

    def encode(self, texts: list[str]) -> Any:
        import torch

        dev = next(self.model.parameters()).device
        with torch.inference_mode():
            return self.model.encode_text(self.tokenizer(texts).to(dev)).float()


def _n_blocks(visual: Any) -> int:
    """Blocks of a ViT image tower with ``forward_intermediates`` (0: no stage kinds)."""
    blocks = getattr(getattr(visual, "transformer", None), "resblocks", None)
    return len(blocks) if blocks is not None and hasattr(visual, "forward_intermediates") else 0


def _token_kinds(visual: Any, n_blocks: int) -> tuple[str, ...]:
    """blocks:K, tokens, tokens@GxG for a class-token ViT tower (its ``ln_post`` the final norm);
    none for a tower that pools with attention (CoCa's ``attn_pool``) or is not a ViT."""
    return TOKEN_KINDS if n_blocks and getattr(visual, "attn_pool", None) is None else ()


def _vector_kinds(kinds: Any) -> list[str]:
    """The kinds of the vector path (pooled, stageN_avg)."""
    return [k for k in kinds if parse_token_kind(k) is None and parse_layer_kind(k) is None]


def _layer_set(visual: Any, n_blocks: int) -> LayerSet | None:
    """The resblocks of a class-token ViT tower, through ``ln_post`` (none for CoCa's attention
    pooling or a tower without ``forward_intermediates``)."""
    if not _token_kinds(visual, n_blocks):
        return None
    mods = tuple(f"visual.transformer.resblocks.{i}" for i in range(n_blocks))
    return LayerSet(mods, ("cls", "mean"), norm="visual.ln_post", via="open_clip visual.forward_intermediates")


def _token_outputs(toks: dict[str, tuple[str, int]], normed: list[Any], grid: Any, name: str) -> dict[str, Any]:
    """The token kinds from the last K blocks' outputs through the final norm ``[B, 1 + T, D]``
    (oldest first; one class token first)."""
    import torch

    res = {}
    for k, (kind, n) in toks.items():
        if kind == "blocks":
            res[k] = torch.stack([t[:, 0] for t in normed[len(normed) - n :]], dim=1)
        else:
            patches = normed[-1][:, 1:]
            res[k] = (
                patches if kind == "tokens" else grid_pool(patches, token_grid(patches.shape[1], grid, name), n, name)
            )
    return res


def _check_name(open_clip: Any, name: str) -> None:
    if name.startswith(("hf-hub:", "local-dir:")) or name in open_clip.list_models():
        return
    raise BackboneError(
        S.close_names(name, open_clip.list_models(), "open_clip architecture", "open_clip.list_models()")
    )


def _weights_file(open_clip: Any, name: str, weights: str, offline: bool) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint file to load and what to record: a path as given, an open_clip pretrained
    tag (``laion2b_s34b_b79k``) downloaded by open_clip's own ``download_pretrained`` into the
    hub cache, or None (``random:SEED``; ``hf-hub:`` names, which open_clip loads itself)."""
    from pathlib import Path

    from featcache.models.sources import hub

    if S.seed_of(weights, "open_clip") is not None:
        return None, {}
    p = Path(weights).expanduser()
    if p.is_file():
        return str(p), {}
    tags = open_clip.list_pretrained_tags_by_model(name)
    if weights not in tags:
        hint = f"{name}'s open_clip tags: {', '.join(tags)}" if tags else "open_clip.list_pretrained()"
        raise BackboneError(
            f"open_clip:{name} has no pretrained tag or file {weights!r} (see {hint}); or give random:SEED"
        )
    cfg = open_clip.get_pretrained_cfg(name, weights)
    repo = (cfg.get("hf_hub") or "").rstrip("/").rsplit("/", 1)[0] if cfg.get("hf_hub") else None
    try:
        if hub.is_offline(offline):
            path = cached_file(cfg)
            if path is None:
                raise hub.missing(f"open_clip:{name} ({weights})", f"--model open_clip:{name} --weights {weights}")
        else:
            if cfg.get("hf_hub") and cached_file(cfg) is None:  # a hub that does not answer: now, not in a minute
                hub.check_reachable(
                    *_hub_repo_file(cfg["hf_hub"]),
                    f"open_clip:{name} ({weights})",
                    f"--model open_clip:{name} --weights {weights}",
                )
            path = open_clip.download_pretrained(cfg, cache_dir=str(hub.hf_cache_dir()) if repo else None)
    except Exception as exc:  # hub and network errors of many types
        if isinstance(exc, BackboneError):
            raise
        fetch = f"--model open_clip:{name} --weights {weights}"
        if hub.is_network_error(exc):
            import huggingface_hub.constants as hc  # what open_clip's download asked (read at its import)

            raise hub.unreachable(f"open_clip:{name} ({weights})", fetch, exc, hc.ENDPOINT) from None
        raise BackboneError(f"cannot download open_clip:{name} {weights} ({hub.reason(exc)})") from None
    return path, {"pretrained_tag": weights, "hub_id": repo, "revision": hub.revision_of(path)}


def _hub_repo_file(hf_hub: str) -> tuple[str, str]:
    """(repo, file) of an open_clip ``hf_hub`` entry (``ORG/NAME/`` names its default file)."""
    import os

    if hf_hub.endswith("/"):
        return hf_hub.rstrip("/"), "open_clip_pytorch_model.bin"
    repo, fname = os.path.split(hf_hub.rstrip("/"))
    return repo, fname


def cached_file(cfg: dict[str, Any]) -> str | None:
    """The cached file of an open_clip pretrained config (hub cache or its url's cache)."""
    import os

    from featcache.models.sources import hub

    if cfg.get("hf_hub"):
        from huggingface_hub import try_to_load_from_cache

        repo, fname = _hub_repo_file(cfg["hf_hub"])
        stem = fname.rsplit(".", 1)[0]
        for f in (f"{stem}.safetensors", fname):
            hit = try_to_load_from_cache(repo, f, cache_dir=str(hub.hf_cache_dir()))
            if isinstance(hit, str) and os.path.isfile(hit):
                return hit
    if cfg.get("url"):
        p = os.path.join(os.path.expanduser("~/.cache/clip"), os.path.basename(cfg["url"]))
        return p if os.path.isfile(p) else None
    return None


def _create(open_clip: Any, name: str, path: str | None, seed: int | None) -> tuple[Any, Any]:
    """open_clip's ``create_model_and_transforms`` (its own strict checkpoint loading and key
    conversions); open_clip's "no pretrained weights" warning only where none are loaded."""
    import logging

    quiet = _DropRandomInitWarning() if path is not None or seed is not None else None
    root = logging.getLogger()
    if quiet:
        root.addFilter(quiet)
    try:
        model, _, transform = S.seeded(seed, lambda: open_clip.create_model_and_transforms(name, pretrained=path))
    except RuntimeError as exc:  # a checkpoint of another architecture: strict load_state_dict
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise BackboneError(
            f"{path} does not fit open_clip:{name} ({first}); pass the checkpoint of this architecture"
        ) from None
    finally:
        if quiet:
            root.removeFilter(quiet)
    return model, transform


def _hub_file(repo: str) -> str | None:
    """The cached weights of an open_clip ``hf-hub:`` repo (as open_clip's loader names them)."""
    import os

    from huggingface_hub import try_to_load_from_cache

    from featcache.models.sources import hub

    for f in ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin"):
        hit = try_to_load_from_cache(repo, f, cache_dir=str(hub.hf_cache_dir()))
        if isinstance(hit, str) and os.path.isfile(hit):
            return hit
    return None


class _DropRandomInitWarning:
    def filter(self, record: Any) -> bool:
        return "No pretrained weights loaded" not in str(record.getMessage())


def build(
    name: str, weights: str, *, device: str = "cpu", trainable: bool = False, offline: bool = False, **_: Any
) -> Any:
    from featcache.models.sources import hub

    open_clip = S.require("open_clip", "open_clip")
    _check_name(open_clip, name)
    seed = S.seed_of(weights, "open_clip")
    hub_name = name.startswith("hf-hub:")
    path, more = (None, {}) if hub_name and seed is None else _weights_file(open_clip, name, weights, offline)
    if hub_name and seed is None and hub.is_offline(offline) and _hub_file(name[7:]) is None:
        raise hub.missing(f"open_clip:{name}", f"--model open_clip:{name}")
    from featcache.models import weights as _w

    fetch = f"--model open_clip:{name}" + ("" if hub_name else f" --weights {weights}")
    cached = _hub_file(name[7:]) if hub_name and seed is None else path
    # what the cache holds is checked before open_clip reads it
    checked = {cached: _w.checked_sha256(cached, fetch)} if cached is not None else {}
    with _w.reading(cached, fetch) if cached is not None else contextlib.nullcontext():
        model, transform = _create(open_clip, name, path, seed)
    if hub_name and seed is None:  # open_clip downloaded config and weights itself: record the cached file
        path = _hub_file(name[7:])
        more = {"hub_id": name[7:], "revision": hub.revision_of(path)}
    if seed is not None:
        sha, tag, wfile = S.load_weights(model, weights, "open_clip", name)
    elif path is not None:
        sha, wfile = checked.get(path) or _w.checked_sha256(path, fetch), path
        tag = f"@{more['pretrained_tag']}" if "pretrained_tag" in more else "" if hub_name else f"@{Path(path).stem}"
        more["weight_files"] = {Path(path).name: sha}
    else:
        sha, tag, wfile = S.state_sha256(model), "", None
    size = model.visual.image_size
    size = (3, *(size if isinstance(size, (tuple, list)) else (size, size)))

    n_blocks = _n_blocks(model.visual)
    kinds = ("pooled", *(f"stage{i}_avg" for i in range(n_blocks)), *_token_kinds(model.visual, n_blocks))
    layers = _layer_set(model.visual, n_blocks)

    def features(x: Any, kinds_: Any) -> dict[str, Any]:
        import torch

        lay = {k: layers.record(k) for k in kinds_ if layers is not None and layers.offers(k)}
        S.check_kinds([k for k in kinds_ if k not in lay], kinds, f"open_clip:{name}")
        stages = sorted({int(k[5:-4]) for k in kinds_ if k.startswith("stage")})
        toks = {k: t for k in kinds_ if (t := parse_token_kind(k)) is not None}
        if not stages and not toks and not lay:
            return {"pooled": model.encode_image(x)}
        k_max = max([n for kind, n in toks.values() if kind == "blocks"] + [1 if toks else 0])
        check_blocks(k_max, n_blocks, f"open_clip:{name}")
        last = list(range(n_blocks - k_max, n_blocks))
        take = sorted(set(stages) | set(last) | {r["index"] for r in lay.values()})
        extra = bool(toks or lay)
        out = model.visual.forward_intermediates(x, indices=take, output_fmt="NLC", output_extra_tokens=extra)
        got = dict(zip(take, out["image_intermediates"]))
        res = {
            k: out["image_features"] if k == "pooled" else got[int(k[5:-4])].mean(dim=1) for k in _vector_kinds(kinds_)
        }
        pre = dict(zip(take, out["image_intermediates_prefix"])) if extra else {}
        if toks:
            normed = [model.visual.ln_post(torch.cat([pre[i], got[i]], dim=1)) for i in last]  # the final norm
            res.update(_token_outputs(toks, normed, model.visual.grid_size, f"open_clip:{name}"))
        if lay:
            res.update(vit_layer_outputs(lay, {i: (got[i], pre[i]) for i in take}, model.visual.ln_post))
        return {k: res[k] for k in kinds_}

    return S.finish(
        source="open_clip",
        name=name,
        model=model,
        transform=transform,
        weights=weights,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=kinds,
        library="open_clip_torch",
        sha=sha,
        tag=tag,
        wfile=wfile,
        input_size=size,
        text_tower=OpenClipText(model, open_clip.get_tokenizer(name), name),
        layers=layers,
        **{k: v for k, v in more.items() if v is not None},
    )


def list_models() -> Iterator[tuple[str, str, bool | None]]:
    """open_clip's pretrained (architecture, tag) pairs, and whether each file is cached."""
    import open_clip

    for arch, tag in open_clip.list_pretrained():
        yield f"open_clip:{arch}", tag, cached_file(open_clip.get_pretrained_cfg(arch, tag)) is not None
