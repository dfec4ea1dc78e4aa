"""Prompt templates and class names for text towers (``featcache embed-classes``, the zero-shot
check of ``featcache probe``).

Template sets (``--templates``):

==================  ==========================================================================
``clip-imagenet``   CLIP's 80 ImageNet prompts (``open_clip.OPENAI_IMAGENET_TEMPLATES``)
``simple``          ``open_clip.SIMPLE_IMAGENET_TEMPLATES``
``elevater``        ELEVATER's own per-dataset templates (``template_map`` of
                    Elevater_Toolkit_IC ``vision_benchmark/datasets/prompts.py``; a dataset it
                    does not list gets its default ``["a photo of a {}"]``, as its
                    ``extract_text_features`` does)
``clip-benchmark``  CLIP_benchmark's per-dataset templates
                    (``clip_benchmark/datasets/en_zeroshot_classification_templates.json``)
FILE                one template per line with ``{}`` or ``{c}`` (CLIP_benchmark's
                    ``zeroshot_classification_templates.txt``), a JSON list, or a JSON object
                    dataset -> list
==================  ==========================================================================

Class names (``--classnames``): ``store`` (the dataset's in the store), ``elevater``
(``class_map``; an entry that is a list of synonyms gives its first, as ELEVATER does),
``clip-benchmark`` (``en_classnames.json``), or FILE (CLIP_benchmark's ``classnames.txt``: one
name per line; or a JSON list / object dataset -> list). The per-dataset sets ship as data files
in ``prompt_data/`` (both toolkits are MIT licensed; ``prompt_data/NOTICE``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from featcache.errors import ConfigError

OPEN_CLIP_SETS = ("clip-imagenet", "simple")
DATASET_SETS = ("elevater", "clip-benchmark")
TEMPLATE_SETS = OPEN_CLIP_SETS + DATASET_SETS
CLASSNAME_SETS = ("store", *DATASET_SETS)
_FILES = {
    ("elevater", "templates"): "elevater.json",
    ("elevater", "classes"): "elevater.json",
    ("clip-benchmark", "templates"): "clip_benchmark_templates.json",
    ("clip-benchmark", "classes"): "clip_benchmark_classnames.json",
}


@cache
def _data(fname: str) -> dict[str, Any]:
    text = resources.files("featcache.core").joinpath("prompt_data").joinpath(fname).read_text(encoding="utf-8")
    return json.loads(text)


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _entries(kind: str, what: str) -> dict[str, Any]:
    d = _data(_FILES[(kind, what)])["datasets"]
    if kind == "elevater":
        return {k: v[what] for k, v in d.items()}
    return d


@cache
def _elevater_tasks() -> tuple[dict[str, Any], ...]:
    """The elevater-ic suite's task table, read as data (the suite file's ``[[tasks]]``; the core
    imports no stage, so not through :func:`featcache.suites.load_suite`, which validates it)."""
    text = resources.files("featcache.suites").joinpath("elevater-ic.toml").read_text(encoding="utf-8")
    return tuple(tomllib.loads(text)["tasks"])


def _elevater_sources(dataset: str) -> list[str]:
    """ELEVATER's names (``elevater:NAME`` sources) of the elevater-ic tasks named or aliased ``dataset``."""
    return [
        t["source"].split(":", 1)[1]
        for t in _elevater_tasks()
        if dataset in (t["name"], *t.get("aliases", ())) and t.get("source", "").startswith("elevater:")
    ]


def resolve_dataset(kind: str, dataset: str, what: str = "templates") -> str | None:
    """``dataset``'s key in the set ``kind``: the key itself, the same letters and digits
    (``eurosat-clip`` = ELEVATER's ``eurosat_clip``), or the ``elevater:NAME`` source of the
    elevater-ic suite task of that name or alias; None when the set has no entry."""
    keys = _entries(kind, what)
    if dataset in keys:
        return dataset
    names = [dataset]
    if kind == "elevater":
        names.extend(_elevater_sources(dataset))
    by_norm = {_norm(k): k for k in keys}
    return next((by_norm[_norm(n)] for n in names if _norm(n) in by_norm), None)


def _dataset_entry(kind: str, what: str, dataset: str) -> list:
    key = resolve_dataset(kind, dataset, what)
    if key is None:
        if kind == "elevater" and what == "templates":
            return list(_data("elevater.json")["default_templates"])
        have = ", ".join(sorted(_entries(kind, what)))
        raise ConfigError(
            f"{kind} has no {what} for dataset {dataset!r}; give --prompt-dataset NAME (one of: {have}) "
            f"or a file (--{'classnames' if what == 'classes' else 'templates'} FILE)"
        )
    return list(_entries(kind, what)[key])


def _read_list(spec: str, dataset: str, flag: str) -> list[str]:
    p = Path(spec).expanduser()
    if not p.is_file():
        raise ConfigError(f"{flag} {spec!r}: not a file; give a file or a named set")
    text = p.read_text(encoding="utf-8")
    if p.suffix != ".json":
        return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    obj = json.loads(text)
    if isinstance(obj, dict):
        if dataset not in obj:
            raise ConfigError(f"{flag} {spec}: no entry for dataset {dataset!r} (has {sorted(obj)[:8]})")
        obj = obj[dataset]
    return [str(t) for t in obj]


def load_templates(spec: str, dataset: str = "") -> list[str]:
    """Template strings (``{}`` = the class name) of a named set (for ``dataset``) or a file."""
    if spec in OPEN_CLIP_SETS:
        try:
            import open_clip as oc
        except ImportError:
            raise ConfigError(f"--templates {spec} needs open_clip: pip install 'featcache[clip]'") from None
        fns = oc.OPENAI_IMAGENET_TEMPLATES if spec == "clip-imagenet" else oc.SIMPLE_IMAGENET_TEMPLATES
        out = [t("{}") if callable(t) else str(t) for t in fns]
    elif spec in DATASET_SETS:
        out = [str(t) for t in _dataset_entry(spec, "templates", dataset)]
    else:
        if not Path(spec).expanduser().is_file():
            raise ConfigError(f"--templates {spec!r}: give {' | '.join(TEMPLATE_SETS)} or a templates file")
        out = _read_list(spec, dataset, "--templates")
    out = [t.replace("{c}", "{}") for t in out]
    if not out or any("{}" not in t for t in out):
        raise ConfigError(f"--templates {spec}: every template needs {{}} (or {{c}}) where the class name goes")
    return out


def load_classnames(spec: str, dataset: str = "") -> list[str]:
    """Class names of a named set (for ``dataset``) or a file (``store`` is the caller's)."""
    if spec in DATASET_SETS:
        # ELEVATER's extract_text_features: `if type(classname) == list: classname = classname[0]`
        return [str(c[0] if isinstance(c, list) else c) for c in _dataset_entry(spec, "classes", dataset)]
    out = _read_list(spec, dataset, "--classnames")
    if not out:
        raise ConfigError(f"--classnames {spec}: no class names in it (one per line)")
    return out


def templates_sha256(templates: Sequence[str]) -> str:
    """The hash the class embeddings' provenance records for a template list."""
    return hashlib.sha256("\n".join(templates).encode()).hexdigest()


def template_label(spec: str) -> str:
    """How provenance names a template set: the set's name, or the file's name."""
    return spec if spec in TEMPLATE_SETS else Path(spec).name
