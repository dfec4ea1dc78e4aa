"""Inference backends for the feature forward: eager PyTorch, ``torch.compile`` and CPU engines.

Each backend turns a :class:`~featcache.extract.features.FeatureHead` into a callable
``x -> {kind: tensor}`` with the head's outputs. The engines (ONNX Runtime, OpenVINO) are
built on their first call, from that batch's shape (the batch dimension stays dynamic) and
with the torch thread count in force then, so a resume that restores the recorded thread count
builds them with it. They compute fp32 only (OpenVINO is told so: on a bf16 CPU its default
would be bf16). Measured against eager in ``benchmarks/inference_backends.py``; eager stays the
default (see docs/benchmarks.md, "Inference backends").

>>> fwd = make_forward(head, "onnxruntime")  # doctest: +SKIP
>>> fwd(x)["pooled"].shape  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.core.registry import Registry
from featcache.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardBackend:
    """One ``--backend`` of the feature forward. ``make(head)``: the head's forward as a
    callable ``x -> {kind: tensor}`` (``None``: ``auto``, which :mod:`featcache.extract.auto`
    resolves to another one); ``pip``: set for a CPU engine computing fp32 only, the pip line
    that installs its package (the package of the backend's name, imported before any work)."""

    make: Callable[[Any], Callable] | None
    pip: str = ""


#: the ``--backend`` words of ``featcache extract``, in help order (a new one:
#: ``BACKENDS.register(name, ForwardBackend(make))`` in its own module, or ``"module:attr"``)
BACKENDS: Registry[ForwardBackend] = Registry("forward backend", ConfigError)


def engines() -> list[str]:
    """The registered CPU engines (the backends with a ``pip`` line)."""
    return [name for name in BACKENDS if BACKENDS[name].pip]


def check_backend(backend: str, amp: str, device: str) -> None:
    """Refuse a backend that cannot run this request (unknown, an engine off the CPU, or an
    engine with an autocast precision), saying what to use instead."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend} is invalid: choose one of {', '.join(BACKENDS)}")
    engine = bool(BACKENDS[backend].pip)
    if engine and not device.startswith("cpu"):
        raise ConfigError(f"--backend {backend} runs on the CPU only; use --device cpu or --backend eager|compile")
    if engine and amp != "none":
        raise ConfigError(
            f"--backend {backend} computes fp32 only; use --precision fp32 (Python: amp='fp32') or --backend eager|compile"
        )


def _module(head) -> Any:
    """The head as an ``nn.Module`` returning its kinds as a tuple (what exporters take)."""
    import torch

    class _Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = head.model

        def forward(self, x):
            return tuple(head(x).values())

    return _Head().eval()


def _need(pkg: str, backend: str) -> Any:
    """Import an engine's package, or say which pip install brings it."""
    import importlib

    try:
        return importlib.import_module(pkg)
    except ImportError:
        raise ConfigError(f"--backend {backend} needs the {pkg} package: {BACKENDS[backend].pip}") from None


def export_onnx(head, x, path: Path) -> None:
    """Export the head to ONNX at ``path`` with a dynamic batch dimension (the TorchScript
    exporter where this torch still has it: ~6x faster to export than the dynamo one)."""
    import torch

    _need("onnx", "onnxruntime")
    mod = _module(head)
    names = list(head.kinds)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                mod, (x,), str(path), input_names=["x"], output_names=names,
                dynamic_axes={"x": {0: "batch"}}, dynamo=False,
            )  # fmt: skip
        except (TypeError, RuntimeError, ValueError):  # a torch without the TorchScript exporter
            batch = torch.export.Dim("batch", min=1, max=1 << 16)
            torch.onnx.export(
                mod, (x,), str(path), input_names=["x"], output_names=names,
                dynamic_shapes={"x": {0: batch}}, dynamo=True, verbose=False,
            )  # fmt: skip


def _onnxruntime(head, x) -> Callable:
    import numpy as np
    import torch

    ort = _need("onnxruntime", "onnxruntime")
    with tempfile.TemporaryDirectory(prefix="featcache-onnx-") as d:
        path = Path(d) / "head.onnx"
        export_onnx(head, x, path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = torch.get_num_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    kinds = list(head.kinds)

    def run(x):
        outs = sess.run(None, {"x": np.ascontiguousarray(x.numpy(), dtype=np.float32)})
        return {k: torch.from_numpy(v) for k, v in zip(kinds, outs)}

    return run


def _openvino(head, x) -> Callable:
    import numpy as np
    import torch

    ov = _need("openvino", "openvino")
    model = ov.convert_model(_module(head), example_input=x, input=[(-1, *x.shape[1:])])
    compiled = ov.compile_model(
        model,
        "CPU",
        {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads()},
    )
    kinds = list(head.kinds)

    def run(x):
        res = compiled(np.ascontiguousarray(x.numpy(), dtype=np.float32))
        return {k: torch.from_numpy(np.asarray(res[i])) for i, k in enumerate(kinds)}

    return run


def make_forward(head, backend: str = "eager") -> Callable:
    """The head's forward on ``backend`` (a name in :data:`BACKENDS` other than ``auto``):
    eager, ``compile`` (inductor, with freezing: the weights become constants, valid since the
    forward runs under inference mode), or an engine built from the first batch it sees (its
    build time falls in the first call; ``fwd.stats["build_s"]`` holds it afterwards, for
    ``compile`` the first call's time)."""
    be = BACKENDS.get(backend)
    if be is None or be.make is None:
        raise ConfigError(f"--backend {backend} is invalid: choose one of {', '.join(BACKENDS)}")
    if be.pip and getattr(head, "layer_records", None):
        from featcache.models.sources.layers import no_layers

        raise no_layers(f"--backend {backend}", "exports a fixed graph that featcache does not build for them")
    return be.make(head)


def _eager(head) -> Callable:
    return head.__call__


def _compiled(head) -> Callable:
    import torch

    compiled = torch.compile(head.__call__, options={"freezing": True})
    first: dict[str, float] = {}

    def run_compiled(x):
        if "build_s" in first:
            return compiled(x)
        t = time.perf_counter()
        out = compiled(x)
        first["build_s"] = time.perf_counter() - t  # the compile, plus one batch
        return out

    run_compiled.stats = first  # type: ignore[attr-defined]
    return run_compiled


def _engine(backend: str, build: Callable[[Any, Any], Callable]) -> Callable[[Any], Callable]:
    """A CPU engine's ``make``: its package checked now, the engine built by ``build(head,
    x)`` from the first batch."""

    def make(head) -> Callable:
        _need(backend, backend)  # fail before any work, not at the first batch
        state: dict[str, Any] = {}

        def fwd(x):
            if "run" not in state:
                log.info("building the %s engine for %s (batch %d)", backend, head.bb.name, x.shape[0])
                t = time.perf_counter()
                state["run"] = build(head, x.contiguous())
                state["build_s"] = time.perf_counter() - t
            return state["run"](x)

        fwd.stats = state  # type: ignore[attr-defined]  # build_s: the engine's build time, once built
        return fwd

    return make


BACKENDS.register("eager", ForwardBackend(_eager), note="PyTorch, the default")
BACKENDS.register("compile", ForwardBackend(_compiled), note="torch.compile, inductor with freezing")
for _name, _build, _pip in (
    ("onnxruntime", _onnxruntime, "pip install onnxruntime onnx"),
    ("openvino", _openvino, "pip install openvino"),
):
    BACKENDS.register(_name, ForwardBackend(_engine(_name, _build), _pip), note=f"CPU engine, fp32; {_pip}")
BACKENDS.register(
    "auto",
    ForwardBackend(None),
    note="the least start-up + images / rate among the backends measured on this machine and cached, "
    "features within 1e-4 of eager's; eager for short jobs",
)
