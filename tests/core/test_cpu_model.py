"""``featcache.core.cpu.cpu_model``: the CPU label benchmarks print beside their figures."""

from __future__ import annotations

import builtins
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from featcache.core.cpu import cpu_model


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_names_the_model_lscpu_names():
    lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    named = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    if named is None:
        pytest.skip("this /proc/cpuinfo has no model name line (e.g. an ARM kernel)")
    assert cpu_model() == named
    assert cpu_model() != "unknown"
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        by_lscpu = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
        assert cpu_model() in by_lscpu


def test_without_proc_cpuinfo_falls_back_to_platform(monkeypatch):
    real_open = builtins.open

    def no_cpuinfo(path, *a, **k):
        if str(path) == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_cpuinfo)
    assert cpu_model.__wrapped__() == (platform.processor() or "unknown")
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_model.__wrapped__() == "unknown"
