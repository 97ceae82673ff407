"""Every output table loads as it is in DuckDB, Polars, pyarrow.dataset, Ray Data and HF datasets.

Each table has a folder of its own, so a recursive reader pointed at it reads exactly that
table (the CTAL log once shared ``ctal/`` with its summary and alarms, and a reader merged
three schemas into one table), and no column has a type a reader refuses (``datasets``
refused the ``map<string,int64>`` of ``events/pdf``).
"""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest

from modalign.pipeline.layout import TABLES, OutputLayout

pytestmark = pytest.mark.integration


def _files(out, name) -> list[str]:
    return sorted(str(p) for p in OutputLayout(out).table_dir(name).rglob("*.parquet"))


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
    assert out.sessions() == ["sample-meeting"]
    pdf = out.table("events_pdf").to_table()
    counts = [c for row in pdf.column("pii_counts").to_pylist() for c in row]
    assert counts and all(set(c) == {"kind", "count"} and c["count"] > 0 for c in counts)
    assert {"person", "email"} <= {c["kind"] for c in counts}  # the slides' planted names and emails
    records = out.table("records").to_table()
    assert set(records.column("modality").to_pylist()) == {"video", "audio", "pdf"}
    ctal = out.table("ctal").to_table()
    assert "decision" in ctal.column_names and "residual_p50_ms" not in ctal.column_names
    assert out.table("ctal_summary").to_table().num_rows == len(set(records.column("source_id").to_pylist()))
