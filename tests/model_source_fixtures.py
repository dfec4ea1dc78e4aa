"""Tiny real architectures with random weights for the model-source contract tests (no download)."""

from __future__ import annotations

import json
from pathlib import Path

#: an open_clip ViT config small enough for a CPU test (same model classes as ViT-B-32)
TINY_OPEN_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}


def register_tiny_open_clip(tmp: Path, name: str = "featcache-tiny-vit") -> str:
    import open_clip

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / f"{name}.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(tmp / f"{name}.json")
    return name


def save_tiny_hf_clip(d: Path) -> Path:
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "vocab_size": 1000,
            "max_position_embeddings": 77,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=16,
    )
    CLIPModel(cfg).eval().save_pretrained(d)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def _tokenizer():
    """A word-level CLIP-style fast tokenizer over a small vocabulary (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a an the of photo picture drawing digit number zero one two three four five six seven eight nine "
    words += "bad good small big close-up cropped bright dark rendition sketch tattoo origami toy plastic "
    words += "0 1 2 3 4 5 6 7 8 9"
    vocab = {"<pad>": 0, "<|startoftext|>": 1, "<|endoftext|>": 2, "<unk>": 3}
    for w in [*words.split(), ".", ",", "'", "{", "}", "-"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=77,
    )


def save_tiny_hf_dinov2(d: Path) -> Path:
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    cfg = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    Dinov2Model(cfg).eval().save_pretrained(d)
    BitImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        do_center_crop=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(d)
    return d


USER_MODULE = """
import torch.nn as nn


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x):
        return self.body(x)


def make():
    return TinyNet()
"""
