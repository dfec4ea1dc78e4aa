"""``open_clip:ARCH``: open_clip's image tower (``pooled`` = ``encode_image``, the projected
embedding zero-shot uses) with open_clip's own eval transform; the text tower
(``encode_text`` on open_clip's tokenizer) embeds class names."""

from __future__ import annotations

from typing import Any

from featcache.extract import sources as S

KINDS = ("pooled",)


class OpenClipText:
    """open_clip's text tower: prompts -> ``encode_text`` embeddings (not normalised)."""

    def __init__(self, model: Any, tokenizer: Any, arch: str):
        self.model, self.tokenizer, self.name = model, tokenizer, f"open_clip:{arch}"

    def encode(self, texts: list[str]) -> Any:
        import torch

        dev = next(self.model.parameters()).device
        with torch.inference_mode():
            return self.model.encode_text(self.tokenizer(texts).to(dev)).float()


def build(name: str, weights: str, *, device: str = "cpu", trainable: bool = False, **_: Any) -> Any:
    open_clip = S.require("open_clip", "open_clip")
    seed = S.seed_of(weights, "open_clip")
    model, _, transform = S.seeded(seed, lambda: open_clip.create_model_and_transforms(name, pretrained=None))
    sha, tag, wfile = S.load_weights(model, weights, "open_clip", name)
    size = model.visual.image_size
    size = (3, *(size if isinstance(size, (tuple, list)) else (size, size)))

    def features(x: Any, kinds: Any) -> dict[str, Any]:
        S.check_kinds(kinds, KINDS, f"open_clip:{name}")
        return {"pooled": model.encode_image(x)}

    return S.finish(
        source="open_clip",
        name=name,
        model=model,
        transform=transform,
        weights=weights,
        device=device,
        trainable=trainable,
        features_fn=features,
        kinds=KINDS,
        library="open_clip_torch",
        sha=sha,
        tag=tag,
        wfile=wfile,
        input_size=size,
        text_tower=OpenClipText(model, open_clip.get_tokenizer(name), name),
    )
