"""End to end: `modalign sample` + `modalign run` + `modalign inspect`, checked against ground truth."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from modalign.schemas.load import load_model
from modalign.schemas.manifest import Manifest
from modalign.schemas.policy import DeidPolicy

pytestmark = pytest.mark.e2e

DURATION_S = 6.0
MODALIGN = str(Path(sys.executable).parent / "modalign")


@pytest.fixture(scope="module")
def demo(sample_run):
    """The shared CLI run (tests/e2e/conftest.py): its root holds sample/, out/ and keys/."""
    assert sample_run["duration_s"] == DURATION_S
    return sample_run["root"], sample_run["run"], load_model(Manifest, sample_run["manifest_path"])


def _table(out: Path, pattern: str):
    files = sorted(out.glob(pattern))
    assert files, f"no files match {pattern}"
    return ds.dataset(files, format="parquet").to_table()


def test_run_exits_zero_and_prints_summary(demo):
    root, run, _ = demo
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ticks" in run.stdout and "drift alarms" in run.stdout
    counts = json.loads((root / "out" / "run.json").read_text())["counts"]
    assert counts["events"]["video"] >= DURATION_S * 25 - 1
    assert counts["faces_blurred"] > 0 and counts["pii_replaced"] > 0
    assert counts["quarantined"] == 0


def test_tick_count_is_duration_times_25(demo):
    root, _, _ = demo
    rec = _table(root / "out", "records/*/*.parquet")
    ticks = len(set(rec.column("tick_index").to_pylist()))
    assert abs(ticks - DURATION_S * 25) <= 1
    assert json.loads((root / "out" / "run.json").read_text())["counts"]["ticks"] == ticks


def test_residuals_within_tolerance_and_lapel_gap_logged(demo):
    root, _, manifest = demo
    rec = _table(root / "out", "records/*/*.parquet").to_pylist()
    tol_ms = {"video": 33, "audio": 40, "pdf": 200}
    matched = [r for r in rec if r["decision"] == "matched"]
    assert all(abs(r["residual_ns"]) <= tol_ms[r["modality"]] * 1e6 for r in matched)
    video = [r for r in rec if r["modality"] == "video"]
    assert sum(r["decision"] == "matched" for r in video) >= len(video) - 1
    audio_res = [abs(r["residual_ns"]) / 1e6 for r in matched if r["modality"] == "audio"]
    assert np.percentile(audio_res, 95) <= 5.0  # MFCC frames every 10 ms: nearest within 5 ms
    # The lapel recorder starts late (its clock offset): ticks before it are gaps, logged in CTAL.
    lapel_offset_ms = manifest.ground_truth.audio_offsets_ns["lapel"] / 1e6
    lapel = [r for r in rec if r["source_id"] == "lapel"]
    first_match = min(r["tick_index"] for r in lapel if r["decision"] == "matched")
    assert abs(first_match * 40 - lapel_offset_ms) <= 40
    ctal = _table(root / "out", "ctal/log/*/*.parquet").to_pylist()
    lapel_gaps = [c for c in ctal if "lapel" in c["reason"]]
    assert len(lapel_gaps) >= first_match - 1 and all(c["decision"] == "gap" for c in lapel_gaps)
    # The lapel's clock offset is not in the manifest: estimated against the room video's audio.
    summary = {r["source_id"]: r for r in _table(root / "out", "ctal/summary/*/*.parquet").to_pylist()}
    assert summary["lapel"]["offset_method"] == "estimated"
    assert abs(summary["lapel"]["offset_ns"] / 1e6 - lapel_offset_ms) <= 10.0
    (jsonl_file,) = (root / "out" / "ctal" / "jsonl" / manifest.session_id).glob("*.jsonl")
    jsonl = jsonl_file.read_text().splitlines()
    assert len(jsonl) == len(ctal) and json.loads(jsonl[0])["session_id"] == manifest.session_id


def test_ocr_text_contains_slide_words_and_no_planted_pii(demo):
    root, _, manifest = demo
    text = " ".join(_table(root / "out", "events/pdf/*/*.parquet").column("text").to_pylist())
    for word in manifest.ground_truth.slide_words:
        assert word.lower() in text.lower(), word
    assert "<PERSON_" in text or "<EMAIL_" in text


def _needles(manifest: Manifest) -> list[bytes]:
    out = []
    for p in manifest.ground_truth.planted_pii:
        out.append(p.value.encode())
        if p.kind == "email":
            out.append(p.value.split("@")[0].encode())
        if p.kind == "phone":
            out.append("".join(c for c in p.value if c.isdigit())[-7:].encode())
        if p.kind == "person":
            out += [part.encode() for part in p.value.split() if len(part) > 3]
    return out


def _decoded_text(table) -> bytes:
    """Every non-float value of a table as text (float vectors would match digit needles by chance)."""
    import pyarrow as pa

    def numeric(t) -> bool:
        return pa.types.is_floating(t) or ((pa.types.is_list(t) or pa.types.is_fixed_size_list(t))
                                           and pa.types.is_floating(t.value_type))

    keep = [f.name for f in table.schema if not numeric(f.type)]
    return repr(table.select(keep).to_pylist()).encode()


def test_no_planted_personal_data_in_any_output_file(demo):
    root, _, manifest = demo
    needles = _needles(manifest)
    assert needles
    files = [p for p in (root / "out").rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:
        blobs = [path.read_bytes()]
        if path.suffix == ".parquet":  # compressed on disk: scan the decoded values too
            blobs.append(_decoded_text(pq.read_table(path)))
        for blob in blobs:
            low = blob.lower()
            squeezed = re.sub(rb"[\s()\-]", b"", low)  # OCR spacing: "clara.hartmann@ example.com"
            for n in needles:
                n = n.lower()
                assert n not in low and re.sub(rb"[\s()\-]", b"", n) not in squeezed, \
                    f"planted personal data found in {path.relative_to(root)}"
    assert not any((root / "out").rglob("keys*")), "pseudonym keys must never be inside the output folder"


def test_face_region_blurred_rest_untouched(demo):
    import av
    from PIL import Image

    root, _, manifest = demo
    video = _table(root / "out", "events/video/*/*.parquet").to_pylist()
    with_face = [r for r in video if r["face_boxes"]]
    assert len(with_face) >= 0.9 * len(video)
    src = {}
    with av.open(str(root / "sample" / "room.mp4")) as c:
        for i, f in enumerate(c.decode(video=0)):
            src[i] = f.to_ndarray(format="rgb24")
    checked = 0
    for r in with_face[:: max(1, len(with_face) // 10)]:
        out = np.asarray(Image.open(io.BytesIO(r["frame_jpeg"])).convert("RGB")).astype(np.int16)
        orig = src[r["frame_index"]].astype(np.int16)
        mask = np.zeros(out.shape[:2], bool)
        for b in r["face_boxes"]:
            mask[b["y0"]:b["y1"], b["x0"]:b["x1"]] = True
        inside = np.abs(out - orig)[mask].mean()
        outside = np.abs(out - orig)[~mask].mean()
        assert inside > 30, f"face region barely changed (mean abs diff {inside:.1f})"
        assert outside < 4, f"pixels outside the face changed (mean abs diff {outside:.1f})"
        checked += 1
    assert checked >= 5


def test_lineage_rows_name_every_source(demo):
    root, _, manifest = demo
    rows = _table(root / "out", "lineage/sources/*/*.parquet").to_pylist()
    sources = manifest.ingest_sources()  # the room video's own sound is a source of its own
    assert {r["source_id"] for r in rows} == {s.id for s in sources} == {s.id for s in manifest.sources} | {
        "room_video.audio"}
    for r in rows:
        spec = next(s for s in sources if s.id == r["source_id"])
        path = root / "sample" / spec.uri
        assert r["source_uri"] == path.resolve().as_uri()
        assert r["source_sha256"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        assert r["source_version"] == f"local:{path.stat().st_size}:{path.stat().st_mtime_ns}"
        assert r["status"] == "ingested" and r["policy"] == DeidPolicy().tag
    lapel = next(r for r in rows if r["source_id"] == "lapel")
    assert lapel["clock_method"] == "estimated" and lapel["clock_reference"] == "room_video"
    assert abs(lapel["clock_offset_ns"] - manifest.ground_truth.audio_offsets_ns["lapel"]) <= 10_000_000
    feats = _table(root / "out", "features/*/*/*/*.parquet")
    assert set(feats.column("source_id").to_pylist()) == {s.id for s in sources}
    assert all(m and "@" in m for m in feats.column("model_id").to_pylist())
    assert all(feats.column("source_uri").to_pylist())
    assert any((root / "out" / "index").glob("*.faiss"))


def test_inspect_and_idempotent_rerun(demo, tmp_path):
    root, _, _ = demo
    shown = subprocess.run([MODALIGN, "inspect", str(root / "out")], capture_output=True, text=True, check=True)
    assert "alignment residuals" in shown.stdout and "lapel" in shown.stdout
    # the re-run works on copies: the shared run's OUT and key store stay as it left them (test_canary scans them)
    out, keys = tmp_path / "out", tmp_path / "keys"
    shutil.copytree(root / "out", out)
    shutil.copytree(root / "keys", keys)
    env = dict(os.environ, MODALIGN_KEY_STORE=str(keys))
    import modalign

    events = ("events_video", "events_audio", "events_pdf")
    first_tables = {t: modalign.open(out).table(t).to_table().sort_by("event_id") for t in events}
    first = json.loads((out / "run.json").read_text())["run_id"][:12]
    before = sorted(str(p.relative_to(out)) for p in (out / "events").rglob("*.parquet"))
    assert before and all(first in p for p in before)
    rerun = subprocess.run([MODALIGN, "run", str(root / "sample" / "manifest.yaml"), "--out", str(out),
                            "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    after = sorted(str(p.relative_to(out)) for p in (out / "events").rglob("*.parquet"))
    second = summary["run_id"][:12]
    # the re-run's parts replaced the first run's one for one (committed, then the old ones removed)
    assert after == [p.replace(first, second) for p in before]
    # determinism: the same input and config give identical de-identified events (blurred pixels,
    # blur boxes, pseudonyms, MFCCs), value for value
    for t in events:
        again = modalign.open(out).table(t).to_table().sort_by("event_id")
        assert again.num_rows and again.equals(first_tables[t]), t
    cache = summary["counts"]["cache"]
    assert cache["hits"]["frame"] > 0 and cache["misses"]["frame"] == 0  # every frame feature from the cache
    assert cache["hit_rate"] >= 0.95


def test_bad_manifest_stops_before_work_naming_the_field(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("session_id: s1\nsources:\n  - id: a\n    uri: x.mp4\n    modality: hologram\n")
    r = subprocess.run([MODALIGN, "run", str(bad), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 1
    assert "sources.0.modality" in r.stderr
    assert not (tmp_path / "out").exists()
