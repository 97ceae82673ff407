"""Canary scan: a session seeded with known personal data, run end to end with the CLI; then
every file the run wrote anywhere (OUT, its TMPDIR, Ray's temp/session dir with logs and any
spill files, the console output) is searched for the planted values and for raw pixels of the
planted face. Zero hits allowed.

Canaries: the sample's planted names, e-mails and phones (``manifest.ground_truth``), also
with whitespace removed and case folded (OCR splits "clara.hartmann@ example.com"), name
parts, phone digits; Parquet and JSON are decoded before searching. Face: 48-byte runs of
raw RGB (and BGR) rows of the face crop as it appears in the decoded source video. JPEG
frames cannot hold raw runs, so the stored frames' face boxes are also compared with the
source: they must differ (mean abs > 30) while the slide panel beside them matches.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from modalign.schemas.load import load_model
from modalign.schemas.manifest import Manifest

pytestmark = pytest.mark.e2e

DURATION_S = 6.0
FPS = 25
RUN_BYTES = 48  # 16 RGB pixels
FACE_FRAMES = (0, 60, 120)
FACE_ROWS = (30, 60, 90, 120)


@pytest.fixture(scope="module")
def canary(sample_run):
    """The shared CLI run (tests/e2e/conftest.py: its own TMPDIR and RAY_TMPDIR, so all it wrote is found)."""
    assert sample_run["duration_s"] == DURATION_S
    return {"run": sample_run["run"], "dirs": sample_run["dirs"],
            "manifest": load_model(Manifest, sample_run["manifest_path"]),
            "video": sample_run["root"] / "sample" / "room.mp4"}


def _written_files(dirs: dict[str, Path]) -> list[Path]:
    files = []
    for p in dirs.values():
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(f for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return files


def _decoded_text(path: Path, raw: bytes) -> str:
    """Parquet / Arrow IPC decoded to JSON (binary columns skipped); anything else as UTF-8."""
    def numeric(t: pa.DataType) -> bool:  # float vectors: their digits would match phone needles by chance
        return pa.types.is_floating(t) or ((pa.types.is_list(t) or pa.types.is_fixed_size_list(t))
                                           and pa.types.is_floating(t.value_type))

    def dump(table: pa.Table) -> str:
        keep = [f.name for f in table.schema
                if not (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or numeric(f.type))]
        return json.dumps(table.select(keep).to_pylist(), default=str, ensure_ascii=False)

    if raw[:4] == b"PAR1":
        return dump(pq.read_table(io.BytesIO(raw)))
    if raw[:6] == b"ARROW1":
        return dump(pa.ipc.open_file(io.BytesIO(raw)).read_all())
    return raw.decode("utf-8", errors="replace")


def _canaries(manifest: Manifest) -> dict[str, list[str]]:
    """Per planted value: the forms searched for (normalised: no whitespace, case folded)."""
    out: dict[str, list[str]] = {}
    for p in manifest.ground_truth.planted_pii:
        norm = re.sub(r"\s+", "", p.value).casefold()
        forms = {norm}
        if p.kind == "person":
            forms |= {part.casefold() for part in p.value.split() if len(part) >= 5}
        if p.kind == "email":
            forms.add(norm.split("@")[0])  # the local part alone (it is the name)
        if p.kind == "phone":
            digits = re.sub(r"\D", "", p.value)
            forms |= {digits, digits[-10:]}
        out[p.value] = sorted(forms)
    return out


def _decode_video(path: Path) -> dict[int, np.ndarray]:
    import av

    frames = {}
    with av.open(str(path)) as c:
        for i, f in enumerate(c.decode(video=0)):
            frames[i] = f.to_ndarray(format="rgb24")
    return frames


def test_run_succeeds_and_removes_personal_data(canary):
    run = canary["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads((canary["dirs"]["out"] / "run.json").read_text())["counts"]
    assert counts["faces_blurred"] > 0 and counts["pii_replaced"] > 0 and counts["quarantined"] == 0


def _scan(files: list[Path], canaries: dict[str, list[str]]) -> list[str]:
    leaks = []
    for f in files:
        raw = f.read_bytes()
        text = _decoded_text(f, raw)
        haystacks = {
            "decoded": re.sub(r"\s+", "", text).casefold(),
            "raw": re.sub(rb"\s+", b"", raw).lower(),
            "path": re.sub(r"\s+", "", str(f)).casefold(),
        }
        for value, forms in canaries.items():
            for form in forms:
                for where, hay in haystacks.items():
                    if isinstance(hay, bytes):
                        pat = rb"(?<!\d)" + form.encode() + rb"(?!\d)" if form.isdigit() else re.escape(form.encode())
                    else:
                        pat = rf"(?<!\d){form}(?!\d)" if form.isdigit() else re.escape(form)
                    if re.search(pat, hay):
                        leaks.append(f"{value!r} as {form!r} ({where}) in {f}")
                if not form.isdigit() and form.encode("utf-16-le") in raw.lower():
                    leaks.append(f"{value!r} as UTF-16 in {f}")
    return leaks


def test_scanner_finds_planted_leaks(canary, tmp_path):
    """Control: the scan does find canaries hidden the ways OCR and storage would hide them."""
    canaries = _canaries(canary["manifest"])
    pq.write_table(pa.table({"text": ["see clara.hartmann@ example.com"]}), tmp_path / "a.parquet",
                   compression="zstd")
    (tmp_path / "b.log").write_text("worker: Marcus  Whit field said hello")
    (tmp_path / "c.bin").write_bytes(b"\x00" + "Presented by Clara Hartmann".encode("utf-16-le"))
    (tmp_path / "d.txt").write_text("call 5550104477 now")
    (tmp_path / "e.txt").write_text("t_ns 15550104477 is a timestamp, not a phone")
    leaks = _scan(sorted(tmp_path.iterdir()), canaries)
    hit_files = {Path(line.rsplit(" in ", 1)[1]).name for line in leaks}
    assert hit_files == {"a.parquet", "b.log", "c.bin", "d.txt"}


def test_no_canary_string_in_any_written_file(canary):
    files = _written_files(canary["dirs"])
    assert any(f.suffix == ".parquet" for f in files) and any("logs" in f.parts for f in files)
    canaries = _canaries(canary["manifest"])
    assert len(canaries) >= 6
    leaks = _scan(files, canaries)
    assert not leaks, "\n".join(leaks[:20])


def test_no_raw_face_pixels_in_any_written_file(canary):
    from modalign.pipeline.sample import sample_face_box

    frames = _decode_video(canary["video"])
    runs = []
    for i in FACE_FRAMES:
        x0, y0, x1, y1 = sample_face_box(i * 1_000_000_000 // FPS)
        crop = frames[i][y0:y1, x0:x1]
        for r in FACE_ROWS:
            rgb = np.ascontiguousarray(crop[r, 40:40 + RUN_BYTES // 3])
            assert rgb.std() > 8  # textured face pixels, not a flat run that could occur anywhere
            assert rgb.tobytes() in frames[i].tobytes()  # control: the search finds raw rows
            runs += [rgb.tobytes(), np.ascontiguousarray(rgb[:, ::-1]).tobytes()]  # RGB and BGR
    leaks = [f"face row run in {f}" for f in _written_files(canary["dirs"])
             for run in [f.read_bytes()] for r in runs if r in run]
    assert not leaks, "\n".join(sorted(set(leaks))[:20])


def test_stored_frames_have_the_face_anonymised(canary):
    from PIL import Image

    from modalign.pipeline.sample import PANEL_BOX, sample_face_box

    files = sorted((canary["dirs"]["out"] / "events" / "video").rglob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f, columns=["t_ns", "frame_jpeg", "text_boxes", "face_boxes"])
                              for f in files])
    frames = _decode_video(canary["video"])
    checked = 0
    for t_ns, jpeg, text_boxes, face_boxes in zip(table.column("t_ns").to_pylist(),
                                                  table.column("frame_jpeg").to_pylist(),
                                                  table.column("text_boxes").to_pylist(),
                                                  table.column("face_boxes").to_pylist()):
        i = round(t_ns * FPS / 1e9)
        if i % 10 or i not in frames:
            continue
        stored = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.int16)
        src = frames[i].astype(np.int16)
        x0, y0, x1, y1 = sample_face_box(t_ns)
        face_diff = np.abs(stored[y0:y1, x0:x1] - src[y0:y1, x0:x1]).mean()
        px0, py0, px1, py1 = PANEL_BOX
        # The slide panel shows personal data as text: those lines are blurred (text_boxes),
        # the rest of the panel is the same frame, only JPEG error (where no padded face box,
        # which reaches the hair and the neck, overlaps it).
        assert text_boxes, i
        keep = np.ones(stored.shape[:2], bool)
        for b in text_boxes:
            keep[b["y0"]:b["y1"], b["x0"]:b["x1"]] = False
        untouched = keep.copy()
        for b in face_boxes:
            untouched[b["y0"]:b["y1"], b["x0"]:b["x1"]] = False
        panel = untouched[py0:py1, px0:px1]
        assert panel.mean() > 0.5, (i, "the panel is mostly under boxes: nothing left to compare")
        panel_diff = np.abs(stored[py0:py1, px0:px1] - src[py0:py1, px0:px1])[panel].mean()
        assert panel_diff < 8, (i, panel_diff)
        text_diff = np.abs(stored - src)[~keep].mean()
        assert text_diff > 30, (i, text_diff)
        assert face_diff > 30, (i, face_diff)
        checked += 1
    assert checked >= DURATION_S * FPS // 10 - 1
