"""``embed-classes`` and ``embed-captions`` hold the text tower to the recorded image weights with
one function: weights that changed since the features were extracted are one error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from featcache.errors import BackboneError, ProvenanceMismatchError
from featcache.extract import text


@pytest.fixture
def now_has(monkeypatch):
    def use(sha: str, tower: object = "tower") -> None:
        bb = SimpleNamespace(weights_sha256=sha, text_tower=tower, name="clip")
        monkeypatch.setattr("featcache.models.backbones.create_backbone", lambda *a, **k: bb)

    monkeypatch.setattr(text, "recorded_model", lambda cache, d, b: ("open_clip:RN50", "openai", "a" * 64))
    return use


def test_changed_weights_are_one_error_naming_both_hashes(now_has):
    now_has("b" * 64)
    with pytest.raises(ProvenanceMismatchError, match=r"sha256 aaaaaaaaaaaa\.\.\. but open_clip:RN50 \(openai\) now"):
        text.text_tower_backbone(None, "d", "bb", None, None, "cpu")


def test_the_recorded_weights_pass_and_a_tower_is_required(now_has):
    now_has("a" * 64)
    assert text.text_tower_backbone(None, "d", "bb", None, None, "cpu").name == "clip"
    now_has("a" * 64, tower=None)
    with pytest.raises(BackboneError, match="has no text tower"):
        text.text_tower_backbone(None, "d", "bb", None, None, "cpu")


def test_captions_use_the_same_check():
    import inspect

    from featcache.extract import captions

    assert "text_tower_backbone(" in inspect.getsource(captions)
    assert "weights_sha256 !=" not in inspect.getsource(captions)
