"""VideoFramesOperator: exact PTS timing (variable frame rate), sampling, pixels, errors."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from media_faults import fail_after
from modalign.operators.ingest.base import SourceContext
from modalign.operators.ingest.video import (VideoFramesConfig, VideoFramesOperator, frames_to_numpy, iter_frames,
                                             video_frames_schema)
from modalign.schemas.errors import InputError, LimitExceededError, UnreadableInputError, UnsupportedInputError
from modalign.schemas.manifest import ClockMapping, SourceSpec

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


def test_a_range_keeps_its_own_frames_and_the_frames_are_stored_without_a_copy(vfr_clip):
    """A batch's frames of one run of rows (a video range's own) are a slice of the decoded
    table, and the stored form reads them chunk by chunk from where they are: the pixels of a
    batch were copied twice before (the range filter, then the chunks concatenated for JPEG)."""
    from modalign.pipeline.worker import rows_where

    table = next(iter(VideoFramesOperator().read(ctx_for(vfr_clip))))
    n = table.num_rows
    assert n >= 6
    whole = frames_to_numpy(table)
    own = np.zeros(n, dtype=bool)
    own[2:n - 1] = True
    kept = rows_where(table, own)
    assert kept.column("frame_index").to_pylist() == table.column("frame_index").to_pylist()[2:n - 1]
    assert rows_where(table, np.ones(n, dtype=bool)) is table
    gap = own.copy()
    gap[3] = False  # not one run of rows: filtered
    assert rows_where(table, gap).column("frame_index").to_pylist() == [i for i, k in zip(
        table.column("frame_index").to_pylist(), gap) if k]

    chunked = pa.concat_tables([kept.slice(0, 2), kept.slice(2)])
    assert chunked.column("frame").num_chunks == 2
    frames = list(iter_frames(chunked))
    assert len(frames) == n - 3 and all(np.shares_memory(f, whole) for f in frames)
    assert all((f == w).all() for f, w in zip(frames, whole[2:n - 1]))


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


def test_demux_failure_midway_yields_then_reports_range(vfr_clip, monkeypatch):
    fail_after(monkeypatch, "demux", 8)  # the demuxer raises after 8 packets (a damaged container index)
    got = []
    with pytest.raises(InputError) as e:
        for t in VideoFramesOperator().read(ctx_for(vfr_clip)):
            got.append(t)
    t_ns = pa.concat_tables(got).column("t_ns").to_pylist()
    truth = [OFFSET_NS + p * 1_000_000 for p in PTS_MS]
    assert 4 <= len(t_ns) <= 8 and t_ns == sorted(t_ns) and set(t_ns) <= set(truth)  # decoder delay: 8 packets
    assert e.value.code == "decode_failed"
    assert e.value.start_t_ns == t_ns[-1] + 1
    assert e.value.end_t_ns is not None and e.value.end_t_ns >= truth[-1]


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
    import modalign.operators.ingest.video as video

    monkeypatch.setattr(video, "declared_span_ns", lambda *a: (0, None))
    got = []
    with pytest.raises(LimitExceededError) as e:
        for t in VideoFramesOperator(VideoFramesConfig(max_duration_s=1.0)).read(ctx_for(vfr_clip)):
            got.append(t)
    within = [p for p in PTS_MS if p <= 1000]
    assert pa.concat_tables(got).column("t_ns").to_pylist() == [OFFSET_NS + p * 1_000_000 for p in within]
    first_over = PTS_MS[len(within)]
    assert e.value.code == "duration_exceeded" and e.value.start_t_ns == OFFSET_NS + first_over * 1_000_000


# ---- rotation, keyframes, resize, damage -------------------------------------------------

def marker_clip(path: Path, frames: int = 3, size: tuple[int, int] = (64, 48)) -> Path:
    """Grey frames with a white 16x16 marker in the top-left corner (as encoded)."""
    import av

    w, h = size
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            img = np.full((h, w, 3), 60, np.uint8)
            img[:16, :16] = 255
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts = i
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    return path


def set_display_matrix(path: Path, a: int, b: int, c: int, d: int) -> Path:
    """Write the rotation part of the tkhd matrix (16.16 fixed point), as a phone does."""
    import struct

    data = bytearray(path.read_bytes())
    at = data.find(b"tkhd")
    assert data[at + 4] == 0  # version 0 box
    matrix = at + 4 + 4 + 20 + 8 + 8  # fullbox header, times/ids/duration, reserved, layer..volume
    fx = [v * 65536 & 0xFFFFFFFF for v in (a, b, 0, c, d, 0, 0, 0)] + [0x40000000]
    data[matrix:matrix + 36] = struct.pack(">9I", *fx)
    return Path(path).write_bytes(bytes(data)) and path


def marker_corner(frame: np.ndarray) -> str:
    """Which corner holds the white marker: tl, tr, bl or br."""
    h, w = frame.shape[:2]
    corners = {"tl": frame[:8, :8], "tr": frame[:8, w - 8:], "bl": frame[h - 8:, :8], "br": frame[h - 8:, w - 8:]}
    return max(corners, key=lambda k: corners[k].mean())


@pytest.mark.parametrize("matrix,corner,swapped", [
    ((1, 0, 0, 1), "tl", False),     # identity
    ((0, 1, -1, 0), "tr", True),     # 90 degrees clockwise (a phone held upright): FFmpeg rotation -90
    ((-1, 0, 0, -1), "br", False),   # 180
    ((0, -1, 1, 0), "bl", True),     # 270 clockwise
])
def test_display_matrix_rotates_frames_upright(tmp_path, matrix, corner, swapped):
    path = set_display_matrix(marker_clip(tmp_path / "phone.mp4"), *matrix)
    table = pa.concat_tables(VideoFramesOperator().read(ctx_for(path)))
    frames = frames_to_numpy(table)
    w, h = (48, 64) if swapped else (64, 48)
    assert frames.shape == (3, h, w, 3)
    assert set(table.column("width").to_pylist()) == {w} and set(table.column("height").to_pylist()) == {h}
    assert all(marker_corner(f) == corner for f in frames)


def test_legacy_rotate_tag_is_clockwise():
    from modalign.operators.ingest.video import quarter_turns

    class F:
        rotation = 0

    class S:
        metadata = {"rotate": "90"}

    assert quarter_turns(F(), S()) == 3  # np.rot90 k=3: a quarter turn clockwise
    F.rotation = -90
    assert quarter_turns(F(), type("S0", (), {"metadata": {}})()) == 3
    F.rotation = 180
    assert quarter_turns(F(), S()) == 2


@pytest.fixture(scope="session")
def gop_clip(tmp_path_factory) -> Path:
    """40 frames at 10 fps (time base 1/10), a keyframe every 10 frames, no scene cuts."""
    import av

    path = tmp_path_factory.mktemp("gop") / "gop.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.codec_context.options = {"x264-params": "keyint=10:min-keyint=10:scenecut=0"}
        for i in range(40):
            f = av.VideoFrame.from_ndarray(np.full((H, W, 3), level(i), np.uint8), format="rgb24")
            f.pts = i
            for pk in s.encode(f):
                c.mux(pk)
        for pk in s.encode(None):
            c.mux(pk)
    return path


def test_keyframes_only_decodes_just_the_keyframes(gop_clip):
    table = pa.concat_tables(VideoFramesOperator(VideoFramesConfig(keyframes_only=True)).read(ctx_for(gop_clip, 0)))
    assert table.column("t_ns").to_pylist() == [k * 100_000_000 for k in (0, 10, 20, 30)]
    assert table.column("frame_index").to_pylist() == [0, 1, 2, 3]  # index among decoded (key) frames
    means = frames_to_numpy(table).reshape(4, -1).mean(axis=1)
    np.testing.assert_allclose(means, [level(k) for k in (0, 10, 20, 30)], atol=4)


def test_keyframes_only_combines_with_sample_fps(gop_clip):
    op = VideoFramesOperator(VideoFramesConfig(keyframes_only=True, sample_fps=0.5))  # one per 2 s
    table = pa.concat_tables(op.read(ctx_for(gop_clip, 0)))
    assert table.column("t_ns").to_pylist() == [0, 2_000_000_000]


def test_max_side_downscales_on_decode_keeping_aspect(vfr_clip):
    table = pa.concat_tables(VideoFramesOperator(VideoFramesConfig(max_side=80)).read(ctx_for(vfr_clip)))
    frames = frames_to_numpy(table)
    assert frames.shape == (len(PTS_MS), 60, 80, 3)
    assert set(table.column("width").to_pylist()) == {80} and set(table.column("height").to_pylist()) == {60}
    np.testing.assert_allclose(frames.reshape(len(PTS_MS), -1).mean(axis=1), [level(i) for i in range(len(PTS_MS))],
                               atol=4)
    same = pa.concat_tables(VideoFramesOperator(VideoFramesConfig(max_side=4000)).read(ctx_for(vfr_clip)))
    assert frames_to_numpy(same).shape[1:3] == (H, W)  # never upscaled


def test_max_side_applies_to_the_rotated_frame(tmp_path):
    path = set_display_matrix(marker_clip(tmp_path / "phone.mp4", size=(128, 96)), 0, 1, -1, 0)
    frames = frames_to_numpy(pa.concat_tables(VideoFramesOperator(VideoFramesConfig(max_side=64)).read(ctx_for(path))))
    assert frames.shape[1:3] == (64, 48) and all(marker_corner(f) == "tr" for f in frames)


def test_corrupt_middle_quarantines_only_the_lost_stretch(tmp_path):
    """Random bytes over the middle of mdat: frames before and after are ingested (same
    pixels as the intact file), one error spans the lost ones."""
    from hostile_corpus import make_corrupt_middle_mp4, write_h264

    good = write_h264(tmp_path / "good.mp4", frames=100, noise=False, seed=1)
    bad = tmp_path / "bad.mp4"
    make_corrupt_middle_mp4(bad)
    ref = pa.concat_tables(VideoFramesOperator().read(ctx_for(good, 0)))
    got = []
    with pytest.raises(UnreadableInputError) as e:
        for t in VideoFramesOperator().read(ctx_for(bad, 0)):
            got.append(t)
    table = pa.concat_tables(got)
    t_ref, t_got = ref.column("t_ns").to_pylist(), table.column("t_ns").to_pylist()
    lost = sorted(set(t_ref) - set(t_got))
    assert set(t_got) <= set(t_ref) and 5 <= len(lost) <= 50 and t_got[-1] == t_ref[-1]
    assert e.value.code == "corrupt_frames"
    assert e.value.start_t_ns <= lost[0] and lost[-1] <= e.value.end_t_ns
    # conservative by at most the decoder's delay (a few frames of 40 ms) on either side
    assert lost[0] - e.value.start_t_ns <= 5 * 40_000_000 and e.value.end_t_ns - lost[-1] <= 5 * 40_000_000
    ref_frames = dict(zip(t_ref, frames_to_numpy(ref)))
    kept = [i for i, t in enumerate(t_got) if t < e.value.start_t_ns or t > e.value.end_t_ns]
    got_frames = frames_to_numpy(table)
    assert all(np.array_equal(got_frames[i], ref_frames[t_got[i]]) for i in kept)


def test_the_audio_track_of_a_video_is_an_audio_source(tmp_path):
    """One MP4 with H.264 + AAC: the video operator reads the frames, the audio operator the
    MFCCs of the same file, on the same clock."""
    import av

    from modalign.operators.ingest.audio import AudioMfccOperator

    path = tmp_path / "av.mp4"
    sr = 16000
    with av.open(str(path), "w") as c:
        a = c.add_stream("aac", rate=sr, layout="mono")
        v = c.add_stream("libx264", rate=25)
        v.width, v.height, v.pix_fmt = 64, 48, "yuv420p"
        for i in range(50):  # 2 s of video
            f = av.VideoFrame.from_ndarray(np.full((48, 64, 3), level(i), np.uint8), format="rgb24")
            f.pts = i
            for pk in v.encode(f):
                c.mux(pk)
        for pk in v.encode(None):
            c.mux(pk)
        t = np.arange(2 * sr) / sr
        x = np.where(t >= 1.0, 0.3 * np.sin(2 * np.pi * 300 * t), 0.0).astype(np.float32)  # sound from 1 s
        for i in range(0, x.size, 1024):
            af = av.AudioFrame.from_ndarray(x[None, i:i + 1024], format="fltp", layout="mono")
            af.sample_rate, af.pts, af.time_base = sr, i, Fraction(1, sr)
            for pk in a.encode(af):
                c.mux(pk)
        for pk in a.encode(None):
            c.mux(pk)
    video = pa.concat_tables(VideoFramesOperator().read(ctx_for(path, 0)))
    spec = SourceSpec(id="mic", uri=path.name, modality="audio", clock=ClockMapping(offset_ns=0))
    audio = pa.concat_tables(AudioMfccOperator().read(SourceContext("s1", spec, path, f"file://{path}", "v1")))
    assert video.column("t_ns").to_pylist() == [i * 40_000_000 for i in range(50)]
    t = audio.column("t_ns").to_numpy()
    assert t[0] == 0 and 195 <= len(t) <= 205
    voiced = audio.column("voiced").to_numpy(zero_copy_only=False)
    onset = t[np.argmax(voiced)]
    assert abs(onset - 1_000_000_000) <= 30_000_000 and voiced[t >= 1_100_000_000].all()


@pytest.mark.parametrize("cut", ["between", "inside"])
def test_a_file_cut_short_is_truncated_wherever_the_cut_falls(tmp_path, cut):
    """A faststart MP4 cut after packet 40 of 75: cut between two packets, decoding simply ends; cut
    inside packet 40, its part fails to decode first. Either way the file ended before the packets its
    index declares (no demuxer error): ``truncated`` from the last good frame to the declared end."""
    import av

    from hostile_corpus import write_h264

    path = write_h264(tmp_path / "whole.mp4", options={"movflags": "faststart"})
    with av.open(str(path)) as c:
        packets = [(p.pos, p.size) for p in c.demux(c.streams.video[0]) if p.size]
    assert len(packets) == 75
    pos, size = packets[40]
    (tmp_path / "cut.mp4").write_bytes(path.read_bytes()[: pos + (size // 2 if cut == "inside" else 0)])
    got = []
    with pytest.raises(UnreadableInputError) as e:
        for t in VideoFramesOperator().read(ctx_for(tmp_path / "cut.mp4")):
            got.append(t)
    n = sum(t.num_rows for t in got)
    assert e.value.code == "truncated" and 30 <= n <= 40, (e.value.code, n)
    assert e.value.start_t_ns == pa.concat_tables(got).column("t_ns").to_pylist()[-1] + 1
    assert e.value.end_t_ns == OFFSET_NS + 3_000_000_000  # 75 frames at 25 fps, as declared
