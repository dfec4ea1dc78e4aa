"""The one stage-run skeleton (featcache.core.stagerun): the registry of stages the sweep looks
up, the median rule and carried hparams declared once per stage, and its place in the layers
(it imports no stage; the sweep reaches stages through it, not through their runners)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import featcache
from featcache.core.stagerun import STAGES, Stage, get_stage
from featcache.errors import ConfigError

ROOT = Path(featcache.__file__).parent
STAGE_PACKAGES = ("probes", "finetune", "retrieval", "sweep", "suites", "analysis", "extract")


def _featcache_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("featcache"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("featcache"))
    return names


def test_every_stage_entry_is_its_packages_public_function():
    import featcache.dense
    import featcache.finetune
    import featcache.probes
    import featcache.retrieval

    public = {
        "dense": featcache.dense.run_dense,
        "probe": featcache.probes.run_probes,
        "finetune": featcache.finetune.finetune,
        "retrieval": featcache.retrieval.run_retrieval,
    }
    assert set(STAGES) == set(public)
    for name, fn in public.items():
        module, attr = get_stage(name).entry.split(":")
        assert getattr(__import__(module, fromlist=[attr]), attr) is fn
        assert module.count(".") == 1  # the package's public name, not a runner module


def test_sweep_runs_an_item_by_looking_its_stage_up(monkeypatch):
    """A stage registered under a new name runs through the executor's adapter unchanged:
    no if-chain on stage names."""
    from featcache.sweep.executor import call_stage
    from featcache.sweep.planner import WorkItem

    monkeypatch.setitem(STAGES, "echo", Stage("echo", "json:dumps"))
    assert call_stage(WorkItem("echo", "k", {"a": 1}, (), "b", "d", "p")) == '{"a": 1}'
    assert "probe" not in inspect.getsource(call_stage)


def test_a_stage_declares_one_of_the_three_median_rules():
    with pytest.raises(ConfigError, match="'protocol', 'always' or 'never'"):
        Stage("x", "json:dumps", "sometimes")


def test_an_unknown_stage_names_the_registered_ones():
    import featcache.finetune
    import featcache.probes
    import featcache.retrieval  # noqa: F401  (each registers its stage)

    with pytest.raises(ConfigError, match=r"registered stages: \['dense', 'finetune', 'probe', 'retrieval'\]"):
        get_stage("linear")


def test_median_rule_per_stage():
    import featcache.finetune
    import featcache.probes
    import featcache.retrieval  # noqa: F401  (importing a stage's package registers its stage)
    from featcache.core.protocols import get_protocol

    probe = get_stage("probe")
    assert probe.wants_medians("vtab1k")
    assert probe.wants_medians(get_protocol("vtab1k"))
    assert not probe.wants_medians("full")
    assert get_stage("finetune").wants_medians("full")
    assert not get_stage("retrieval").wants_medians("semantic")
    assert "task_metric" in probe.median_carry
    assert "task_metric" in get_stage("finetune").median_carry


def test_each_stage_registers_its_own_stage_and_the_skeleton_names_none():
    """In a fresh interpreter the skeleton alone knows no stage; importing a stage's package
    (not its runner) registers that stage; the skeleton's source names no stage's module."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from featcache.core.stagerun import STAGES\n"
        "assert not STAGES, STAGES\n"
        "import featcache.probes\n"
        "assert set(STAGES) == {'probe'}, STAGES\n"
        "assert 'featcache.probes.runner' not in sys.modules\n"
        "import featcache.finetune, featcache.retrieval\n"
        "assert set(STAGES) == {'probe', 'finetune', 'retrieval'}, STAGES\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    source = (ROOT / "core" / "stagerun.py").read_text()
    assert not [s for s in STAGE_PACKAGES if f'"featcache.{s}' in source]  # no entry point string


def test_skeleton_imports_no_stage_and_the_sweep_no_runner():
    """Stages import the skeleton; it imports no stage (their entry points are strings), and
    the sweep calls stages through it rather than importing their runner modules."""
    found = _featcache_imports(ROOT / "core" / "stagerun.py")
    assert not {m for m in found for s in STAGE_PACKAGES if m == f"featcache.{s}" or m.startswith(f"featcache.{s}.")}
    sweep = set().union(*(_featcache_imports(p) for p in (ROOT / "sweep").rglob("*.py")))
    assert not {m for m in sweep if m.endswith(".runner")}
    for stage in ("probes/runner.py", "finetune/runner.py"):
        assert "featcache.core.stagerun" in _featcache_imports(ROOT / stage)
