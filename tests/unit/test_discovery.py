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
    assert ids[0] == "meet-1" and len(ids) == 2  # cam.mp4 belongs to the manifest, not a session of its own
    assert ids[1].startswith("lone_call-")  # the space is folded; a hash of the name keeps it unique
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


def test_any_legal_file_name_is_a_session(tmp_path):
    """Defect: 'dotdot name ü.mp4' stopped the whole run with a pydantic traceback."""
    names = ["dotdot name ü.mp4", "dotdot name u.mp4", "Łódź 会议.wav", "..hidden.wav", "ä.pdf", "plain.wav"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    sessions = discover(tmp_path)
    ids = {s.manifest.sources[0].uri: s.manifest.session_id for s in sessions}
    assert set(ids) == set(names) and len(set(ids.values())) == len(names)  # one valid, distinct id each
    assert ids["plain.wav"] == "plain"
    assert ids["dotdot name ü.mp4"].startswith("dotdot_name_u-") and ids["Łódź 会议.wav"].startswith("odz-")


def test_a_manifest_is_parsed_once(tmp_path, monkeypatch):
    """Defect: discovery read and parsed every manifest twice."""
    import modalign.pipeline.discovery as discovery

    (tmp_path / "m.yaml").write_text("session_id: s1\nsources:\n  - {id: a, uri: a.wav, modality: audio}\n")
    calls = []
    real = discovery.read_mapping
    monkeypatch.setattr(discovery, "read_mapping", lambda p: calls.append(p) or real(p))
    assert [s.manifest.session_id for s in discover(tmp_path)] == ["s1"]
    assert calls == [tmp_path / "m.yaml"]
