"""Discovery: manifests, loose media as one-source sessions, validation before any work."""

from __future__ import annotations

import pytest

from hostile_corpus import BAD_TENANTS, ESCAPING_URIS
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


# -- containment: nothing outside the input root is read -------------------------------------

@pytest.fixture
def outside(tmp_path):
    """An input folder and, beside it, a file it must never reach (also through a symlink)."""
    root, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "secret.wav").write_bytes(b"RIFF-not-yours")
    (root / "link_out.wav").symlink_to(elsewhere / "secret.wav")
    (root / "ok.wav").write_bytes(b"x")
    return root, elsewhere


@pytest.mark.parametrize("uri", ESCAPING_URIS)
def test_a_manifest_source_outside_its_folder_stops_the_run_naming_the_field(outside, uri):
    root, _ = outside
    (root / "m.yaml").write_text("session_id: s\nsources:\n  - {id: ok, uri: ok.wav, modality: audio}\n"
                                 f"  - {{id: bad, uri: '{uri}', modality: audio}}\n")
    with pytest.raises(ConfigError, match=r"sources\.1\.uri"):
        discover(root / "m.yaml")


def test_in_a_folder_run_only_the_escaping_source_is_refused(outside):
    root, elsewhere = outside
    (root / "m.yaml").write_text("session_id: s\nsources:\n  - {id: ok, uri: ok.wav, modality: audio}\n"
                                 "  - {id: bad, uri: ../elsewhere/secret.wav, modality: audio}\n")
    sessions = {s.manifest.session_id: s for s in discover(root)}
    refused = {spec.id: exc for spec, exc in sessions["s"].refusals()}
    assert set(refused) == {"bad"} and refused["bad"].code == "path_outside_root"
    assert "sources.1.uri" in refused["bad"].message
    link = next(s for s in sessions.values() if s.manifest.sources[0].uri == "link_out.wav")
    assert [spec.uri for spec, _ in link.refusals()] == ["link_out.wav"]  # the symlink is followed, then refused


def test_allowed_roots_and_harmless_dots_are_accepted(outside):
    root, elsewhere = outside
    (root / "sub").mkdir()
    (root / "m.yaml").write_text("session_id: s\nsources:\n  - {id: a, uri: sub/../ok.wav, modality: audio}\n"
                                 f"  - {{id: b, uri: '{(elsewhere / 'secret.wav').as_uri()}', modality: audio}}\n")
    (session,) = discover(root / "m.yaml", allowed_roots=(elsewhere,))
    assert [session.resolve(s) for s in session.manifest.sources] == [root.resolve() / "ok.wav",
                                                                       (elsewhere / "secret.wav").resolve()]


@pytest.mark.parametrize("tenant", BAD_TENANTS)
def test_tenant_is_validated_like_every_id(tmp_path, tenant):
    (tmp_path / "m.yaml").write_text(f"session_id: s\ntenant: '{tenant}'\nsources:\n"
                                     "  - {id: a, uri: a.wav, modality: audio}\n")
    with pytest.raises(ConfigError, match="tenant"):
        discover(tmp_path / "m.yaml")
