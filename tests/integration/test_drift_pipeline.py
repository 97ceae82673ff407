"""A recorder whose clock drifts raises one drift alarm through the whole pipeline.

The lapel recorder's clock runs 2 % slow; its manifest gives the right offset but no skew
and asks to verify it against the room recorder (``clock.verify_with``). The ingest worker
measures the offset per window, the aligner turns the growing difference into an alarm.
"""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest

from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig
from signals import noise_bursts, record, write_wav

pytestmark = pytest.mark.integration

MS = 1_000_000


def test_skewed_recorder_raises_one_alarm_at_the_crossing(ray_local, tmp_path):
    offset, skew = 250 * MS, 20_000.0
    sound = noise_bursts(52, seed=3)
    write_wav(tmp_path / "room.wav", record(sound, 50.0, 0, 0.0, 0.005, seed=4))
    write_wav(tmp_path / "lapel.wav", record(sound, 48.0, offset, skew, 0.01, seed=5))
    (tmp_path / "meeting.yaml").write_text(
        "session_id: drift\nsources:\n"
        "  - {id: room, uri: room.wav, modality: audio}\n"
        f"  - {{id: lapel, uri: lapel.wav, modality: audio, clock: {{offset_ns: {offset}, verify_with: room}}}}\n")

    out = tmp_path / "out"
    summary = Runner(RunConfig(key_store=tmp_path / "keys"), out).run(tmp_path / "meeting.yaml")

    assert summary["counts"]["drift_alarms"] == 1
    alarm = ds.dataset(out / "ctal" / "alarms", format="parquet").to_table().to_pylist()[0]
    s = skew * 1e-6
    crossing_tick = int((offset + 800 * MS * (1 + s) / s) // (40 * MS)) + 1  # residual offset passes 800 ms
    assert abs(alarm["start_tick"] - crossing_tick) <= 1, (alarm["start_tick"], crossing_tick)
    assert sorted(alarm["sources"]) == ["lapel", "room"]
    ctal = ds.dataset(out / "ctal" / "log" / "drift", format="parquet").to_table().to_pylist()
    assert any(c["decision"] == "out_of_tolerance" and c["tick_index"] == alarm["start_tick"] for c in ctal)
    # The manifest's mapping was verified, not replaced.
    lapel = next(r for r in summary["alignment"]["drift"] if r["source_id"] == "lapel")
    assert lapel["offset_method"] == "manifest" and lapel["offset_ns"] == offset
