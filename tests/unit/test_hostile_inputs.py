"""Every file of the hostile corpus ends in the right InputError: no crash, no hang, no OOM.

The corpus (tests/hostile_corpus.py) is written once per session; each entry is read by
the operator of its modality under a wall-clock deadline, and must raise the expected
class with the expected reason code, naming the source URI and never its content.
"""

from __future__ import annotations

import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest

from hostile_corpus import CORPUS, Hostile, write_corpus
from modalign.operators.ingest.audio import AudioMfccOperator
from modalign.operators.ingest.base import SourceContext
from modalign.operators.ingest.pdf import PdfTextOperator
from modalign.operators.ingest.video import VideoFramesOperator
from modalign.schemas.errors import InputError
from modalign.schemas.manifest import SourceSpec

pytestmark = pytest.mark.unit

DEADLINE_S = 30  # each file; all of them together take ~3 s
MAX_RSS_GROWTH_MB = 300  # the decoding process (poppler/tesseract run under their own RLIMIT_AS)

OPERATORS = {"video": VideoFramesOperator, "audio": AudioMfccOperator, "pdf": PdfTextOperator}


@contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError in the main thread) when the block runs longer than ``seconds``."""

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    return write_corpus(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="session")
def operators() -> dict:
    ops = {k: cls() for k, cls in OPERATORS.items()}
    for op in ops.values():
        op.ensure_setup()  # model/binary loading is not what the deadline measures
    return ops


def ctx_for(path: Path, modality: str) -> SourceContext:
    spec = SourceSpec(id="src", uri=path.name, modality=modality)
    return SourceContext("hostile", spec, path, path.as_uri(), "sha256:test")


@pytest.mark.parametrize("h", CORPUS, ids=[h.name for h in CORPUS])
def test_hostile_input_ends_in_its_input_error(h: Hostile, corpus, operators):
    ctx = ctx_for(corpus[h.name], h.modality)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got: list[pa.Table] = []
    with deadline(DEADLINE_S), pytest.raises(InputError) as e:
        for table in operators[h.modality].read(ctx):
            got.append(table)
    err = e.value
    assert type(err) is h.error and err.code == h.code, f"{type(err).__name__}[{err.code}]: {err}"
    assert err.source_uri == ctx.uri and ctx.uri in str(err)
    assert len(err.message) < 400 and "Quarterly" not in str(err) and "Action items" not in str(err)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert growth_mb < MAX_RSS_GROWTH_MB
    if h.partial:  # the good part was ingested, the rest is a range after it
        assert got and err.start_t_ns is not None and err.end_t_ns is not None
        t = pa.concat_tables(got).column("t_ns").to_pylist()
        assert t == sorted(t) and err.start_t_ns <= err.end_t_ns
        if h.code == "truncated":  # right after the last frame (video) or sample (audio)
            assert t[-1] < err.start_t_ns <= t[-1] + 40_000_000
    else:
        assert not got


def test_the_lying_wav_keeps_its_real_second(corpus, operators):
    got = []
    with pytest.raises(InputError) as e:
        for table in operators["audio"].read(ctx_for(corpus["lying_size.wav"], "audio")):
            got.append(table)
    t = pa.concat_tables(got).column("t_ns").to_pylist()
    assert t[0] == 0 and t[-1] == 970_000_000  # (16000 - 400) // 160 + 1 = 98 frames
    assert e.value.start_t_ns == 999_937_501  # right after the last sample, 15999 / 16 kHz
    assert e.value.end_t_ns == 0x7FFFFFF0 * 10**9 // 32000  # what the header claims (18.6 h)


@pytest.mark.parametrize("name", ["huge_page.pdf", "image_bomb.pdf"])
def test_oversized_pdf_pages_are_rejected_without_rendering(corpus, operators, monkeypatch, name):
    def no_render(*_a, **_k):
        raise AssertionError("rendered")

    op = operators["pdf"]
    monkeypatch.setattr(op, "_render", no_render)
    with pytest.raises(InputError) as e:
        list(op.read(ctx_for(corpus[name], "pdf")))
    assert e.value.code in ("page_too_large", "image_too_large") and e.value.start_t_ns == 0


def test_the_huge_frame_video_is_rejected_before_decoding(corpus, operators, monkeypatch):
    import av

    def no_decode(*_a, **_k):
        raise AssertionError("decoded")

    monkeypatch.setattr(VideoFramesOperator, "_decoded", no_decode)
    with pytest.raises(InputError) as e:
        list(operators["video"].read(ctx_for(corpus["huge_frames.avi"], "video")))
    assert e.value.code == "pixels_exceeded" and "16000x16000" in str(e.value)
    with av.open(str(corpus["huge_frames.avi"])) as c:  # the container really declares it
        assert (c.streams.video[0].width, c.streams.video[0].height) == (16000, 16000)
