"""Generate a realistic sample session (``modalign sample DIR``): the demo and test input.

Sits before the whole data flow: it writes what a user would point ``modalign run`` at, a
meeting of three sources on one session clock, plus the ground truth to check outputs by:

- ``room.mp4``: 640x360, 25 fps H.264 (yuv420p) + mono AAC. A slide panel shows the PDF
  page active at that time; a real face photo (a crop of ``skimage.data.astronaut()``,
  public domain) glides along an arc, always fully in frame (``sample_face_box``). Its
  audio track carries the speech from session time ``SPEECH_START_NS``. Clock offset 0.
- ``lapel.wav``: 16 kHz 16-bit mono, the same speech as recorded by a second device whose
  local zero is session time ``LAPEL_OFFSET_NS`` (ground truth; the manifest asks the
  pipeline to estimate it against the room video: ``clock.estimate_from``), with its own noise.
- ``slides.pdf``: landscape pages (title + lines) with non-personal words and planted
  personal data (names, emails, phones); page i is active from ``page_schedule_ns[i]``.
- ``manifest.yaml``: a ``modalign.schemas.manifest.Manifest`` with ``ground_truth``.

Speech comes from Debian ``espeak-ng``; the output is a function of (duration_s, seed)
only. Nothing is written outside the output folder. Known OCR traits of these slides
(tesseract 5, 200 dpi): emails come out split after the ``@`` (``name@ example.com``), so
PII detection over OCR text must cope; every name, phone and ``SLIDE_WORDS`` entry is
read verbatim.
"""

from __future__ import annotations

import io
import math
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np

from modalign.schemas.errors import ConfigError, DependencyMissingError
from modalign.schemas.load import dump_yaml
from modalign.schemas.manifest import ClockMapping, GroundTruth, Manifest, PlantedPII, SourceSpec
from modalign.schemas.units import NS_PER_S

SESSION_ID = "sample-meeting"
VIDEO_ID, LAPEL_ID, SLIDES_ID = "room_video", "lapel", "slides"
VIDEO_FILE, LAPEL_FILE, SLIDES_FILE, MANIFEST_FILE = "room.mp4", "lapel.wav", "slides.pdf", "manifest.yaml"

# Video geometry (pixels) and timing.
FRAME_W, FRAME_H, FPS = 640, 360, 25
MARGIN = 12
PANEL_BOX = (MARGIN, MARGIN, MARGIN + 336, MARGIN + 189)  # x0, y0, x1, y1: slide area, 16:9
FACE_SIZE = 144
FACE_CROP = (150, 28, 150 + FACE_SIZE, 28 + FACE_SIZE)  # x0, y0, x1, y1 in astronaut(): head and hair
FACE_PERIOD_S = 10.0  # the face goes from top-right to bottom-left and back in this time

# Audio timing (session clock). The lapel recorder starts 730 ms after the video: not a
# multiple of the 40 ms tick nor of the 10 ms MFCC hop, so alignment must really estimate.
SPEECH_START_NS = 1_200_000_000
LAPEL_OFFSET_NS = 730_000_000
SENTENCE_GAP_NS = 350_000_000
ROOM_RATE_HZ = 48_000
LAPEL_RATE_HZ = 16_000
ESPEAK_WPM = 150
MIN_DURATION_S = 4.5
MAX_DURATION_S = 1800.0  # 30 min: the long sessions the memory benchmarks ask for

# Spoken in order (repeated if the session is long); only sentences that end before the
# session ends are spoken and make up the ground-truth transcript.
SENTENCES = (
    "Welcome to the quarterly planning review.",
    "Today we look at the roadmap and the main milestones.",
    "The infrastructure budget is on track for this year.",
    "Storage and network upgrades start next month.",
    "We will share the next steps after the meeting.",
)

# Slide pages: (title, lines). Every planted value below appears verbatim on its page, and
# each person's line is one that en_core_web_sm tags as PERSON (checked in the unit tests).
PAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Quarterly Planning Review", (
        "Presented by Clara Hartmann",
        "Finance and Operations",
        "Contact: clara.hartmann@example.com",
    )),
    ("Roadmap Milestones", (
        "Infrastructure migration finishes in March",
        "Vendor contracts renewed for two years",
        "Marcus Whitfield leads the vendor review",
    )),
    ("Infrastructure Budget", (
        "Storage and network upgrades",
        "Support desk: +44 20 7946 0958",
        "Questions to Marcus Whitfield after the meeting",
    )),
    ("Next Steps", (
        "Clara Hartmann owns the infrastructure plan",
        "Email: marcus.whitfield@example.org",
        "Phone: (555) 010-4477",
    )),
)
PLANTED_PII: tuple[tuple[str, str, int], ...] = (  # kind, value, page_index
    ("person", "Clara Hartmann", 0),
    ("email", "clara.hartmann@example.com", 0),
    ("person", "Marcus Whitfield", 1),
    ("phone", "+44 20 7946 0958", 2),
    ("person", "Marcus Whitfield", 2),
    ("person", "Clara Hartmann", 3),
    ("email", "marcus.whitfield@example.org", 3),
    ("phone", "(555) 010-4477", 3),
)
SLIDE_WORDS = (  # exactly as printed (case included); each one tesseract reads at 200 dpi
    "Quarterly", "Planning", "Review", "Finance", "Roadmap", "Milestones",
    "Infrastructure", "Vendor", "Budget", "Storage", "Questions", "Steps",
)


def subject_id(name: str) -> str:
    """Opaque data-subject id of a planted person (ids travel into lineage: never the name itself)."""
    persons = sorted({value for kind, value, _ in PLANTED_PII if kind == "person"})
    return f"subject-{persons.index(name) + 1:04d}"


def sample_face_box(t_ns: int) -> tuple[int, int, int, int]:
    """Pixel box (x0, y0, x1, y1; x1/y1 exclusive) of the face crop in room.mp4 at session time t_ns.

    The top-left corner moves on a quarter ellipse from the top-right corner (t=0) to the
    bottom-left corner (t=FACE_PERIOD_S/2) and back, with sinusoidal easing, so the face is
    always fully in frame and clear of the slide panel's text. Independent of duration/seed.
    """
    phase = 2.0 * math.pi * (t_ns / NS_PER_S) / FACE_PERIOD_S
    theta = (math.pi / 4.0) * (1.0 - math.cos(phase))  # 0 .. pi/2
    span_x = FRAME_W - FACE_SIZE - 2 * MARGIN
    span_y = FRAME_H - FACE_SIZE - 2 * MARGIN
    x0 = MARGIN + int(round(span_x * math.cos(theta)))
    y0 = MARGIN + int(round(span_y * math.sin(theta)))
    return x0, y0, x0 + FACE_SIZE, y0 + FACE_SIZE


def sample_face_crop() -> np.ndarray:
    """The RGB uint8 face image (FACE_SIZE x FACE_SIZE x 3) pasted into room.mp4."""
    skdata = _require("skimage.data", "scikit-image")
    x0, y0, x1, y1 = FACE_CROP
    return np.ascontiguousarray(skdata.astronaut()[y0:y1, x0:x1, :3])


def slide_panels() -> list[np.ndarray]:
    """One RGB uint8 image per page, PANEL_BOX-sized: what room.mp4 shows in its slide area."""
    _require("PIL", "Pillow")
    from PIL import Image, ImageDraw

    pw, ph = PANEL_BOX[2] - PANEL_BOX[0], PANEL_BOX[3] - PANEL_BOX[1]
    title_font, line_font = _font(20), _font(13)
    panels = []
    for title, lines in PAGES:
        img = Image.new("RGB", (pw, ph), (250, 250, 247))
        d = ImageDraw.Draw(img)
        d.text((14, 10), title, font=title_font, fill=(20, 38, 82))
        d.line([14, 40, pw - 14, 40], fill=(31, 74, 140), width=2)
        for j, line in enumerate(lines):
            d.text((18, 58 + j * 28), line, font=line_font, fill=(20, 20, 20))
        d.rectangle([0, 0, pw - 1, ph - 1], outline=(90, 90, 90))
        panels.append(np.asarray(img, dtype=np.uint8))
    return panels


def page_schedule_ns(duration_ns: int, n_pages: int = len(PAGES)) -> list[int]:
    """Local start time of each page: evenly spread, page 0 at 0."""
    return [duration_ns * i // n_pages for i in range(n_pages)]


def page_at(t_ns: int, schedule_ns: list[int]) -> int:
    """Index of the page active at t_ns (sample-and-hold; page 0 before the first change)."""
    idx = 0
    for i, start in enumerate(schedule_ns):
        if start <= t_ns:
            idx = i
    return idx


def generate_sample(out_dir: Path, duration_s: float = 12.0, seed: int = 0) -> Path:
    """Write a sample session into out_dir and return the manifest path (out_dir/manifest.yaml).

    Deterministic for (duration_s, seed): the seed drives the recorders' noise.
    Raises ConfigError for a duration outside [MIN_DURATION_S, MAX_DURATION_S] and
    DependencyMissingError when espeak-ng, PyAV, reportlab, Pillow or scikit-image is absent.
    """
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s)
            and MIN_DURATION_S <= duration_s <= MAX_DURATION_S):
        raise ConfigError(
            f"sample duration must be between {MIN_DURATION_S} and {MAX_DURATION_S} seconds, got {duration_s!r}"
        )
    duration_ns = int(round(duration_s * NS_PER_S))
    rng = np.random.default_rng(seed)
    speech_22k, rate, transcript = _speech_track(duration_ns)  # fails before any file is written

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = page_schedule_ns(duration_ns)

    _write_pdf(out_dir / SLIDES_FILE)
    room = _place(_resample(speech_22k, rate, ROOM_RATE_HZ), ROOM_RATE_HZ, SPEECH_START_NS, duration_ns)
    room = 0.6 * room + rng.normal(0.0, 0.0008, room.shape)
    _write_video(out_dir / VIDEO_FILE, duration_ns, schedule, room.astype(np.float32))

    lapel_len_ns = duration_ns - LAPEL_OFFSET_NS
    lapel = _place(_resample(speech_22k, rate, LAPEL_RATE_HZ), LAPEL_RATE_HZ,
                   SPEECH_START_NS - LAPEL_OFFSET_NS, lapel_len_ns)
    lapel = 0.85 * lapel + rng.normal(0.0, 0.002, lapel.shape)
    _write_wav(out_dir / LAPEL_FILE, lapel, LAPEL_RATE_HZ)

    persons = sorted({v for k, v, _ in PLANTED_PII if k == "person"})
    manifest = Manifest(
        session_id=SESSION_ID,
        sources=[
            SourceSpec(id=VIDEO_ID, uri=VIDEO_FILE, modality="video", clock=ClockMapping(offset_ns=0)),
            # The lapel recorder's offset is not written down, as with a real recorder: the
            # pipeline estimates it against the room video's audio (ground truth below).
            SourceSpec(id=LAPEL_ID, uri=LAPEL_FILE, modality="audio", clock=ClockMapping(estimate_from=VIDEO_ID)),
            SourceSpec(id=SLIDES_ID, uri=SLIDES_FILE, modality="pdf", clock=ClockMapping(offset_ns=0),
                       page_schedule_ns=schedule),
        ],
        subjects=[subject_id(p) for p in persons],
        ground_truth=GroundTruth(
            duration_ns=duration_ns,
            transcript=transcript,
            speech_source_id=LAPEL_ID,
            audio_offsets_ns={VIDEO_ID: 0, LAPEL_ID: LAPEL_OFFSET_NS},
            slide_words=list(SLIDE_WORDS),
            planted_pii=[PlantedPII(kind=k, value=v, page_index=p) for k, v, p in PLANTED_PII],
            face_source_id=VIDEO_ID,
        ),
    )
    path = out_dir / MANIFEST_FILE
    path.write_text(dump_yaml(manifest), encoding="utf-8")
    return path


# --- helpers -----------------------------------------------------------------------------


def _require(module: str, pip: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DependencyMissingError(f"Python package {pip} (needed by `modalign sample`)", pip=pip) from None


def _espeak(text: str) -> tuple[np.ndarray, int]:
    """Synthesize one sentence with espeak-ng; float64 mono in [-1, 1] and its rate (Hz)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise DependencyMissingError("espeak-ng (speech for the sample session)", apt="espeak-ng")
    proc = subprocess.run([exe, "--stdout", "-s", str(ESPEAK_WPM), text],
                          capture_output=True, check=False, timeout=60)
    if proc.returncode != 0 or len(proc.stdout) < 64:
        raise DependencyMissingError("a working espeak-ng (it exited with an error)", apt="espeak-ng")
    # espeak-ng --stdout streams a WAV whose size fields are placeholders: read what is there.
    with wave.open(io.BytesIO(proc.stdout)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        raw = w.readframes(w.getnframes())
    if width != 2 or channels != 1:
        raise DependencyMissingError("espeak-ng writing 16-bit mono WAV", apt="espeak-ng")
    pcm = np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2").astype(np.float64) / 32768.0
    # Trim the trailing silence espeak appends, keeping 50 ms of tail.
    loud = np.flatnonzero(np.abs(pcm) > 0.01)
    end = min(len(pcm), (int(loud[-1]) if loud.size else 0) + rate // 20)
    return pcm[:end], rate


def _speech_track(duration_ns: int) -> tuple[np.ndarray, int, str]:
    """Concatenate sentences (with gaps) that fit between SPEECH_START_NS and the session end."""
    cache: dict[str, np.ndarray] = {}
    rate = 0
    parts: list[np.ndarray] = []
    spoken: list[str] = []
    t_ns = SPEECH_START_NS
    end_limit = duration_ns - 200_000_000  # leave a little silence at the end
    i = 0
    while True:
        text = SENTENCES[i % len(SENTENCES)]
        if text not in cache:
            cache[text], rate = _espeak(text)
        pcm = cache[text]
        gap = 0 if not parts else SENTENCE_GAP_NS
        length_ns = len(pcm) * NS_PER_S // rate
        if t_ns + gap + length_ns > end_limit:
            break
        if gap:
            parts.append(np.zeros(gap * rate // NS_PER_S))
        parts.append(pcm)
        spoken.append(text)
        t_ns += gap + length_ns
        i += 1
    if not spoken:
        raise ConfigError(f"sample duration {duration_ns / NS_PER_S:.1f} s is too short for one spoken sentence")
    return np.concatenate(parts), rate, " ".join(spoken)


def _resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    resample_poly = _require("scipy.signal", "scipy").resample_poly
    g = math.gcd(rate_in, rate_out)
    return resample_poly(x, rate_out // g, rate_in // g)


def _place(speech: np.ndarray, rate: int, start_local_ns: int, length_ns: int) -> np.ndarray:
    """A track of length_ns (local clock) with speech starting at start_local_ns, zero elsewhere."""
    n = length_ns * rate // NS_PER_S
    start = start_local_ns * rate // NS_PER_S
    out = np.zeros(n)
    seg = speech[: max(0, n - start)]
    out[start:start + len(seg)] = seg
    return out


def _write_wav(path: Path, x: np.ndarray, rate: int) -> None:
    pcm = np.clip(np.round(x * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def _write_pdf(path: Path) -> None:
    """Landscape A4 pages; large Helvetica so OCR reads every line at 200 dpi."""
    _require("reportlab", "reportlab")
    from reportlab.lib.colors import Color
    from reportlab.lib.pagesizes import A4, landscape
    from reportlab.pdfgen.canvas import Canvas

    w, h = landscape(A4)
    c = Canvas(str(path), pagesize=(w, h), invariant=1)  # invariant: no timestamp / random id
    c.setTitle("Quarterly Planning Review")
    c.setAuthor("modalign sample")
    c.setSubject("sample session slides")
    for title, lines in PAGES:
        # Dark text on white throughout: tesseract drops light-on-dark titles.
        c.setFillColor(Color(0.08, 0.15, 0.32))
        c.setFont("Helvetica-Bold", 40)
        c.drawString(60, h - 80, title)
        c.setStrokeColor(Color(0.12, 0.29, 0.55))
        c.setLineWidth(4)
        c.line(60, h - 102, w - 60, h - 102)
        c.setFillColor(Color(0.08, 0.08, 0.08))
        c.setFont("Helvetica", 28)
        for j, line in enumerate(lines):
            c.drawString(80, h - 190 - j * 70, line)
        c.showPage()
    c.save()


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # FreeType build of Pillow: scalable font
    except (TypeError, OSError, ImportError):  # pragma: no cover - Pillow without FreeType
        return ImageFont.load_default()


def _background() -> np.ndarray:
    """A plain 'room': vertical grey-beige gradient."""
    ramp = np.linspace(0.0, 1.0, FRAME_H)[:, None, None]
    top, bottom = np.array([196, 190, 178]), np.array([120, 112, 104])
    img = top + (bottom - top) * ramp
    return np.broadcast_to(img, (FRAME_H, FRAME_W, 3)).round().astype(np.uint8)


def _write_video(path: Path, duration_ns: int, schedule: list[int], audio: np.ndarray) -> None:
    """Encode frames (PTS i/25 s) and the mono audio track (PTS in samples) into one MP4."""
    from fractions import Fraction

    av = _require("av", "av")
    n_frames = int(round(duration_ns * FPS / NS_PER_S))
    bg = _background()
    panels = slide_panels()
    face = sample_face_crop()
    px0, py0, px1, py1 = PANEL_BOX

    with av.open(str(path), mode="w", format="mp4") as container:
        vs = container.add_stream("libx264", rate=FPS)
        vs.width, vs.height, vs.pix_fmt = FRAME_W, FRAME_H, "yuv420p"
        vs.codec_context.time_base = Fraction(1, FPS)
        vs.options = {"crf": "18", "preset": "veryfast", "g": str(2 * FPS)}
        vs.thread_count = 1  # one core; x264 output is then bit-identical run to run
        aud = container.add_stream("aac", rate=ROOM_RATE_HZ, layout="mono")
        aud.codec_context.time_base = Fraction(1, ROOM_RATE_HZ)
        aud.bit_rate = 96_000

        def push_audio(pos: int, until: int) -> int:
            """Encode audio[pos:until] in blocks of at most 1024 samples; returns until."""
            while pos < until:
                block = audio[pos:min(until, pos + 1024)]
                af = av.AudioFrame.from_ndarray(block[None, :], format="flt", layout="mono")
                af.sample_rate = ROOM_RATE_HZ
                af.pts = pos
                af.time_base = Fraction(1, ROOM_RATE_HZ)
                for pkt in aud.encode(af):
                    container.mux(pkt)
                pos += len(block)
            return pos

        # Interleave: the audio up to the end of each video frame, then that frame.
        a_pos = 0
        for i in range(n_frames):
            t_ns = i * NS_PER_S // FPS
            a_pos = push_audio(a_pos, min(len(audio), (i + 1) * ROOM_RATE_HZ // FPS))
            frame = bg.copy()
            frame[py0:py1, px0:px1] = panels[page_at(t_ns, schedule)]
            fx0, fy0, fx1, fy1 = sample_face_box(t_ns)
            frame[fy0:fy1, fx0:fx1] = face
            vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
            vf.pts = i
            vf.time_base = Fraction(1, FPS)
            for pkt in vs.encode(vf):
                container.mux(pkt)
        push_audio(a_pos, len(audio))
        for pkt in aud.encode(None):
            container.mux(pkt)
        for pkt in vs.encode(None):
            container.mux(pkt)
