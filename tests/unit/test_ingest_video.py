"""VideoFramesOperator: exact PTS timing (variable frame rate), sampling, pixels, errors."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from operators.ingest.base import SourceContext
from operators.ingest.video import VideoFramesConfig, VideoFramesOperator, frames_to_numpy, video_frames_schema
from pipeline.errors import InputError, LimitExceededError, UnreadableInputError, UnsupportedInputError
from schemas.manifest import ClockMapping, SourceSpec

pytestmark = pytest.mark.unit

W, H = 160, 120
# Variable frame rate over 2 s: bursts, gaps and irregular steps, in ms (time base 1/1000).
PTS_MS = [0, 40, 80, 100, 150, 250, 260, 300, 400, 433, 466, 500] + list(range(540, 2000, 37))
OFFSET_NS = 5_000_000_000


def level(i: int) -> int:
    """Grey level painted into frame i (distinct, far apart, survives x264)."""
    return 16 + (i * 5) % 224


def encode(path: Path, pts_ms: list[int], container_opts: dict | None = None) -> Path:
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.time_base = s.codec_context.time_base = Fraction(1, 1000)
        for i, p in enumerate(pts_ms):
            img = np.full((H, W, 3), level(i), np.uint8)
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = p, Fraction(1, 1000)
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    return path


def ctx_for(path: Path, offset_ns: int = OFFSET_NS) -> SourceContext:
    spec = SourceSpec(id="cam", uri=path.name, modality="video", clock=ClockMapping(offset_ns=offset_ns))
    return SourceContext(session_id="s1", spec=spec, path=path, uri=f"file://{path}", version="v1")


@pytest.fixture(scope="session")
def vfr_clip(tmp_path_factory) -> Path:
    return encode(tmp_path_factory.mktemp("video") / "vfr.mp4", PTS_MS)


def read_all(op: VideoFramesOperator, ctx: SourceContext) -> list[pa.Table]:
    return list(op.read(ctx))


def test_vfr_timestamps_are_exact_pts_plus_offset(vfr_clip):
    op = VideoFramesOperator(VideoFramesConfig(batch_frames=8))
    tables = read_all(op, ctx_for(vfr_clip))
    assert all(t.num_rows <= 8 for t in tables) and len(tables) == -(-len(PTS_MS) // 8)
    table = pa.concat_tables(tables)
    assert table.column("t_ns").to_pylist() == [OFFSET_NS + p * 1_000_000 for p in PTS_MS]
    for pts, tb, ms in zip(table.column("pts").to_pylist(), table.column("time_base").to_pylist(), PTS_MS):
        assert pts * Fraction(tb) == Fraction(ms, 1000)
    assert table.column("frame_index").to_pylist() == list(range(len(PTS_MS)))
    assert set(table.column("width").to_pylist()) == {W} and set(table.column("height").to_pylist()) == {H}
    assert table.column("event_id")[3].as_py() == "s1/cam/frame/3"
    assert tables[0].schema == video_frames_schema(H, W)
    frames = frames_to_numpy(table)
    assert frames.shape == (len(PTS_MS), H, W, 3) and frames.dtype == np.uint8
    means = frames.reshape(len(PTS_MS), -1).mean(axis=1)
    np.testing.assert_allclose(means, [level(i) for i in range(len(PTS_MS))], atol=4)


def test_sample_fps_picks_first_frame_at_or_after_each_step(vfr_clip):
    op = VideoFramesOperator(VideoFramesConfig(sample_fps=10))
    table = pa.concat_tables(read_all(op, ctx_for(vfr_clip, offset_ns=0)))
    expected = []
    for step_ms in range(0, 2000, 100):
        first = next((i for i, p in enumerate(PTS_MS) if p >= step_ms), None)
        if first is not None and first not in expected:
            expected.append(first)
    assert table.column("frame_index").to_pylist() == expected
    assert table.column("t_ns").to_pylist() == [PTS_MS[i] * 1_000_000 for i in expected]
    means = frames_to_numpy(table).reshape(len(expected), -1).mean(axis=1)
    np.testing.assert_allclose(means, [level(i) for i in expected], atol=4)


def test_frames_to_numpy_is_a_zero_copy_view(vfr_clip):
    table = next(iter(VideoFramesOperator().read(ctx_for(vfr_clip))))
    view = frames_to_numpy(table)
    values = table.column("frame").chunk(0).storage.values
    assert view.__array_interface__["data"][0] == values.buffers()[1].address + values.offset
    assert not view.flags.writeable


def test_generic_schema_matches_tables_but_for_frame_shape(vfr_clip):
    table = next(iter(VideoFramesOperator().read(ctx_for(vfr_clip))))
    generic = VideoFramesOperator().output_schema()
    assert generic.names == table.schema.names
    for f in generic:
        if f.name == "frame":
            assert f.type.extension_name == table.schema.field("frame").type.extension_name
            assert f.type.value_type == pa.uint8() and f.type.shape[2] == 3
        else:
            assert f.type == table.schema.field(f.name).type


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty", "missing"])
def test_unreadable_files_name_the_uri(vfr_clip, tmp_path, content):
    path = tmp_path / "bad.mp4"
    if content == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    elif content == "truncated":
        data = vfr_clip.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif content == "empty":
        path.write_bytes(b"")
    ctx = ctx_for(path)
    with pytest.raises(UnreadableInputError) as e:
        read_all(VideoFramesOperator(), ctx)
    assert ctx.uri in str(e.value) and e.value.source_uri == ctx.uri


def test_audio_only_file_is_unsupported(tmp_path):
    import av

    path = tmp_path / "tone.wav"
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000, layout="mono")
        f = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        f.sample_rate, f.pts = 8000, 0
        for pk in list(s.encode(f)) + list(s.encode(None)):
            c.mux(pk)
    with pytest.raises(UnsupportedInputError) as e:
        read_all(VideoFramesOperator(), ctx_for(path))
    assert e.value.code == "no_video_stream"


def test_limits_reject_before_decoding(vfr_clip):
    with pytest.raises(LimitExceededError) as e:
        read_all(VideoFramesOperator(VideoFramesConfig(max_pixels=W * H - 1)), ctx_for(vfr_clip))
    assert e.value.code == "pixels_exceeded"
    with pytest.raises(LimitExceededError) as e:
        read_all(VideoFramesOperator(VideoFramesConfig(max_duration_s=1.0)), ctx_for(vfr_clip))
    assert e.value.code == "duration_exceeded"


def test_decode_failure_midway_yields_then_reports_range(vfr_clip, monkeypatch):
    import av

    real_open = av.open

    class Failing:
        """A container whose decoder raises after 5 frames."""

        def __init__(self, c):
            self._c = c

        def __getattr__(self, name):
            return getattr(self._c, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._c.close()

        def decode(self, *a, **k):
            for i, f in enumerate(self._c.decode(*a, **k)):
                if i == 5:
                    raise av.error.InvalidDataError(1094995529, "Invalid data found")
                yield f

    monkeypatch.setattr(av, "open", lambda *a, **k: Failing(real_open(*a, **k)))
    got = []
    with pytest.raises(InputError) as e:
        for t in VideoFramesOperator().read(ctx_for(vfr_clip)):
            got.append(t)
    assert pa.concat_tables(got).column("t_ns").to_pylist() == [OFFSET_NS + p * 1_000_000 for p in PTS_MS[:5]]
    assert e.value.code == "decode_failed"
    assert e.value.start_t_ns == OFFSET_NS + PTS_MS[4] * 1_000_000 + 1
    assert e.value.end_t_ns is not None and e.value.end_t_ns >= OFFSET_NS + PTS_MS[-1] * 1_000_000


def test_truncated_stream_with_declared_duration_is_partial(tmp_path):
    import av

    path = tmp_path / "noise.mkv"
    rng = np.random.default_rng(1)
    with av.open(str(path), "w") as c:  # incompressible noise: bytes grow evenly with time
        s = c.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        for i in range(75):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8), format="rgb24")
            f.pts = i
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    got = []
    with pytest.raises(UnreadableInputError) as e:
        for t in VideoFramesOperator().read(ctx_for(path, offset_ns=0)):
            got.append(t)
    last = pa.concat_tables(got).column("t_ns").to_pylist()[-1]
    assert 0 < last < 2_000_000_000
    assert e.value.start_t_ns == last + 1 and e.value.end_t_ns == 3_000_000_000


def test_duration_limit_midway_keeps_the_frames_within_it(vfr_clip, monkeypatch):
    """A header that declares no duration: the limit is enforced on decoded PTS."""
    import operators.ingest.video as video

    monkeypatch.setattr(video, "declared_span_ns", lambda *a: (0, None))
    got = []
    with pytest.raises(LimitExceededError) as e:
        for t in VideoFramesOperator(VideoFramesConfig(max_duration_s=1.0)).read(ctx_for(vfr_clip)):
            got.append(t)
    within = [p for p in PTS_MS if p <= 1000]
    assert pa.concat_tables(got).column("t_ns").to_pylist() == [OFFSET_NS + p * 1_000_000 for p in within]
    first_over = PTS_MS[len(within)]
    assert e.value.code == "duration_exceeded" and e.value.start_t_ns == OFFSET_NS + first_over * 1_000_000
