"""Every output table loads as it is in DuckDB, Polars, pyarrow.dataset, Ray Data and HF datasets.

Each table has a folder of its own, so a recursive reader pointed at it reads exactly that
table (the CTAL log once shared ``ctal/`` with its summary and alarms, and a reader merged
three schemas into one table), and no column has a type a reader refuses (``datasets``
refused the ``map<string,int64>`` of ``events/pdf``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from modalign.pipeline.layout import TABLES, OutputLayout
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig
from signals import noise_bursts, record, write_wav

pytestmark = pytest.mark.integration

MS = 1_000_000


@pytest.fixture(scope="module")
def sample_out(ray_local, sample_manifest, tmp_path_factory) -> Path:
    """One run that fills every table: the sample meeting, a drifting recorder (a drift
    alarm), a broken file (a quarantine row) and a monitor set to alarm."""
    d = tmp_path_factory.mktemp("readers-in")
    shutil.copytree(sample_manifest.parent, d / "meeting")
    (d / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 300)
    sound = noise_bursts(32, seed=3)
    (d / "drift").mkdir()
    write_wav(d / "drift" / "room.wav", record(sound, 30.0, 0, 0.0, 0.005, seed=4))
    write_wav(d / "drift" / "lapel.wav", record(sound, 29.0, 250 * MS, 40_000.0, 0.01, seed=5))
    (d / "drift" / "meeting.yaml").write_text(
        "session_id: drift\nsources:\n  - {id: room, uri: room.wav, modality: audio}\n"
        f"  - {{id: lapel, uri: lapel.wav, modality: audio, clock: {{offset_ns: {250 * MS}, verify_with: room}}}}\n")
    out = tmp_path_factory.mktemp("readers-out") / "out"
    # small monitor windows and alpha 0 (the threshold is the mean of past divergences): monitor alarms
    monitor = {"embedding": {"window": 4, "reference_windows": 2, "alpha": 0, "alpha_step": 0}}
    summary = Runner(RunConfig(key_store=out.parent / "keys", monitor=monitor), out, progress=lambda _m: None).run(d)
    assert summary["counts"]["drift_alarms"] >= 1 and summary["counts"]["quarantined"] >= 1
    assert summary["counts"]["monitor_alarms"]["embedding_drift"] >= 1
    return out


def _files(out, name) -> list[str]:
    import modalign

    return [str(p) for p in modalign.open(out).files(name)]


@pytest.mark.parametrize("name", list(TABLES))
def test_each_table_reads_the_same_in_every_reader(sample_out, name):
    import datasets
    import duckdb
    import polars as pl
    import ray

    folder = OutputLayout(sample_out).table_dir(name)
    files = _files(sample_out, name)
    assert files, f"the sample run wrote no {name} table"
    schema = TABLES[name].schema()
    arrow = ds.dataset(folder, format="parquet").to_table()  # the folder, recursively: this table only
    assert arrow.schema.names == schema.names
    n = arrow.num_rows

    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{folder}/**/*.parquet')").fetchall()[0][0] == n
    assert pl.scan_parquet(files).collect().shape == (n, len(schema))
    rd = ray.data.read_parquet(str(folder))
    assert rd.count() == n and rd.schema().names == schema.names
    hf = datasets.Dataset.from_parquet(files, keep_in_memory=True)
    assert hf.num_rows == n and hf.column_names == schema.names


def test_the_tables_hold_content(sample_out):
    """Not just readable: the sample's events, timeline and CTAL are there, each in its own table."""
    import modalign

    out = modalign.open(sample_out)
    assert out.sessions() == ["broken", "drift", "sample-meeting"]
    pdf = out.table("events_pdf").to_table()
    counts = [c for row in pdf.column("pii_counts").to_pylist() for c in row]
    assert counts and all(set(c) == {"kind", "count"} and c["count"] > 0 for c in counts)
    assert {"person", "email"} <= {c["kind"] for c in counts}  # the slides' planted names and emails
    records = out.table("records").to_table()
    assert set(records.column("modality").to_pylist()) == {"video", "audio", "pdf"}
    assert out.table("drift_alarms").to_table().column("session_id").to_pylist()[0] == "drift"
    assert out.table("quarantine").to_table().column("source_uri").to_pylist()[0].endswith("broken.mp4")
    ctal = out.table("ctal").to_table()
    assert "decision" in ctal.column_names and "residual_p50_ms" not in ctal.column_names
    pairs = set(zip(*out.table("records").to_table(columns=["session_id", "source_id"]).to_pydict().values()))
    summary = out.table("ctal_summary").to_table().to_pylist()
    assert {(r["session_id"], r["source_id"]) for r in summary if r["ticks"]} == pairs
    assert [r["ticks"] for r in summary if r["session_id"] == "broken"] == [0]  # no events: no timeline
