"""Fixtures of the integration tests that more than one module needs.

``lineage_run``: one real pipeline run (a few seconds of Ray work) that the lineage tests
share: ``test_lineage_queries`` (trace, access, the subject registry),
``test_lineage_erasure`` (erase, verify, the denylist: on copies) and
``test_access_report_browser`` and ``test_report_browser`` (the HTML pages in chromium). Its
three sessions:

- ``sample-meeting``: the generated sample (video with its own sound track, lapel audio,
  slides PDF); session subjects subject-0001 and subject-0002, so in every source.
- ``solo``: two audio recorders; session subject subject-0003 (both recorders), and the room
  recorder alone also lists subject-0001 and subject-0007 (per-source subjects). Erasing
  subject-0001 takes the room recorder and keeps the lapel recorder, row for row.
- ``deck``: the meeting's slides again in a session that lists no subject: only the subject
  registry (a name, outside OUT) links it to subject-0001.

The embedding monitor runs with windows of 4 vectors (2 of them the reference), so that every
session has windows.

A test that changes OUT or the key store works on a copy (``shutil.copytree``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

MS = 1_000_000


@pytest.fixture(scope="session")
def chromium():
    """One real headless Chromium (Debian's, through chromedriver) for every browser test."""
    from browser import headless_chromium

    with headless_chromium() as browser:
        yield browser


@dataclass(frozen=True)
class LineageRun:
    out: Path  # the run's output folder (never changed by a test)
    input: Path  # the INPUT folder: meeting/, solo/, deck/
    keys: Path  # the key store (next to OUT, outside it)


@pytest.fixture(scope="session")
def lineage_run(ray_local, sample_manifest, tmp_path_factory) -> LineageRun:
    """One run over the three sessions above (see the module docstring)."""
    from modalign.pipeline.runner import Runner
    from modalign.schemas.config import RunConfig
    from signals import noise_bursts, record, write_wav

    d = tmp_path_factory.mktemp("lineage-in")
    shutil.copytree(sample_manifest.parent, d / "meeting")
    sound = noise_bursts(4, seed=7)
    (d / "solo").mkdir()
    write_wav(d / "solo" / "room.wav", record(sound, 3.0, 0, 0.0, 0.005, seed=8))
    write_wav(d / "solo" / "lapel.wav", record(sound, 2.5, 250 * MS, 0.0, 0.01, seed=9))
    (d / "solo" / "manifest.yaml").write_text(
        "session_id: solo\nsubjects: [subject-0003]\nsources:\n"
        "  - {id: room, uri: room.wav, modality: audio, subjects: [subject-0001, subject-0007]}\n"
        f"  - {{id: lapel, uri: lapel.wav, modality: audio, clock: {{offset_ns: {250 * MS}}}}}\n")
    (d / "deck").mkdir()
    shutil.copy(sample_manifest.parent / "slides.pdf", d / "deck" / "slides.pdf")
    (d / "deck" / "manifest.yaml").write_text(
        "session_id: deck\nsources:\n  - {id: slides, uri: slides.pdf, modality: pdf}\n")
    root = tmp_path_factory.mktemp("lineage-out")
    out, keys = root / "out", root / "keys"
    # small monitor windows, so that the sessions have embedding-monitor windows to erase and rebuild
    config = RunConfig(key_store=keys, monitor={"embedding": {"window": 4, "reference_windows": 2}})
    summary = Runner(config, out, progress=lambda _m: None).run(d)
    assert summary["counts"]["sessions"] == 3 and summary["counts"]["quarantined"] == 0
    return LineageRun(out=out, input=d, keys=keys)
