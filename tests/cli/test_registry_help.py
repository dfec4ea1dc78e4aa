"""The CLI's help and choices are built from the registries when the parser is built (issue 20
item 4): every registered protocol, task metric, data format, model source, weight source and
shipped suite is in the help of the commands that take it, and a member registered now (then
removed again) shows up there without a string being edited."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from featcache import suites
from featcache.cli import build_parser
from featcache.core import metrics, protocols
from featcache.data.readers import registry as formats
from featcache.models import backbones, sources

#: registry -> [(command, option dest)] whose help (or choices) names every member
WHERE = {
    "probe protocol": [("probe", "protocol"), ("sweep", "protocols")],
    "finetune protocol": [("finetune", "protocol"), ("sweep", "finetune")],
    "task metric": [("probe", "metric")],
    "data format": [("extract", "data"), ("finetune", "data")],
    "model source": [("extract", "model"), ("finetune", "model")],
    "weight source": [("extract", "weights"), ("finetune", "weights")],
    "suite": [("extract", "suite"), ("probe", "suite"), ("finetune", "suite"), ("suites", "name")],
}


def _texts(parser, registry: str) -> list[str]:
    """The help text (with its choices) of every option that lists ``registry``'s members."""
    sub = next(a for a in parser._actions if a.dest == "command").choices
    out = []
    for command, dest in WHERE[registry]:
        action = next(a for a in sub[command]._actions if a.dest == dest)
        out.append(f"{(action.help or '').replace('%%', '%')} {list(action.choices or ())}")
    return out


def _members() -> dict[str, list[str]]:
    """How each registry's members are named in the help, as registered now."""
    return {
        "probe protocol": protocols.protocol_usages("probe"),
        "finetune protocol": protocols.protocol_usages("finetune"),
        "task metric": list(metrics.TASK_METRICS),
        "data format": [f.usage for f in {f.kind: f for f in formats.FORMATS.values()}.values()],
        "model source": ["timm:NAME", *(sources._USAGE[s][0] for s in sources._SOURCES)],
        "weight source": [backbones._WEIGHTS_USAGE[s][0] for s in backbones.list_weights_sources()],
        "suite": suites.list_suites(),
    }


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.mark.parametrize("registry", sorted(WHERE))
def test_every_registered_member_is_in_the_help(parser, registry):
    members = _members()[registry]
    assert members, registry
    for text in _texts(parser, registry):
        missing = [m for m in members if m not in text]
        assert not missing, (registry, missing, text)


@contextlib.contextmanager
def _restored(*registries: dict):
    """Each registry (a dict) as it was before the block, whatever the block added."""
    saved = [dict(r) for r in registries]
    try:
        yield
    finally:
        for r, s in zip(registries, saved):
            r.clear()
            r.update(s)


def _finetune_like(name: str):
    def make(arg=None):
        return dataclasses.replace(protocols.get_protocol("full", "finetune"), spec=name, name=name)

    return make


def _register_probe_protocol():
    protocols.register_protocol("r20-probe", usage="r20-probe:K (K >= 1)")(lambda arg=None: None)
    return "r20-probe:K (K >= 1)"


def _register_finetune_protocol():
    protocols.register_protocol("r20-tune", stage="finetune")(_finetune_like("r20-tune"))
    return "r20-tune"


def _register_format():
    formats.register_format("r20fmt", usage="r20fmt:LIST", note="a throwaway")(lambda arg, name, opts: {})
    return "r20fmt:LIST"


def _register_model_source():
    sources.register_source("r20src", "featcache.no_such_module", usage="r20src:ARCH")
    return "r20src:ARCH"


def _register_weight_source():
    backbones.register_weights_source("r20w", usage="r20w:KEY")(lambda name, arg, keep_head: None)
    return "r20w:KEY"


THROWAWAY = {
    "probe protocol": (_register_probe_protocol, lambda: (protocols._REGISTRY, protocols._USAGE)),
    "finetune protocol": (_register_finetune_protocol, lambda: (protocols._REGISTRY, protocols._USAGE)),
    "data format": (_register_format, lambda: (formats.FORMATS,)),
    "model source": (_register_model_source, lambda: (sources._SOURCES, sources._USAGE)),
    "weight source": (_register_weight_source, lambda: (backbones._WEIGHTS_SOURCES, backbones._WEIGHTS_USAGE)),
}


@pytest.mark.parametrize("registry", sorted(THROWAWAY))
def test_a_member_registered_now_is_in_the_help(registry):
    register, dicts = THROWAWAY[registry]
    with _restored(*dicts()):
        shown = register()
        assert shown in _members()[registry]
        for text in _texts(build_parser(), registry):
            assert shown in text, (registry, text)
    assert shown not in _members()[registry]  # removed again: the registry as it was
    assert all(shown not in t for t in _texts(build_parser(), registry))


def test_a_task_metric_registered_now_is_a_probe_metric_choice(monkeypatch):
    from featcache.probes.cli import config_from_args

    monkeypatch.setattr(metrics, "TASK_METRICS", metrics.TASK_METRICS)  # restored after
    monkeypatch.setattr(metrics, "MULTILABEL_METRICS", metrics.MULTILABEL_METRICS)
    words = ["probe", "--cache", "c", "--all", "--dataset", "d", "--results", "r", "--metric", "r20_top1"]
    with _restored(metrics.METRICS):
        metrics.register_metric("r20_top1", metrics.top1, task=True)
        assert "r20_top1" in metrics.TASK_METRICS
        assert "r20_top1" not in metrics.MULTILABEL_METRICS
        (text,) = _texts(build_parser(), "task metric")
        assert "r20_top1" in text
        assert config_from_args(build_parser().parse_args(words)).metric == "r20_top1"
    monkeypatch.undo()
    assert "r20_top1" not in metrics.METRICS
    assert "r20_top1" not in metrics.TASK_METRICS
    with pytest.raises(SystemExit):  # unregistered: no choice any more
        build_parser().parse_args(words)


def test_a_taken_metric_name_is_refused():
    from featcache.errors import ConfigError

    with pytest.raises(ConfigError, match="metric 'top1' is already registered"):
        metrics.register_metric("top1", metrics.top5, task=True)
    assert metrics.METRICS["top1"] is metrics.top1


def test_a_taken_model_source_name_is_refused():
    from featcache.errors import BackboneError

    for name in ("timm", "torchvision"):
        with pytest.raises(BackboneError, match=f"model source '{name}' is already registered"):
            sources.register_source(name, "featcache.no_such_module")
    sources.register_source("hf", sources._SOURCES["hf"][0])  # the same module again is harmless


def test_a_suite_shipped_now_is_in_the_help(monkeypatch):
    shipped = suites.list_suites
    monkeypatch.setattr(suites, "list_suites", lambda: [*shipped(), "r20-suite"])
    for text in _texts(build_parser(), "suite"):
        assert "r20-suite" in text, text
