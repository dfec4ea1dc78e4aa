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
            # the tokenizer's own ids (CLIP's 49406/49407 lie outside this vocabulary: HF would
            # then pool every prompt at its start token and all text embeddings would be equal)
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
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


# ------------------------------------------------------------------ contract runs in other processes
#: every registered source plus an nn.Module object, as the kill and torchrun contract tests run them
PROCESS_SOURCES = ("timm", "torchvision", "open_clip", "hf", "python", "module")
#: digits test rows in chunks of 8 (6 chunks): 32-px timm, the libraries' own sizes elsewhere
ROWS, CHUNK = 48, 8


def make_assets(tmp: Path) -> dict[str, str]:
    """The tiny models on disk (open_clip config, HF CLIP directory, user module), by path."""
    tmp.mkdir(parents=True, exist_ok=True)
    oc = tmp / "oc"
    oc.mkdir(exist_ok=True)
    (oc / "featcache-tiny-vit.json").write_text(json.dumps(TINY_OPEN_CLIP))
    (tmp / "usermods").mkdir(exist_ok=True)
    (tmp / "usermods" / "featcache_user_net.py").write_text(USER_MODULE)
    clip = tmp / "hfclip"
    if not (clip / "config.json").exists():
        save_tiny_hf_clip(clip)
    return {
        "open_clip_json": str(oc / "featcache-tiny-vit.json"),
        "hf_clip": str(clip),
        "usermods": str(tmp / "usermods"),
    }


def activate(assets: dict[str, str]) -> None:
    """Make the assets usable in this process (open_clip knows the config; the user module imports)."""
    import sys

    import open_clip

    open_clip.add_model_config(assets["open_clip_json"])
    if assets["usermods"] not in sys.path:
        sys.path.insert(0, assets["usermods"])


def source_config(source: str, assets: dict[str, str], cache: str, **kw):
    """The ExtractConfig of ``source`` on the contract's rows (``activate`` first)."""
    import torch

    from featcache.extract import ExtractConfig

    if source == "module":
        import featcache_user_net

        torch.manual_seed(1)
        spec, weights = featcache_user_net.make().eval(), "module"
    else:
        spec, weights = {
            "timm": ("timm:test_resnet", "random:0"),
            "torchvision": ("torchvision:mobilenet_v3_small", "random:0"),
            "open_clip": ("open_clip:featcache-tiny-vit", "random:0"),
            "hf": (f"hf:{assets['hf_clip']}", "dir"),
            "python": ("python:featcache_user_net:make", "random:2"),
        }[source]
    if source == "timm":
        kw.setdefault("input_size", 32)
    return ExtractConfig(
        spec,
        weights,
        "digits",
        cache=cache,
        splits=("test",),
        limit=ROWS,
        chunk_rows=CHUNK,
        batch_size=CHUNK,
        dtype="float32",
        backbone_name="bb",
        workers=0,
        threads=1,
        device="cpu",
        progress=False,
        **kw,
    )


def extract_slowly(source: str, assets: dict[str, str], cache: str, pause: float) -> None:
    """Extract ``source`` with a pause before each batch's forward, so a kill lands mid-way
    (run in a child process: the test SIGKILLs it)."""
    import time

    from featcache.extract import extract
    from featcache.extract.pipeline import FeatureHead

    activate(assets)
    forward = FeatureHead.__call__

    def slow(self, *a, **k):
        time.sleep(pause)
        return forward(self, *a, **k)

    FeatureHead.__call__ = slow
    extract(source_config(source, assets, cache))


def _torchrun_main(assets_json: str, out: str) -> None:
    """Under torchrun: every source of PROCESS_SOURCES into ``out/SOURCE.zarr``, in one process group."""
    import logging

    import torch.distributed as dist

    from featcache.extract import extract

    logging.basicConfig(level=logging.INFO)
    assets = json.loads(Path(assets_json).read_text())
    activate(assets)
    dist.init_process_group("gloo")
    try:
        for source in PROCESS_SOURCES:
            extract(source_config(source, assets, str(Path(out) / f"{source}.zarr")))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    _torchrun_main(*sys.argv[1:3])


# ------------------------------------------------------------------ the Hugging Face hub, offline
def put_in_hub_cache(
    cache: Path, repo: str, files: dict[str, Path], commit: str, ref: str = "main", link: bool = True
) -> Path:
    """Files laid out as ``huggingface_hub`` caches a model repo: ``models--ORG--NAME/blobs/<sha256>``,
    ``snapshots/<commit>/<name>`` (a relative link to the blob, as the hub makes it; a copy with
    ``link=False``, as on a file system without links) and ``refs/<ref>``."""
    import hashlib
    import os
    import shutil

    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        blob = root / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snap / name).unlink(missing_ok=True)
        if link:
            os.symlink(os.path.relpath(blob, snap), snap / name)
        else:
            shutil.copyfile(src, snap / name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


class HubServer:
    """A loopback HTTP server serving one model repo in the hub's layout, as ``huggingface_hub``
    reads it: ``GET /api/models/{repo}/revision/{rev}`` (id, sha), ``GET /api/models/{repo}/tree/{rev}``
    (the file list) and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with the headers its
    ``get_hf_file_metadata`` reads (``X-Repo-Commit``, ``ETag``: the sha256 of an LFS file,
    ``Content-Length``). ``requests``: the paths asked for; ``served``: bytes served in place of
    a file's own (its ETag still the sha256 of the file's own bytes); ``status``: an HTTP status
    every request is answered with instead (a hub in trouble), or ``"close"``: every connection
    closed without an answer."""

    def __init__(self, repo: str, files: dict[str, Path], commit: str, served: dict[str, bytes] | None = None):
        import hashlib
        import http.server
        import threading

        self.repo, self.commit, self.requests = repo, commit, []
        self.files = {n: p.read_bytes() for n, p in files.items()}
        self.sha = {n: hashlib.sha256(b).hexdigest() for n, b in self.files.items()}
        self.served, self.status = dict(served or {}), None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head):
                path = self.path.split("?", 1)[0]
                server.requests.append(f"{self.command} {path}")
                if server.status == "close":  # the connection closed without an answer
                    self.close_connection = True
                    return None
                if server.status is not None:
                    return self._send(server.status, b"hub in trouble", {"Content-Type": "text/plain"}, head)
                api = f"/api/models/{server.repo}/"
                if path.startswith(api + "revision/"):
                    body = json.dumps(
                        {"id": server.repo, "sha": server.commit, "siblings": [{"rfilename": n} for n in server.files]}
                    ).encode()
                    return self._send(200, body, {"Content-Type": "application/json"}, head)
                if path.startswith(api + "tree/"):
                    body = json.dumps(
                        [
                            {
                                "type": "file",
                                "path": n,
                                "size": len(b),
                                "oid": hashlib.sha1(b).hexdigest(),
                                "lfs": {"oid": server.sha[n], "size": len(b), "pointerSize": 134},
                            }
                            for n, b in server.files.items()
                        ]
                    ).encode()
                    return self._send(200, body, {"Content-Type": "application/json"}, head)
                prefix = f"/{server.repo}/resolve/"
                if path.startswith(prefix):
                    name = path[len(prefix) :].split("/", 1)[1]
                    if name in server.files:
                        hdr = {
                            "X-Repo-Commit": server.commit,
                            "ETag": f'"{server.sha[name]}"',
                            "Content-Type": "application/octet-stream",
                        }
                        body = server.served.get(name, server.files[name])
                        return self._send(200, body, hdr, head)
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": server.commit}, head)
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
