"""``featcache publish`` / ``pull`` / ``hf://`` (issue 58): a published store is validated and
loaded by mlcroissant, loads with ``datasets``, and is pulled back through a loopback HTTP server
that answers the Hub's API the way huggingface_hub calls it (``HfFileSystem``: repo info, tree,
paths-info, ranged reads of ``resolve``; ``snapshot_download``: the tree and HEAD/GET of
``resolve`` with ``X-Repo-Commit``/``ETag``/``Content-Length``); a damaged chunk on the server is
named on read."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache.errors import ConfigError, CorruptStoreError, NotInStoreError
from featcache.store.cache import open_cache
from featcache.store.hub import HubPath
from featcache.store.publish import CROISSANT_1_1, CROISSANT_CONTEXT, PublishConfig, publish, pull, sha256_file
from featcache.store.verify import verify

REPO = "featcache-test/digits-lite0"
BACKBONE = "tf_efficientnet_lite0"
#: the chunk the damage tests flip a byte of (test split, first row chunk of `pooled`)
CHUNK = "store.zarr/features/tf_efficientnet_lite0/digits/test/pooled/c/0/0"


# ----------------------------------------------------------------------------- the loopback Hub
class _Hub(BaseHTTPRequestHandler):
    """The Hub's endpoints for one dataset repo, serving ``server.folder`` at ``server.commit``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _missing(self) -> None:
        self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})

    def _entry(self, rel: str) -> dict:
        p = self.server.folder / rel
        if p.is_dir():
            return {"type": "directory", "path": rel, "oid": hashlib.sha1(rel.encode()).hexdigest()}
        data = self.server.read(rel)
        return {"type": "file", "path": rel, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}

    def _listing(self, rel: str, recursive: bool) -> list[dict]:
        base = self.server.folder / rel
        items = base.rglob("*") if recursive else base.iterdir()
        return [self._entry(p.relative_to(self.server.folder).as_posix()) for p in sorted(items)]

    def do_GET(self, head: bool = False) -> None:
        url = urlparse(self.path)
        parts = [*(unquote(p) for p in url.path.split("/")), "", ""]  # padded: /api/datasets/ORG/NAME is repo info
        prefix = ["", "api", "datasets", *REPO.split("/")]
        if parts[:5] == prefix and parts[5] in ("revision", ""):
            files = [p.relative_to(self.server.folder).as_posix() for p in self.server.folder.rglob("*") if p.is_file()]
            return self._json({"id": REPO, "sha": self.server.commit, "siblings": [{"rfilename": f} for f in files]})
        if parts[:5] == prefix and parts[5] == "tree":
            rel = "/".join(parts[7:]).strip("/")
            if not (self.server.folder / rel).is_dir():
                return self._missing()
            recursive = parse_qs(url.query).get("recursive", ["False"])[0].lower() == "true"
            return self._json(self._listing(rel, recursive))
        if parts[:5] == ["", "datasets", *REPO.split("/"), "resolve"]:
            return self._resolve("/".join(parts[6:]).strip("/"), head)
        return self._missing()

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_POST(self) -> None:
        parts = [*(unquote(p) for p in urlparse(self.path).path.split("/")), ""]
        if parts[:5] != ["", "api", "datasets", *REPO.split("/")] or parts[5] != "paths-info":
            return self._missing()
        form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
        paths = [p.strip("/") for p in form.get("paths", [])]
        return self._json([self._entry(p) for p in paths if (self.server.folder / p).exists()])

    def _resolve(self, rel: str, head: bool) -> None:
        if not (self.server.folder / rel).is_file():
            return self._missing()
        data = self.server.read(rel)
        headers = {"X-Repo-Commit": self.server.commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        headers["Accept-Ranges"] = "bytes"
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, stop = int(a), min(len(data), int(b) + 1 if b else len(data))
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            return self._send(206, data[start:stop], headers, head)
        return self._send(200, data, headers, head)


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, folder: Path):
        super().__init__(("127.0.0.1", 0), _Hub)
        self.folder = folder
        self.commit = hashlib.sha1(b"featcache publish test").hexdigest()
        self.damaged: set[str] = set()

    def read(self, rel: str) -> bytes:
        data = bytearray((self.folder / rel).read_bytes())
        if rel in self.damaged:
            data[len(data) // 2] ^= 0x40  # one byte flipped in the middle of the served file
        return bytes(data)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def published(digits_cache, tmp_path_factory) -> Path:
    return publish(PublishConfig(digits_cache, str(tmp_path_factory.mktemp("pub") / "digits-lite0")))


@pytest.fixture(scope="module")
def hub(published):
    server = _HubServer(published)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    with pytest.MonkeyPatch.context() as mp:  # read when a store is opened (huggingface_hub: at import)
        mp.setenv("HF_ENDPOINT", server.endpoint)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def remote(hub):
    """The published store read through HfFileSystem from the loopback Hub."""
    return open_cache(f"hf://datasets/{REPO}@main")


def _store_rows(cache, split: str):
    f = cache.load(BACKBONE, "digits", split)
    return [str(i) for i in f.ids], f.labels, f.X


# ----------------------------------------------------------------------------- fast: URLs, refusals
_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(
    org=_NAME,
    name=_NAME,
    rev=st.none() | _NAME,
    path=st.none() | st.from_regex(r"[a-z0-9_]{1,8}(/[a-z0-9_.]{1,8}){0,2}", fullmatch=True),
)
def test_hub_urls_parse_into_what_hffilesystem_reads(org, name, rev, path):
    url = f"hf://datasets/{org}/{name}" + (f"@{rev}" if rev else "") + (f"/{path}" if path else "")
    hub = HubPath.parse(url)
    assert (hub.repo_id, hub.revision, hub.path) == (f"{org}/{name}", rev, path or "store.zarr")
    assert hub.fs_path() == url.removeprefix("hf://") + ("" if path else "/store.zarr")


def test_hub_urls_refused_in_one_line(monkeypatch, tmp_path, capsys):
    for bad in ("hf://models/x/y", "hf://datasets/x", "hf://datasets/x/y@"):
        with pytest.raises(ConfigError, match="not a Hub dataset URL"):
            HubPath.parse(bad)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(NotInStoreError, match="could not be reached"):
        open_cache("hf://datasets/org/name")
    with pytest.raises(NotInStoreError, match="could not be reached"):
        pull("hf://datasets/org/name", tmp_path / "x.zarr", cache_dir=str(tmp_path / "hub"))
    assert not (tmp_path / "x.zarr").exists()
    from featcache import cli

    assert cli.main(["verify", "--repair", "hf://datasets/org/name"]) != 0  # before any request
    assert "read-only here, nothing to repair in place: pull it" in capsys.readouterr().err


# ----------------------------------------------------------------------------- publish
def test_croissant_validates_and_its_records_are_the_stores_rows(published, digits_cache):
    import mlcroissant as mlc
    from mlcroissant._src.core.context import Context, CroissantVersion
    from mlcroissant._src.core.rdf import make_context

    doc = json.loads((published / "croissant.json").read_text())
    ctx = Context()
    ctx.conforms_to = CroissantVersion.V_1_1
    assert doc["@context"] == make_context(ctx) == CROISSANT_CONTEXT
    assert doc["conformsTo"] == CROISSANT_1_1
    for fo in doc["distribution"]:  # every file object: a relative contentUrl and the file's sha256
        assert not urlparse(fo["contentUrl"]).scheme
        assert not fo["contentUrl"].startswith("/")
        assert fo["sha256"] == sha256_file(published / fo["contentUrl"])
    ds = mlc.Dataset(jsonld=str(published / "croissant.json"))
    assert not ds.metadata.issues.errors, ds.metadata.issues.report()
    assert not ds.metadata.issues.warnings, ds.metadata.issues.report()
    cache = open_cache(digits_cache)
    assert {rs.uuid for rs in ds.metadata.record_sets} == {f"{BACKBONE}--digits/{s}" for s in ("train", "test")}
    for split in ("test", "train"):
        rs = f"{BACKBONE}--digits/{split}"
        fields = {f.name: f for r in ds.metadata.record_sets if r.uuid == rs for f in r.fields}
        assert sorted(fields) == ["id", "label", "pooled", "valid"]
        assert fields["pooled"].is_array
    # the records of one split (450 rows); the train split's Parquet rows are checked through
    # datasets below, and every record set is built by the same code
    rs = f"{BACKBONE}--digits/test"
    recs = list(ds.records(rs))
    ids, labels, X = _store_rows(cache, "test")
    assert [r[f"{rs}/id"].decode() for r in recs] == ids
    assert np.array_equal([r[f"{rs}/label"] for r in recs], labels)
    assert all(r[f"{rs}/valid"] for r in recs)
    assert np.array_equal(np.array([r[f"{rs}/pooled"] for r in recs], dtype=np.float32), X)


def test_the_folder_loads_with_datasets_and_the_card_names_what_it_holds(published, digits_cache, tmp_path):
    import datasets
    from huggingface_hub import DatasetCard

    cache = open_cache(digits_cache)
    by_config = datasets.load_dataset(str(published), cache_dir=str(tmp_path / "hf"))  # the card's configs
    files = {s: str(published / f"data/{BACKBONE}--digits/{s}.parquet") for s in ("train", "test")}
    plain = datasets.load_dataset("parquet", data_files=files, cache_dir=str(tmp_path / "hf"))
    for split in ("train", "test"):
        ids, labels, X = _store_rows(cache, split)
        for d in (by_config[split], plain[split]):
            t = d.with_format("arrow")[:]  # the rows datasets read, as one Arrow table (no per-row objects)
            assert t["id"].to_pylist() == ids
            assert np.array_equal(t["label"].to_numpy(), labels)
            pooled = t["pooled"].combine_chunks()
            assert set(pooled.value_lengths().to_numpy()) == {X.shape[1]}
            assert np.array_equal(pooled.flatten().to_numpy().reshape(X.shape), X)
    card = DatasetCard.load(published / "README.md")
    assert card.data.license == "other"  # the store records none; the text says so
    assert "records no license" in card.text
    (cfg,) = card.data.configs
    assert cfg["config_name"] == f"{BACKBONE}--digits"
    assert sorted(f["split"] for f in cfg["data_files"]) == ["test", "train"]
    meta = card.data.featcache
    prov = cache.provenance(BACKBONE, "digits", "train")
    assert meta["backbones"] == [
        {
            "backbone": BACKBONE,
            "model": prov.model_name,
            "weights": prov.weights_source,
            "weights_sha256": prov.weights_sha256,
        }
    ]
    assert {(k["split"], k["kind"], tuple(k["shape"])) for k in meta["kinds"]} == {
        ("train", "pooled", (1347, 1280)),
        ("test", "pooled", (450, 1280)),
    }
    assert {(s["split"], s["n"], s["classes"]) for s in meta["splits"]} == {("train", 1347, 10), ("test", 450, 10)}


def test_publish_chosen_kinds_and_refusals(digits_cache, tmp_path, capsys):
    """``--kinds`` rewrites the chosen kinds through the store's writer: the copy verifies and
    reads the same rows; an unknown kind or a folder already used is one line, nothing written."""
    from featcache import cli

    out = tmp_path / "sub"
    args = ["publish", digits_cache, str(out), "--kinds", "pooled", "--license", "cc-by-4.0", "--name", REPO]
    assert cli.main(args) == 0
    assert verify(str(out / "store.zarr")) == []
    a, b = open_cache(digits_cache), open_cache(str(out / "store.zarr"))
    assert np.array_equal(a.load(BACKBONE, "digits", "test").X, b.load(BACKBONE, "digits", "test").X)
    assert "license: cc-by-4.0" in (out / "README.md").read_text()
    doc = json.loads((out / "croissant.json").read_text())
    assert (doc["license"], doc["name"], doc["url"]) == ("cc-by-4.0", REPO, f"https://huggingface.co/datasets/{REPO}")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert cli.main(["publish", digits_cache, str(out)]) != 0
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    with pytest.raises(NotInStoreError, match="tokens"):
        publish(PublishConfig(digits_cache, str(tmp_path / "none"), kinds=("tokens",)))
    assert not (tmp_path / "none").exists()


# ----------------------------------------------------------------------------- hf:// and pull
def test_open_hf_url_reads_the_published_store_through_hffilesystem(hub, remote, digits_cache, capsys):
    from featcache import cli

    local = open_cache(digits_cache)
    # featcache open: where it was read from (the commit the revision named), the metadata documents
    # checked against their digests, and the catalog as ls prints it
    assert cli.main(["open", f"hf://datasets/{REPO}"]) == 0
    out = capsys.readouterr().out
    head = f"hf://datasets/{REPO}: repo {REPO}, revision main (the default), commit {hub.commit}, folder store.zarr/"
    assert out.startswith(head + f"; read through HfFileSystem from {hub.endpoint}\n")
    for split, shape in (("test", "450x1280"), ("train", "1347x1280")):
        assert re.search(rf"{BACKBONE} .* digits .* {split} .* pooled .* {shape} ", out)
    assert out.rstrip().endswith(
        "OK (the metadata documents against their digests checked; --verify reads every chunk)"
    )
    assert remote.entries() == local.entries()
    r, loc = remote.load(BACKBONE, "digits", "test"), local.load(BACKBONE, "digits", "test")
    assert np.array_equal(r.X, loc.X)
    assert np.array_equal(r.ids, loc.ids)
    assert r.fingerprint == loc.fingerprint
    assert remote.stored_fingerprint(BACKBONE, "digits", "train") == local.stored_fingerprint(
        BACKBONE, "digits", "train"
    )
    with pytest.raises(ConfigError, match="read-only"):
        open_cache(f"hf://datasets/{REPO}", mode="a")
    with pytest.raises(NotInStoreError, match=rf"has no folder nope/ at commit {hub.commit} "):
        open_cache(f"hf://datasets/{REPO}@main/nope")
    with pytest.raises(NotInStoreError, match=r"hf://datasets/other/repo: the Hub answered 404 .*check ORG/NAME"):
        open_cache("hf://datasets/other/repo")


def test_pull_verifies_and_reads_offline_from_the_hub_cache(hub, digits_cache, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants as hf_constants

    from featcache import cli

    hf_cache = tmp_path / "hub"
    dest = pull(f"hf://datasets/{REPO}", tmp_path / "pulled.zarr", cache_dir=str(hf_cache))
    assert verify(str(dest)) == []
    local = open_cache(digits_cache).load(BACKBONE, "digits", "train")
    assert np.array_equal(open_cache(str(dest)).load(BACKBONE, "digits", "train").X, local.X)
    # offline, through the CLI: the Hub is never asked (the endpoint is a closed port); HF_HUB_OFFLINE
    # is read when the store is opened, not only when huggingface_hub is imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_cache))  # HF_HUB_CACHE, as read at import
    assert cli.main(["pull", f"hf://datasets/{REPO}", str(tmp_path / "offline.zarr")]) == 0
    assert np.array_equal(open_cache(str(tmp_path / "offline.zarr")).load(BACKBONE, "digits", "train").X, local.X)
    capsys.readouterr()
    assert cli.main(["open", f"hf://datasets/{REPO}@main"]) == 0  # read in place from the Hub cache
    out = capsys.readouterr().out
    assert f"repo {REPO}, revision main, commit {hub.commit}, folder store.zarr/; read offline" in out
    assert "1347x1280" in out
    assert "450x1280" in out
    with pytest.raises(NotInStoreError, match="not in the local Hub cache"):
        pull(f"hf://datasets/{REPO}", tmp_path / "never.zarr", cache_dir=str(tmp_path / "empty-cache"))
    assert not (tmp_path / "never.zarr").exists()


def test_a_damaged_chunk_on_the_hub_is_named_on_read_and_by_pull(hub, remote, tmp_path, capsys):
    from featcache import cli

    hub.damaged.add(CHUNK)
    try:  # iter_blocks checks each chunk as load does (load also re-reads a changed chunk a few times)
        with pytest.raises(CorruptStoreError, match=r"digits/test .*pooled chunk\(s\) \[0\] corrupt"):
            list(remote.iter_blocks(BACKBONE, "digits", "test", "pooled", max_memory=1 << 30))
        with pytest.raises(CorruptStoreError, match=r"test/pooled: chunk 0 \(rows 0-449\)") as err:
            pull(f"hf://datasets/{REPO}", tmp_path / "bad.zarr", cache_dir=str(tmp_path / "hub"))
        assert "nothing was written" in str(err.value)
        capsys.readouterr()  # verify names it, and says what fits a store that is read-only here
        assert cli.main(["verify", f"hf://datasets/{REPO}"]) == 1
        out = capsys.readouterr().out
        assert re.search(r"PROBLEM features/.*/digits/test/pooled: chunk 0 \(rows 0-449\)", out)
        assert "a published store is read-only here: pull it again" in out
        assert "--repair" not in out
        assert "re-run" not in out
        assert not (tmp_path / "bad.zarr").exists()
        assert not list(tmp_path.glob(".bad.zarr.partial-*"))
    finally:
        hub.damaged.discard(CHUNK)
