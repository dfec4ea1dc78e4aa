"""Every registry refuses a second registration under a taken name (as protocols always did),
rather than silently replacing the first."""

from __future__ import annotations

import pytest

from featcache.errors import BackboneError, ConfigError, ProtocolError
from featcache.extract.backbones import list_weights_sources, register_weights_source
from featcache.extract.readers.registry import FORMATS, register_format
from featcache.protocols import register_protocol


def _other(*args):  # a second function, never called
    raise AssertionError("not called")


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_data_formats_refuse_duplicates(kind):
    first = FORMATS[kind]
    with pytest.raises(ConfigError, match=f"data format '{kind}' is already registered"):
        register_format(kind)(_other)
    assert FORMATS[kind] is first
    assert register_format(kind)(first.reader) is first.reader  # the same function again is harmless
    assert FORMATS[kind] is first


@pytest.mark.parametrize("scheme", list_weights_sources())
def test_weight_sources_refuse_duplicates(scheme):
    with pytest.raises(BackboneError, match=f"weights source '{scheme}' is already registered"):
        register_weights_source(scheme)(_other)


def test_protocols_refuse_duplicates():
    with pytest.raises(ProtocolError, match="already registered"):
        register_protocol("full")(_other)
