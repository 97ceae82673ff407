"""An audio stream cut into ranges (``ingest.audio.range_min_s``): every range decodes the stream from
its start and warms the voice-activity detector and the quality meter up before its first frame, so
the ranges together give a whole decode's rows, byte for byte, in the same tables; an error is
reported once, by the range it cuts short."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from media_faults import fail_after
from signals import HI, encode_audio, noise_bursts

from modalign.operators.ingest.audio import AudioMfccOperator, AudioRange
from modalign.operators.ingest.base import SourceContext
from modalign.pipeline.items import DoneItem, QuarantineItem, SourceJob
from modalign.pipeline.worker import IngestWorker
from modalign.schemas.config import RunConfig
from modalign.schemas.files import sha256_file, stat_version
from modalign.schemas.manifest import SourceSpec

pytestmark = pytest.mark.integration

AUDIO = {"chunk_s": 1.0, "range_min_s": 4.0}  # tables of 100 frames; a 14 s stream in 3 ranges
COLUMNS = ["event_id", "t_ns", "frame_index", "mfcc", "voiced", "quality"]


RATE = 44_100  # resampled to 16 kHz: 441 input samples to 160, the resampler's longest cycle


@pytest.fixture(scope="module")
def talk(tmp_path_factory) -> SourceJob:
    """14 s of voiced bursts with pauses over a steady -40 dBFS hiss, AAC at 44.1 kHz: the voice-activity
    detector's floor is the hiss, so a range that started cold would take its first frames for voice."""
    rng = np.random.default_rng(7)
    t = np.arange(14 * RATE) / RATE
    x = np.interp(t * HI, np.arange(14 * HI), noise_bursts(14.0, seed=7)) + 0.01 * rng.standard_normal(t.size)
    path = encode_audio(tmp_path_factory.mktemp("audio-ranges") / "talk.m4a", x, RATE)
    spec = SourceSpec(id="talk", uri=path.name, modality="audio")
    return SourceJob(run_id="r" * 32, session_id="s", spec=spec, path=path, uri=path.as_uri(),
                     version=stat_version(path))


def _rows(out: Path) -> pa.Table:
    return ds.dataset(out / "events" / "audio", format="parquet").to_table(columns=COLUMNS).sort_by("frame_index")


def _parts(out: Path) -> list[pa.Table]:
    """The event parts, in part-number order."""
    files = sorted((out / "events" / "audio").rglob("*.parquet"), key=lambda f: int(f.stem.rsplit("-", 1)[1]))
    return [pq.read_table(f, columns=COLUMNS) for f in files]


def test_ranges_of_a_resampled_stream_equal_a_whole_decode_byte_for_byte(talk, tmp_path):
    """AAC at 44.1 kHz resampled to 16 kHz, anonymised (the default policy), in 3 ranges."""
    keys = tmp_path / "keys"
    worker = IngestWorker(RunConfig(key_store=keys, ingest={"audio": AUDIO}), tmp_path / "ranged", keys)
    ranges = worker.ranges(talk, 3)
    assert [(r.index, r.count, r.start_frame, r.end_frame) for r in ranges] == \
           [(0, 3, 0, 500), (1, 3, 500, 900), (2, 3, 900, None)]
    assert all(r.sha256 == "sha256:" + sha256_file(talk.path) for r in ranges)
    assert worker.ranges(talk, 1) == []  # one actor: whole
    items = [list(worker.ingest(replace(talk, range=r))) for r in ranges]
    assert not [i for it in items for i in it if isinstance(i, QuarantineItem)]
    dones = [it[-1] for it in items]
    assert all(isinstance(d, DoneItem) and d.row.status == "ingested" for d in dones)

    whole = IngestWorker(RunConfig(key_store=keys, ingest={"audio": {**AUDIO, "range_min_s": None}}),
                         tmp_path / "whole", keys)
    assert whole.ranges(talk, 3) == []
    whole_done = list(whole.ingest(talk))[-1]

    got, want = _rows(tmp_path / "ranged"), _rows(tmp_path / "whole")
    assert want.num_rows == 1398 and got.equals(want)  # ids, times, MFCCs, voiced, quality: byte for byte
    assert sum(d.row.events for d in dones) == whole_done.row.events == want.num_rows
    # The same tables (the audio embedder pools whole seconds from each table's first frame), in
    # part order, each starting at a multiple of chunk_s.
    ranged_parts, whole_parts = _parts(tmp_path / "ranged"), _parts(tmp_path / "whole")
    assert len(ranged_parts) == len(whole_parts) == 14
    assert all(a.equals(b) for a, b in zip(ranged_parts, whole_parts))
    assert [p.column("frame_index")[0].as_py() for p in ranged_parts] == list(range(0, 1400, 100))
    # Voice and pauses on either side of each border: what the warm-up is for (a range started
    # cold would take the hiss of its first seconds for voice, and its quality floor would differ).
    voiced = want.column("voiced").to_pylist()
    for border in (500, 900):
        assert len(set(voiced[border - 100:border])) == len(set(voiced[border:border + 100])) == 2


def test_an_error_is_reported_once_by_the_range_it_cuts_short(talk, tmp_path, monkeypatch):
    """The decoder fails 7.5 s in (frame 750): the first range ends where the second starts, the
    second reports the failure, the third meets it before its start and ends quietly; together the
    rows and the quarantine row of a whole decode."""
    keys = tmp_path / "keys"
    worker = IngestWorker(RunConfig(key_store=keys, ingest={"audio": AUDIO}), tmp_path / "ranged", keys)
    ranges = worker.ranges(talk, 3)
    fail_after(monkeypatch, "decode", 323)  # AAC frames of 1024 samples at 44.1 kHz: 7.50 s
    items = [list(worker.ingest(replace(talk, range=r))) for r in ranges]
    quarantined = [[i.row for i in it if isinstance(i, QuarantineItem)] for it in items]
    assert [len(q) for q in quarantined] == [0, 1, 0]
    assert [it[-1].row.status for it in items] == ["ingested", "partial", "ingested"]
    assert [it[-1].row.events for it in items][::2] == [500, 0]

    whole = IngestWorker(RunConfig(key_store=keys, ingest={"audio": {**AUDIO, "range_min_s": None}}),
                         tmp_path / "whole", keys)
    (row,) = [i.row for i in whole.ingest(talk) if isinstance(i, QuarantineItem)]
    assert row.reason_code == "decode_failed" and 7.4e9 < row.start_t_ns < 7.6e9
    assert quarantined[1][0] == row  # the same row: times, code and message
    got, want = _rows(tmp_path / "ranged"), _rows(tmp_path / "whole")
    assert 740 < want.num_rows < 760 and got.equals(want)


def test_a_range_not_cut_at_table_borders_is_refused(talk):
    op = AudioMfccOperator(RunConfig(key_store="k").ingest.audio.model_copy(update=AUDIO))
    odd = AudioRange(index=0, count=2, start_frame=0, end_frame=650, origin_ns=0, frames=1400, hop=160, rate_hz=16000)
    ctx = SourceContext(session_id="s", spec=talk.spec, path=talk.path, uri=talk.uri, version=talk.version, window=odd)
    with pytest.raises(ValueError, match="multiples of 100 frames"):
        next(iter(op.read(ctx)))
