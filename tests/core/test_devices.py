"""One device and precision resolution (featcache.core.devices) for extraction and fine-tuning: the
same words mean the same precision in both stages, each stage keeps its own log lines."""

from __future__ import annotations

import logging

import pytest

import featcache.core.cpu as fcpu
from featcache.core import devices
from featcache.errors import BackendUnavailableError, ConfigError
from featcache.extract.pipeline import recorded_precision
from featcache.finetune import train as FT


@pytest.mark.parametrize("word", ["auto", "fp32", "none", "bf16"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_both_stages_resolve_every_shared_word_alike(word, device, monkeypatch):
    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ("avx512_bf16",))
    got = devices.resolve_precision(word, device)
    assert FT.resolve_precision(word, device) == got  # "none" was refused by fine-tuning
    assert recorded_precision(word, device) == ("none" if got == "fp32" else got)  # the provenance word


def test_a_word_the_stage_does_not_offer_is_refused_naming_its_field():
    with pytest.raises(ConfigError, match=r"--precision fp16 is invalid \(Python: precision=\): choose auto, fp32"):
        FT.resolve_precision("fp16", "cuda")
    with pytest.raises(ConfigError, match=r"--precision int8 is invalid \(Python: amp=\)"):
        recorded_precision("int8", "cpu")


def test_bf16_without_cpu_hardware_is_a_config_and_a_backend_error(monkeypatch):
    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ())
    for call, field in ((FT.resolve_precision, "precision"), (recorded_precision, "amp")):
        with pytest.raises(ConfigError, match=rf"--precision fp32 \(Python: {field}='fp32'\)") as e:
            call("bf16", "cpu")
        assert isinstance(e.value, BackendUnavailableError)


def test_auto_device_logs_the_stage_line(caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    from featcache.models.model import backbone_device

    with caplog.at_level(logging.INFO):
        assert FT.resolve_device("auto") == backbone_device("auto") == "cpu"
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert (
        "featcache.finetune.train",
        "no CUDA device: fine-tuning runs on CPU (fp32); use a scaled-down schedule",
    ) in lines
    assert ("featcache.models.model", "no CUDA device; backbone runs on CPU") in lines
    with pytest.raises(BackendUnavailableError, match="device='cuda:0' requested but CUDA is not available"):
        devices.resolve_device("cuda:0")
