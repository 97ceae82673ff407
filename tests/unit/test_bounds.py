"""Config and manifest bounds: out-of-range values fail before any work, naming the dotted field."""

from __future__ import annotations

import time

import pytest

from modalign.pipeline.discovery import discover
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError
from modalign.schemas.load import load_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("yaml_text, field", [
    ("align: {tick_hz: 1.0e9}", "align.tick_hz"),
    ("align: {tick_hz: .inf}", "align.tick_hz"),
    ("align: {tick_hz: .nan}", "align.tick_hz"),
    ("align: {tolerance_ms: {video: -5}}", "align.tolerance_ms.video"),
    ("align: {tolerance_ms: {vidoe: 20}}", "align.tolerance_ms.vidoe"),
    ("align: {allowed_lateness_ms: 1.0e12}", "align.allowed_lateness_ms"),
    ("ingest: {video: {max_side: 100000}}", "ingest.video.max_side"),
    ("ingest: {audio: {sample_rate_hz: 1}}", "ingest.audio.sample_rate_hz"),
    ("ingest: {audio: {hop_ms: 50, win_ms: 25}}", "ingest.audio"),
    ("ingest: {pdf: {ocr_workers: 100000}}", "ingest.pdf.ocr_workers"),
    ("ingest: {max_file_bytes: 1.0e30}", "ingest.max_file_bytes"),
    ("embed: {device: tpu}", "embed.device"),
    ("embed: {roi_boxes: [[10, 10, 5, 5]]}", "embed.roi_boxes"),
    ("runtime: {max_in_flight: 0}", "runtime.max_in_flight"),
])
def test_out_of_bounds_config_names_the_field(tmp_path, yaml_text, field):
    (tmp_path / "c.yaml").write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as err:
        load_model(RunConfig, tmp_path / "c.yaml")
    assert field in str(err.value)


def _manifest(tmp_path, body: str):
    (tmp_path / "m.yaml").write_text("session_id: s\nsources:\n" + body)
    return tmp_path / "m.yaml"


@pytest.mark.parametrize("body, needle", [
    ("  - {id: a, uri: a.wav, modality: audio, clock: {offset_ns: 1180591620717411303424}}\n", "sources.0.clock.offset_ns"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {skew_ppm: 1.0e9}}\n", "sources.0.clock.skew_ppm"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {estimate_from: b}}\n"
     "  - {id: b, uri: b.wav, modality: audio, clock: {estimate_from: a}}\n", "cycle: a -> b -> a"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {verify_with: b}}\n"
     "  - {id: b, uri: b.wav, modality: audio, clock: {estimate_from: c}}\n"
     "  - {id: c, uri: c.wav, modality: audio, clock: {estimate_from: a}}\n", "cycle"),
    ("  - {id: a, uri: a.wav, modality: audio, clock: {estimate_from: deck}}\n"
     "  - {id: deck, uri: d.pdf, modality: pdf}\n", "is a PDF"),
    ("  - {id: deck, uri: d.pdf, modality: pdf, page_schedule_ns: [0, 1.0e30]}\n", "sources.0.page_schedule_ns"),
])
def test_out_of_bounds_manifest_names_the_field(tmp_path, body, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace(">", ">")):
        discover(_manifest(tmp_path, body))


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\nembed:\n  image_encoder: {name: x, weights: w.pt, "
                                     "factory: 'm:f', factory_kwargs: {bomb: *a8}}\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases"):
        load_model(RunConfig, tmp_path / "c.yaml")
    assert time.monotonic() - started < 5  # refused while parsing, never expanded


def test_a_huge_manifest_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "m.yaml"
    with open(path, "w") as f:
        f.write("session_id: s\nsources:\n")
        row = "  - {id: a, uri: a.wav, modality: audio}\n"
        f.write(row * (5 * 2**20 // len(row)))
    with pytest.raises(ConfigError, match="byte limit"):
        discover(path)
