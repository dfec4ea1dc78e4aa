"""``open_clip:ARCH``: open_clip's image tower (``pooled`` = ``encode_image``, the projected
embedding zero-shot uses) with open_clip's own eval transform; the text tower
(``encode_text`` on open_clip's tokenizer) embeds class names. ``stageN_avg`` (a ViT image
tower): the mean of block N's patch tokens, from open_clip's own ``visual.forward_intermediates``
(whose ``image_features`` is then ``pooled``, the same forward)."""

from __future__ import annotations

from typing import Any

from featcache.extract import sources as S


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


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **_: Any) -> Any:
    open_clip = S.require("open_clip", "open_clip")
    seed = S.seed_of(weights, "open_clip")
    model, _, transform = S.seeded(seed, lambda: open_clip.create_model_and_transforms(name, pretrained=None))
    sha, tag, wfile = S.load_weights(model, weights, "open_clip", name)
    size = model.visual.image_size
    size = (3, *(size if isinstance(size, (tuple, list)) else (size, size)))

    kinds = ("pooled", *(f"stage{i}_avg" for i in range(_n_blocks(model.visual))))

    def features(x: Any, kinds_: Any) -> dict[str, Any]:
        S.check_kinds(kinds_, kinds, f"open_clip:{name}")
        stages = sorted({int(k[5:-4]) for k in kinds_ if k != "pooled"})
        if not stages:
            return {"pooled": model.encode_image(x)}
        out = model.visual.forward_intermediates(x, indices=stages, output_fmt="NLC")
        got = dict(zip(stages, out["image_intermediates"]))
        return {k: out["image_features"] if k == "pooled" else got[int(k[5:-4])].mean(dim=1) for k in kinds_}

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
    )
