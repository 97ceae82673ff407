"""Discovery: manifests, loose media as one-source sessions, validation before any work."""

from __future__ import annotations

import pytest

from modalign.pipeline.discovery import discover
from modalign.schemas.errors import ConfigError

pytestmark = pytest.mark.unit


def test_folder_of_manifest_and_loose_media(tmp_path):
    (tmp_path / "meet").mkdir()
    (tmp_path / "meet" / "cam.mp4").write_bytes(b"x")
    (tmp_path / "meet" / "m.yaml").write_text(
        "session_id: meet-1\nsources:\n  - {id: cam, uri: cam.mp4, modality: video}\n")
    (tmp_path / "lone call.wav").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("ignored")
    sessions = discover(tmp_path)
    ids = [s.manifest.session_id for s in sessions]
    assert ids == ["meet-1", "lone_call"]  # cam.mp4 belongs to the manifest, not a session of its own
    lone = sessions[1]
    assert lone.manifest.sources[0].modality == "audio"
    assert lone.source_uri(lone.manifest.sources[0]).endswith("lone%20call.wav")


def test_invalid_manifest_in_folder_stops_everything(tmp_path):
    (tmp_path / "ok.wav").write_bytes(b"x")
    (tmp_path / "bad.yaml").write_text("session_id: s\nsources:\n  - {id: a, uri: a.mp4, modality: laser}\n")
    with pytest.raises(ConfigError, match="sources.0.modality"):
        discover(tmp_path)


def test_missing_input_and_unknown_file_type(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        discover(tmp_path / "nope")
    (tmp_path / "x.docx").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a manifest"):
        discover(tmp_path / "x.docx")
    with pytest.raises(ConfigError, match="no manifests or media"):
        discover(tmp_path)
