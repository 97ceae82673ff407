"""Manifests, configs and table schemas: one declaration, errors that name the field."""

from __future__ import annotations

import pyarrow as pa
import pytest

from modalign.schemas.errors import ConfigError
from modalign.pipeline.layout import with_lineage
from modalign.schemas.config import RunConfig
from modalign.schemas.load import load_model
from modalign.schemas.manifest import Manifest
from modalign.schemas.tables import ALL_TABLES, LineageColumns, MfccRow, RecordRow, TextBlockRow

pytestmark = pytest.mark.unit


def _write(tmp_path, text: str, name: str = "f.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_config_key_names_the_dotted_field(tmp_path):
    p = _write(tmp_path, "ingest:\n  video:\n    sampel_fps: 2\n")
    with pytest.raises(ConfigError) as err:
        load_model(RunConfig, p)
    assert "ingest.video.sampel_fps" in str(err.value) and str(p) in str(err.value)


def test_config_values_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="align.tick_hz"):
        load_model(RunConfig, _write(tmp_path, "align: {tick_hz: -1}\n"))
    cfg = load_model(RunConfig, _write(tmp_path, "align: {tick_hz: 30}\npolicy: {version: '8'}\n"))
    assert cfg.align.tick_hz == 30 and cfg.policy.tag.startswith("modalign-default@8+")


@pytest.mark.parametrize("body, field", [
    ("session_id: s\nsources: []\n", "sources"),
    ("session_id: s\nsources:\n  - {id: a, uri: a.mp4, modality: video}\n  - {id: a, uri: b.wav, modality: audio}\n",
     "duplicate source id"),
    ("session_id: s\nsources:\n  - {id: a, uri: a.pdf, modality: pdf, page_schedule_ns: [0, 5, 5]}\n",
     "sources.0.page_schedule_ns"),
    ("session_id: s\nsources:\n  - {id: a, uri: a.wav, modality: audio, clock: {estimate_from: zz}}\n", "estimate_from"),
    ("session_id: '../x'\nsources:\n  - {id: a, uri: a.wav, modality: audio}\n", "session_id"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_bad_manifests_are_config_errors_naming_the_problem(tmp_path, body, field):
    with pytest.raises(ConfigError) as err:
        load_model(Manifest, _write(tmp_path, body))
    assert field in str(err.value)


def test_every_output_table_derives_its_arrow_schema_from_its_row_model():
    for model in ALL_TABLES:
        schema = model.schema()
        assert schema.names == list(model.model_fields)
        assert schema.metadata[b"table"].decode() == model.TABLE
    # Lineage columns sit on every row of the data tables, with their units in names.
    for model in (RecordRow, MfccRow, TextBlockRow):
        assert set(LineageColumns.model_fields) <= set(model.model_fields)
    rec = RecordRow.schema()
    assert rec.field("t_ns").type == pa.int64() and rec.field("residual_ns").nullable
    assert MfccRow.schema().field("mfcc").type == pa.list_(pa.float32())


def test_with_lineage_fills_constant_columns_and_casts():
    table = pa.table({"event_id": ["e1", "e2"], "t_ns": [0, 10_000_000], "frame_index": [0, 1],
                      "mfcc": pa.FixedSizeListArray.from_arrays(pa.array([0.5] * 80, pa.float32()), 40),
                      "deid": [{"policy": "p@1", "method": "waveform_dropped", "detector": "none", "count": 0,
                                "threshold": 0.0}] * 2})
    lineage = dict(session_id="s", source_id="mic", source_uri="file:///m.wav", source_version="sha256:00",
                   operators="audio_mfcc@0.1.0", policy="p@1", model_id=None)
    out = with_lineage(table, lineage, MfccRow.schema())
    assert out.schema == MfccRow.schema()
    assert out.column("source_uri").to_pylist() == ["file:///m.wav"] * 2
    assert out.column("voiced").null_count == 2  # optional column not computed upstream
    with pytest.raises(KeyError, match="session_id"):
        with_lineage(table, {}, MfccRow.schema())


def test_readme_config_and_manifest_examples_are_valid(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = readme.split("```yaml\n")[1:]
    config = next(b.split("```")[0] for b in blocks if b.startswith("ingest:"))
    manifest = next(b.split("```")[0] for b in blocks if b.startswith("session_id:"))
    cfg = load_model(RunConfig, _write(tmp_path, config, "c.yaml"))
    assert cfg.policy.voice.action == "keep_mfcc" and cfg.policy.voice.legal_basis and cfg.runtime.address == "auto"
    m = load_model(Manifest, _write(tmp_path, manifest, "m.yaml"))
    assert {s.id for s in m.sources} == {"room_video", "lapel", "slides"}
