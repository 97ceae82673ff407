"""VoicePolicyOperator: keep_mfcc passes MFCC frames with a header; drop withholds them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from operators.deid.voice import VoicePolicyConfig, VoicePolicyOperator
from schemas.policy import VoicePolicy

pytestmark = pytest.mark.unit

N_MFCC = 40


def mfcc_table(n: int = 5, with_waveform: bool = False) -> pa.Table:
    rng = np.random.default_rng(1)
    mfcc = rng.standard_normal((n, N_MFCC)).astype(np.float32)
    cols = {
        "event_id": [f"s1/lapel/audio/{i}" for i in range(n)],
        "t_ns": pa.array([i * 10_000_000 for i in range(n)], pa.int64()),
        "frame_index": pa.array(range(n), pa.int64()),
        "mfcc": pa.FixedSizeListArray.from_arrays(pa.array(mfcc.reshape(-1)), N_MFCC),
    }
    if with_waveform:
        cols["samples"] = pa.array([rng.standard_normal(160).astype(np.float32).tolist() for _ in range(n)])
    return pa.table(cols)


def test_keep_mfcc_passes_frames_and_adds_header():
    table = mfcc_table()
    out = VoicePolicyOperator().process(table)
    assert out.num_rows == 5
    assert out.drop_columns(["deid"]).equals(table)
    assert out.column("deid").to_pylist() == [
        {"policy": "modalign-default@1", "method": "waveform_dropped", "detector": "none", "count": 0, "threshold": 0.0}
    ] * 5
    # the MFCC values are the input's buffer, not a copy
    a = table.column("mfcc").chunk(0).values.to_numpy()
    b = out.column("mfcc").chunk(0).values.to_numpy()
    assert np.shares_memory(a, b)


def test_drop_gives_zero_rows_with_schema_kept():
    table = mfcc_table()
    op = VoicePolicyOperator(VoicePolicyConfig(voice=VoicePolicy(action="drop"), policy_tag="strict@2"))
    out = op.process(table)
    assert out.num_rows == 0
    assert out.schema == op.output_schema(table.schema)
    assert out.schema.names == ["event_id", "t_ns", "frame_index", "mfcc", "deid"]
    assert out.schema.field("mfcc").type == table.schema.field("mfcc").type
    assert table.num_rows == 5  # input untouched


def test_raw_waveform_column_never_passes():
    out = VoicePolicyOperator().process(mfcc_table(3, with_waveform=True))
    assert "samples" not in out.column_names
    assert out.num_rows == 3 and out.column("mfcc").type.list_size == N_MFCC
