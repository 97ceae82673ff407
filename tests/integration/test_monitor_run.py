"""The embedding monitor in real runs: the tables every commit writes (on the shared
``lineage_run``, windows of 4), ``inspect``, the metrics, and ``--reference OUT0``."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

import modalign
from modalign.operators.monitor.embedding_drift import split_windows
from modalign.pipeline.cli import main
from modalign.pipeline.metrics import Metrics
from modalign.pipeline.runner import Runner
from modalign.schemas.config import RunConfig

pytestmark = pytest.mark.integration


def test_every_commit_monitors_its_features(lineage_run, capsys):
    output = modalign.open(lineage_run.out)
    windows = output.table("monitor_windows").to_table().to_pylist()
    features = output.table("features").to_table(columns=["model_id", "granularity", "session_id", "t_ns"]).to_pylist()
    # per (model, granularity, session): the windows cut that session's vectors, in time order
    groups: dict[tuple, list[int]] = {}
    for f in features:
        groups.setdefault((f["model_id"], f["granularity"], f["session_id"]), []).append(f["t_ns"])
    got: dict[tuple, list[dict]] = {}
    for w in windows:
        got.setdefault((w["model_id"], w["granularity"], w["session_id"]), []).append(w)
    for key, ts in groups.items():
        ts.sort()
        cuts = split_windows(len(ts), 4)
        rows = sorted(got.get(key, []), key=lambda r: r["window_index"])
        assert [(r["vectors"], r["start_t_ns"], r["end_t_ns"]) for r in rows] == [
            (c.stop - c.start, ts[c.start], ts[c.stop - 1]) for c in cuts], key
    assert len(windows) == sum(len(v) for v in got.values()) == output.run["monitor"]["windows"] > 0
    # per stream, windows count on over the sessions in id order; the first 2 are the reference
    for s in output.run["monitor"]["streams"]:
        rows = sorted((w for w in windows if (w["model_id"], w["granularity"]) == (s["model_id"], s["granularity"])),
                      key=lambda r: r["window_index"])
        assert [r["window_index"] for r in rows] == list(range(s["windows"]))
        assert [r["session_id"] for r in rows] == sorted(r["session_id"] for r in rows)
        assert [r["reference"] for r in rows[:2]] == [True] * min(2, len(rows))
        scored = [r for r in rows if not r["reference"]]
        assert all(r["divergence"] is not None and r["threshold"] > 0 and r["alpha"] >= 2.0 for r in scored)
        assert s["ready"] == (len(rows) >= 2)
    alarms = output.table("monitor_alarms").to_table().to_pylist() if output.files("monitor_alarms") else []
    flagged = sum(w["drift_alarm"] + w["norm_alarm"] for w in windows)
    assert len(alarms) == flagged == sum(output.run["counts"]["monitor_alarms"].values())
    # statistics only: no vector, feature id or event id
    for name in ("monitor_windows", "monitor_alarms"):
        for f in output.files(name):
            assert not {"vector", "feature_id", "event_id"} & set(pq.read_schema(f).names)
    assert main(["inspect", str(lineage_run.out)]) == 0
    text = capsys.readouterr().out
    assert f"embedding monitor: {len(alarms)} alarm(s) in " in text and "windows, reference first 2 windows" in text


def test_a_reference_output_and_the_metrics(lineage_run, tmp_path, capsys):
    deck = tmp_path / "in"
    shutil.copytree(lineage_run.input / "deck", deck)
    out = tmp_path / "out"
    metrics = Metrics()
    config = RunConfig(key_store=lineage_run.keys, monitor={"embedding": {"window": 4, "reference_windows": 2},
                                                            "reference": str(lineage_run.out)})
    summary = Runner(config, out, progress=lambda _m: None, metrics=metrics).run(deck)
    rows = modalign.open(out).table("monitor_windows").to_table().to_pylist()
    assert rows and not any(r["reference"] for r in rows)  # OUT0's windows are the reference: all scored
    ref_windows = modalign.open(lineage_run.out).table("monitor_windows").to_table().to_pylist()
    for s in summary["monitor"]["streams"]:
        n0 = sum(1 for w in ref_windows if (w["model_id"], w["granularity"]) == (s["model_id"], s["granularity"]))
        assert s["reference"] == f"{n0} windows of {lineage_run.out}", s
    assert metrics.value("modalign_monitor_windows") == len(rows) == summary["monitor"]["windows"]
    for kind in ("embedding_drift", "norm_jump"):
        assert metrics.value("modalign_monitor_alarms", alarm=kind) == summary["counts"]["monitor_alarms"].get(kind, 0)
    assert np.isfinite([r["divergence"] for r in rows]).all()
    # a reference that is no output stops the run before any work, naming it
    rc = main(["run", str(deck), "--out", str(tmp_path / "out2"), "--reference", str(tmp_path / "nowhere")])
    assert rc == 1 and not (tmp_path / "out2").exists()
    assert "nowhere" in capsys.readouterr().err
