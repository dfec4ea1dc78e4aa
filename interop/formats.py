"""The result formats featcache writes and reads: one module per format, each holding a
:class:`ResultFormat` registered in :data:`RESULT_FORMATS` (a new format is one file: its
``FORMAT`` and a ``RESULT_FORMATS.register(...)`` line, here for a built-in, in the module itself
for one of your own named by ``FEATCACHE_PLUGINS``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.core.registry import Registry
from featcache.errors import ResultsError
from featcache.interop.runs import Imported, Run

__all__ = ["RESULT_FORMATS", "ExportContext", "ResultFormat", "detect_format"]


@dataclass(frozen=True)
class ExportContext:
    """What a writer is told beside the runs: the folder, the organisation that names models
    where a format wants ``org/name``, and the featcache version."""

    out: Path
    org: str
    version: str


@dataclass(frozen=True)
class ResultFormat:
    """One format. ``write(runs, ctx)`` writes the runs it takes and returns ``(files written,
    lines naming each run left out)`` (None: import only); ``read(path)`` gives the rows of a
    file or folder as :class:`~featcache.interop.runs.Imported`; ``detect(path)`` says whether
    ``path`` looks like this format (``import --format auto``)."""

    write: Callable[[Sequence[Run], ExportContext], tuple[list[Path], list[str]]] | None
    read: Callable[[Path], Imported]
    detect: Callable[[Path], bool]


#: format name -> its :class:`ResultFormat` (lazy: a format's module is imported when used)
RESULT_FORMATS: Registry[ResultFormat] = Registry("result format", ResultsError)
RESULT_FORMATS.register(
    "clip_benchmark",
    "featcache.interop.clip_benchmark_format:FORMAT",
    note="CLIP_benchmark's per-run JSON (read by `clip_benchmark build`)",
)
RESULT_FORMATS.register(
    "mteb",
    "featcache.interop.mteb_format:FORMAT",
    note="MTEB/MIEB results/{org__model}/{revision}/{Task}.json beside model_meta.json",
)
RESULT_FORMATS.register(
    "lm-eval",
    "featcache.interop.lm_eval_format:FORMAT",
    note="lm-evaluation-harness's {model}/results_<timestamp>.json",
)
RESULT_FORMATS.register(
    "model-index",
    "featcache.interop.model_index_format:FORMAT",
    note="the Hugging Face model card's model-index (README.md per backbone)",
)
RESULT_FORMATS.register(
    "timm", "featcache.interop.timm_format:FORMAT", note="timm's results-imagenet*.csv (import only)"
)


def writable_formats() -> list[str]:
    return [n for n in RESULT_FORMATS if RESULT_FORMATS[n].write is not None]


def detect_format(path: Path) -> str:
    """The one registered format ``path`` looks like; none or several: a ResultsError."""
    found = [n for n in RESULT_FORMATS if _detects(RESULT_FORMATS[n], path)]
    if len(found) != 1:
        what = "no format" if not found else f"several formats ({', '.join(found)})"
        raise ResultsError(f"{path} looks like {what}; name it with --format ({', '.join(RESULT_FORMATS)})")
    return found[0]


def _detects(fmt: ResultFormat, path: Path) -> bool:
    try:
        return bool(fmt.detect(path))
    except (OSError, ValueError, UnicodeDecodeError):
        return False


def read_json(path: Path) -> Any:
    """A JSON file's content; not JSON: a ResultsError naming the file."""
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: not a JSON file ({exc})") from None
