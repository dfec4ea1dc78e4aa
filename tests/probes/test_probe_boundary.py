"""Issue 60: the probe's flags at the boundary: a protocol refuses another protocol's flag
in words about the protocol the user named; a batch larger than the data is capped."""

from __future__ import annotations

import pytest

from featcache.errors import ProbeError
from featcache.probes import ProbeConfig


@pytest.mark.parametrize("protocol", ["attentive:vjepa", "attentive:aim"])
@pytest.mark.parametrize(("option", "flag"), [("batch_size", "--batch-size"), ("epoch_length", "--epoch-length")])
def test_a_flag_of_another_protocol_is_refused_about_the_protocol_named(protocol, option, flag):
    with pytest.raises(ProbeError) as err:
        ProbeConfig(
            "c.zarr", ("a",), "d", protocol, kind="tokens@2x2", results_path="r.parquet", **{option: 64}
        ).resolve()
    msg = str(err.value)
    assert msg.startswith(f"--protocol {protocol} does not take {flag}: it fixes its own batches and schedule")
    assert f"drop {flag}" in msg
    assert "solver's options" not in msg  # the old wording, about dinov2-linear's schedule


def test_batch_cap_keeps_a_batch_within_the_data():
    from featcache.probes.runner import _cap_batch

    opts = {"batch_size": 10**9, "metric": "top1"}
    assert _cap_batch(opts, 270, "b") == (
        {"batch_size": 270, "metric": "top1"},
        {"batch_size_given": 10**9, "batch_size": 270},
    )
    assert _cap_batch({"batch_size": 64}, 270, "b") == ({"batch_size": 64}, {})
    assert _cap_batch({"Cs": [1.0]}, 270, "b") == ({"Cs": [1.0]}, {})
