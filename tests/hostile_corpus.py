"""A hostile input corpus, generated in code (small: ~1 MB in all, ~2 s to write).

Besides the media files below, the corpus lists the hostile paths, ids, configs and
manifests (``ESCAPING_URIS``, ``BAD_TENANTS``, ``HOSTILE_CONFIGS``, ``HOSTILE_MANIFESTS``):
tests/unit/test_discovery.py and test_bounds.py run each, the integration run adds escaping
symlinks to the media folder, and tests/integration/test_environment_faults.py and
test_kill_recovery.py hold the disk and process cases (they need mounts and processes).

Each entry is a file that must end in one ``InputError`` with a known reason code, never
a crash, a hang or an out-of-memory. ``CORPUS`` lists them with the operator that reads
them and the code it must raise; ``runner_code`` is what the runner's quarantine row says
(the runner itself rejects zero-byte files; files discovery does not treat as media never
reach an operator). Used by tests/unit/test_hostile_inputs.py (operator level, one test
per entry) and tests/integration/test_hostile_corpus.py (the whole folder through Ray).
Imported as ``hostile_corpus`` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import struct
import wave
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modalign.schemas.errors import InputError, LimitExceededError, UnreadableInputError, UnsupportedInputError


# ---- building blocks -------------------------------------------------------------------

def write_wav(path: Path, seconds: float = 1.0, rate: int = 16_000, seed: int = 0) -> Path:
    """Mono s16 WAV: a 440 Hz tone over faint noise (voiced throughout)."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.001 * np.random.default_rng(seed).standard_normal(t.size)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return path


def write_h264(path: Path, frames: int = 75, size: tuple[int, int] = (160, 120), noise: bool = True,
               options: dict | None = None, gop: int = 25, seed: int = 0) -> Path:
    """H.264 MP4 at 25 fps; noise frames make the bytes grow evenly with time, otherwise
    frame i is grey level ``(7 * i) % 256`` with a moving band of a random colour."""
    import av

    w, h = size
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", options=options or {}) as c:
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.codec_context.gop_size = gop
        for i in range(frames):
            if noise:
                img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            else:
                img = np.full((h, w, 3), (7 * i) % 256, np.uint8)
                img[:, (3 * i) % w:] = rng.integers(0, 256, 3)
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def minimal_pdf(pages: list[tuple[float, float, bytes, bytes]], extra: list[bytes] | None = None) -> bytes:
    """A PDF written by hand: each page is (width_pt, height_pt, content stream, resources
    dict); ``extra`` objects are numbered after the pages (2 + 2 * n_pages + 1 ...)."""
    n = len(pages)
    objs: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>",
                         b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(n))
                         + b"] /Count %d >>" % n]
    for i, (w, h, content, resources) in enumerate(pages):
        objs.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %g %g] /Resources %s /Contents %d 0 R >>"
                    % (w, h, resources, 4 + 2 * i))
        objs.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    objs += extra or []
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, o in enumerate(objs):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i + 1, o)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def text_pdf(path: Path, text: str = "Quarterly review of the roadmap", **kw) -> Path:
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path), **kw)
    c.setFont("Helvetica", 20)
    c.drawString(72, 700, text)
    c.showPage()
    c.save()
    return path


# ---- the hostile files -----------------------------------------------------------------

def make_empty(path: Path) -> None:
    path.write_bytes(b"")


def make_wav_named_mp4(path: Path) -> None:
    write_wav(path)


def make_pdf_named_wav(path: Path) -> None:
    text_pdf(path)


def make_truncated_mp4(path: Path) -> None:
    """moov at the end (the muxer default): cut in half, the index is gone."""
    write_h264(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def make_truncated_faststart_mp4(path: Path) -> None:
    """moov first: cut in half, the first 1.4 s decode and the rest is declared but absent."""
    write_h264(path, options={"movflags": "faststart"})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def make_corrupt_middle_mp4(path: Path) -> None:
    """2 kB of random bytes over the middle of mdat: a stretch of frames cannot be decoded."""
    write_h264(path, frames=100, noise=False, seed=1)
    data = bytearray(path.read_bytes())
    at = data.find(b"mdat")
    size = struct.unpack(">I", data[at - 4:at])[0]
    mid = at + size // 2
    data[mid:mid + 2000] = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def make_lying_size_wav(path: Path) -> None:
    """1 s of audio whose data chunk claims 2 GB (18.6 h)."""
    write_wav(path)
    data = bytearray(path.read_bytes())
    at = data.find(b"data")
    data[at + 4:at + 8] = struct.pack("<I", 0x7FFFFFF0)
    path.write_bytes(bytes(data))


def make_zero_rate_wav(path: Path) -> None:
    write_wav(path)
    data = bytearray(path.read_bytes())
    at = data.find(b"fmt ")
    data[at + 12:at + 20] = struct.pack("<II", 0, 0)  # sample rate, byte rate
    path.write_bytes(bytes(data))


def make_huge_frames_avi(path: Path) -> None:
    """An MJPEG AVI of 256x256 frames whose headers (AVI and JPEG) declare 16000x16000."""
    import av

    with av.open(str(path), "w", format="avi") as c:
        s = c.add_stream("mjpeg", rate=5)
        s.width, s.height, s.pix_fmt = 256, 256, "yuvj420p"
        for i in range(3):
            f = av.VideoFrame.from_ndarray(np.full((256, 256, 3), 40 * i, np.uint8), format="rgb24")
            f.pts = i
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    data = bytearray(path.read_bytes())
    avih = data.find(b"avih") + 8
    data[avih + 32:avih + 40] = struct.pack("<II", 16000, 16000)  # dwWidth, dwHeight
    strf = data.find(b"strf") + 8
    data[strf + 4:strf + 12] = struct.pack("<ii", 16000, 16000)  # biWidth, biHeight
    at = 0
    while (at := data.find(b"\xff\xc0", at)) >= 0:  # every JPEG SOF0: height, width
        data[at + 5:at + 9] = struct.pack(">HH", 16000, 16000)
        at += 2
    path.write_bytes(bytes(data))


def make_image_bomb_pdf(path: Path) -> None:
    """A letter page showing one 20000x20000 1-bit image: 48 kB on disk, 400 Mpx declared."""
    w = h = 20000
    comp = zlib.compressobj(9)
    row = bytes(w // 8)
    stream = b"".join(comp.compress(row) for _ in range(h)) + comp.flush()
    image = (b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray "
             b"/BitsPerComponent 1 /Filter /FlateDecode /Length %d >>\nstream\n%s\nendstream"
             % (w, h, len(stream), stream))
    page = (612, 792, b"q 612 0 0 792 0 0 cm /Im0 Do Q", b"<< /XObject << /Im0 5 0 R >> >>")
    path.write_bytes(minimal_pdf([page], extra=[image]))


def make_huge_page_pdf(path: Path) -> None:
    """One 200 x 200 inch page (14400 pt, the PDF maximum): 1.6 Gpx at 200 dpi."""
    path.write_bytes(minimal_pdf([(14400, 14400, b"", b"<< >>")]))


def make_many_pages_pdf(path: Path) -> None:
    path.write_bytes(minimal_pdf([(612, 792, b"", b"<< >>")] * 2000))


def make_encrypted_pdf(path: Path) -> None:
    from reportlab.lib.pdfencrypt import StandardEncryption

    text_pdf(path, encrypt=StandardEncryption("user-secret", "owner-secret"))


def make_random_mp4(path: Path) -> None:
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 20_000, dtype=np.uint8).tobytes())


def make_notes_txt(path: Path) -> None:
    path.write_text("Meeting notes\nAction items: review the budget\n" * 40)


@dataclass(frozen=True)
class Hostile:
    name: str                    # file name in the corpus folder
    modality: str                # the operator that reads it: video | audio | pdf
    make: Callable[[Path], None]
    error: type[InputError]      # the class the operator raises
    code: str                    # the reason code the operator raises
    runner_code: str | None      # the quarantine row's code in a run (None: not discovered as media)
    partial: bool = False        # some events are ingested before the error (a range is quarantined)


CORPUS: list[Hostile] = [
    Hostile("empty.mp4", "video", make_empty, UnreadableInputError, "file_empty", "file_empty"),
    Hostile("wav_as.mp4", "video", make_wav_named_mp4, UnsupportedInputError, "no_video_stream", "no_video_stream"),
    Hostile("pdf_as.wav", "audio", make_pdf_named_wav, UnsupportedInputError, "wrong_type", "wrong_type"),
    Hostile("truncated.mp4", "video", make_truncated_mp4, UnreadableInputError, "unreadable", "unreadable"),
    Hostile("truncated_faststart.mp4", "video", make_truncated_faststart_mp4, UnreadableInputError, "truncated",
            "truncated", partial=True),
    Hostile("corrupt_middle.mp4", "video", make_corrupt_middle_mp4, UnreadableInputError, "corrupt_frames",
            "corrupt_frames", partial=True),
    Hostile("lying_size.wav", "audio", make_lying_size_wav, UnreadableInputError, "truncated", "truncated",
            partial=True),
    Hostile("zero_rate.wav", "audio", make_zero_rate_wav, UnreadableInputError, "unreadable", "unreadable"),
    Hostile("huge_frames.avi", "video", make_huge_frames_avi, LimitExceededError, "pixels_exceeded",
            "pixels_exceeded"),
    Hostile("image_bomb.pdf", "pdf", make_image_bomb_pdf, LimitExceededError, "image_too_large", "image_too_large"),
    Hostile("huge_page.pdf", "pdf", make_huge_page_pdf, LimitExceededError, "page_too_large", "page_too_large"),
    Hostile("many_pages.pdf", "pdf", make_many_pages_pdf, LimitExceededError, "pages_exceeded", "pages_exceeded"),
    Hostile("encrypted.pdf", "pdf", make_encrypted_pdf, UnreadableInputError, "pdf_encrypted", "pdf_encrypted"),
    Hostile("random.mp4", "video", make_random_mp4, UnreadableInputError, "unreadable", "unreadable"),
    Hostile("notes.txt", "video", make_notes_txt, UnsupportedInputError, "not_media", None),
]


# -- paths, ids, configs and manifests: each must fail before any work, naming the field ---------

# Manifest uris that lead out of the manifest's folder ("link_out.wav" is a symlink to outside).
ESCAPING_URIS = ["../../../../etc/passwd", "/etc/shadow", "file:///etc/hostname", "link_out.wav", "s3://bucket/x.wav"]

BAD_TENANTS = ["../../..", "a/b", ".hidden", "x" * 200, ""]

# (run config YAML, the dotted field the error must name)
HOSTILE_CONFIGS = [
    ("align: {tick_hz: 1.0e9}", "align.tick_hz"),
    ("align: {tick_hz: .inf}", "align.tick_hz"),
    ("align: {tick_hz: .nan}", "align.tick_hz"),
    ("align: {tolerance_ms: {video: -5}}", "align.tolerance_ms.video"),
    ("align: {tolerance_ms: {vidoe: 20}}", "align.tolerance_ms.vidoe"),
    ("align: {allowed_lateness_ms: 1.0e12}", "align.allowed_lateness_ms"),
    ("ingest: {video: {max_side: 100000}}", "ingest.video.max_side"),
    ("ingest: {audio: {sample_rate_hz: 1}}", "ingest.audio.sample_rate_hz"),
    ("ingest: {audio: {hop_ms: 50, win_ms: 25}}", "ingest.audio"),
    ("ingest: {pdf: {ocr_workers: 100000}}", "ingest.pdf.ocr_workers"),
    ("ingest: {max_file_bytes: 1.0e30}", "ingest.max_file_bytes"),
    ("embed: {device: tpu}", "embed.device"),
    ("embed: {roi_boxes: [[10, 10, 5, 5]]}", "embed.roi_boxes"),
    ("runtime: {max_in_flight: 0}", "runtime.max_in_flight"),
    ("runtime: {lease_ttl_s: 0.01}", "runtime.lease_ttl_s"),
]

# (the sources of a manifest, what the error must say)
HOSTILE_MANIFESTS = [
    ("  - {id: a, uri: a.wav, modality: audio, clock: {offset_ns: 1180591620717411303424}}\n",
     "sources.0.clock.offset_ns"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {skew_ppm: 1.0e9}}\n", "sources.0.clock.skew_ppm"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {estimate_from: b}}\n"
     "  - {id: b, uri: b.wav, modality: audio, clock: {estimate_from: a}}\n", "cycle: a -> b -> a"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {verify_with: b}}\n"
     "  - {id: b, uri: b.wav, modality: audio, clock: {estimate_from: c}}\n"
     "  - {id: c, uri: c.wav, modality: audio, clock: {estimate_from: a}}\n", "cycle"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {estimate_from: deck}}\n"
     "  - {id: deck, uri: d.pdf, modality: pdf}\n", "is a PDF"),
    ("  - {id: deck, uri: d.pdf, modality: pdf, page_schedule_ns: [0, 1.0e30]}\n", "sources.0.page_schedule_ns"),
]


def write_corpus(folder: Path) -> dict[str, Path]:
    """Write every ``CORPUS`` file into ``folder``; returns name -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for h in CORPUS:
        paths[h.name] = folder / h.name
        h.make(paths[h.name])
    return paths


__all__ = ["CORPUS", "Hostile", "write_corpus", "write_wav", "write_h264", "minimal_pdf", "text_pdf", "ESCAPING_URIS",
           "BAD_TENANTS", "HOSTILE_CONFIGS", "HOSTILE_MANIFESTS"]
