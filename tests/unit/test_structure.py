"""The structure: one declaration per modality, table, reason code and environment variable.

Each test here failed on the code before the structure issue (the defect is named).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from modalign.operators.modalities import PLANS
from modalign.pipeline.layout import TABLES, OutputLayout
from modalign.schemas.errors import ConfigError, QuarantineReason
from modalign.schemas.manifest import Manifest, Modality
from modalign.schemas.tables import ALL_TABLES, QuarantineRow, VideoFrameRow

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_every_modality_has_one_plan_with_its_own_event_table():
    assert set(PLANS) == set(Modality.__args__)  # type: ignore[attr-defined]
    assert len({p.event_row for p in PLANS.values()}) == len(PLANS)
    from modalign.operators.embed.registry import ENCODERS, encoder_for

    for name, plan in PLANS.items():
        assert plan.encoder in ENCODERS and name in ENCODERS[plan.encoder].payloads
        assert set(plan.embed_columns) >= {"event_id", "t_ns"} and encoder_for(name) is ENCODERS[plan.encoder]


def test_each_table_has_a_folder_of_its_own():
    paths = [row.PATH for row in ALL_TABLES]
    assert len(set(paths)) == len(paths) and all(paths)
    for a in paths:  # no table folder inside another's (a recursive reader would merge them)
        assert not any(b != a and b.startswith(a + "/") for b in paths), a
    assert set(TABLES) == {row.TABLE for row in ALL_TABLES}


def test_feature_file_names_do_not_collide(tmp_path):
    """Defect: session 'a-b' with source 'c' and session 'a' with source 'b-c' shared a file."""
    lay = OutputLayout(tmp_path)
    assert lay.features("m@1", "frame", "a-b", "c", "x1", 0) != lay.features("m@1", "frame", "a", "b-c", "x1", 0)


def test_quarantine_reasons_are_one_enum_and_every_code_in_the_tree_is_in_it():
    """Defect: 'missing' and 'file_missing' named the same cause, and codes were free strings."""
    with pytest.raises(ValueError):
        QuarantineRow(session_id="s", source_id="a", source_uri="file:///a", source_version=None,
                      stage="discover", reason_code="missing", message="m")
    used = set()
    for path in list((ROOT / "operators").rglob("*.py")) + list((ROOT / "pipeline").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        used |= set(re.findall(r'code="([a-z_]+)"', text))
        used |= set(re.findall(r'_err\([^)]*"([a-z_]+)"\)', text))
    assert used and used <= {r.value for r in QuarantineReason}, used - {r.value for r in QuarantineReason}


def test_a_tilde_key_store_means_one_folder(tmp_path, monkeypatch):
    """Defect: '~' in $MODALIGN_KEY_STORE was checked as ./~/keys but written to $HOME/keys."""
    from modalign.operators.deid.keystore import KeyStore
    from modalign.pipeline.runner import Runner
    from modalign.schemas.config import RunConfig
    from modalign.schemas.environment import key_store_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MODALIGN_KEY_STORE", "~/out/keys")
    monkeypatch.chdir(tmp_path)
    assert key_store_dir() == KeyStore().root == tmp_path / "out" / "keys"
    with pytest.raises(ConfigError, match="inside the output folder"):
        Runner(RunConfig(), tmp_path / "out")
    with pytest.raises(ConfigError, match="inside the output folder"):  # the config field, the same rule
        Runner(RunConfig(key_store="~/out/k2"), tmp_path / "out")


def test_package_versions_come_from_whichever_build_is_installed(monkeypatch):
    """Defect: version('faiss-cpu') raised in the GPU image (faiss-gpu) after all the work was done."""
    import importlib.metadata as md

    from modalign.pipeline.runner import VERSIONED_PACKAGES, package_version

    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "1.15.1" if d == "faiss-gpu" else (
        (_ for _ in ()).throw(md.PackageNotFoundError(d)) if d == "faiss-cpu" else real(d)))
    assert package_version(*VERSIONED_PACKAGES["faiss"]) == "1.15.1"
    assert package_version("no-such-distribution-xyz") is None


def test_counters_by_the_operator_that_wrote_the_header():
    """Defect: keep-action face headers were counted as frame_text_blurred; voice never reached run.json."""
    video, audio, pdf = PLANS["video"], PLANS["audio"], PLANS["pdf"]
    face_kept = {"method": "keep", "detector": "mediapipe", "count": 2}
    face = {"method": "blur_permute", "detector": "mediapipe", "count": 2}
    text = {"method": "blur_permute", "detector": "tesseract", "count": 3}
    assert video.counter("deid", face_kept, 1) is None
    assert video.counter("deid", face, 1) == ("faces_blurred", 2)
    assert video.counter("text_deid", text, 1) == ("frame_text_blurred", 3)
    assert audio.counter("deid", {"method": "waveform_dropped", "detector": "none", "count": 0}, 1) == (
        "voice_frames:waveform_dropped", 1)
    assert pdf.counter("deid", {"method": "pseudonymise", "detector": "x", "count": 4}, 1) == ("pii_replaced", 4)


def test_a_video_with_its_own_sound_is_two_sources_unless_switched_off():
    m = Manifest.model_validate({"session_id": "s", "sources": [
        {"id": "cam", "uri": "cam.mp4", "modality": "video", "clock": {"offset_ns": 5}},
        {"id": "mute", "uri": "mute.mp4", "modality": "video", "audio_track": False},
        {"id": "mic", "uri": "mic.wav", "modality": "audio"}]})
    got = [(s.id, s.modality, s.uri, s.track_of, s.clock.offset_ns) for s in m.ingest_sources()]
    assert got == [("cam", "video", "cam.mp4", None, 5), ("cam.audio", "audio", "cam.mp4", "cam", 5),
                   ("mute", "video", "mute.mp4", None, 0), ("mic", "audio", "mic.wav", None, 0)]
    with pytest.raises(ValueError, match="cam.audio"):
        Manifest.model_validate({"session_id": "s", "sources": [
            {"id": "cam", "uri": "cam.mp4", "modality": "video"},
            {"id": "cam.audio", "uri": "x.wav", "modality": "audio"}]})


def test_the_installed_packages_are_the_tree():
    """pyproject lists every package folder, each under the modalign namespace."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"modalign"} | {"modalign." + ".".join(p.parent.relative_to(ROOT).parts)
                            for top in ("pipeline", "operators", "schemas") for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found


def test_local_ray_gets_a_private_temp_folder(tmp_path, monkeypatch):
    import stat

    from modalign.schemas.environment import ray_temp_dir

    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    d = ray_temp_dir()
    assert d.parent == tmp_path and stat.S_IMODE(d.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert ray_temp_dir(shared) == shared and stat.S_IMODE(shared.stat().st_mode) == 0o700
