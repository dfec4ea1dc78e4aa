"""``hf:DIR``: a ``transformers`` model saved with ``save_pretrained`` (``CLIPModel``: its
vision tower and text tower; ``Dinov2Model`` or any ``AutoModel`` vision model), with the
directory's own image processor. Kinds: ``pooled`` (``CLIPModel``: ``get_image_features``,
the projected embedding; others: ``pooler_output``), ``pooler`` (``pooler_output``), ``cls``
(token 0 of ``last_hidden_state``), ``tokens_mean`` (mean of the other tokens), ``stageN_avg``
(mean of the non-CLS tokens of layer N's output, ``hidden_states[N + 1]``, N = 0..layers-1);
``blocks:K``, ``tokens``, ``tokens@GxG`` from the same hidden states through the tower's final
layer norm (:class:`_TokenKinds`; ``blocks:K`` only for a tower with a class token). ``layers:...``:
block i's class token and mean patch token (``hidden_states[i + 1]``) through the same final
layer norm, and before it with ``layers+raw`` (:func:`_layer_set`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from featcache.errors import BackboneError
from featcache.models import sources as S
from featcache.models import weights as _w
from featcache.models.sources.layers import LayerSet, module_path, vit_layer_outputs
from featcache.models.sources.tokens import TOKEN_KINDS, check_blocks, grid_pool, parse_token_kind, token_grid

KINDS = ("pooled", "pooler", "cls", "tokens_mean")


class HFProcessorTransform:
    """PIL image -> ``pixel_values[0]`` of the directory's image processor (picklable)."""

    def __init__(self, processor: Any):
        self.processor = processor

    def __call__(self, img: Any) -> Any:
        return self.processor(images=img, return_tensors="pt")["pixel_values"][0]

    def __repr__(self) -> str:
        return f"HFProcessorTransform({self.processor.to_dict()})"


class HFClipText:
    """HF ``CLIPModel``'s text tower: prompts -> ``get_text_features``."""

    def __init__(self, model: Any, tokenizer: Any, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, f"hf:{name}"

    def encode(self, texts: list[str]) -> Any:
        import torch

        dev = next(self.model.parameters()).device
        tok = self.tokenizer(texts, padding=True, return_tensors="pt").to(dev)
        with torch.inference_mode():
            out = self.model.get_text_features(**tok)
        return (out if torch.is_tensor(out) else out.pooler_output).float()


def _size(processor: Any) -> tuple[int, int, int]:
    s = getattr(processor, "crop_size", None) or getattr(processor, "size", None) or {}
    h = s.get("height") or s.get("shortest_edge")
    w = s.get("width") or s.get("shortest_edge")
    if h is None or w is None:
        raise BackboneError(
            f"the Hugging Face image processor declares no input size (crop_size/size: {s!r}); "
            "give the checkpoint a preprocessor_config.json with a size"
        )
    return (3, int(h), int(w))


def _locate(name: str, offline: bool) -> tuple[Path, dict[str, Any]]:
    """The model folder of ``hf:DIR`` or ``hf:ORG/NAME[@REVISION]`` (a hub id, read through
    ``huggingface_hub`` into its cache) and what to record of it."""
    from featcache.models.sources import hub

    d = Path(name).expanduser()
    if d.is_dir():
        if not (d / "config.json").is_file():
            raise BackboneError(f"hf:{name} is not a directory written by save_pretrained (no config.json)")
        return d, {}
    if not hub.HUB_ID.match(name):
        raise BackboneError(
            f"hf:{name} is neither a directory nor a hub id ORG/NAME[@REVISION] (e.g. hf:openai/clip-vit-base-patch32)"
        )
    repo, _, rev = name.partition("@")
    d = hub.snapshot(repo, rev or None, offline=offline, fetch=f"--model hf:{name}")
    return d, {"hub_id": repo, "revision": hub.revision_of(str(d) + "/") or rev}


def _check_code(d: Path, name: str, trust: bool) -> None:
    """A folder whose config maps classes to its own Python files runs that code: refused in
    one line unless ``trust_remote_code``."""
    import json

    try:
        auto = json.loads((d / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError):
        auto = None
    if auto and not trust:
        raise BackboneError(
            f"hf:{name} ships its own model code ({', '.join(sorted(auto))} in config.json); featcache does not run "
            "it unless you pass --trust-remote-code (Python: trust_remote_code=True) after reading that code"
        )


class _TokenKinds:
    """blocks:K, tokens, tokens@GxG of a Hugging Face vision tower from its hidden states
    (``output_hidden_states=True``; ``hidden_states[i + 1]`` is block i's output), each through the
    tower's final layer norm (``post_layernorm``: CLIP's pooler path; ``layernorm``: ViT, DINOv2),
    prefix tokens (class + ``num_register_tokens``) excluded from the patch tokens."""

    def __init__(self, norm: Any, n_prefix: int, has_cls: bool, layers: int, patch: Any, name: str):
        self.norm, self.n_prefix, self.has_cls, self.layers, self.patch, self.name = (
            norm, n_prefix, has_cls, layers, patch, name,
        )  # fmt: skip
        self.offered = () if norm is None else TOKEN_KINDS if has_cls else TOKEN_KINDS[1:]

    @classmethod
    def of(cls, vision: Any, vcfg: Any, layers: int, name: str) -> _TokenKinds:
        import torch

        inner = getattr(vision, "vision_model", vision)  # CLIPVisionModel wraps its transformer
        norm = next(
            (m for a in ("post_layernorm", "layernorm") if isinstance(m := getattr(inner, a, None), torch.nn.Module)),
            None,
        )
        emb = getattr(inner, "embeddings", None)
        has_cls = any(getattr(emb, a, None) is not None for a in ("cls_token", "class_embedding"))
        n_prefix = 1 + int(getattr(vcfg, "num_register_tokens", 0) or 0) if has_cls else 0
        return cls(norm, n_prefix, has_cls, layers, getattr(vcfg, "patch_size", None), name)

    def __call__(self, kind: str, hidden: Any, x: Any) -> Any:
        import torch

        what, n = parse_token_kind(kind) or ("", 0)
        if what == "blocks":
            check_blocks(n, self.layers, self.name)
            return torch.stack([self.norm(h)[:, 0] for h in hidden[len(hidden) - n :]], dim=1)
        patches = self.norm(hidden[-1])[:, self.n_prefix :]
        if what == "tokens":
            return patches
        p = self.patch if isinstance(self.patch, (tuple, list)) else (self.patch, self.patch)
        hw = (x.shape[-2] // int(p[0]), x.shape[-1] // int(p[1])) if self.patch else None
        return grid_pool(patches, token_grid(patches.shape[1], hw, self.name), n, self.name)


def _layer_set(model: Any, vision: Any, tok: _TokenKinds) -> LayerSet | None:
    """The encoder blocks of a vision tower (the ``ModuleList`` of ``num_hidden_layers`` blocks
    whose outputs are ``hidden_states[1:]``), by module path in ``model``; None where not found."""
    import torch

    inner = getattr(vision, "vision_model", vision)
    enc = getattr(inner, "encoder", None)
    blocks = next((m for a in ("layers", "layer") if isinstance(m := getattr(enc, a, None), torch.nn.ModuleList)), None)
    if blocks is None or len(blocks) != tok.layers:
        return None
    path = module_path(model, blocks)
    norm = module_path(model, tok.norm) if tok.norm is not None else ""
    parts = ("cls", "mean") if tok.has_cls else ("mean",)
    mods = tuple(f"{path}.{i}" for i in range(len(blocks)))
    return LayerSet(mods, parts, norm=norm, via="transformers output_hidden_states")


def _layer_outputs(layers: LayerSet | None, tok: _TokenKinds, kinds: Any, hidden: Any) -> dict[str, Any]:
    """The layer kinds among ``kinds`` from the hidden states (block i's output: ``hidden[i + 1]``)."""
    lay = {k: layers.record(k) for k in kinds if layers is not None and layers.offers(k)}
    n = tok.n_prefix
    got = {
        r["index"]: (hidden[r["index"] + 1][:, n:], hidden[r["index"] + 1][:, :n] if n else None) for r in lay.values()
    }
    return vit_layer_outputs(lay, got, tok.norm)


def build(
    name: str,
    weights: str,
    *,
    device: str = "cpu",
    trainable: bool = False,
    trust_remote_code: bool = False,
    offline: bool = False,
    **_: Any,
) -> Any:
    transformers = S.require("transformers", "hf")
    seed = S.seed_of(weights, "hf")
    if weights not in ("timm", "dir", "hub") and seed is None:
        raise BackboneError(
            f"hf:{name} reads the model's own weights (weights='dir'), or random:SEED for its architecture "
            f"randomly initialised; got {weights!r}"
        )
    d, where = _locate(name, offline)
    _check_code(d, name, trust_remote_code)
    trust = {"trust_remote_code": bool(trust_remote_code), "local_files_only": True}
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(d, **trust)
    except (OSError, ValueError) as e:
        raise BackboneError(
            f"hf:{name} has no image processor; save one beside the model (processor.save_pretrained({str(d)!r})): {e}"
        ) from None
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
    if seed is not None:  # the architecture of the folder's config, seeded; its weights unread
        config = transformers.AutoConfig.from_pretrained(d, **trust)
        model = S.seeded(seed, lambda: transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code))
        sha, tag = S.load_weights(model, weights, "hf", name)[:2]
        used, files = weights, []
    else:  # each file checked against what the hub promised before transformers reads it
        where["weight_files"] = {f.name: _w.checked_sha256(f, f"--model hf:{name}") for f in files}
        with _w.reading(files[0] if files else d, f"--model hf:{name}"):
            model = transformers.AutoModel.from_pretrained(d, **trust)
        sha, tag, used = (where["weight_files"][files[0].name] if files else S.state_sha256(model)), "", "dir"
    is_clip = hasattr(model, "get_image_features")
    vision = model.vision_model if is_clip else model

    vcfg = getattr(model.config, "vision_config", model.config)
    layers = int(vcfg.num_hidden_layers)
    tok = _TokenKinds.of(vision, vcfg, layers, f"hf:{name}")
    kinds_all = (*KINDS, *(f"stage{i}_avg" for i in range(layers)), *tok.offered)
    layer_set = _layer_set(model, vision, tok)

    def features(x: Any, kinds: Any) -> dict[str, Any]:
        lay = [k for k in kinds if layer_set is not None and layer_set.offers(k)]
        S.check_kinds([k for k in kinds if k not in lay], kinds_all, f"hf:{name}")
        hidden = bool(lay) or any(k.startswith("stage") or parse_token_kind(k) is not None for k in kinds)
        out = vision(pixel_values=x, output_hidden_states=True) if hidden else vision(pixel_values=x)
        res: dict[str, Any] = _layer_outputs(layer_set, tok, lay, out.hidden_states) if lay else {}
        for k in kinds:
            if k in res:
                continue
            if parse_token_kind(k) is not None:
                res[k] = tok(k, out.hidden_states, x)
            elif k.startswith("stage"):
                res[k] = out.hidden_states[int(k[5:-4]) + 1][:, 1:].mean(dim=1)
            elif k == "pooled":
                res[k] = model.visual_projection(out.pooler_output) if is_clip else out.pooler_output
            elif k == "pooler":
                res[k] = out.pooler_output
            elif k == "cls":
                res[k] = out.last_hidden_state[:, 0]
            else:
                res[k] = out.last_hidden_state[:, 1:].mean(dim=1)
        return res

    text = None
    if is_clip:
        text = HFClipText(model, transformers.AutoTokenizer.from_pretrained(d, **trust), name)
    transform = HFProcessorTransform(processor)
    return S.finish(
        source="hf",
        name=name if "hub_id" in where else str(d.resolve()),
        key_name=where.get("hub_id") or d.name,
        model=model,
        transform=transform,
        weights=used,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=kinds_all,
        library="transformers",
        sha=sha,
        tag=tag,
        wfile=str(files[0]) if files else None,
        input_size=_size(processor),
        text_tower=text,
        model_class=type(model).__name__,
        layers=layer_set,
        **where,
    )


def list_models() -> Iterator[tuple[str, str, bool | None]]:
    """The model repos in the Hugging Face hub cache (the hub itself is not listed offline)."""
    from featcache.models.sources.hub import hf_cache_dir

    root = hf_cache_dir()
    for d in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        repo = d.name[len("models--") :].replace("--", "/", 1)
        if (d / "snapshots").is_dir() and any((d / "snapshots").iterdir()):
            yield f"hf:{repo}", "dir", True
