"""featcache uses zarr through its public API; the one internal it needs (running a store
coroutine from synchronous code, zarr-developers/zarr-python#3637) lives in
``featcache/store/_zarr_internal.py``. These tests fail when zarr moves or changes that
internal, and when any other library module imports ``zarr.core``."""

from __future__ import annotations

import ast
import asyncio
import inspect
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore, MemoryStore

import featcache
from featcache.store import manifest
from featcache.store._zarr_internal import sync
from featcache.store.summary import checksums_digest

ROOT = Path(featcache.__file__).parent
ADAPTER = ROOT / "store" / "_zarr_internal.py"
SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}


def zarr_core_uses(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: ...`` for every import of ``zarr.core`` (or below) and every
    ``zarr.core`` attribute chain in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        hit = sorted({n for n in names if n == "zarr.core" or n.startswith("zarr.core.")})
        if hit:
            out.append(f"{path.relative_to(root)}:{node.lineno}: {hit[0]}")
    return out


def test_only_the_adapter_uses_zarr_internals():
    files = sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))
    assert ROOT / "store" / "manifest.py" in files  # the scan sees the package
    assert zarr_core_uses(ADAPTER), "the adapter no longer needs zarr.core: drop it and this test"
    found = [line for p in files if p != ADAPTER for line in zarr_core_uses(p)]
    assert not found, (
        "zarr.core is zarr's private API: use the public one, or add the internal to "
        "featcache/store/_zarr_internal.py (naming the zarr issue):\n" + "\n".join(found)
    )


def test_the_scan_sees_zarr_core(tmp_path):
    (tmp_path / "m.py").write_text(
        "import zarr\nimport zarr.core.sync\nfrom zarr.core.buffer import x\nfrom zarr import core\n"
        "from zarr.buffer import default_buffer_prototype\n\ndef f():\n    return zarr.core\n"
    )
    assert zarr_core_uses(tmp_path / "m.py", tmp_path) == [
        "m.py:2: zarr.core.sync",
        "m.py:3: zarr.core.buffer",
        "m.py:4: zarr.core",
        "m.py:8: zarr.core",
    ]


def test_zarr_still_has_the_internal_the_adapter_wraps():
    from zarr.core.sync import sync as zarr_sync  # moved or renamed: update the adapter

    params = list(inspect.signature(zarr_sync).parameters)
    assert params[0] == "coro", params
    assert set(params[1:]) <= {"loop", "timeout"}, params


def test_sync_runs_on_the_loop_zarr_runs_store_io_on():
    """The adapter's coroutine and the store calls of zarr's own synchronous API share one
    running loop (stores bound to zarr's loop, e.g. fsspec's, keep working), in a thread
    other than the caller's."""
    seen = []

    class Recording(MemoryStore):
        async def get(self, key, prototype=None, byte_range=None):
            seen.append(asyncio.get_running_loop())
            return await super().get(key, prototype, byte_range)

    store = Recording()
    zarr.create_group(store=store, zarr_format=3)
    zarr.open_group(store=store, mode="r")

    async def where():
        return asyncio.get_running_loop(), threading.get_ident()

    loop, thread = sync(where())
    assert seen, "zarr's synchronous API no longer reads through Store.get"
    assert {id(x) for x in seen} == {id(loop)}
    assert thread != threading.get_ident()


def test_sync_returns_the_result_and_raises_the_error():
    async def ok():
        return 7

    async def bad():
        raise KeyError("k")

    assert sync(ok()) == 7
    with pytest.raises(KeyError, match="k"):
        sync(bad())


def test_raw_store_io_on_memory_and_local_stores(tmp_path):
    """The manifest's byte I/O and the chunk checksum digest, through the adapter, on two stores."""
    for store in (MemoryStore(), LocalStore(str(tmp_path / "s.zarr"))):
        manifest.write_raw(store, "x/y.json", b'{"a": 1}')
        assert manifest.read_raw(store, "x/y.json") == b'{"a": 1}'
        assert manifest.read_raw(store, "x/missing.json") is None
        manifest.delete_raw(store, "x/y.json")
        assert manifest.read_raw(store, "x/y.json") is None
        g = zarr.create_group(store=store, zarr_format=3)
        a = g.create_array("a", shape=(4,), chunks=(2,), dtype="int64", compressors=zarr.codecs.Crc32cCodec())
        a[:] = np.arange(4)
        first = checksums_digest(g, ["a"])
        assert first is not None
        a[2:] = [5, 6]
        assert checksums_digest(g, ["a"]) not in (None, first)
