"""The one memory-size parser (featcache.core.memory), and the two stages that use it: the
similarity configs refuse with a ConfigError naming --max-memory, retrieval with a DataError
and a default for None."""

from __future__ import annotations

import re

import pytest

from featcache.core.memory import parse_memory
from featcache.errors import ConfigError, DataError


@pytest.mark.parametrize(
    ("text", "want"),
    [("2GB", 2 * 1000**3), ("512MiB", 512 * 1024**2), (" 1.5 gb ", 1_500_000_000), ("1e9", 10**9), (10**9, 10**9)],
)
def test_sizes(text, want):
    assert parse_memory(text) == want


@pytest.mark.parametrize(
    ("text", "says"),
    [("lots", "is invalid: write e.g. 2GB"), ("1e400", "is not a finite size"), (float("inf"), "is not a finite size")],
)
def test_what_is_no_size_is_refused_naming_the_flag(text, says):
    with pytest.raises(ConfigError, match=re.escape(f"--max-memory {text!r} {says}")):
        parse_memory(text)


def test_below_one_mebibyte_and_none():
    with pytest.raises(ConfigError, match="is below 1 MB"):
        parse_memory("10KB")
    with pytest.raises(ConfigError, match="None is invalid"):
        parse_memory(None)
    assert parse_memory(None, default=123 * 1024**2) == 123 * 1024**2
    with pytest.raises(DataError, match=r"^max memory 'lots' is invalid"):
        parse_memory("lots", name="max memory", error=DataError)


def test_both_stages_parse_with_it():
    from featcache.retrieval.search import DEFAULT_MAX_MEMORY
    from featcache.retrieval.search import parse_memory as retrieval_memory
    from featcache.similarity import AuditConfig, SimilarityConfig

    assert retrieval_memory(None) == DEFAULT_MAX_MEMORY
    assert retrieval_memory("512MiB") == parse_memory("512MiB")
    with pytest.raises(DataError, match=r"write e\.g\. 2GB"):
        retrieval_memory("1e400")
    assert SimilarityConfig(cache="c", dataset="d", max_memory="3GB").memory == 3 * 1000**3
    for value in ("lots", "1e400", "10KB"):
        with pytest.raises(ConfigError, match=f"--max-memory '{value}'"):
            SimilarityConfig(cache="c", dataset="d", max_memory=value)
        with pytest.raises(ConfigError, match=f"--max-memory '{value}'"):
            AuditConfig(cache="c", dataset="d", backbone="b", out="o.csv", max_memory=value)
