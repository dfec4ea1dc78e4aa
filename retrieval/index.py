"""Approximate search with FAISS indexes (IVF, HNSW, PQ, OPQ ... any ``faiss.index_factory``
string), trained on a seeded sample of the gallery, stored beside the store and reused.

``--index auto`` picks a factory the way autofaiss does (criteo/autofaiss, commit 709c6dba,
``autofaiss/external/optimize.py`` ``get_optimal_index_keys_v2`` and its helpers, and
``autofaiss/external/metadata.py`` ``IndexMetadata.estimated_index_size_in_bytes``, ported in
:func:`candidate_factories` and :func:`estimated_index_bytes`): the candidates that fit the
memory budget, in autofaiss's order; then, where autofaiss tunes ``nprobe``/``efSearch`` for a
query-time target, featcache takes the first candidate and smallest search parameter whose
recall@k against exact search on held-out gallery rows reaches ``min_recall``.

Indexes live in a sibling folder of the store (``<cache>.indexes/``; the store itself knows no
stage), one ``<key>.faiss`` (``faiss.serialize_index`` bytes) and ``<key>.json`` (factory,
metric, training sample ids, gallery fingerprint, sha256 checksum of the bytes) per index. A
rerun with the same gallery and spec reads the index back; one whose bytes do not match the
recorded checksum is refused and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from math import ceil, floor, log2, sqrt
from typing import Any

import numpy as np

from featcache.errors import ConfigError, DataError
from featcache.retrieval.prepared import PreparedRows

log = logging.getLogger(__name__)

__all__ = [
    "AUTO",
    "EXACT",
    "BuiltIndex",
    "IndexFactoryError",
    "candidate_factories",
    "check_factory",
    "estimated_index_bytes",
    "index_search",
    "train_rows",
]

EXACT = "exact"
AUTO = "auto"
#: dimensions a factory string is tried with when no features are at hand (config time):
#: 1536 divides by every PQ size autofaiss proposes (4..256), 720 and 1000 catch the rest
_PROBE_DIMS = (1536, 720, 1000)
NPROBE_GRID = tuple(2**i for i in range(0, 21))
EF_GRID = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class IndexFactoryError(ConfigError, DataError):
    """A FAISS index-factory string that FAISS cannot build (or that does not fit the features)."""


def _faiss():
    from featcache.core.optional import import_faiss

    return import_faiss()


def faiss_metric(metric: str) -> int:
    faiss = _faiss()
    return faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT


def _faiss_reason(exc: Exception) -> str:
    """The one useful line of a FAISS C++ error (after its 'Error: ' / last ': ')."""
    text = " ".join(str(exc).split())
    m = re.search(r"Error: (.*)$", text)
    return (m.group(1) if m else text.rsplit(": ", 1)[-1]).strip()


def check_factory(factory: str, dim: int | None = None, metric: str = "cosine") -> None:
    """Raise :class:`IndexFactoryError` (one line) unless FAISS builds ``factory`` for ``dim``
    (``None``: for any of a few common dimensions: a syntax check)."""
    if not isinstance(factory, str) or not factory.strip():
        raise IndexFactoryError("--index takes a FAISS index_factory string such as IVF4096,Flat, HNSW32, or auto")
    faiss = _faiss()
    first: Exception | None = None
    for d in (dim,) if dim is not None else _PROBE_DIMS:
        try:
            faiss.index_factory(int(d), factory, faiss_metric(metric))
            return
        except RuntimeError as exc:
            first = first or exc
    assert first is not None
    where = f" for {dim}-d features" if dim is not None else ""
    raise IndexFactoryError(
        f"--index {factory!r}: FAISS cannot build it{where} ({_faiss_reason(first)}); give an "
        "index_factory string such as Flat, IVF4096,Flat, IVF4096,PQ64, HNSW32 or OPQ64,IVF4096,PQ64, or auto"
    )


# ---------------------------------------------------------------- autofaiss port
def _nb_clusters(factory: str) -> int | None:
    """autofaiss ``index_key_to_nb_cluster`` (None instead of its ValueError)."""
    m = re.findall(r"IVF\d+|IMI\d+x\d+", factory)
    if not m:
        return None
    if m[0].startswith("IVF"):
        return int(m[0][3:])
    a, b = (int(x) for x in re.findall(r"\d+", m[0]))
    return 2 ** (a * b)


def train_rows(factory: str, n: int) -> int:
    """Training sample size: autofaiss ``get_optimal_train_size`` without a memory bound (100
    points per IVF cluster, at most the gallery); 256 x 100 for a PQ without IVF (its 256
    centroids per sub-quantizer; featcache's choice); 0 for factories needing no training."""
    nc = _nb_clusters(factory)
    if nc is not None:
        return int(min(round(100 * nc), n))
    if re.search(r"PQ\d+|SQ|PCA|OPQ|LSH|RQ|LSQ", factory):
        return int(min(256 * 100, n))
    return 0


def get_optimal_nb_clusters(nb_vectors: int) -> list[int]:
    """autofaiss ``get_optimal_nb_clusters``, verbatim."""
    out: list[float] = []
    if nb_vectors < 1_000_000:
        x_initial = 4 * sqrt(nb_vectors)
        x_closest_power = 2 ** round(log2(x_initial))
        out += [round(x_closest_power), 2 * x_closest_power, x_closest_power, round(x_initial)]
    elif nb_vectors < 10_000_000:
        out += [16_384, 65_536]
    elif nb_vectors < 300_000_000:
        out += [65_536, 2**17, 2**18]
    else:
        out += [2**17, 2**18, 65_536, 2**20]
    return [int(x) for x in out] or [256]


def get_optimal_quantization(nb_vectors: int, dim: int, max_bytes: float | None) -> list[str]:
    """autofaiss ``get_optimal_quantization`` (force_quantization_value=None)."""
    target = 0.0 if max_bytes is None else 4.0 * nb_vectors * dim / float(max_bytes)
    out = []
    for pq in (256, 128, 64, 48, 32, 24, 16, 8, 4):
        if pq >= dim:
            continue
        for nc in get_optimal_nb_clusters(nb_vectors):
            if (4 * dim) / (pq + 8) >= target:  # 8: the id stored beside each code
                y = (min(dim // pq, 6) + 1) * pq
                cluster = f"IVF{nc}" if nc < 1000 else f"IVF{nc}_HNSW32"
                out.append(f"OPQ{pq}_{y},{cluster},PQ{pq}x8")
    return out


def autofaiss_index_keys(nb_vectors: int, dim: int, max_bytes: int) -> list[str]:
    """autofaiss ``get_optimal_index_keys_v2`` with its defaults (flat_threshold=1000,
    quantization_threshold=10000, not memory-mappable, no direct map, CPU)."""
    if nb_vectors < 1000:
        return ["Flat"]
    if nb_vectors < 10000:
        return ["HNSW15"]
    m_hnsw = floor((max_bytes / (4 * nb_vectors) - dim) / 2)
    if m_hnsw >= 8:
        return [f"HNSW{min(m_hnsw, 32)}"]
    if nb_vectors < 1_000_000:
        keys = [f"IVF{nc},Flat" for nc in get_optimal_nb_clusters(nb_vectors)]
        if estimated_index_bytes(keys[0], nb_vectors, dim) <= max_bytes:
            return keys
    return get_optimal_quantization(nb_vectors, dim, max_bytes)


def estimated_index_bytes(factory: str, n: int, dim: int) -> int:
    """autofaiss ``IndexMetadata.estimated_index_size_in_bytes`` (make_direct_map=False) for
    Flat, HNSW, IVF*,Flat, OPQ*_*,IVF*[_HNSW*],PQ*; featcache adds ``IVF*,PQ*`` and ``OPQ*,...``
    without an output dimension (the same sum, the OPQ matrix d x d) and ``PQ*`` alone
    (codes only). -1 for factories it has no formula for (those never pass a budget)."""
    p = [int(x) for x in re.findall(r"\d+", factory)]
    if factory == "Flat":
        return n * dim * 4
    if m := re.fullmatch(r"OPQ(\d+)(?:_(\d+))?,IVF(\d+)(?:_HNSW(\d+))?,PQ(\d+)(?:x(\d+))?", factory):
        m_opq, out_d, nc, m_hnsw, pq, nbits = (int(g) if g else None for g in m.groups())
        assert m_opq is not None
        assert nc is not None
        assert pq is not None
        total = n * (ceil(pq * (nbits or 8) / 8) + 8) + nc * dim * 4
        total += nc * (m_hnsw or 0) * 2 * 4
        return int(total + m_opq * (out_d or dim) * 4)
    if m := re.fullmatch(r"IVF(\d+)(?:_HNSW(\d+))?,PQ(\d+)(?:x(\d+))?", factory):
        nc, m_hnsw, pq, nbits = (int(g) if g else None for g in m.groups())
        assert nc is not None
        assert pq is not None
        return int(n * (ceil(pq * (nbits or 8) / 8) + 8) + nc * dim * 4 + nc * (m_hnsw or 0) * 8)
    if re.fullmatch(r"HNSW\d+(,Flat)?", factory):
        return n * p[0] * 2 * 4 + n * dim * 4
    if re.fullmatch(r"IVF\d+,Flat", factory):
        return n * dim * 4 + p[0] * dim * 4
    if m := re.fullmatch(r"PQ(\d+)(?:x(\d+))?", factory):
        return int(n * ceil(int(m.group(1)) * int(m.group(2) or 8) / 8))
    return -1


def candidate_factories(n: int, dim: int, max_bytes: int) -> list[str]:
    """The factories ``--index auto`` tries, in order: autofaiss's list, then (where nothing in
    it fits: autofaiss returns HNSW15 below 10,000 vectors whatever the budget) its
    quantization list; only those whose estimated size fits ``max_bytes``."""
    keys = list(dict.fromkeys(autofaiss_index_keys(n, dim, max_bytes)))  # autofaiss repeats some
    fits = [k for k in keys if 0 <= estimated_index_bytes(k, n, dim) <= max_bytes]
    if not fits and n >= 1000:
        quant = dict.fromkeys(get_optimal_quantization(n, dim, max_bytes))
        fits = [k for k in quant if 0 <= estimated_index_bytes(k, n, dim) <= max_bytes]
    if not fits:
        flat = n * dim * 4
        raise ConfigError(
            f"no FAISS index of {n} x {dim} features fits --max-memory {max_bytes / 1e9:.3g} GB "
            f"(the flat index needs {flat / 1e9:.3g} GB); raise --max-memory or give --index FACTORY"
        )
    return fits


# ---------------------------------------------------------------- search parameters
def search_params(index: Any) -> dict[str, int]:
    """The index's current nprobe / efSearch (what it searches with)."""
    faiss = _faiss()
    out: dict[str, int] = {}
    with contextlib.suppress(RuntimeError):
        out["nprobe"] = int(faiss.extract_index_ivf(index).nprobe)
    base = faiss.downcast_index(index.index if hasattr(index, "chain") else index)
    hnsw = getattr(base, "hnsw", None)
    if hnsw is None and "nprobe" in out:
        hnsw = getattr(faiss.downcast_index(faiss.extract_index_ivf(index).quantizer), "hnsw", None)
    if hnsw is not None:
        out["ef_search"] = int(hnsw.efSearch)
    return out


def set_search_params(index: Any, factory: str, nprobe: int | None, ef_search: int | None) -> None:
    """Set nprobe / efSearch with ``faiss.ParameterSpace``; a parameter the index lacks is a
    one-line error."""
    faiss = _faiss()
    ps = faiss.ParameterSpace()
    for name, flag, value in (("nprobe", "--nprobe", nprobe), ("efSearch", "--ef-search", ef_search)):
        if value is None:
            continue
        try:
            ps.set_index_parameter(index, name, int(value))
        except RuntimeError:
            raise IndexFactoryError(f"{flag} does not apply to index {factory!r} (it has no {name}); drop it") from None


def index_search(index: Any, Q: PreparedRows, k: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Scores (higher is better, -inf where missing) and gallery indices (-1) [Q, k]."""
    kk = max(1, min(k, int(index.ntotal)))
    sc, ix = index.search(Q.array(), kk)
    ix = ix.astype(np.int64)
    sc = (-sc if metric == "l2" else sc).astype(np.float32)
    sc = np.where(ix < 0, -np.inf, sc).astype(np.float32)
    if kk < k:
        sc = np.concatenate([sc, np.full((sc.shape[0], k - kk), -np.inf, np.float32)], axis=1)
        ix = np.concatenate([ix, np.full((ix.shape[0], k - kk), -1, np.int64)], axis=1)
    return sc, ix


# ---------------------------------------------------------------- build, store, reuse
@dataclass
class BuiltIndex:
    """A trained, filled FAISS index and what it was built from."""

    index: Any
    factory: str
    provenance: dict
    reused: bool = False

    @property
    def params(self) -> dict[str, int]:
        return search_params(self.index)


def _sample(n: int, size: int, seed: int) -> np.ndarray:
    """``size`` sorted row indices of ``n`` (numpy's seeded permutation)."""
    return np.sort(np.random.default_rng(seed).permutation(n)[:size]).astype(np.int64)


def _to_gpu(faiss, index):
    """(index on GPU 0, True) where faiss sees a GPU and can move it, else (index, False)."""
    get = getattr(faiss, "get_num_gpus", None)
    if not get or get() <= 0:
        return index, False
    try:
        res = faiss.StandardGpuResources()
        gpu = faiss.index_cpu_to_gpu(res, 0, index)
        gpu.referenced_resources = res  # keep alive
        return gpu, True
    except (RuntimeError, AttributeError) as exc:
        log.info("FAISS cannot build %s on the GPU (%s); building on the CPU", type(index).__name__, _faiss_reason(exc))
        return index, False


#: stored codes above this size are allocated once at their final size before rows are added
RESERVE_BYTES = 64 * 1024**2


def _reserve_lists(ivf: Any, sizes: np.ndarray) -> None:
    """Allocate each inverted list at its final length (resize up, then back to empty: a
    std::vector keeps its capacity), so adding never doubles a list's buffer."""
    faiss = _faiss()
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if not isinstance(lists, faiss.ArrayInvertedLists):
        return
    for no in np.flatnonzero(sizes):
        lists.resize(int(no), int(sizes[no]))
        lists.resize(int(no), 0)


def add_rows(index: Any, G: PreparedRows) -> None:
    """Add every gallery row, block by block, without the up-to-2x overshoot of FAISS's
    growing buffers (a list or flat store appended row by row doubles its capacity; for a
    1.28M x 2048 IVF,Flat that is up to 10 GB more at peak than the index itself):

    - a flat store (``Flat``, ``HNSW*`` over a flat storage) is allocated at its final size;
    - an IVF index (not under a transform) assigns every row first, allocates each list at
      its final length, then adds the rows with those assignments (``add_core``: no second
      assignment). Smaller indexes (codes under :data:`RESERVE_BYTES`) are added plainly.

    The index is the same, byte for byte, as ``index.add`` of every block makes it."""
    faiss = _faiss()
    n = G.shape[0]
    base = faiss.downcast_index(index)
    flat = faiss.downcast_index(base.storage) if isinstance(base, faiss.IndexHNSW) else base
    if isinstance(flat, faiss.IndexFlatCodes) and n * flat.code_size > RESERVE_BYTES and flat.ntotal == 0:
        flat.codes.resize(n * flat.code_size)
        flat.codes.resize(0)
    if not isinstance(base, faiss.IndexIVF) or n * base.code_size <= RESERVE_BYTES:
        for _, _, Gb in G.blocks():
            index.add(Gb)
        return
    assign = np.empty(n, np.int64)
    for lo, hi, Gb in G.blocks():
        assign[lo:hi] = base.quantizer.assign(Gb, 1).ravel()
    _reserve_lists(base, np.bincount(assign, minlength=base.nlist))
    for lo, hi, Gb in G.blocks():
        a = np.ascontiguousarray(assign[lo:hi])
        base.add_core(hi - lo, faiss.swig_ptr(Gb), None, faiss.swig_ptr(a))


def build_index(G: PreparedRows, factory: str, metric: str, *, seed: int = 0, n_train: int | None = None) -> BuiltIndex:
    """Train ``factory`` on a seeded sample of the gallery rows and add every row (blocks)."""
    faiss = _faiss()
    check_factory(factory, G.shape[1], metric)
    t0 = time.perf_counter()
    index = faiss.index_factory(G.shape[1], factory, faiss_metric(metric))
    index, on_gpu = _to_gpu(faiss, index)
    if not on_gpu:
        log.info("building FAISS index %s on the CPU (no FAISS GPU)", factory)
    n = G.shape[0]
    size = 0 if index.is_trained else min(n, n_train if n_train else train_rows(factory, n) or n)
    ids = _sample(n, size, seed) if size else np.zeros(0, np.int64)
    if size:
        try:
            index.train(np.ascontiguousarray(G.take(ids), np.float32))
        except RuntimeError as exc:
            raise IndexFactoryError(
                f"--index {factory!r}: FAISS cannot train it on {size} rows ({_faiss_reason(exc)}); "
                "use fewer IVF lists / PQ bits for this gallery"
            ) from None
    if on_gpu:  # a GPU index has no host buffers to size
        for _, _, Gb in G.blocks():
            index.add(Gb)
        index = faiss.index_gpu_to_cpu(index)
    else:
        add_rows(index, G)
    prov = {
        "factory": factory,
        "metric": metric,
        "dim": int(G.shape[1]),
        "n_gallery": int(n),
        "train_seed": int(seed),
        "n_train": int(size),
        "train_rows": ids.tolist(),
        "built_on": "gpu" if on_gpu else "cpu",
        "build_seconds": time.perf_counter() - t0,
        "faiss_version": str(getattr(faiss, "__version__", "")),
    }
    return BuiltIndex(index, factory, prov)


def index_key(gallery_fingerprint: str, factory: str, metric: str, seed: int, n_train: int | None) -> str:
    """File name stem of a stored index: a readable factory part and a hash of what defines it."""
    spec = json.dumps([gallery_fingerprint, factory, metric, seed, n_train])
    slug = re.sub(r"[^A-Za-z0-9]+", "-", factory).strip("-")
    return f"{slug}-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"


def index_dir(cache: str) -> str:
    """Where a store's indexes live: the sibling folder ``<cache>.indexes``."""
    return cache.rstrip("/") + ".indexes"


#: bytes per read/write of a stored index: it streams through FAISS's callback IO, so a
#: 10 GB IVF,Flat index is never held twice (serialised bytes beside the index) in memory
IO_BLOCK = 16 * 1024**2


def write_index_to(index: Any, fh) -> tuple[int, str]:
    """Write ``index`` to the binary file ``fh`` in blocks (FAISS ``write_index`` through a
    callback writer): (bytes written, their sha256). ``fh=None`` only counts and hashes."""
    faiss = _faiss()
    digest, n = hashlib.sha256(), 0

    def put(b: bytes) -> int:
        nonlocal n
        digest.update(b)
        n += len(b)
        if fh is not None:
            fh.write(b)
        return len(b)

    faiss.write_index(index, faiss.PyCallbackIOWriter(put, IO_BLOCK))
    return n, digest.hexdigest()


def save_index(built: BuiltIndex, where: str, key: str, extra: dict) -> dict:
    """Write ``<where>/<key>.faiss`` then ``.json`` (written last: an index without it is ignored)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(where)
    fs.makedirs(root, exist_ok=True)
    tmp = f"{root}/{key}.faiss.tmp"
    with fs.open(tmp, "wb") as fh:
        size, sha = write_index_to(built.index, fh)
    fs.mv(tmp, f"{root}/{key}.faiss")
    prov = {**built.provenance, **extra, "sha256": sha, "bytes": size}
    with fs.open(f"{root}/{key}.json", "w") as fh:
        json.dump(prov, fh)
    built.provenance = prov
    return prov


def _file_sha256(fs, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while block := fh.read(IO_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _read_index(fs, path: str, sha256: str) -> Any:
    """Deserialise ``path`` in blocks (FAISS ``read_index`` through a callback reader),
    hashing what it reads; None if those bytes are not the ones checked (changed meanwhile)."""
    faiss = _faiss()
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:

        def get(n: int) -> bytes:
            b = fh.read(n)
            digest.update(b)
            return b

        index = faiss.read_index(faiss.PyCallbackIOReader(get, IO_BLOCK))
        while rest := fh.read(IO_BLOCK):  # bytes FAISS did not need still belong to the file
            digest.update(rest)
    return index if digest.hexdigest() == sha256 else None


#: what a stored index's record must hold, and of which type (a record without them is damaged)
RECORD_FIELDS: dict[str, type] = {
    "factory": str,
    "metric": str,
    "dim": int,
    "n_gallery": int,
    "sha256": str,
    "bytes": int,
}
#: gallery rows searched to check that a stored index holds this gallery's rows (its own row
#: found among its top :data:`SELF_K`); below :data:`SELF_MIN_ROWS` rows chance finds them too
SELF_ROWS, SELF_K, SELF_MIN_ROWS = 32, 10, 40


def read_record(fs, path: str) -> tuple[dict | None, str]:
    """A stored index's record, or (None, why it is unusable): unreadable, truncated (what a
    kill during its write leaves), not a JSON object (``[]``, ``null``) or missing a field."""
    try:
        with fs.open(path) as fh:
            prov = json.load(fh)
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    if not isinstance(prov, dict):
        return None, f"not an index record (a JSON {type(prov).__name__})"
    bad = [k for k, t in RECORD_FIELDS.items() if not isinstance(prov.get(k), t) or isinstance(prov.get(k), bool)]
    return (None, f"missing or mistyped {', '.join(bad)}") if bad else (prov, "")


def index_disagrees(index: Any, prov: dict) -> str:
    """Why the index itself contradicts its record (FAISS ``ntotal``/``d`` against the
    recorded gallery rows and width), or ''."""
    if int(index.ntotal) != prov["n_gallery"] or int(index.d) != prov["dim"]:
        return (
            f"it holds {int(index.ntotal)} x {int(index.d)} vectors but its record says "
            f"{prov['n_gallery']} x {prov['dim']}"
        )
    return ""


def gallery_disagrees(index: Any, G: PreparedRows) -> str:
    """Why the index does not hold gallery ``G``'s rows, or '': a seeded sample of the rows is
    searched and at least half must find themselves among the index's top :data:`SELF_K` (an
    index built from other features, such as another backbone's of the same width, finds
    them by chance only)."""
    if int(index.ntotal) != G.shape[0] or int(index.d) != G.shape[1]:
        return f"it holds {int(index.ntotal)} x {int(index.d)} vectors, the gallery is {G.shape[0]} x {G.shape[1]}"
    if G.shape[0] < SELF_MIN_ROWS:
        return ""
    rows = _sample(G.shape[0], SELF_ROWS, 0)
    _, ix = index.search(np.ascontiguousarray(G.take(rows), np.float32), SELF_K)
    found = int((ix == rows[:, None]).any(axis=1).sum())
    if 2 * found < rows.size:
        return f"only {found} of {rows.size} gallery rows find themselves among its top {SELF_K}: other features"
    return ""


def load_index(where: str, key: str, expect: dict, G: PreparedRows | None = None) -> BuiltIndex | None:
    """The stored index ``key`` if its record matches ``expect``, its bytes its checksum and
    the index itself its record and gallery ``G`` (:func:`index_disagrees`,
    :func:`gallery_disagrees`); None (and a warning when something stored was refused)
    otherwise, so the caller rebuilds it. The bytes are hashed before FAISS reads them
    (corrupt bytes are never deserialised) and again as it reads."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(where)
    blob = f"{root}/{key}.faiss"
    if not fs.exists(f"{root}/{key}.json") or not fs.exists(blob):
        return None
    prov, why = read_record(fs, f"{root}/{key}.json")
    if prov is None:
        log.warning("stored index record %s/%s.json is %s; refused, rebuilding the index", where, key, why)
        return None
    diff = sorted(k for k, v in expect.items() if prov.get(k) != v)
    if diff:
        log.warning("stored index %s/%s was built from other %s; refused, rebuilding it", where, key, diff)
        return None
    index = _read_index(fs, blob, prov["sha256"]) if _file_sha256(fs, blob) == prov.get("sha256") else None
    if index is None:
        log.warning("stored index %s/%s.faiss does not match its recorded sha256; refused, rebuilding it", where, key)
        return None
    why = index_disagrees(index, prov) or (gallery_disagrees(index, G) if G is not None else "")
    if why:
        log.warning("stored index %s/%s.faiss does not fit this gallery (%s); refused, rebuilding it", where, key, why)
        return None
    return BuiltIndex(index, prov["factory"], prov, reused=True)


def rows_digest(ids: Any) -> str:
    """sha256 of the gallery's row ids, in order (the rows an index's positions stand for)."""
    return hashlib.sha256(json.dumps([str(i) for i in np.asarray(ids).tolist()]).encode()).hexdigest()


def _stored_problem(fs, root: str, key: str) -> str:
    """What is wrong with stored index ``key`` (its record, its bytes, the index against its
    record), or ''. An index file without a record is what an interrupted save leaves: no damage."""
    prov, why = read_record(fs, f"{root}/{key}.json")
    if prov is None:
        return f"record {key}.json is {why}"
    blob = f"{root}/{key}.faiss"
    if not fs.exists(blob):
        return f"index file {key}.faiss is missing"
    if fs.size(blob) != prov["bytes"] or _file_sha256(fs, blob) != prov["sha256"]:
        return f"index file {key}.faiss does not match its record's sha256/bytes"
    index = _read_index(fs, blob, prov["sha256"])
    if index is None:
        return f"index file {key}.faiss changed while it was read"
    why = index_disagrees(index, prov)
    return f"index file {key}.faiss contradicts its record: {why}" if why else ""


def verify_index_records(cache: str, repair: bool = False) -> list[str]:
    """``featcache verify``'s check of the indexes stored beside store ``cache``: one problem line
    per record that is unreadable, truncated or not a record, per index file missing or not
    matching its record's sha256/bytes, and per index whose ``ntotal``/``d`` contradict its
    record. ``repair``: the damaged index and record are removed (the next ``retrieve
    --index`` rebuilds them)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(index_dir(cache))
    if not fs.isdir(root):
        return []
    keys = sorted({n.rsplit("/", 1)[-1][: -len(".json")] for n in fs.ls(root, detail=False) if n.endswith(".json")})
    out = []
    for key in keys:
        why = _stored_problem(fs, root, key)
        if not why:
            continue
        if repair:
            for suffix in (".json", ".faiss"):
                if fs.exists(f"{root}/{key}{suffix}"):
                    fs.rm(f"{root}/{key}{suffix}")
        then = "removed by --repair" if repair else "`featcache verify --repair` removes it"
        out.append(f"stored index {root}/{key}: {why}; the next `featcache retrieve --index` rebuilds it ({then})")
    return out


def check_index_dir(where: str) -> None:
    """A folder an index can be stored in, else one line before the index is built: a file at
    ``where``, a folder that cannot be made, a read-only local folder."""
    import os

    import fsspec

    from featcache.errors import CacheNotWritableError

    fs, root = fsspec.core.url_to_fs(where)
    why = "it is a file" if fs.exists(root) and not fs.isdir(root) else ""
    if not why:
        try:
            fs.makedirs(root, exist_ok=True)
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if not why and local and not os.access(root, os.W_OK | os.X_OK):
        why = "it is not writable"
    if why:
        raise CacheNotWritableError(
            f"cannot store FAISS indexes in {where} ({why}); give --index-dir a writable folder "
            "(default: <cache>.indexes beside the store)"
        )
