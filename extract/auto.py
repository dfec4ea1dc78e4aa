"""``--backend auto`` and ``--precision auto``: the fastest forward that keeps the features.

**Backend.** Each backend's start-up (build + first batch beyond a steady batch) and steady
images/s are measured on this machine and cached per (backbone, input size, precision, device,
CPU ISA, torch threads, library versions) in a small JSON file (:func:`costs_path`). For a job
of ``n`` images the choice is the backend with the smallest ``start-up + n / rate``
(:func:`choose_backend`, a pure function); a backend whose features left the agreement bound
against eager (max abs diff 1e-4, cosine 0.999999, as tests/extract/test_backends.py checks) is never
chosen. A backend not measured yet is measured (its engine built and kept if chosen) only when
its expected start-up is at most :data:`CALIBRATE_FRACTION` of eager's time for the job
(:func:`to_measure`), so measuring costs at most that fraction when it loses. A resume takes
the backend the stored features were computed with.

**Precision.** ``auto`` is bf16 autocast where the device computes bf16 in hardware (CUDA; a
CPU with ``amx_bf16``/``avx512_bf16``) and the backbone's bf16 features agree with fp32 on the
job's first batch (every row's cosine >= :data:`BF16_MIN_COSINE`; :func:`bf16_agreement`),
else fp32; an explicit ``bf16`` whose check fails is refused. Either way the check is recorded
in the provenance (``extra.precision_check``). A resume takes the stored precision.

Engines compute fp32 only, so the precision is resolved first and ``--backend auto`` chooses
among the backends that run it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from featcache.extract.backends import engines

log = logging.getLogger(__name__)

#: environment variable naming the cost cache file (tests point it at a temporary folder)
COSTS_ENV = "FEATCACHE_BACKEND_COSTS"
#: the backend agreement bound against eager (tests/extract/test_backends.py)
ATOL, MIN_COSINE = 1e-4, 0.999999
#: the bf16 check: every checked row's cosine against fp32 at least this (lite0 on digits at
#: 112 px: min 0.9947 over 32 rows; on Fashion-MNIST min 0.988 over 1,000 rows)
BF16_MIN_COSINE = 0.98
#: start-up assumed for a backend never measured here (measured on the 2-core VM under load,
#: lite0 64 px: onnxruntime 13 s, openvino 52 s, compile 296 s)
PRIOR_STARTUP_S = {"onnxruntime": 15.0, "openvino": 60.0, "compile": 300.0}
#: measure an unmeasured backend only if its assumed start-up is at most this share of eager's job
CALIBRATE_FRACTION = 0.1
#: no measurement at all for jobs of at most this many batches (nothing could repay it)
MIN_BATCHES_TO_MEASURE = 8


@dataclass(frozen=True)
class BackendCost:
    """One backend's measured cost for one key: start-up seconds, steady images/s and its
    features' agreement with eager on the measured batch."""

    startup_s: float
    images_per_s: float
    max_abs_diff: float = 0.0
    cosine_min: float = 1.0

    @property
    def agrees(self) -> bool:
        return self.max_abs_diff <= ATOL and self.cosine_min >= MIN_COSINE


# --------------------------------------------------------------------------- the cost cache
def costs_path() -> Path:
    """The cost cache: ``$FEATCACHE_BACKEND_COSTS``, else ``$XDG_CACHE_HOME/featcache/backend_costs.json``
    (``~/.cache`` without ``XDG_CACHE_HOME``)."""
    env = os.environ.get(COSTS_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "featcache" / "backend_costs.json"


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "-"


def cost_key(model: str, input_size: Sequence[int], precision: str, device: str, threads: int | None) -> str:
    """The cache key of a measurement: what decides a backend's speed on this machine."""
    from featcache.core.cpu import cpu_isa

    dev = device.split(":")[0]
    isa = cpu_isa() if dev == "cpu" else dev
    libs = ",".join(f"{p}={_version(p)}" for p in ("torch", "onnxruntime", "openvino"))
    size = "x".join(str(int(s)) for s in input_size)
    return f"{model}|{size}|{precision}|{dev}|{isa}|threads={threads}|{libs}"


def _read_all(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring the backend cost cache %s (%s); it is rewritten when measured", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def load_costs(key: str) -> dict[str, BackendCost]:
    """The cached costs of ``key`` (empty when none or the file is unreadable)."""
    out = {}
    for b, c in (_read_all(costs_path()).get(key) or {}).items():
        try:
            out[b] = BackendCost(
                **{k: float(c[k]) for k in ("startup_s", "images_per_s", "max_abs_diff", "cosine_min")}
            )
        except (KeyError, TypeError, ValueError):
            continue  # a malformed entry is measured again
    return out


def record_costs(key: str, costs: Mapping[str, BackendCost]) -> None:
    """Merge ``costs`` into the cache (atomic replace; an unwritable cache is logged, not fatal)."""
    if not costs:
        return
    path = costs_path()
    data = _read_all(path)
    data.setdefault(key, {}).update({b: asdict(c) for b, c in costs.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the backend cost cache %s (%s); measurements are not kept", path, exc)


# --------------------------------------------------------------------------- the choice (pure)
def candidates(device: str, precision: str) -> tuple[str, ...]:
    """Backends that can run ``precision`` on ``device``: the engines on a CPU in fp32 only."""
    if device.startswith("cpu") and precision in ("fp32", "none"):
        return ("eager", "compile", *engines())
    return ("eager", "compile")


def to_measure(n_images: int, batch_size: int, costs: Mapping[str, BackendCost], cands: Sequence[str]) -> list[str]:
    """The backends to measure for this job, in order: eager (its rate is the reference) unless
    cached, then each unmeasured candidate whose assumed start-up is at most
    :data:`CALIBRATE_FRACTION` of eager's time for the job. Nothing for a job of at most
    :data:`MIN_BATCHES_TO_MEASURE` batches."""
    if n_images <= MIN_BATCHES_TO_MEASURE * batch_size:
        return []
    out = [] if "eager" in costs else ["eager"]
    eager_ips = costs["eager"].images_per_s if "eager" in costs else None
    for b in cands:
        if b == "eager" or b in costs:
            continue
        if eager_ips is None or PRIOR_STARTUP_S[b] <= CALIBRATE_FRACTION * n_images / eager_ips:
            out.append(b)  # eager unmeasured: decided again once its rate is known
    return out


def choose_backend(n_images: int, costs: Mapping[str, BackendCost], cands: Sequence[str]) -> tuple[str, str]:
    """(backend, why) for a job of ``n_images``: the smallest ``start-up + n / rate`` among the
    measured candidates whose features agree with eager; eager when it is not measured."""
    if "eager" not in costs:
        return "eager", f"{n_images} images: too few to measure the backends, eager"
    est, left = {}, []
    for b in cands:
        c = costs.get(b)
        if c is None:
            continue
        if not c.agrees:
            left.append(f"{b} off the agreement bound (max |diff| {c.max_abs_diff:.2g}, cosine {c.cosine_min:.7f})")
            continue
        est[b] = c.startup_s + n_images / c.images_per_s
    best = min(est, key=lambda b: est[b])  # dict order: eager first wins a tie
    parts = [
        f"{b} {costs[b].startup_s:.1f} s + {n_images} / {costs[b].images_per_s:.1f} img/s = {t:.1f} s"
        for b, t in est.items()
    ]
    unmeasured = [b for b in cands if b not in costs]
    why = f"{n_images} images: " + "; ".join(parts + left)
    if unmeasured:
        why += f" ({', '.join(unmeasured)} not measured: the job is too short to repay their start-up)"
    return best, why


# --------------------------------------------------------------------------- measuring
def _agreement(out: Mapping[str, Any], ref: Mapping[str, Any], ok: Any = None) -> tuple[float, float]:
    """(max abs diff, min row cosine) of ``out`` against ``ref`` over every kind (rows ``ok`` only)."""
    import torch

    diff, cos = 0.0, 1.0
    for k, r in ref.items():
        # one cosine per row over its whole array (a token kind's row is [T, D])
        a, b = out[k].detach().double().cpu().flatten(1), r.detach().double().cpu().flatten(1)
        if ok is not None:
            a, b = a[ok], b[ok]
        if not len(a):
            continue
        diff = max(diff, float((a - b).abs().max()))
        na, nb = a.norm(dim=1), b.norm(dim=1)
        c = torch.where((na == 0) & (nb == 0), torch.ones_like(na), (a * b).sum(1) / (na * nb).clamp_min(1e-300))
        cos = min(cos, float(c.min()))
    return diff, cos


def _timed(fn: Callable[[], Any], cuda: bool) -> tuple[Any, float]:
    import torch

    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def measure(
    head: Any, x: Any, backends: Sequence[str], amp_dtype: Any, ref: Mapping[str, Any] | None = None
) -> tuple[dict, dict]:
    """Build and time each backend on batch ``x`` (first call = build + batch, then the faster
    of two steady batches; start-up = the difference, 0 for eager); ``({backend: BackendCost}, {backend: built forward})``.
    Agreement is against eager's output ``ref`` (computed here when None). A backend that
    fails to build is logged and left out."""
    import torch

    from featcache.extract.backends import make_forward

    cuda = str(x.device).startswith("cuda")
    costs, built = {}, {}
    with torch.inference_mode(), torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        want: Mapping[str, Any] = head(x) if ref is None else ref
        for b in backends:
            try:
                fwd = make_forward(head, b)
                out, first = _timed(lambda fwd=fwd: fwd(x), cuda)
                steady = min(_timed(lambda fwd=fwd: fwd(x), cuda)[1] for _ in range(2))
            except Exception as exc:  # an engine that cannot take this model: not a candidate now
                log.warning(
                    "--backend auto: %s failed on %s (%s: %s); not used", b, head.bb.name, type(exc).__name__, exc
                )
                continue
            diff, cos = _agreement(out, want)
            startup = 0.0 if b == "eager" else max(0.0, first - steady)  # eager builds nothing (warmed by ref)
            costs[b] = BackendCost(startup, len(x) / max(steady, 1e-9), diff, cos)
            built[b] = fwd
            log.info(
                "measured --backend %s on %s: start-up %.1f s, %.1f img/s, max |diff| %.2g",
                b,
                head.bb.name,
                costs[b].startup_s,
                costs[b].images_per_s,
                diff,
            )
    return costs, built


def bf16_agreement(head: Any, x: Any, ok: Any = None, threshold: float = BF16_MIN_COSINE) -> dict[str, Any]:
    """The bf16 check: ``head``'s features of batch ``x`` under bf16 autocast against fp32
    (valid rows ``ok``): ``{"cosine_min", "max_abs_diff", "threshold", "rows", "passed"}``."""
    import torch

    dev = x.device.type
    with torch.inference_mode():
        ref = head(x)
        with torch.autocast(dev, dtype=torch.bfloat16):
            low = head(x)
    rows = int(ok.sum()) if ok is not None else len(x)
    diff, cos = _agreement({k: v.float() for k, v in low.items()}, ref, ok)
    return {
        "cosine_min": round(cos, 6),
        "max_abs_diff": round(diff, 6),
        "threshold": threshold,
        "rows": rows,
        "passed": bool(rows > 0 and cos >= threshold),
    }


# --------------------------------------------------------------------------- one job's resolution
@dataclass
class Resolved:
    """What ``auto`` (or the explicit words) resolved to for one job."""

    amp: str  # as the provenance records it: none | bf16 | fp16
    backend: str
    fwd: Callable
    record: dict[str, Any]  # into each provenance's ``extra``
    forward_ips: float | None = None  # eager's measured rate at the job's threads (None: not measured)
    decode_ips: float | None = None  # decode + preprocess of the first batch, one core


def first_batch(src: Any, bb: Any, batch_size: int, channels_last: bool) -> tuple[Any, Any, float]:
    """(the job's first batch on the device, its valid-row mask, decode+preprocess images/s on
    one core), made as :mod:`featcache.extract.loop` makes batches."""
    import torch

    from featcache.data.preprocess import split_transform
    from featcache.extract.batching import ImageRows, collate

    cuda = bb.device.startswith("cuda")
    fast = split_transform(bb.transform)
    ds = ImageRows(src, bb.transform, tuple(bb.data_config["input_size"]), fast)
    t = time.perf_counter()
    items = [ds[i] for i in range(min(batch_size, len(src)))]
    _, x, ok, _ = collate(items, channels_last=channels_last and not cuda, fast=None if cuda else fast)
    decode_ips = len(items) / max(time.perf_counter() - t, 1e-9)
    x = x.to(bb.device)
    if cuda and fast is not None:
        x = fast.normalize(x, channels_last)
    elif channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, ok.to(x.device), decode_ips


def resolve_precision_auto(
    cfg: Any, head: Any, dev: str, stored: Any, batch: Callable[[], tuple]
) -> tuple[str, dict[str, Any]]:
    """(recorded precision, provenance record) of ``cfg.amp`` (see the module docstring);
    ``stored``: a stored provenance of this job (a resume) or None; ``batch()``: the first batch."""
    from featcache.core.devices import PRECISION_ALIASES
    from featcache.errors import PrecisionUnavailableError
    from featcache.extract.settings import compute_settings, recorded_precision

    asked = PRECISION_ALIASES.get(cfg.amp, cfg.amp)
    rec: dict[str, Any] = {"precision_check": None}
    if asked == "default":  # bf16 on CUDA, fp32 on CPU, no check (the behaviour before auto)
        return recorded_precision("auto", dev), rec
    if asked == "auto" and stored is not None and compute_settings(stored)["precision"]:
        old = compute_settings(stored)["precision"]
        rec["precision_reason"] = f"resumed: the stored features were computed in {'fp32' if old == 'none' else old}"
        return recorded_precision("fp32" if old == "none" else old, dev), rec
    if asked == "auto":
        from featcache.core.cpu import bf16_support

        hw, why = (
            (True, "CUDA") if dev.startswith("cuda") else bf16_support() if dev.startswith("cpu") else (False, dev)
        )
        if cfg.backend in engines():
            rec["precision_reason"] = f"fp32: --backend {cfg.backend} computes fp32 only"
            return "none", rec
        if not hw:
            rec["precision_reason"] = f"fp32: {why}"
            return "none", rec
    amp = recorded_precision("bf16" if asked == "auto" else str(asked), dev)
    if amp != "bf16":
        return amp, rec
    x, ok, _ = batch()
    check = rec["precision_check"] = bf16_agreement(head, x, ok)
    if check["passed"]:
        rec["precision_reason"] = (
            f"bf16: first batch's cosine vs fp32 >= {check['threshold']} (min {check['cosine_min']})"
        )
        return "bf16", rec
    msg = (
        f"{head.bb.name}'s bf16 features disagree with fp32 on the job's first batch: min cosine "
        f"{check['cosine_min']} < {check['threshold']} over {check['rows']} rows"
    )
    if asked == "bf16":
        raise PrecisionUnavailableError(f"--precision bf16 refused: {msg}; use --precision fp32 (Python: amp='fp32')")
    rec["precision_reason"] = f"fp32: {msg}"
    return "none", rec


def resolve_backend_auto(
    cfg: Any, head: Any, dev: str, amp: str, stored: Any, n_images: int, threads: int | None, batch: Callable[[], tuple]
) -> Resolved:
    """The forward of ``cfg.backend`` (``auto``: :func:`choose_backend` over the cached and,
    where worth it, newly measured costs; a resume: the stored backend)."""
    import importlib.util

    import torch

    from featcache.extract.backends import check_backend, make_forward
    from featcache.extract.settings import compute_settings

    rec: dict[str, Any] = {"backend_requested": cfg.backend}
    if cfg.backend != "auto":
        check_backend(cfg.backend, amp, dev)
        return Resolved(amp, cfg.backend, make_forward(head, cfg.backend), rec)
    old = compute_settings(stored)["backend"] if stored is not None else None
    if old is not None and old != "auto":
        check_backend(old, amp, dev)
        rec["backend_reason"] = "resumed: the stored features were computed with it"
        return Resolved(amp, old, make_forward(head, old), rec)
    layers = bool(getattr(head, "layer_records", None))  # per-layer kinds run on eager or compile only
    cands = [
        b
        for b in candidates(dev, amp)
        if b not in engines() or (not layers and importlib.util.find_spec(b) is not None)
    ]
    key = cost_key(head.bb.name, head.bb.data_config["input_size"], amp, dev, threads)
    costs = load_costs(key)
    built: dict[str, Callable] = {}
    first = to_measure(n_images, cfg.batch_size, costs, cands)
    decode_ips = None
    if first:
        x, _, decode_ips = batch()
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
        with torch.inference_mode(), torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            ref = head(x)  # warm-up and the agreement reference
        new, built = measure(head, x, [b for b in first if b == "eager"], amp_dtype, ref)
        costs.update(new)
        rest = [b for b in to_measure(n_images, cfg.batch_size, costs, cands) if b != "eager"]
        new2, built2 = measure(head, x, rest, amp_dtype, ref)
        new.update(new2)
        built.update(built2)
        costs.update(new2)
        record_costs(key, new)
    choice, why = choose_backend(n_images, costs, cands)
    rec["backend_reason"] = why
    eager = costs.get("eager")
    fwd = built.get(choice) or make_forward(head, choice)
    return Resolved(amp, choice, fwd, rec, eager.images_per_s if eager else None, decode_ips)


def resolve(cfg: Any, head: Any, dev: str, stored: Any, n_images: int, threads: int | None, src: Any) -> Resolved:
    """The job's precision, then its backend (engines run fp32 only), each logged in one line."""
    cache: dict[str, tuple] = {}

    def batch() -> tuple:
        if "x" not in cache:
            cache["x"] = first_batch(src, head.bb, cfg.batch_size, cfg.channels_last)
        return cache["x"]

    amp, prec = resolve_precision_auto(cfg, head, dev, stored, batch)
    res = resolve_backend_auto(cfg, head, dev, amp, stored, n_images, threads, batch)
    res.record.update(prec)
    if res.decode_ips is None and "x" in cache:
        res.decode_ips = cache["x"][2]
    if cfg.amp == "auto":
        log.info("--precision auto = %s (%s)", "fp32" if amp == "none" else amp, prec.get("precision_reason"))
    if cfg.backend == "auto":
        log.info("--backend auto = %s (%s)", res.backend, res.record.get("backend_reason"))
    return res
