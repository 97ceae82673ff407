"""The runner on a real local Ray: bad inputs are quarantined, the rest of the run completes."""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as ds
import pytest

from modalign.pipeline.runner import EXIT_QUARANTINED, Runner
from modalign.schemas.config import RunConfig
from clips import write_clip, write_tone

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mixed")
    write_tone(d / "good.wav")
    (d / "empty.mp4").write_bytes(b"")
    (d / "notes.pdf").write_bytes(b"this is not a pdf at all\n" * 20)
    write_clip(d / "clip.mp4", seconds=1.0, sound=False)
    data = (d / "clip.mp4").read_bytes()
    (d / "truncated.mp4").write_bytes(data[: len(data) // 3])
    return d


def test_bad_inputs_quarantined_rest_complete(ray_local, mixed_folder, tmp_path):
    out = tmp_path / "out"
    cfg = RunConfig(key_store=tmp_path / "keys")
    messages: list[str] = []
    summary = Runner(cfg, out, progress=messages.append).run(mixed_folder)

    assert summary["exit_code"] == EXIT_QUARANTINED
    q = ds.dataset(out / "quarantine", format="parquet").to_table().to_pylist()
    by_name = {Path(r["source_uri"]).name: r for r in q}
    assert by_name["empty.mp4"]["reason_code"] == "file_empty"
    assert by_name["notes.pdf"]["reason_code"] == "not_pdf"
    assert by_name["notes.pdf"]["stage"] == "pdf_text"  # the operator that rejected it
    assert by_name["truncated.mp4"]["reason_code"] in ("unreadable", "decode_failed")
    assert "readable" in by_name["truncated.mp4"]["message"]  # says what is wrong; source_uri names the file
    assert "good.wav" not in by_name and "clip.mp4" not in by_name

    # The good sources are complete: 2 s of audio -> ~200 MFCC frames, 50 ticks; 25 video frames.
    good = ds.dataset(out / "records" / "good", format="parquet").to_table()
    assert abs(good.num_rows - 50) <= 1
    clip = ds.dataset(out / "records" / "clip", format="parquet").to_table()
    assert clip.num_rows == 25 and set(clip.column("decision").to_pylist()) == {"matched"}
    lineage = ds.dataset(out / "lineage" / "sources", format="parquet").to_table().to_pylist()
    status = {(Path(r["source_uri"]).name, r["source_id"]): r["status"] for r in lineage}
    assert status[("good.wav", "source")] == "ingested" and status[("clip.mp4", "source")] == "ingested"
    assert status[("clip.mp4", "source.audio")] == "no_stream"  # the clip has no sound: not bad input
    assert any("quarantine" in m for m in messages)


def test_sources_outside_the_input_are_never_read(ray_local, tmp_path):
    """A manifest naming ../outside.pdf and a symlink to it: quarantined, no byte of it in OUT."""
    import hashlib

    from reportlab.pdfgen import canvas

    root, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    secret = elsewhere / "secret.pdf"
    c = canvas.Canvas(str(secret))
    c.drawString(72, 720, "OUTSIDE-SECRET-4711 payroll of the whole company")
    c.save()
    write_tone(root / "good.wav")
    (root / "leak.pdf").symlink_to(secret)
    (root / "m.yaml").write_text("session_id: meet\nsources:\n  - {id: mic, uri: good.wav, modality: audio}\n"
                                 "  - {id: deck, uri: ../elsewhere/secret.pdf, modality: pdf}\n")
    out = tmp_path / "out"
    summary = Runner(RunConfig(key_store=tmp_path / "keys"), out, progress=lambda _m: None).run(root)

    assert summary["exit_code"] == EXIT_QUARANTINED and summary["counts"]["events"]["audio"] > 0
    q = ds.dataset(out / "quarantine", format="parquet").to_table().to_pylist()
    assert sorted((r["source_id"], r["reason_code"]) for r in q) == [("deck", "path_outside_root"),
                                                                      ("source", "path_outside_root")]
    assert all(r["source_version"] is None and r["stage"] == "discover" for r in q)
    digest = hashlib.sha256(secret.read_bytes()).hexdigest().encode()
    for f in out.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert b"OUTSIDE-SECRET" not in data and digest not in data, f
    assert summary["counts"]["events"]["pdf"] == 0
