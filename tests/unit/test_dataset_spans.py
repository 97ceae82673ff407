"""The pure parts of the training-dataset join (``pipeline.dataset``): spans on the tick grid, MFCC
slots, work items, shards over workers and ranks, splits by session."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from modalign.pipeline.dataset import (Geometry, WorkItem, assign_splits, even_shard_items, parse_split, plan_items,
                                       shard_items, shard_of, split_of)
from modalign.schemas.errors import ConfigError

pytestmark = pytest.mark.unit
MS = 1_000_000


def test_tick_samples_are_one_tick_each():
    g = Geometry.of("tick", None, None, 25.0)
    assert (g.clip_ticks, g.stride_ticks, g.mfcc_frames, g.squeeze) == (1, 1, 4, True)
    assert g.n_samples(300) == 300 and g.n_samples(0) == 0
    starts, ends = g.spans(0, 3)
    assert starts.tolist() == [0, 40 * MS, 80 * MS] and ends.tolist() == [40 * MS, 80 * MS, 120 * MS]


def test_clips_cover_whole_ticks_with_a_stride():
    g = Geometry.of("clip", 2.0, 0.5, 25.0)
    assert (g.clip_ticks, g.stride_ticks, g.mfcc_frames, g.squeeze) == (50, 12, 200, False)  # 0.5 s = 12.5 -> 12 ticks
    # 300 ticks: clips start at 0, 12, ..., the last whole one at 240 (240 + 50 = 290 <= 300; 252 + 50 > 300)
    assert g.n_samples(300) == 21 and g.n_samples(49) == 0 and g.n_samples(50) == 1
    starts, ends = g.spans(20, 21)
    assert starts.tolist() == [240 * 40 * MS] and ends.tolist() == [290 * 40 * MS]
    assert Geometry.of("clip", 2.0, None, 25.0).stride_ticks == 50  # stride defaults to the clip


def test_rational_tick_rates_keep_exact_integer_times():
    g = Geometry.of("clip", 1.0, None, 30.0)
    starts, ends = g.spans(0, 3)
    assert starts.tolist() == [0, 1_000_000_000, 2_000_000_000]  # 30 ticks of 33_333_333.3 ns, floored
    assert (ends - starts).tolist() == [1_000_000_000] * 3
    assert g.mfcc_frames == 100


@pytest.mark.parametrize("args", [("clip", None, None), ("clip", 0.01, None), ("tick", 1.0, None), ("frame", 1.0, None)])
def test_bad_geometry_is_a_config_error(args):
    with pytest.raises(ConfigError):
        Geometry.of(*args, tick_hz=25.0)


def test_time_range_keeps_the_samples_inside_it():
    g = Geometry.of("clip", 1.0, None, 25.0)  # 1 s clips
    assert g.in_range(250, None) == (0, 10)
    assert g.in_range(250, (1_000_000_000, 4_000_000_000)) == (1, 4)  # [1,2) [2,3) [3,4)
    assert g.in_range(250, (1_500_000_000, 4_200_000_000)) == (2, 4)  # [1,2) starts too early, [4,5) ends too late
    assert g.in_range(250, (None, 2_000_000_000)) == (0, 2)
    assert g.in_range(250, (9_500_000_000, None)) == (10, 10)


def test_mfcc_slots_take_the_frame_in_each_hop_and_mark_gaps():
    g = Geometry.of("tick", None, None, 25.0)
    # frames 3 ms after each 10 ms step, one missing (t=23 ms), and a skewed pair in one slot (41, 47 ms)
    t = np.array([3, 13, 33, 41, 47, 53, 63, 73], dtype=np.int64) * MS
    slots = g.mfcc_slots(np.array([0, 40 * MS], dtype=np.int64), t)
    assert slots.tolist() == [[0, 1, -1, 2], [3, 5, 6, 7]]  # slot [40,50) keeps its first frame (41 ms)
    assert g.mfcc_slots(np.array([100 * MS]), t).tolist() == [[-1, -1, -1, -1]]
    assert g.mfcc_slots(np.array([0]), np.array([], dtype=np.int64)).tolist() == [[-1] * 4]


def test_items_cut_sessions_and_shards_cover_them_exactly_once():
    items = plan_items([("a", 0, 10), ("b", 3, 7), ("c", 0, 0)], 4)
    assert items == [WorkItem("a", 0, 4), WorkItem("a", 4, 8), WorkItem("a", 8, 10), WorkItem("b", 3, 7)]
    shards = [(rank, worker) for rank in range(2) for worker in range(2)]
    got = Counter()
    for rank, worker in shards:
        idx, count = shard_of(rank, 2, worker, 2)
        assert count == 4 and idx == rank * 2 + worker
        for it in shard_items(items, idx, count):
            got.update((it.session_id, k) for k in range(it.first, it.stop))
    want = Counter([("a", k) for k in range(10)] + [("b", k) for k in range(3, 7)])
    assert got == want  # every sample once: no duplicate, no gap
    with pytest.raises(ConfigError):
        shard_of(2, 2, 0, 1)


def test_splits_depend_on_the_session_alone():
    sessions = [f"s{i:03d}" for i in range(200)]
    splits = assign_splits(sessions, [0.8, 0.2], seed=7)
    assert set(splits) == {"train", "val"}
    assert sorted(splits["train"] + splits["val"]) == sessions and not set(splits["train"]) & set(splits["val"])
    assert 120 <= len(splits["train"]) <= 190  # about 80 %
    more = assign_splits(sessions + ["new-1", "new-2"], [0.8, 0.2], seed=7)
    assert all(s in more["train"] for s in splits["train"]) and all(s in more["val"] for s in splits["val"])
    other = assign_splits(sessions, [0.8, 0.2], seed=8)
    assert other != splits  # the seed changes the draw
    assert split_of("x", [0.0, 1.0], 0) == 1 and split_of("x", [1.0, 0.0], 0) == 0
    assert set(assign_splits(sessions, [0.8, 0.1, 0.1], 0)) == {"train", "val", "test"}


@pytest.mark.parametrize("text", ["0.9,0.2", "-0.1,1.1", "", "a,b"])
def test_bad_split_fractions(text):
    with pytest.raises((ConfigError, ValueError)):
        parse_split(text)
    assert parse_split("0.9,0.1") == [0.9, 0.1]


# -- frame decoding ----------------------------------------------------------------------------

def _jpeg(img: np.ndarray, **kw) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _photo(h: int = 360, w: int = 640) -> np.ndarray:
    """A real photograph (skimage's astronaut) resized to a video frame: smooth skin and sharp edges."""
    from PIL import Image
    from skimage import data

    return np.asarray(Image.fromarray(data.astronaut()).resize((w, h), Image.BILINEAR))


@pytest.mark.parametrize("kw", [dict(quality=85), dict(quality=95, subsampling=0), dict(quality=60, subsampling=2)])
def test_the_fast_decoder_gives_pillows_pixels(kw):
    from modalign.pipeline.dataset import _Decoder, _decode_pil

    data = _jpeg(_photo(), **kw)
    dec = _Decoder()
    first = dec(data, (360, 640))  # the parity check: decoded both ways
    assert dec.checked and dec.use_cv2, "OpenCV and Pillow disagree on this libjpeg build"
    ref = _decode_pil(data, (360, 640))
    assert np.array_equal(first, ref) and np.array_equal(dec(data, (360, 640)), ref)
    gray = _jpeg(_photo()[:, :, 1])  # a 1-channel JPEG comes out RGB, channels equal, as Pillow gives it
    assert np.array_equal(dec(gray, (360, 640)), _decode_pil(gray, (360, 640)))
    assert dec(data, (180, 320)).shape == (180, 320, 3)  # another size: Pillow's resize
    assert np.array_equal(dec(data, (180, 320)), _decode_pil(data, (180, 320)))


def test_a_decoder_that_disagrees_with_pillow_is_never_used(monkeypatch):
    from modalign.pipeline.dataset import _Decoder, _decode_pil

    dec = _Decoder()
    real = dec._cv
    calls = []

    def off_by_one(data):  # another libjpeg's rounding, say
        calls.append(1)
        return real(data) ^ np.uint8(1)

    monkeypatch.setattr(dec, "_cv", off_by_one)
    data = _jpeg(_photo())
    ref = _decode_pil(data, (360, 640))
    assert np.array_equal(dec(data, (360, 640)), ref)
    assert dec.checked and not dec.use_cv2 and calls == [1]
    assert np.array_equal(dec(data, (360, 640)), ref) and calls == [1]  # Pillow from then on


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_even_shards_hold_equal_counts_contiguous_in_time(mode):
    # 3 sessions of 253, 7 and 120 samples in items of 50: 380 samples over 2 ranks x 3 workers
    items = plan_items([("a", 0, 253), ("b", 0, 7), ("c", 0, 120)], 50)
    shards = [even_shard_items(items, k, 6, mode) for k in range(6)]
    got = Counter((i.session_id, x) for sh in shards for i in sh for x in range(i.first, i.stop))
    every = Counter((i.session_id, x) for i in items for x in range(i.first, i.stop))
    sizes = [sum(i.stop - i.first for i in sh) for sh in shards]
    if mode == "drop":
        assert sizes == [63] * 6 and max(got.values()) == 1 and sum((every - got).values()) == 380 - 378
    else:
        assert sizes == [64] * 6 and set(got) == set(every) and sum((got - every).values()) == 384 - 380
    for sh in shards:  # each shard one stretch of the sample order: few files to read
        flat = [(i.session_id, x) for i in sh for x in range(i.first, i.stop)]
        order = [(i.session_id, x) for i in items for x in range(i.first, i.stop)] * 2
        start = order.index(flat[0])
        assert flat == order[start:start + len(flat)]
        assert all(i.stop > i.first for i in sh)
    assert even_shard_items([], 0, 4, mode) == []


def test_even_takes_drop_or_pad():
    with pytest.raises(ConfigError, match="even"):
        even_shard_items(plan_items([("a", 0, 10)], 5), 0, 2, "round")


def _parts_context(tmp_path, spans, source="cam", modality="video"):
    """A ``Context`` over one session whose ``modality`` source has one part per span of t_ns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from modalign.pipeline.dataset import EVENT_TABLES, Context
    from modalign.pipeline.layout import OutputLayout

    files = []
    for part, (lo, hi) in spans:
        rel = f"{EVENT_TABLES[modality].PATH}/s1/{source}-a{part % 3}-{part:05d}.parquet"  # attempts mixed, as after an erasure
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"t_ns": pa.array([lo, hi], pa.int64()), "source_id": [source, source]}), tmp_path / rel)
        files.append(rel)
    ctx = Context(spec=None, geometry=None, tolerance_ns={}, n_mfcc=40, root=str(tmp_path),
                  layout=OutputLayout.of(tmp_path), uri=str(tmp_path), session_files={"s1": sorted(files)}, n_ticks={},
                  streams=(), quality={})
    reads = Counter()
    footer = ctx.footer
    ctx.footer = lambda rel: (reads.update([rel]), footer(rel))[1]
    return ctx, sorted(files), reads


def _brute(ctx, files, lo, hi):
    return sorted(f for f in files if ctx.footer(f).lo <= hi and ctx.footer(f).hi >= lo)


def test_a_stream_source_reads_the_footers_of_the_parts_it_needs_only(tmp_path):
    from modalign.pipeline.dataset import _source_parts

    spans = [(p, (p * 1000, p * 1000 + 900)) for p in range(200)]  # 200 parts in time order
    ctx, files, reads = _parts_context(tmp_path, spans)
    for lo, hi in [(0, 50), (5_500, 8_200), (199_950, 250_000), (123_901, 123_950), (-10, -1), (10**9, 10**9 + 1)]:
        reads.clear()
        got = _source_parts(ctx, files, "video", "cam", lo, hi)
        assert len(reads) <= 12  # a binary search over 200 parts and the overlapping ones, not 200 footers
        assert sorted(got) == _brute(ctx, files, lo, hi)
    assert len(_source_parts(ctx, files, "video", "cam", 5_500, 8_200)) == 4  # parts 5 to 8
    assert _source_parts(ctx, files, "video", "other", 0, 10**9) == []  # another source's parts are not its


def test_parts_out_of_time_order_are_found_by_reading_every_footer(tmp_path):
    from modalign.pipeline.dataset import _source_parts

    spans = [(p, (p * 1000, p * 1000 + 900)) for p in range(40)]
    spans[20] = (20, (1000 * 35 + 950, 1000 * 35 + 990))  # part 20 holds times of part 35's span
    ctx, files, reads = _parts_context(tmp_path, spans)
    want = _brute(ctx, files, 35_000, 35_999)
    assert len(want) == 2
    assert sorted(_source_parts(ctx, files, "video", "cam", 19_000, 36_000)) == _brute(ctx, files, 19_000, 36_000)
    assert ("video", "cam") in ctx.unordered  # seen out of order once: every later lookup reads all
    assert sorted(_source_parts(ctx, files, "video", "cam", 35_000, 35_999)) == want
    pdf, pdf_files, _ = _parts_context(tmp_path / "pdf", [(p, (p * 1000, p * 1000 + 900)) for p in range(40)][::-1],
                                       modality="pdf")
    assert len(_source_parts(pdf, pdf_files, "pdf", "cam", 0, 10**9)) == 40  # pages: every part checked
